"""What a sequence asks of its next token's logits beyond temperature and top-p/top-k/min-p
(engine/sampling.py): a logit bias, no end-of-sequence token before `min_tokens`, and the
penalties on tokens already seen (OpenAI's presence and frequency penalties over the
output; Hugging Face's repetition penalty over the prompt and the output), in vLLM's order:
bias and min_tokens, then the penalties, on the raw logits before temperature.

Per row state is sparse: the count of each token the output holds (presence and frequency)
and the ids the prompt and output hold (repetition), never a vocabulary-wide tensor per
sequence. A step gathers the (row, token) pairs of every row that uses a rule and applies
it to all of them in one indexed operation, so its cost follows the tokens a sequence has
seen, not rows x vocabulary. Rows that ask for nothing cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .base import SamplingParams


@dataclass(slots=True)
class LogitRules:
    presence: float
    frequency: float
    repetition: float
    bias: dict[int, float]
    min_tokens: int
    prompt_ids: list[int]
    counts: dict[int, int] = field(default_factory=dict)  # each generated token -> its place below
    count_ids: torch.Tensor | None = None  # `counts` as tensors: its keys, in first-seen order,
    count_values: torch.Tensor | None = None  # and their counts, updated in place as tokens come
    seen: set[int] = field(default_factory=set)  # in the prompt or the output (repetition)
    seen_ids: torch.Tensor | None = None  # `seen` as a tensor, grown as tokens come
    bias_ids: torch.Tensor | None = None  # the bias as tensors, made once
    bias_values: torch.Tensor | None = None

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids: Sequence[int]) -> LogitRules | None:
        """The sequence's rules, or None when it asks for none of them."""
        p = params
        asks = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
        if not asks and p.min_tokens <= 0:
            return None
        keep_prompt = list(prompt_ids) if p.repetition_penalty != 1.0 else []
        return cls(
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
            dict(p.logit_bias),
            p.min_tokens,
            keep_prompt,
            seen=set(keep_prompt),
        )

    @property
    def penalizes(self) -> bool:
        return bool(self.presence or self.frequency)

    def observe(self, token: int) -> None:
        """A token was generated."""
        if self.penalizes:
            at = self.counts.get(token)
            if at is not None:
                if self.count_values is not None:
                    self.count_values[at] += 1
            else:
                self.counts[token] = len(self.counts)
                if self.count_ids is not None and self.count_values is not None:
                    self.count_ids = torch.cat([self.count_ids, self.count_ids.new_tensor([token])])
                    self.count_values = torch.cat([self.count_values, self.count_values.new_ones(1)])
        if self.repetition != 1.0 and token not in self.seen:
            self.seen.add(token)
            if self.seen_ids is not None:
                self.seen_ids = torch.cat([self.seen_ids, self.seen_ids.new_tensor([token])])

    def _state(self, device: torch.device, dtype: torch.dtype) -> None:
        if self.bias and self.bias_ids is None:
            self.bias_ids = torch.tensor(list(self.bias), dtype=torch.long, device=device)
            self.bias_values = torch.tensor(list(self.bias.values()), dtype=dtype, device=device)
        if self.repetition != 1.0 and self.seen_ids is None:
            self.seen_ids = torch.tensor(sorted(self.seen), dtype=torch.long, device=device)
        if self.penalizes and self.count_ids is None:  # before any token: counts is empty
            self.count_ids = torch.zeros(0, dtype=torch.long, device=device)
            # float32 whatever the logits: a half-precision count stops growing at 2048
            self.count_values = torch.zeros(0, dtype=torch.float32, device=device)


def apply_rules(
    logits: torch.Tensor, rules: Sequence[LogitRules | None], generated: Sequence[int], eos_ids: Sequence[int]
) -> None:
    """Apply each row's rules to `logits` [rows, vocab] in place; `generated[i]` is how many
    tokens row i has produced so far."""
    chosen = [(i, r) for i, r in enumerate(rules) if r is not None]
    if not chosen:
        return
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype
    for _, r in chosen:
        r._state(device, dtype)
    biased = [(i, r.bias_ids, r.bias_values) for i, r in chosen if r.bias_ids is not None]
    if biased:  # every row's bias in one scatter
        rows = torch.cat([torch.full_like(ids, i) for i, ids, _ in biased])
        ids = torch.cat([ids for _, ids, _ in biased])
        values = torch.cat([v for _, _, v in biased if v is not None])
        logits.index_put_((rows, ids), values, accumulate=True)
    early = [i for i, r in chosen if generated[i] < r.min_tokens]
    eos = [e for e in eos_ids if e < vocab]
    if early and eos:
        logits[torch.tensor(early, device=device).unsqueeze(1), torch.tensor(eos, device=device)] = float("-inf")
    repeat = [(i, r.seen_ids, r.repetition) for i, r in chosen if r.seen_ids is not None and r.seen_ids.numel()]
    if repeat:
        rows = torch.cat([torch.full_like(ids, i) for i, ids, _ in repeat])
        ids = torch.cat([ids for _, ids, _ in repeat])
        penalty = torch.cat([torch.full(ids.shape, p, dtype=dtype, device=device) for _, ids, p in repeat])
        seen = logits[rows, ids]
        logits[rows, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    penalized = [(i, r) for i, r in chosen if r.counts]
    if penalized:
        ids = torch.cat([r.count_ids for _, r in penalized if r.count_ids is not None])
        counts = torch.cat([r.count_values for _, r in penalized if r.count_values is not None])
        sizes = torch.tensor([len(r.counts) for _, r in penalized], device=device)
        rows = torch.tensor([i for i, _ in penalized], device=device).repeat_interleave(sizes)
        frequency = torch.tensor([r.frequency for _, r in penalized], dtype=dtype, device=device)
        presence = torch.tensor([r.presence for _, r in penalized], dtype=dtype, device=device)
        adjust = counts.to(dtype) * frequency.repeat_interleave(sizes) + presence.repeat_interleave(sizes)
        logits.index_put_((rows, ids), -adjust, accumulate=True)
