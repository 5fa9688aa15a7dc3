"""Engine protocols: the whole contract of a model engine, as the gateway uses it. The
batcher asks for less and says so itself (batcher/protocols.py), without importing this.

Engines know nothing about deadlines, queues or HTTP. They are called from one worker
thread at a time (the batcher owns that thread), so implementations need no locking.
Per-item failures are returned in place of a result, never raised, so that one bad item
cannot fail its batch mates; an exception raised out of a call fails every item of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class ChatTemplateError(ValueError):
    """The model's chat template refuses a conversation (a role it does not know, a broken
    alternation rule, no template at all). The caller's fault, never the engine's: the
    message is the template's own words."""


@dataclass(slots=True)
class EmbeddingResult:
    vector: object  # numpy float32 array, shape [dim], L2-normalised
    tokens: int


@runtime_checkable
class EmbeddingEngine(Protocol):
    name: str
    max_length: int  # tokens; longer inputs are truncated
    dim: int
    # Optional: `vocab_size`, the ids its embedding table holds. An engine with it takes
    # inputs given as token ids (each checked against it); one without takes text only.

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, already truncated to max_length (special tokens included)."""

    def embed(self, batch: Sequence[Sequence[int]]) -> list[EmbeddingResult | Exception]:
        """One forward pass over the batch, padded to its longest member."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # False: the engine makes no text and ignores `stop` (finishing on EOS and length only);
    # the caller detokenizes the token ids, as a front end does for an engine core.
    detokenize: bool = True
    # Canonical JSON text of a JSON schema the output must match (engine/grammar.py).
    json_schema: str | None = None
    # OpenAI's and vLLM's further sampling fields (engine/logits.py); each default asks for nothing.
    top_k: int = 0  # keep the k most likely tokens (0 or -1: all)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # OpenAI's: subtracted from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # Hugging Face's: tokens of the prompt or output, logit / p if > 0 else x p
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # no end-of-sequence token before this many tokens
    ignore_eos: bool = False  # an end-of-sequence token does not end the sequence
    # None: no log probabilities; k >= 0: each token's, and the k most likely alternatives'.
    logprobs: int | None = None
    # The same for every prompt token after the first (engine/prompt_logprobs.py), on the first output.
    prompt_logprobs: int | None = None


@dataclass(slots=True)
class SequenceRequest:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    # Lower runs first (the batcher's class: 0 interactive, 1 batch): when KV memory runs
    # out, running sequences of the highest number yield first, never one of a lower
    # number to make room for a higher.
    priority: int = 0


def sequence_request(
    seq_id: int, prompt_ids: list[int], params: SamplingParams | None, priority: int = 0
) -> SequenceRequest:
    """What the generation scheduler hands the engine for one sequence (its `make_request`);
    no params (the scheduler's warm-up) means 8 greedy tokens."""
    return SequenceRequest(
        seq_id,
        list(prompt_ids),
        params if params is not None else SamplingParams(max_tokens=8, temperature=0.0),
        priority,
    )


# A generated token's log probability: (token id, logprob, [(id, logprob) of the most likely
# tokens, most likely first]), of the distribution it was sampled from (engine/sampling.py).
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass(slots=True)
class StepOutput:
    """What one sequence produced in one engine call.

    `text` is the newly *released* text: text that might still turn out to be the start
    of a stop string is held back until it is known not to be (always "" for a sequence
    whose params say `detokenize=False`). When `finish_reason` is set ("stop" or "length")
    the sequence has left the running set and its cache is freed. `cached_tokens`, set on
    a sequence's first output (the one `add` returns), counts the prompt tokens whose KV
    came from the prefix cache instead of being computed for it.
    """

    seq_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, when its params ask
    # On a sequence's first output, when its params ask: None for the first prompt token, then one each.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class PrefillStep:
    """What one token-budgeted prefill call (`prefill`) did: the first token of each
    sequence whose last chunk ran (its `cached_tokens` set), the sequences whose chunk
    failed alone (dropped), and what its forwards computed: rows, fed tokens padded to each
    forward's widest chunk and not, and prompt tokens looked up in the prefix cache and served by it."""

    outputs: list[StepOutput] = field(default_factory=list)
    failed: dict[int, Exception] = field(default_factory=dict)
    rows: int = 0
    padded_tokens: int = 0
    computed_tokens: int = 0
    queried_tokens: int = 0
    cached_tokens: int = 0


@runtime_checkable
class GenerationEngine(Protocol):
    name: str
    max_context: int  # prompt + completion tokens

    def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """Apply the chat template (with the generation prompt, any function `tools` and
        further names the template reads, `template_kwargs`) and tokenize; raises
        ChatTemplateError for a conversation the template refuses."""

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize a plain completion prompt (with the tokenizer's special tokens, as a
        completion prompt gets them, unless told otherwise)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids as text (a log probability entry's token)."""

    def add(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        """Batched prefill of new sequences; each produces its first token."""

    def step(self) -> list[StepOutput]:
        """One decode step of every running sequence."""

    def remove(self, seq_ids: Sequence[int]) -> None:
        """Drop sequences (cancellation); unknown ids are ignored. Frees their cache."""

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens its prefix cache would serve now (0 without one); only reads."""
        ...

    @property
    def running(self) -> int:
        """Number of sequences in the running set."""

    @property
    def kv_tokens(self) -> int:
        """KV-cache token positions the running rows attend over (for the metric)."""
