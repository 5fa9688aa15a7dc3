"""The locustfile's JSON report (`--ferry-report`): per-entry counts within the SLO and
latency percentiles, counted from each request's scheduled arrival, and how late the
arrivals started. `ferry tune` reads it back (tuner/sweep.py)."""

from __future__ import annotations

import math

from tuner.arrivals import LOAD
from tuner.percentile import percentile

MAX_SAMPLES = 200_000


class Report:
    """Per-entry counts and latencies (from the scheduled arrival), reset when spawning ends."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.entries: dict[str, dict] = {}
        self.lags: list[float] = []
        self.late = 0
        self.last_done = 0.0  # seconds after the first arrival when the last request finished

    def record(self, name: str, ms: float, failed: bool, slo_ms: float) -> None:
        e = self.entries.setdefault(name, {"n": 0, "failures": 0, "within_slo": 0, "ms": []})
        e["n"] += 1
        self.last_done = max(self.last_done, LOAD.elapsed())
        if failed:
            e["failures"] += 1
        elif slo_ms <= 0 or ms <= slo_ms:
            e["within_slo"] += 1
        if not failed and len(e["ms"]) < MAX_SAMPLES:
            e["ms"].append(ms)

    def lag(self, seconds: float) -> None:
        if seconds > 0.010:
            self.late += 1
        if len(self.lags) < MAX_SAMPLES:
            self.lags.append(seconds * 1000)

    def summary(self) -> dict:
        out = {}
        for name, e in self.entries.items():
            out[name] = {k: e[k] for k in ("n", "failures", "within_slo")} | {
                "p50_ms": _ms(e["ms"], 50),
                "p99_ms": _ms(e["ms"], 99),
                "max_ms": max(e["ms"], default=None),
            }
        return {
            "entries": out,
            "late_starts": self.late,
            "lag_p99_ms": _ms(self.lags, 99),
            "lag_max_ms": max(self.lags, default=None),
            "last_done_s": round(self.last_done, 3),
        }


def _ms(values: list[float], q: float) -> float | None:
    """A percentile for the JSON report: rounded, None (null) without samples."""
    p = percentile(values, q)
    return None if math.isnan(p) else round(p, 3)


REPORT = Report()
