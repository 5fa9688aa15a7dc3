"""Speculative decoding by prompt lookup (`--speculation ngram`, vLLM's `ngram` method):
drafts for a running row found by matching its last tokens earlier in its own prompt and
output, verified in the step's packed forward, and kept or left each step by what the
forward costs.

Drafting (`NgramDrafter`): the longest suffix of the row's tokens, `ngram_max` down to
`ngram_min` long, that occurred before (the latest such place); the up to `tokens` tokens
that followed it there are the draft. Answers that copy from the prompt (summaries,
extraction, code edits, quotes of earlier turns) are found so; free-form chat rarely is.

Verification: a row with k drafted tokens feeds its last token and the k drafts in one
packed forward, k + 1 queries that read its blocks (engine/blocks.py: k + 1 "virtual rows"
sharing its block table with lengths L+1 .. L+k+1, so each draft attends to the ones
before it). Greedy rows take the drafts up to the first that differs from the model's
choice, then the model's token there: exactly the tokens they would produce one step at a
time. The KV of the drafts not taken is dropped (the row's length set back, its trailing
blocks freed).

Pricing (`Pricing`): a step's forward takes about `fixed + per_token x tokens` (weights read
once, arithmetic per token), fitted online from the forwards the engine runs. A draft token
pays when the tokens it is expected to add (a row's acceptance rate so far, to the power of
its place in the draft) beat what its cost would buy at the step's current rate: alone, a
row's forward is mostly the weights' fixed read and most drafts pay; at saturation each
token costs its own arithmetic and only near-certain drafts do, so speculation turns
itself off where it cannot pay.

Sampled rows speculate too (`Speculator.verify`): a draft is taken when the row's own
draw at the position before it picks it, so their tokens keep their distribution (and a
seeded row its tokens). Rows with logit rules (penalties, bias, min_tokens), structured
output or log probabilities do not draft: they decode as before, beside the others, in the
same forward.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .base import SamplingParams
from .packed import SharedPrefix
from .sampling import SequenceSampler, greedy_tokens, sample_next_tokens

SPECULATION_MODES = ("off", "ngram")
DEFAULT_TOKENS = 4  # vLLM's num_speculative_tokens for its ngram examples
DEFAULT_NGRAM_MAX = 4  # prompt_lookup_max
DEFAULT_NGRAM_MIN = 2  # prompt_lookup_min
# A row's acceptance rate before it has drafted (a Beta prior worth PRIOR_DRAFTS tokens).
PRIOR_RATE, PRIOR_DRAFTS = 0.5, 4.0


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    mode: str = "off"
    tokens: int = DEFAULT_TOKENS
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN

    def __post_init__(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, not {self.mode!r}")
        if self.tokens < 1:
            raise ValueError("speculative tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("the n-gram bounds need 1 <= min <= max")

    @property
    def on(self) -> bool:
        return self.mode != "off"


class NgramDrafter:
    """Prompt-lookup drafts (module docstring)."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.tokens, self.ngram_max, self.ngram_min = config.tokens, config.ngram_max, config.ngram_min

    def draft(self, history: Sequence[int], most: int | None = None) -> list[int]:
        """Up to `most` (default: the configured count) tokens that followed the latest
        earlier occurrence of the longest suffix of `history` between the n-gram bounds;
        none where no suffix occurred before."""
        most = self.tokens if most is None else min(most, self.tokens)
        n_all = len(history)
        if most <= 0 or n_all < self.ngram_min + 1:
            return []
        tokens = np.asarray(history, dtype=np.int64)
        for n in range(min(self.ngram_max, n_all - 1), self.ngram_min - 1, -1):
            suffix = tokens[-n:]
            # Windows starting at 0 .. n_all - n - 1 (the suffix itself left out).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + most].tolist()
        return []


@dataclass(slots=True)
class RowRate:
    """A row's draft tokens verified and taken so far."""

    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_DRAFTS) / (self.drafted + PRIOR_DRAFTS)


class Pricing:
    """What a packed forward costs by the tokens it feeds, fitted online (exponentially
    weighted least squares over the forwards seen), and which draft tokens pay."""

    def __init__(self, weight: float = 0.05) -> None:
        self.weight = weight
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self.seen = 0

    def observe(self, tokens: int, seconds: float) -> None:
        w, keep = self.weight, 1.0 - self.weight
        self._n = keep * self._n + w
        self._x = keep * self._x + w * tokens
        self._y = keep * self._y + w * seconds
        self._xx = keep * self._xx + w * tokens * tokens
        self._xy = keep * self._xy + w * tokens * seconds
        self.seen += 1

    @property
    def params(self) -> tuple[float, float] | None:
        """(fixed, per token) seconds, or None until forwards of different sizes were seen."""
        if self.seen < 2 or self._n <= 0:
            return None
        mx, my = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            return None
        per_token = max((self._xy / self._n - mx * my) / var, 0.0)
        return max(my - per_token * mx, 0.0), per_token

    def pays(self, base_tokens: int, rows: int, rate: float, ceiling: float | None = None) -> bool:
        """Whether a first draft token of acceptance `rate` would pay (`choose`'s test): when
        not even the best row's would, or it would take the step past `ceiling`, no row need
        be drafted at all."""
        params = self.params
        if params is None:
            return True
        fixed, per_token = params
        time = fixed + per_token * base_tokens
        if ceiling is not None and time + per_token > ceiling:
            return False
        return rate * time > per_token * max(rows, 1)

    def choose(
        self, base_tokens: int, rows: int, offers: Sequence[tuple[float, int]], ceiling: float | None = None
    ) -> list[int]:
        """How many of its draft tokens each row keeps: `offers` is (acceptance rate, tokens
        drafted) per row, `base_tokens` what the forward feeds without drafts (the rows' and
        the chunks' tokens), `rows` the tokens it yields so (one a row). Draft tokens are
        taken best first (a row's j-th is worth rate^j tokens) while each adds more expected
        tokens than its cost would buy at the step's rate then (time per expected token), and
        while the forward stays within `ceiling` seconds (the step's budget: the tightest
        inter-token target of the rows, the share of a step an interactive prompt may wait
        out; None: none). A step already past it takes no draft: drafts make every row's
        token and every waiting first token later. Unknown costs (too few forwards of
        different sizes seen): every draft is taken, which is how the sizes come to differ."""
        keep = [0] * len(offers)
        params = self.params
        if params is None:
            return [k for _, k in offers]
        fixed, per_token = params
        time = fixed + per_token * base_tokens
        produced = float(max(rows, 1))
        heap = [(-rate, i, 1) for i, (rate, k) in enumerate(offers) if k > 0 and rate > 0.0]
        heapq.heapify(heap)
        while heap:
            gain, i, j = heapq.heappop(heap)
            gain = -gain
            # Adding it shortens time per expected token iff gain / per_token > produced / time.
            if gain * time <= per_token * produced:
                break
            if ceiling is not None and time + per_token > ceiling:
                break  # (every draft token costs the same: none after it fits either)
            keep[i] = j
            time += per_token
            produced += gain
            rate, k = offers[i]
            if j < k:
                heapq.heappush(heap, (-(gain * rate), i, j + 1))
        return keep


