"""Per-sequence sampling inside one batch.

Reproducibility contract: a sequence's tokens depend only on its own logits and its own
seeded generator, never on its batch mates. Each sampled sequence draws exactly one
uniform number per step from its private `torch.Generator` and picks the token by
inverse CDF over its (temperature-scaled, top-k/min-p/top-p-filtered) distribution in vocabulary
order. Batch mates change logits only by ~1e-6 of matmul rounding, so seeded output
matches alone and batched except at near-exact ties.

Top-p cost: the nucleus threshold comes from a `topk(TOP_P_PREFILTER_K)` of each row,
which is cheap; only rows whose nucleus does not fit in those k tokens (very flat
distributions, e.g. a randomly initialised model) fall back to an exact full-vocabulary
sort. The result is exact either way. Rows with top_p >= 1 skip both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A trained model's nucleus at top_p <= 0.95 nearly always lies within its top 256
# tokens; topk(256) over a 32k-128k vocabulary is ~10x cheaper than a full sort.
TOP_P_PREFILTER_K = 256
LOGPROB_FLOOR = -9999.0  # the log probability reported for a token that cannot be drawn (vLLM's)


@dataclass(slots=True)
class SequenceSampler:
    temperature: float
    top_p: float
    generator: torch.Generator
    top_k: int = 0  # 0 or less: every token
    min_p: float = 0.0

    @classmethod
    def create(
        cls, temperature: float, top_p: float, seed: int | None, top_k: int = 0, min_p: float = 0.0
    ) -> SequenceSampler:
        return cls(temperature, top_p, make_generator(seed), top_k, min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: seeded as asked, else from the OS entropy source."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's highest logit's index (the first of ties; a NaN wins, as in torch). On
    the CPU in float32 through NumPy's vectorized argmax: torch's CPU argmax keeps an index
    beside every compare and took 0.45-0.8 ms of a 17-20 ms decode step for 64 rows of the
    built-in model's 8,192 logits, NumPy's 0.05 ms (docs/benchmarks.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.detach().contiguous().numpy().argmax(axis=1))
    return logits.argmax(dim=-1)


def sample_next_tokens(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[int]:
    """One token id per row of `logits` ([batch, vocab]), row i sampled with samplers[i]."""
    if logits.shape[0] != len(samplers):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(samplers)} samplers")
    tokens = greedy_tokens(logits)
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        chosen = [samplers[i] for i in sampled]
        tokens[rows] = _sample_rows(logits.index_select(0, rows), chosen)
    return tokens.tolist()


def token_logprobs(
    logits: torch.Tensor, samplers: Sequence[SequenceSampler], tokens: Sequence[int], wanted: Sequence[int | None]
) -> list[tuple[int, float, list[tuple[int, float]]] | None]:
    """Per row, None where `wanted[i]` is None, else (token, its log probability, the
    `wanted[i]` most likely tokens with theirs): the log-softmax of the row's logits (after
    the logit rules and a grammar's mask) over its temperature (1 for greedy rows), before
    top-k, min-p and top-p: the distribution the model and temperature give, as vLLM's
    default `logprobs` reports it."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    out: list[tuple[int, float, list[tuple[int, float]]] | None] = [None] * len(wanted)
    if not rows:
        return out
    device = logits.device
    index = torch.tensor(rows, device=device)
    temps = torch.tensor([samplers[i].temperature if samplers[i].temperature > 0 else 1.0 for i in rows], device=device)
    lp = torch.log_softmax(logits.index_select(0, index).float() / temps.unsqueeze(1), dim=-1)
    entries = logprob_entries(lp, [tokens[i] for i in rows], [wanted[i] or 0 for i in rows])
    for i, entry in zip(rows, entries, strict=True):
        out[i] = entry
    return out


