"""Batch-job metrics, registered on the gateway's `Metrics.registry`.

(Kept here while batcher/metrics.py is being edited elsewhere; they belong there and
can move without changing their names.)
"""
from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge

from .store import JOB_STATUSES

LINE_STATUSES = ("completed", "failed", "cancelled", "expired")

_by_registry: "weakref.WeakKeyDictionary[CollectorRegistry, JobMetrics]" = weakref.WeakKeyDictionary()


class JobMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.jobs = Gauge("ferry_jobs", "Batch jobs in the store, by status.", ["status"], registry=registry)
        self.lines = Counter("ferry_job_lines_total", "Batch-job lines finished, by status (cancelled/expired: never run).",
                             ["status"], registry=registry)
        for s in JOB_STATUSES:
            self.jobs.labels(s).set(0)
        for s in LINE_STATUSES:
            self.lines.labels(s)

    @classmethod
    def on(cls, registry: CollectorRegistry) -> "JobMetrics":
        """One set per registry (two apps on one registry share it)."""
        m = _by_registry.get(registry)
        if m is None:
            m = _by_registry[registry] = cls(registry)
        return m

    def moved(self, old: str | None, new: str) -> None:
        if old == new:
            return
        if old is not None:
            self.jobs.labels(old).dec()
        self.jobs.labels(new).inc()

    def load(self, counts: dict[str, int]) -> None:
        for s in JOB_STATUSES:
            self.jobs.labels(s).set(counts.get(s, 0))
