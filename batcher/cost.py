"""Cost model: predicted execution time of a batch from its size and tokens.

time = a + b * items + c * tokens, fitted by least squares over a sliding window of
observed batches, one fit per phase (embed, prefill, decode). Seeded by a warm-up profile
at startup so the first admission decisions are already informed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LinearCost:
    fixed: float  # seconds per batch
    per_item: float  # seconds per item
    per_token: float  # seconds per (padded) token

    def predict(self, items: int, tokens: int = 0) -> float:
        if items <= 0:
            return 0.0
        return max(0.0, self.fixed + self.per_item * items + self.per_token * tokens)


class CostModel:
    """Online-fitted per-phase linear cost. Thread-compatible: used from the event loop only."""

    def __init__(self, prior: LinearCost | None = None, window: int = 256, refit_every: int = 8):
        self._prior = prior or LinearCost(0.010, 0.002, 0.0)
        self._fit = self._prior
        self._obs: deque[tuple[int, int, float]] = deque(maxlen=window)
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

    def observe(self, items: int, tokens: int, seconds: float) -> float:
        """Record one batch; returns the relative error of the prediction made before it."""
        predicted = self.predict(items, tokens)
        self._obs.append((items, tokens, seconds))
        self._since_fit += 1
        if self._since_fit >= self._refit_every:
            self.refit()
        return abs(seconds - predicted) / max(seconds, 1e-6)

    def refit(self) -> None:
        self._since_fit = 0
        if len(self._obs) < 3:
            return
        data = np.asarray(self._obs, dtype=np.float64)
        n, tok, t = data[:, 0], data[:, 1], data[:, 2]
        # Use the token term only when tokens vary independently of size; otherwise the
        # system is degenerate and a two-parameter fit is the honest one.
        cols = [np.ones_like(n), n]
        use_tokens = np.ptp(tok / np.maximum(n, 1)) > 1e-9 and len(self._obs) >= 6
        if use_tokens:
            cols.append(tok)
        if np.ptp(n) == 0 and not use_tokens:
            # One batch size only: keep the prior's shape, rescale it to the observations.
            prior = self._fit.predict(int(n[0]), int(tok.mean()))
            scale = float(np.median(t)) / max(prior, 1e-9)
            self._fit = LinearCost(self._fit.fixed * scale, self._fit.per_item * scale, self._fit.per_token * scale)
            return
        coef, *_ = np.linalg.lstsq(np.stack(cols, axis=1), t, rcond=None)
        fixed, per_item = max(float(coef[0]), 0.0), max(float(coef[1]), 0.0)
        per_token = max(float(coef[2]), 0.0) if use_tokens else 0.0
        self._fit = LinearCost(fixed, per_item, per_token)
