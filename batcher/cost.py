"""Cost model: predicted execution time of a batch from its size and tokens.

time = a + b * items + c * tokens (+ d * tokens^2 / items where a phase's fit is
`quadratic`), fitted by least squares over a sliding window of observed batches, one fit
per phase (embed, prefill, decode). Seeded by a warm-up profile at startup so the first
admission decisions are already informed.

`tokens` are padded tokens, rows x longest row, so tokens^2 / items = rows x longest^2:
the term for attention, whose work per row grows with its length squared. An encoder's
batches of like lengths (embeddings) fit it; without it, a line through short and long
batches under-predicts long ones and over-predicts short ones.

The fit is a mean; `slowdown` says how much slower than predicted batches run on a bad
stretch (a busy neighbour on a shared CPU): interactive deadlines are checked against it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

SLOWDOWN_QUANTILE = 0.9  # of observed / predicted batch time, over the window
MAX_SLOWDOWN = 1.5  # bounded: a pessimism that shrinks batches must not feed on itself
# First-token promises (Calibration) may stretch further: the raw prediction is what is
# observed against, so a stretched promise does not feed on itself, and a cap it binds at
# is a promise broken after admission (504) instead of a refusal at once (429).
MAX_PROMISE_SLOWDOWN = 4.0
# Calibration.factor_for: predictions within this factor of each other are alike, and this
# many alike ones stand on their own.
LIKE, LIKE_SEEN = 2.0, 24
# ...and over the most recent this many judged too, the larger of the two: a promise tightens
# as soon as a heavier load's first tokens come late, and relaxes only as the window forgets.
RECENT = 64
# The bad batch one in a hundred: what batches that share an interactive request's wait
# (the batch running when it arrives, the batch-class items riding in its own batch) are
# sized against. Never what a request is promised (that would refuse work the engine serves).
TAIL_QUANTILE, MAX_TAIL = 0.99, 2.0


@dataclass(frozen=True, slots=True)
class LinearCost:
    fixed: float  # seconds per batch
    per_item: float  # seconds per item
    per_token: float  # seconds per (padded) token
    per_token_row: float = 0.0  # seconds per token x longest row (tokens^2 / items): attention

    def predict(self, items: int, tokens: int = 0) -> float:
        if items <= 0:
            return 0.0
        square = self.per_token_row * tokens * tokens / items if self.per_token_row else 0.0
        return max(0.0, self.fixed + self.per_item * items + self.per_token * tokens + square)


class CostModel:
    """Online-fitted per-phase linear cost. Thread-compatible: used from the event loop only."""

    def __init__(
        self, prior: LinearCost | None = None, window: int = 256, refit_every: int = 8, quadratic: bool = False
    ):
        self._prior = prior or LinearCost(0.010, 0.002, 0.0)
        self.quadratic = quadratic  # also fit the tokens^2 / items term (attention), when it pays
        self._fit = self._prior
        self._obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._ratios: deque[float] = deque(maxlen=window)  # observed / predicted
        self._slowdown = self._tail = 1.0
        self._refit_every = refit_every
        self._since_fit = 0

    @property
    def params(self) -> LinearCost:
        return self._fit

    @property
    def observations(self) -> int:
        return len(self._obs)

    def predict(self, items: int, tokens: int = 0) -> float:
        return self._fit.predict(items, tokens)

    @property
    def slowdown(self) -> float:
        """The 90th percentile of observed / predicted batch time lately, within [1, 1.5].

        Interactive deadlines multiply predictions by it, so a request is promised only what
        nine batches in ten deliver; bounded, because batches cut smaller by it miss the fit
        by more. Batch sizes that the load needs (the keep-up floor) never use it."""
        return self._slowdown

    @property
    def tail(self) -> float:
        """The 99th percentile of observed / predicted batch time lately, within
        [slowdown, 2]. Promises use `slowdown`; the batches an interactive request waits
        for or shares are sized against `tail`, so that the slow batch one in a hundred
        still leaves it on time (bench_latency, "priority": at the 90th percentile the late
        interactive answers were those batches running long)."""
        return self._tail

    def seed(self, profile: list[tuple[int, int, float]]) -> None:
        """Fit to a warm-up profile of (items, tokens, seconds). The predictions it replaces
        were the prior's guesses, so their errors say nothing about the slowdown."""
        self._obs.extend(profile)
        self.refit()

    def observe(self, items: int, tokens: int, seconds: float) -> float:
        """Record one batch; returns the relative error of the prediction made before it."""
        predicted = self.predict(items, tokens)
        self._obs.append((items, tokens, seconds))
        if predicted > 0:
            self._ratios.append(seconds / predicted)
        self._since_fit += 1
        if self._since_fit >= self._refit_every:
            self.refit()
        return abs(seconds - predicted) / max(seconds, 1e-6)

    def refit(self) -> None:
        """Robust two-parameter fit: time = fixed + slope * x, x = padded tokens when the
        phase reports tokens (embed, prefill), else items (decode).

        Batch size and padded tokens move together, so fitting both at once is ill-conditioned
        and a little noise (a busy neighbour on a shared core) gave absurd coefficients. One
        driver, least squares, then one pass that drops outliers beyond 3 MADs (CPU
        contention only ever makes batches slower), then refit.
        """
        self._since_fit = 0
        if self._ratios:
            slow, tail = np.quantile(np.asarray(self._ratios), [SLOWDOWN_QUANTILE, TAIL_QUANTILE])
            self._slowdown = min(max(float(slow), 1.0), MAX_SLOWDOWN)
            self._tail = min(max(float(tail), self._slowdown), MAX_TAIL)
        if len(self._obs) < 3:
            return
        data = np.asarray(self._obs, dtype=np.float64)
        n, tok, t = data[:, 0], data[:, 1], data[:, 2]
        by_tokens = bool(np.all(tok > 0))
        x = tok if by_tokens else n
        if np.ptp(x) == 0:
            # One size only: keep the prior's shape, rescale it to the observations.
            scale = float(np.median(t)) / max(self._fit.predict(int(n[0]), int(tok[0])), 1e-9)
            p = self._fit
            self._fit = LinearCost(p.fixed * scale, p.per_item * scale, p.per_token * scale, p.per_token_row * scale)
            return
        fixed, slope = _line(x, t)
        resid = t - (fixed + slope * x)
        mad = float(np.median(np.abs(resid - np.median(resid)))) or 1e-9
        keep = np.abs(resid) <= 3 * 1.4826 * mad
        if keep.sum() >= 3 and np.ptp(x[keep]) > 0:
            fixed, slope = _line(x[keep], t[keep])
        self._fit = LinearCost(fixed, 0.0, slope) if by_tokens else LinearCost(fixed, slope, 0.0)
        if self.quadratic and by_tokens:
            self._fit = _with_square(self._fit, n[keep], x[keep], t[keep])


