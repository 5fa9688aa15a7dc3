"""Shared vocabulary of the batcher: work items, batches, outcomes, and the payloads
of generation items (request in, streamed deltas and result out).

Every module imports these; nobody redefines them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

_ids = itertools.count(1)


class Outcome(IntEnum):
    """Terminal states are ordered after PENDING so `finished` is one comparison."""

    PENDING = 0
    RESULT = 1
    ERROR = 2
    CANCELLED = 3
    EXPIRED = 4


class Priority(IntEnum):
    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: str | None) -> Priority:
        if value is None or value == "":
            return cls.INTERACTIVE
        try:
            return cls[value.upper()]
        except KeyError:
            raise ValueError(f"priority must be 'interactive' or 'batch', got {value!r}") from None

    @property
    def label(self) -> str:
        return self.name.lower()


class DispatchReason(str, Enum):
    FULL = "full"
    MAX_WAIT = "max_wait"
    DEADLINE = "deadline"
    ADAPTIVE = "adaptive"
    DRAIN = "drain"
    LANE = "lane"  # interactive work beside the batch in flight (MicroBatcher)


class Stage(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"


@dataclass(eq=False, slots=True)
class WorkItem:
    """One prompt or input. Its future is resolved exactly once, by `finish`."""

    payload: Any
    arrival: float
    deadline: float | None = None
    priority: Priority = Priority.INTERACTIVE
    cost: int = 1  # tokens
    request_id: str = ""
    prompt_index: int = 0
    # Generation items stream deltas through this callback (called on the event loop).
    on_delta: Callable[[Delta], None] | None = None
    # Generation: this request's inter-token target in seconds (its `x-llm-d-slo-tpot-ms`);
    # admission refuses what the predicted decode step cannot meet, and while it runs the
    # running batch is kept small enough for it (docs/api.md).
    itl_target: float | None = None
    # Whose work it is (batcher/fairness.py): an API key's tenant, or a name the gateway took
    # from a trusted header or the request.
    tenant: str = "default"
    # Generation: the tokens it is expected to generate (its limit, or where answers end):
    # what the fair order prices beside its prompt, as its output is charged only as it comes.
    expected_output: float = 0.0
    id: int = field(default_factory=lambda: next(_ids))
    future: asyncio.Future | None = None
    outcome: Outcome = Outcome.PENDING
    # Filled in when the item leaves the queue.
    dispatched_at: float | None = None
    batch_size: int = 0
    reason: DispatchReason | None = None
    # What admission does when it judges the item infeasible: the request's own choice (its
    # `on_infeasible` field or `X-Ferry-On-Infeasible` header), None: the model's setting.
    on_infeasible: str | None = None
    # Best-effort service of an item admission judged infeasible (on_infeasible=serve).
    best_effort: bool = False
    # Generation: admission's uncalibrated prediction of seconds from arrival to the first
    # token (on the item it checked); its first token calibrates later ones (cost.Calibration).
    predicted_wait: float | None = None
    slo_recorded: bool = False
    # Generation: tokens its price leaves out for the engine's prefix cache when it was last
    # priced (`cost + cached` is its price before the cache); queued prompts are priced
    # again as the cache fills.
    cached: int = 0

    @property
    def finished(self) -> bool:
        return self.outcome > Outcome.PENDING

    @property
    def result_future(self) -> asyncio.Future[Any]:
        """The future a batcher gave this item when it accepted it (`future`, never None then)."""
        if self.future is None:
            raise RuntimeError("a work item gets its future when a batcher accepts it")
        return self.future

    def finish(self, outcome: Outcome, value: Any = None) -> bool:
        """Move to a terminal state once; later calls are ignored and return False."""
        if self.finished:
            return False
        self.outcome = outcome
        fut = self.future
        if fut is not None and not fut.done():
            if outcome is Outcome.RESULT:
                fut.set_result(value)
            else:
                fut.set_exception(value)
        return True


@dataclass(slots=True)
class Batch:
    items: list[WorkItem]
    formed_at: float
    reason: DispatchReason

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True, slots=True)
class TokenCount:
    """The tokens of one engine call: the real ones, and what the call computes with every
    input padded to the longest (what the cost model and the padding metric need)."""

    real: int
    padded: int

    @classmethod
    def of(cls, lengths: Sequence[int]) -> TokenCount:
        return cls(sum(lengths), max(lengths, default=0) * len(lengths))

    @property
    def padding_ratio(self) -> float:
        """Padding over padded tokens; 0 for an empty call."""
        return 1.0 - self.real / self.padded if self.padded else 0.0


@dataclass(slots=True)
class GenRequest:
    """Payload of a generation work item (engine-neutral: params is the engine's
    SamplingParams, passed through untouched)."""

    prompt_ids: list[int]
    params: Any


@dataclass(slots=True)
class GenResult:
    """What a generation work item resolves to once its sequence finishes. `cached_tokens`:
    of its prompt tokens, those whose KV the engine's prefix cache served (usage's
    `prompt_tokens_details.cached_tokens`). `logprobs`: each generated token's, where the
    request asked (the engine's `TokenLogprob` tuples), else None."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None  # each prompt token's after the first, where asked


@dataclass(slots=True)
class LogprobLedger:
    """A sequence's log probabilities as its tokens come: all of them (for its result), those
    not yet on a delta, and its prompt's (handed to the first delta after they arrive).
    Shared by the in-process delivery (batcher/delivery.py) and a front end's text assembly
    (gateway/cores/text.py)."""

    tokens: list[Any] | None = None  # each generated token's, where the request asked
    unsent: list[Any] = field(default_factory=list)
    prompt: list[Any] | None = None  # each prompt token's, where the request asked
    prompt_sent: bool = False

    def add(self, entries: Sequence[Any] | None, prompt: Sequence[Any] | None = None) -> None:
        if entries:
            if self.tokens is None:
                self.tokens = []
            self.tokens.extend(entries)
            self.unsent.extend(entries)
        if prompt is not None:
            self.prompt = list(prompt)

    def take(self) -> tuple[list[Any] | None, list[Any] | None]:
        """What the next delta carries: (the tokens' entries not yet sent, the prompt's if not yet sent)."""
        entries, self.unsent = self.unsent or None, []
        prompt = None if self.prompt_sent else self.prompt
        self.prompt_sent = self.prompt_sent or prompt is not None
        return entries, prompt


@dataclass(slots=True)
class Delta:
    """One streamed piece of one sequence, handed to `WorkItem.on_delta`: its new text,
    how many tokens it holds and, where the engine reports them, their ids."""

    item: WorkItem
    text: str
    tokens: int
    finish_reason: str | None = None
    token_ids: Sequence[int] = ()
    logprobs: Sequence[Any] | None = None  # of the `tokens` it counts, where the request asked
    prompt_logprobs: Sequence[Any] | None = None  # on a sequence's first delta, where the request asked
