"""The one percentile definition of the tuner and the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank: the smallest value with at least q% of
    the values at or below it, so a p99 is a latency some request really had (locust's own
    percentiles, which `ferry tune` reads, are also observed values). NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return float(ordered[k])