def logprob_entries(
    lp: torch.Tensor, tokens: Sequence[int], top: Sequence[int]
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Per row of log probabilities `lp` [rows, vocab]: (tokens[i], its log probability, the
    top[i] most likely tokens with theirs, most likely first). Clamps `lp` in place at
    LOGPROB_FLOOR: a masked token's -inf would reach JSON as null."""
    lp.clamp_(min=LOGPROB_FLOOR)
    chosen = lp.gather(1, torch.tensor(list(tokens), device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    most = max(top, default=0)
    values, ids = lp.topk(most, dim=-1) if most else (lp[:, :0], lp[:, :0].long())
    values_l, ids_l = values.tolist(), ids.tolist()
    return [
        (token, chosen[j], list(zip(ids_l[j][:k], values_l[j][:k], strict=True)))
        for j, (token, k) in enumerate(zip(tokens, top, strict=True))
    ]


def _sample_rows(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([s.temperature for s in samplers], device=device)
    top_p = torch.tensor([s.top_p for s in samplers], device=device)
    probs = torch.softmax(logits.float() / temperature.unsqueeze(1), dim=-1)
    probs = _apply_top_k_min_p(probs, samplers)
    probs = _apply_top_p(probs, top_p)
    # Drawn on CPU from each sequence's own generator, whatever the logits' device.
    uniforms = torch.cat([torch.rand(1, generator=s.generator) for s in samplers]).to(device)
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)


def _apply_top_k_min_p(probs: torch.Tensor, samplers: Sequence[SequenceSampler]) -> torch.Tensor:
    """Zero out tokens outside each row's top k, and those less likely than its min_p x its
    most likely token, then make what is left sum to 1 again before top-p measures its
    nucleus (as Hugging Face and vLLM). Only the rows that ask are touched: one top-k gives
    both thresholds (its first value is the row's most likely token) and one mask applies
    the larger."""
    vocab = probs.shape[-1]
    k = [s.top_k if 0 < s.top_k < vocab else 0 for s in samplers]
    rows = [i for i, s in enumerate(samplers) if k[i] or s.min_p > 0]
    if not rows:
        return probs
    device, dtype = probs.device, probs.dtype
    index = torch.tensor(rows, device=device)
    sub = probs.index_select(0, index)
    ks = [k[i] for i in rows]
    top = sub.topk(max(max(ks), 1), dim=-1).values
    kth = top.gather(1, torch.tensor([max(kk, 1) - 1 for kk in ks], device=device).unsqueeze(1))
    kth.mul_(torch.tensor([kk > 0 for kk in ks], device=device, dtype=dtype).unsqueeze(1))  # 0: no top-k
    floor = top[:, :1] * torch.tensor([samplers[i].min_p for i in rows], device=device, dtype=dtype).unsqueeze(1)
    sub.mul_(sub >= torch.maximum(kth, floor))  # masked_fill is several times slower on CPU
    probs[index] = sub / sub.sum(dim=-1, keepdim=True)
    return probs


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside each row's nucleus (rows with top_p >= 1 untouched)."""
    nucleus_rows = (top_p < 1.0).nonzero().squeeze(1)
    if nucleus_rows.numel() == 0:
        return probs
    subset = probs.index_select(0, nucleus_rows)
    thresholds = _nucleus_thresholds(subset, top_p.index_select(0, nucleus_rows))
    probs[nucleus_rows] = subset.masked_fill(subset < thresholds.unsqueeze(1), 0.0)
    return probs


def _nucleus_thresholds(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability still inside the nucleus."""
    k = min(probs.shape[-1], TOP_P_PREFILTER_K)
    thresholds, covered = _thresholds_from_sorted(probs.topk(k, dim=-1).values, top_p)
    if not bool(covered.all()):
        spill = (~covered).nonzero().squeeze(1)
        full = probs.index_select(0, spill).sort(dim=-1, descending=True).values
        thresholds[spill], _ = _thresholds_from_sorted(full, top_p.index_select(0, spill))
    return thresholds


def _thresholds_from_sorted(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds from descending probabilities, and whether the nucleus fits in them."""
    cumulative = sorted_probs.cumsum(dim=-1)
    # The nucleus is the shortest prefix reaching top_p: tokens whose preceding mass < top_p.
    keep = ((cumulative - sorted_probs) < top_p.unsqueeze(1)).sum(dim=-1).clamp_(min=1)
    thresholds = sorted_probs.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
    covered = cumulative[:, -1] >= top_p
    return thresholds, covered
