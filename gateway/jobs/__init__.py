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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .worker import BatchJobWorker

__all__ = ["BatchJobWorker"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that the store alone (the `--api-workers` supervisor takes
    # the data directory's lock with it) does not import the worker and starlette.
    if name == "BatchJobWorker":
        from .worker import BatchJobWorker

        return BatchJobWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
