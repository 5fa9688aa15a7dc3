"""A running sequence's own state (`RunningSequence`), and what each new token does to the
rows of a step (`NextTokens`): the logit rules and grammar masks applied, each row sampled
with its own sampler, the token accounted (text released, stop and length decided)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .base import SamplingParams, SequenceRequest, StepOutput, TokenLogprob
from .detokenize import FINISH_COMPLETE, FINISH_LENGTH, FINISH_STOP, SequenceText
from .forward import CausalForward
from .grammar import GrammarCache, RowMasks
from .logits import LogitRules, apply_rules
from .prefix_cache import chain_keys
from .prompt_logprobs import prompt_logprobs
from .sampling import SequenceSampler, sample_next_tokens, token_logprobs
from .sharing import SHARE_BLOCK, HeldPrefix
from .speculation import RowRate

log = logging.getLogger("ferry.engine")


class SequenceLimits(Protocol):
    eos_token_ids: frozenset[int]
    max_context: int


class NextTokens:
    """Samples and accounts the next token of running sequences, for one engine: `limits`
    is the engine, whose `eos_token_ids` and `max_context` are read at each token."""

    def __init__(self, limits: SequenceLimits, forward: CausalForward, grammars: GrammarCache, rows: int) -> None:
        self.limits, self.forward, self.grammars, self.rows = limits, forward, grammars, rows
        self._masks: RowMasks | None = None

    def sample(self, logits: torch.Tensor, seqs: Sequence[RunningSequence]) -> list[tuple[int, TokenLogprob | None]]:
        """Each row's next token, and its log probabilities where asked: the logit rules
        (bias, min_tokens, penalties: engine/logits.py), constrained rows masked to what
        their grammar allows, then each row sampled with its own sampler."""
        apply_rules(logits, [s.rules for s in seqs], [len(s.tokens) for s in seqs], sorted(self.limits.eos_token_ids))
        matchers = [s.matcher for s in seqs]
        if any(m is not None for m in matchers):
            if self._masks is None:
                self._masks = RowMasks(max(self.rows, len(seqs)), self.grammars.vocab_size)
            self._masks.apply(logits, matchers)
        samplers = [s.sampler for s in seqs]
        tokens = sample_next_tokens(logits, samplers)
        logprobs = token_logprobs(logits, samplers, tokens, [s.params.logprobs for s in seqs])
        return list(zip(tokens, logprobs, strict=True))

    def advance(self, seq: RunningSequence, token: int, logprob: TokenLogprob | None = None) -> StepOutput:
        """Account one new token: release text, decide whether the sequence finishes."""
        seq.tokens.append(token)
        if seq.rules is not None:
            seq.rules.observe(token)
        end = None
        if token in self.limits.eos_token_ids and not seq.params.ignore_eos:
            end = FINISH_STOP
        else:
            if seq.matcher is not None:
                # A token the mask allowed is always accepted; once the grammar admits nothing
                # more (the JSON value is closed) the row ends with this token, its text kept.
                seq.matcher.consume_token(token)
                if seq.matcher.is_stopped() or seq.matcher.is_error():
                    end = FINISH_COMPLETE
            full = seq.total_tokens >= self.limits.max_context
            if end is None and (len(seq.tokens) >= seq.params.max_tokens or full):
                end = FINISH_LENGTH
        logprobs = None if logprob is None else [logprob]
        if seq.text is None:
            return StepOutput(seq.seq_id, [token], "", end, logprobs=logprobs)
        text, reason = seq.text.advance(token, end)
        return StepOutput(seq.seq_id, [token], text, reason, logprobs=logprobs)

    def first(
        self,
        seq: RunningSequence,
        token: int,
        logprob: TokenLogprob | None = None,
        failed: dict[int, Exception] | None = None,
    ) -> StepOutput | None:
        """A prompt's first token (`advance`), with its prompt's log probabilities where its
        params ask. Those take a forward of the prompt's own (engine/prompt_logprobs.py): one
        that fails (a long prompt's memory) fails that prompt alone, in `failed`, and gives
        None (it does not join); without `failed` the error is raised (`add`, which the
        batcher runs again one prompt at a time)."""
        out = self.advance(seq, token, logprob)
        if len(seq.tokens) != 1 or seq.scored is None:
            return out
        try:
            out.prompt_logprobs = seq.score_prompt(self.forward)
        except Exception as exc:
            if failed is None:
                raise
            log.exception("prompt log probabilities of sequence %d failed", seq.seq_id)
            failed[seq.seq_id] = exc
            return None
        return out


@dataclass(slots=True)
class RunningSequence:
    seq_id: int
    params: SamplingParams
    prompt: list[int]
    sampler: SequenceSampler
    text: SequenceText | None
    matcher: Any = None  # llguidance matcher of a constrained row
    rules: LogitRules | None = None  # bias, min_tokens, penalties (engine/logits.py)
    tokens: list[int] = field(default_factory=list)
    scored: list[int] | None = None  # its prompt, kept where its params ask for the prompt's log probabilities
    chain: list[bytes] = field(default_factory=list)  # its prompt's block keys, for shared-prefix attention
    shared: HeldPrefix | None = None  # the prefix its running row references, not in its slot (engine/sharing.py)
    priority: int = 0  # lower runs first: when KV memory runs out, the highest yields first
    spec: RowRate = field(default_factory=RowRate)  # its drafts verified and taken (engine/speculation.py)

    @classmethod
    def of(cls, request: SequenceRequest, detok: Any, grammars: GrammarCache) -> RunningSequence:
        params = request.params
        return cls(
            seq_id=request.seq_id,
            params=params,
            prompt=list(request.prompt_ids),
            sampler=SequenceSampler.create(params.temperature, params.top_p, params.seed, params.top_k, params.min_p),
            rules=LogitRules.of(params, request.prompt_ids),
            # None: the front end detokenizes (an engine core sends token ids only)
            text=SequenceText(detok, request.prompt_ids, params.stop) if params.detokenize else None,
            matcher=grammars.matcher(params.json_schema) if params.json_schema is not None else None,
            scored=list(request.prompt_ids) if params.prompt_logprobs is not None else None,
            # Whole blocks before its last prompt token, as the prefix cache would key them.
            chain=chain_keys(request.prompt_ids, SHARE_BLOCK, max(len(request.prompt_ids) - 1, 0) // SHARE_BLOCK),
            priority=request.priority,
        )

    def score_prompt(self, forward: CausalForward) -> list[TokenLogprob | None] | None:
        """Its prompt's log probabilities where its params ask (a forward of their own)."""
        if self.scored is None:
            return None
        return prompt_logprobs(forward, self.scored, self.params.prompt_logprobs or 0)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion; the cache holds all but the last completion token."""
        return self.prompt_len + len(self.tokens)
