"""What the batcher asks of the code around it, as structural protocols.

The batcher never imports the engine: engine/ classes satisfy these by their shape alone
(`engine.generation.HFGenerationEngine` and `engine.fake.FakeGenerationEngine` are
`SteppingEngine`s, `engine.base.SequenceRequest` is a `PrefillRequest` and
`engine.base.StepOutput` a `SequenceStep`; gateway/models/start.py turns an embeddings
engine into an `Execute`). Each protocol names only what the batcher uses; engine/base.py
holds the engines' full contract, including what only the gateway needs (chat templates,
tokenizers).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


class Execute(Protocol):
    """Runs one batch of a one-shot model (embeddings): one result per payload, in order,
    an Exception in place of the result of a payload that failed alone. Raising fails
    every item of the batch."""

    def __call__(self, payloads: list[Any], /) -> Awaitable[Sequence[Any]]: ...


class EngineCaller(Protocol):
    """Runs a blocking engine call off the event loop (batcher.engine_thread.EngineThread, or
    engine.fake.SimulatedEngineThread in tests). One that also has `start(fn, *args)`, which
    begins the call at once and is awaited later, lets delivery overlap the next step."""

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


class PrefillRequest(Protocol):
    """One sequence to prefill, as the scheduler's `make_request` built it."""

    @property
    def seq_id(self) -> int: ...

    @property
    def prompt_ids(self) -> list[int]: ...


class SequenceStep(Protocol):
    """What one sequence produced in one engine call. `text` is released text only; a
    set `finish_reason` means the sequence has left the engine's running set.
    `cached_tokens`, on the output of a sequence's prefill: its prompt tokens whose KV came
    from the engine's prefix cache (0 for an engine without one)."""

    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def text(self) -> str: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def cached_tokens(self) -> int: ...


# Builds the engine's request for one sequence from (seq_id, prompt ids, the payload's
# params, its class: 0 interactive, 1 batch, which yields KV memory first); params None
# (the scheduler's warm-up) means the engine's defaults.
MakeRequest = Callable[[int, list[int], Any, int], PrefillRequest]


@runtime_checkable
class SteppingEngine(Protocol):
    """Runs a changing set of sequences one token at a time. Called from one worker thread.

    An engine with a fixed number of KV slots also has `max_running: int`; the scheduler
    never runs more sequences than that (engines without it have no such limit). One whose
    `holds_rows` is true has a `held` attribute: the running sequences its next decode
    step leaves out, their KV kept (the scheduler sets it before each iteration, to the
    rows of tenants over their fair share; never every row).
    """

    @property
    def running(self) -> int:
        """Sequences in the running set."""

    @property
    def kv_tokens(self) -> int:
        """KV-cache token positions the running rows attend over (for the metric)."""

    def encode_prompt(self, text: str) -> list[int]:
        """Tokenize a plain prompt (the warm-up's)."""

    def add(self, requests: Sequence[Any]) -> Sequence[SequenceStep]:
        """Prefill new sequences together: one output per request, in request order."""

    def step(self) -> Sequence[SequenceStep]:
        """One decode step of every running sequence."""

    def remove(self, seq_ids: Sequence[int]) -> None:
        """Drop sequences; unknown ids are ignored."""

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens a prefill would serve from the engine's prefix cache now (0 without
        one): the scheduler prices a prompt by the rest. Called from the event loop, not
        the worker thread, so it only reads, and may be stale by the time the prompt runs."""


class PrefillSteps(Protocol):
    """What a `ChunkingEngine.prefill` call did (engine.base.PrefillStep)."""

    @property
    def outputs(self) -> Sequence[SequenceStep]: ...

    @property
    def failed(self) -> dict[int, Exception]: ...

    @property
    def rows(self) -> int: ...

    @property
    def padded_tokens(self) -> int: ...

    @property
    def computed_tokens(self) -> int: ...

    @property
    def queried_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...


@runtime_checkable
class ChunkingEngine(SteppingEngine, Protocol):
    """A `SteppingEngine` that prefills prompts a budgeted chunk at a time (token-budgeted
    steps): `enqueue` takes prompts without computing (one output each: no token, or a
    finish for a prompt refused outright), `prefill(budget, first)` computes at most
    `budget` prompt tokens of the waiting ones (None: all), `first` ahead, and gives the
    first token of each whose last chunk ran. Sequences taken count in `running`."""

    @property
    def prefilling(self) -> int:
        """Of `running`, the sequences still prefilling."""

    def enqueue(self, requests: Sequence[Any]) -> Sequence[SequenceStep]: ...

    def prefill(self, budget: int | None = None, first: Sequence[int] = ()) -> PrefillSteps: ...


@runtime_checkable
class PackingEngine(ChunkingEngine, Protocol):
    """A `ChunkingEngine` that can run a decode step and a budgeted prefill in one forward
    (packed steps): `step_with_prefill(budget, first)` is `step()` then `prefill(budget,
    first)`, their outputs, with the step's work shared; `packs_steps` False: it would run
    them apart (the batcher then calls them apart, to time each). One that adds optional
    work to a step (drafts to verify: speculation) may have a `step_ceiling` attribute: the
    seconds the step may take, which the batcher sets before each iteration (`Chunking`)."""

    packs_steps: bool

    def step_with_prefill(
        self, budget: int | None = None, first: Sequence[int] = ()
    ) -> tuple[Sequence[SequenceStep], PrefillSteps]: ...