class Calibration:
    """How much later than predicted something comes lately: the SLOWDOWN_QUANTILE of
    observed / predicted over a sliding window, within [1, MAX_PROMISE_SLOWDOWN]; promises multiply
    their predictions by `factor`, so one is what nine in ten deliver. The larger of that over
    the window and over its last RECENT: after a load step the window's old ratios outvoted
    the new ones for seconds, when admitted requests came late (measured on the real model
    at 16 requests/s after 8: 7.1% of the admitted late, 4.5% with the recent ones counted).

    The generation scheduler calibrates its time-to-first-token prediction with it: that
    prediction is a sum of queueing (slots freeing, prompts ahead) and cost-model terms, and
    at overload, where admission fills the queue up to the budget, a prediction right on
    average leaves half the admitted requests late at the edge (measured: observed /
    predicted p50 1.03, p90 1.27, and one admitted request in ten late at 1.5x capacity).
    Predictions under `floor` seconds are not observed: their ratio is noise (fixed costs the
    deadline margin covers), and at light load they would inflate the promises of heavy load.
    A request that expires before its first token is observed at its expiry (its wait so far,
    a lower bound); one cancelled first says nothing.

    Its cap was MAX_SLOWDOWN (1.5) until chat at twice its capacity beside interactive
    prompts (bench_latency's chat priority cells) was seen at that cap, the ratio's p90
    about 2.0: up to a quarter of the admitted batch-class requests then expired before
    their first token (docs/benchmarks-history.md, "First-token promises that hold at overload")."""

    def __init__(self, window: int = 256, refresh_every: int = 8, floor: float = 0.02) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._predicted: deque[float] = deque(maxlen=window)
        self._every, self._since, self._floor = refresh_every, 0, floor
        self.factor = 1.0
        self._seen = (np.zeros(0), np.zeros(0))  # (predicted, ratio) as of the last refresh

    def observe(self, predicted: float, observed: float) -> None:
        if predicted < self._floor:
            return
        self._ratios.append(observed / predicted)
        self._predicted.append(predicted)
        self._since += 1
        if self._since >= self._every:
            self._since = 0
            ratios = np.asarray(self._ratios)
            self.factor = _stretch(ratios, np.ones(len(ratios), dtype=bool), 1)
            self._seen = (np.asarray(self._predicted), ratios)

    def factor_for(self, predicted: float) -> float:
        """The factor for a prediction of `predicted` seconds: the SLOWDOWN_QUANTILE of
        observed / predicted over the predictions within a factor LIKE of it, where at least
        LIKE_SEEN were seen; else `factor`, over all. Part of a first token's error is fixed
        (a request's own handling, the engine thread's hand-off): short predictions miss by a
        larger ratio than long ones, and one factor over all stretched the long ones by the
        short ones' ratio, refusing interactive prompts their first tokens would have met."""
        seen, ratios = self._seen
        like = (seen >= predicted / LIKE) & (seen <= predicted * LIKE)
        if int(like.sum()) < LIKE_SEEN:
            return self.factor
        return _stretch(ratios, like, LIKE_SEEN)


