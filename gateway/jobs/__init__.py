"""Batch jobs: OpenAI-compatible files and batches, run as batch-class work items through
the same micro-batchers as interactive traffic, with their state in SQLite under
`--data-dir` so that a restart resumes where it stopped.

- `store`: the SQLite store (files, jobs, per-line status and results).
- `validate`: whole-file validation at batch creation, and turning a line into work.
- `worker`: the executor that feeds lines to the batchers, commits results, cancels,
  expires and finalises jobs.
- `metrics`: `ferry_jobs{status}` and `ferry_job_lines_total{status}`.
"""

from __future__ import annotations

from .worker import BatchJobWorker

__all__ = ["BatchJobWorker"]
