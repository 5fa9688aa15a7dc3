"""Batch-job metrics: the `ferry_jobs` and `ferry_job_lines_total` of batcher/metrics.py,
with the bookkeeping of job status moves."""

from __future__ import annotations

from batcher.metrics import Metrics

from .store import JOB_STATUSES

LINE_STATUSES = ("completed", "failed", "cancelled", "expired")


class JobMetrics:
    """`counting`: this process keeps `ferry_jobs`. Of several front ends on one store only
    the lease's holder does (reloading it from the store at every renewal; the others hold
    0), and a /metrics scrape takes the largest over the front ends alive (its multiprocess
    mode, batcher/metrics.py), so each job counts once."""

    def __init__(self, metrics: Metrics):
        self.counting = True
        self.jobs = metrics.jobs
        self.lines = metrics.job_lines
        for s in JOB_STATUSES:
            self.jobs.labels(s).set(0)
        for s in LINE_STATUSES:
            self.lines.labels(s)

    def moved(self, old: str | None, new: str) -> None:
        if old == new or not self.counting:
            return
        if old is not None:
            self.jobs.labels(old).dec()
        self.jobs.labels(new).inc()

    def load(self, counts: dict[str, int]) -> None:
        for s in JOB_STATUSES:
            self.jobs.labels(s).set(counts.get(s, 0))
