"""What a sequence asks of its next token's logits beyond temperature and top-p/top-k/min-p
(engine/sampling.py): a logit bias, no end-of-sequence token before `min_tokens`, and the
penalties on tokens already seen (OpenAI's presence and frequency penalties over the
output; Hugging Face's repetition penalty over the prompt and the output), in vLLM's order:
bias and min_tokens, then the penalties, on the raw logits before temperature.

Per row state is a count of each output token (and, for the repetition penalty, which
tokens the prompt and output hold), kept as one vocabulary-wide tensor per sequence and
updated a token at a time; a step stacks the tensors of the rows that use them and applies
each rule to all of those rows at once. Rows that ask for nothing cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    counts: torch.Tensor | None = None  # [vocab] float32: times each token was generated
    seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output (repetition)

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
        )

    @property
    def penalizes(self) -> bool:
        return bool(self.presence or self.frequency)

    def observe(self, token: int) -> None:
        """A token was generated."""
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True

    def _state(self, vocab: int, device: torch.device) -> None:
        if self.penalizes and self.counts is None:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if self.repetition != 1.0 and self.seen is None:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=device)] = True


def apply_rules(
    logits: torch.Tensor, rules: Sequence[LogitRules | None], generated: Sequence[int], eos_ids: Sequence[int]
) -> None:
    """Apply each row's rules to `logits` [rows, vocab] in place; `generated[i]` is how many
    tokens row i has produced so far."""
    chosen = [(i, r) for i, r in enumerate(rules) if r is not None]
    if not chosen:
        return
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype
    eos = torch.tensor([e for e in eos_ids if e < vocab], dtype=torch.long, device=device)
    for i, r in chosen:
        r._state(vocab, device)
        if r.bias:
            ids = torch.tensor(list(r.bias), dtype=torch.long, device=device)
            logits[i, ids] += torch.tensor(list(r.bias.values()), dtype=dtype, device=device)
        if generated[i] < r.min_tokens and eos.numel():
            logits[i, eos] = float("-inf")
    repeat = [(i, r) for i, r in chosen if r.seen is not None]
    if repeat:
        index = torch.tensor([i for i, _ in repeat], device=device)
        seen = torch.stack([r.seen for _, r in repeat if r.seen is not None])
        penalty = torch.tensor([r.repetition for _, r in repeat], device=device, dtype=dtype).unsqueeze(1)
        sub = logits.index_select(0, index)
        logits[index] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    penalized = [(i, r) for i, r in chosen if r.counts is not None]
    if penalized:
        index = torch.tensor([i for i, _ in penalized], device=device)
        counts = torch.stack([r.counts for _, r in penalized if r.counts is not None]).to(dtype)
        frequency = torch.tensor([r.frequency for _, r in penalized], device=device, dtype=dtype).unsqueeze(1)
        presence = torch.tensor([r.presence for _, r in penalized], device=device, dtype=dtype).unsqueeze(1)
        logits[index] = logits.index_select(0, index) - frequency * counts - presence * (counts > 0).to(dtype)