class Drafting(Protocol):  # engine/sequence.py's RunningSequence
    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt(self) -> list[int]: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def sampler(self) -> SequenceSampler: ...
    @property
    def rules(self) -> object: ...
    @property
    def matcher(self) -> object: ...
    @property
    def spec(self) -> RowRate: ...
    @property
    def total_tokens(self) -> int: ...


def speculates(seq: Drafting) -> bool:
    """Whether a row's tokens may be drafted and verified (module docstring): nothing that
    changes its logits from one token to the next (logit rules, a grammar) or asks for them."""
    return seq.rules is None and seq.matcher is None and not seq.params.logprobs


class Speculator:
    """An engine's speculation: drafts for its rows, priced (`plan`); drafts taken or left
    after the forward (`verify`); the counts behind the metrics."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self.drafter = NgramDrafter(config)
        self.pricing = Pricing()
        self.drafted = 0  # draft tokens verified so far
        self.accepted = 0  # of those, taken
        self.steps = 0  # forwards that verified any

    def plan(
        self, seqs: Sequence[Drafting], chunk_tokens: int, max_context: int, ceiling: float | None = None
    ) -> list[list[int]] | None:
        """Each row's drafts this step, priced within `ceiling` seconds (`Pricing.choose`);
        None where none pays."""
        best = max((s.spec.rate for s in seqs if speculates(s)), default=0.0)
        if best <= 0.0 or not self.pricing.pays(len(seqs) + chunk_tokens, len(seqs), best, ceiling):
            return None  # (at saturation: the look-ups are not made either)
        drafts: list[list[int]] = []
        for seq in seqs:
            room = min(seq.params.max_tokens - len(seq.tokens), max_context - seq.total_tokens) - 1
            drafts.append(self.drafter.draft(seq.prompt + seq.tokens, room) if room > 0 and speculates(seq) else [])
        if not any(drafts):
            return None
        offers = [(s.spec.rate, len(d)) for s, d in zip(seqs, drafts, strict=True)]
        keep = self.pricing.choose(len(seqs) + chunk_tokens, len(seqs), offers, ceiling)
        drafts = [d[:k] for d, k in zip(drafts, keep, strict=True)]
        return drafts if any(drafts) else None

    def verify(
        self, logits: torch.Tensor, firsts: Sequence[int], drafts: Sequence[list[int]], seqs: Sequence[Drafting]
    ) -> list[list[int]]:
        """Each row's tokens this step: `logits` [queries, vocab] of the rows' queries (a
        row's last token, then its drafts), `firsts` each row's token sampled from its first
        query as every row's is. A row with drafts takes them up to the first its sampler
        would not have chosen at the draft before, then its choice there.

        A greedy row's choice is its greedy token. A sampled row samples its next query only
        once the draft before it was taken (one draw of its generator a token, as one step at
        a time): a draft is then taken with its probability under the row's sampler, and
        where it is not, the token drawn is one of the others in proportion to theirs, which
        is rejection sampling for a draft proposed with certainty. Its tokens keep their
        distribution, and a seeded row gives the tokens it gives without speculation."""
        choices = greedy_tokens(logits).tolist() if any(drafts) else []
        runs: list[list[int]] = []
        at = 0
        for first, draft, seq in zip(firsts, drafts, seqs, strict=True):
            taken = 0
            chosen = first
            while taken < len(draft) and draft[taken] == chosen:
                taken += 1
                if seq.sampler.greedy:
                    chosen = choices[at + taken]
                else:
                    chosen = sample_next_tokens(logits[at + taken : at + taken + 1], [seq.sampler])[0]
            runs.append([*draft[:taken], chosen])
            if draft:
                seq.spec.drafted += len(draft)
                seq.spec.accepted += taken
                self.drafted += len(draft)
                self.accepted += taken
            at += 1 + len(draft)
        if any(drafts):
            self.steps += 1
        return runs


def virtual_groups(groups: Sequence[SharedPrefix], queries: torch.Tensor) -> list[SharedPrefix]:
    """Rows that share a prefix (engine/sharing.py) as the queries they feed this step:
    `queries` is the row of each query (`PagedBatch.query_rows`)."""
    return [SharedPrefix(torch.isin(queries, g.rows).nonzero().squeeze(1), g.kv) for g in groups]