def _stretch(ratios: np.ndarray, counted: np.ndarray, least: int) -> float:
    """The SLOWDOWN_QUANTILE of the `counted` ratios, or of those among the last RECENT where
    at least `least` are and theirs is larger; within [1, MAX_PROMISE_SLOWDOWN]."""
    q = float(np.quantile(ratios[counted], SLOWDOWN_QUANTILE))
    recent = counted[-RECENT:]
    if len(ratios) > RECENT and int(recent.sum()) >= least:
        q = max(q, float(np.quantile(ratios[-RECENT:][recent], SLOWDOWN_QUANTILE)))
    return min(max(q, 1.0), MAX_PROMISE_SLOWDOWN)


class PackedChunkCost:
    """What prompt chunks add to a packed step (the decode rows and the chunks in one
    forward, engine/packed.py), as `fixed + per_token x tokens`, measured: over the last
    `window` packed steps that carried both, each step's time less the decode model's
    prediction for its rows, against its chunk tokens. A line where the chunks' tokens
    spread (least squares, non-negative); where they are all alike (short chat prompts), the
    prefill model's per-token cost (at most what a chunk's tokens add, each) and the median
    of what is left as the fixed part. None until `min_seen` were seen.

    The prefill model cannot say it: its fit mixes prefills run alone, which pay a read of
    every weight, with the chunks of packed steps, whose time it gets back only as the share
    its own prediction claims of the step (`IterationResult.apportion`), so it keeps what it
    believed. On the real model its price of a packed iteration's new prompts made the
    iteration 1.4x what it took (0.285 against 0.199 s at the median), and every first token
    promised behind it that much later; what the chunks add is mostly a fixed part (their
    segment of the forward, their first token's logits and sampling, joining the rows)."""

    def __init__(self, window: int = 64, min_seen: int = 8, refresh_every: int = 4) -> None:
        self._seen: deque[tuple[float, float]] = deque(maxlen=window)  # (tokens, seconds added)
        self._min_seen, self._every, self._since = min_seen, refresh_every, 0
        self.params: tuple[float, float] | None = None  # (fixed, per_token)

    def observe(self, seconds: float, decode: float, tokens: int, per_token: float) -> None:
        """A packed step of `seconds` whose rows the decode model predicts at `decode`, with
        `tokens` chunk tokens; `per_token`: the prefill model's, where the tokens do not spread."""
        if tokens <= 0:
            return
        self._seen.append((float(tokens), max(seconds - decode, 0.0)))
        self._since += 1
        if len(self._seen) < self._min_seen or (self.params is not None and self._since < self._every):
            return
        self._since = 0
        x, t = np.asarray(self._seen).T
        if float(np.ptp(x)) >= 0.25 * float(x.max()) and len(x) >= 2 * self._min_seen:
            self.params = _line(x, t)
        else:  # (a per-token cost above what whole chunks add is not believed)
            per_token = min(per_token, float(np.median(t / x)))
            self.params = (max(float(np.median(t - per_token * x)), 0.0), per_token)

    def predict(self, tokens: int, iterations: int = 1) -> float | None:
        """What `tokens` chunk tokens add to the `iterations` packed steps that carry them
        (the fixed part in each); None until measured."""
        if self.params is None:
            return None
        fixed, per_token = self.params
        return iterations * fixed + per_token * tokens


def _line(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """Least-squares line with both coefficients kept non-negative."""
    slope, fixed = np.polyfit(x, t, 1)
    if slope < 0:
        return float(np.median(t)), 0.0
    if fixed < 0:
        return 0.0, float((x * t).sum() / (x * x).sum())
    return float(fixed), float(slope)


def _with_square(line: LinearCost, n: np.ndarray, x: np.ndarray, t: np.ndarray) -> LinearCost:
    """time = fixed + c * tokens + d * tokens^2 / items over the (outlier-free) observations,
    adopted over the line only when its coefficients are all non-negative and it leaves at
    least 10% less squared error, and only over rows of lengths that differ (for batches of
    one length the two columns are collinear: the line stays)."""
    longest = x / n
    if len(t) < 6 or np.ptp(longest) < 0.25 * float(longest.max()):
        return line  # rows of about one length: the square is the line again
    design = np.stack([np.ones_like(x), x, x * x / n], axis=1)
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    coef = np.linalg.lstsq(design / scale, t, rcond=None)[0] / scale
    if np.any(coef < 0):
        return line
    square_error = float(((design @ coef - t) ** 2).sum())
    line_error = float(((line.fixed + line.per_token * x - t) ** 2).sum())
    if not square_error < 0.9 * line_error:
        return line
    return LinearCost(float(coef[0]), 0.0, float(coef[1]), float(coef[2]))


def cost_report(models: dict[str, CostModel]) -> dict[str, dict[str, float]]:
    """Each phase's fitted cost, in milliseconds, as the admin API shows it, with the
    slowdown promises allow for and the tail the batches around interactive work are sized on."""
    out = {}
    for phase, model in models.items():
        p = model.params
        out[phase] = {
            "fixed_ms": p.fixed * 1e3,
            "per_item_ms": p.per_item * 1e3,
            "per_token_ms": p.per_token * 1e3,
            "per_token_row_ms": p.per_token_row * 1e3,
            "observations": model.observations,
            "slowdown": model.slowdown,
            "tail": model.tail,
        }
    return out
