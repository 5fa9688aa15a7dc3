"""Running one line of a batch job.

The line is translated like a direct request (gateway/translate/), waits for room in its
model's batch share (share.py), and is submitted with `submit_many(priority=Priority.BATCH)`
to the same served batcher interactive requests use, so batch work fills the capacity
interactive work leaves and never pushes interactive requests past their budgets. A
refusal at admission (queue full, deadline infeasible) is not a failure: the line waits
and tries again. Its results, or its error, become the line's output record, the same
response body a direct request would get.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from batcher.errors import (
    BatchingError,
    Cancelled,
    DeadlineExceeded,
    DeadlineInfeasible,
    ModelUnavailable,
    QueueFull,
    ShuttingDown,
    TenantQuota,
)
from batcher.types import Priority, WorkItem

from ..errors import APIError, error_body
from ..models.served import ServedBatcher
from ..models.start import ServedModel
from ..responses import json_bytes
from ..translate.chat import GenerationWork
from ..translate.structured import compile_structures
from ..translate.work import Work
from .host import JobsHost
from .job import Job, LineRun
from .share import Share
from .store import COMPLETED, FAILED, line_id
from .validate import prepare

RETRY_MIN, RETRY_MAX = 0.01, 0.5  # seconds between admission retries

Outcome = tuple[str, str]  # the line's status and its output record


class LineExecutor:
    def __init__(self, host: JobsHost) -> None:
        self.host = host
        self.shares: dict[str, Share] = {}
        self.admission_retries = 0

    async def execute(self, job: Job, run: LineRun, row: dict) -> Outcome | None:
        """(status, output record), or None when the line did not run (it stays pending)."""
        rid = uuid.uuid4().hex
        try:
            served, work = prepare(self.host, row["url"], row["body"])
            if isinstance(work, GenerationWork):
                await compile_structures(work.structures, served.engine)
        except APIError as exc:
            if exc.status == 503:
                return None
            return failed(job, row, rid, exc)
        batcher = run.batcher = served.batcher
        share = self.shares.setdefault(served.name, Share())
        n = len(work.payloads)
        if not await self._enter(job, share, served, n):
            return None
        try:
            if not await self._submit(job, run, batcher, work, rid):
                return None
            outcome = await _gather(batcher, run.items)
        except BatchingError as exc:  # refused for good at admission (more items than the queue holds)
            return failed(job, row, rid, APIError.from_batching(exc))
        finally:
            share.release(n)
        if not isinstance(outcome, BaseException):
            try:
                body = work.response(outcome)
            except APIError as exc:  # the model's outputs cannot make a response (a custom model's)
                return failed(job, row, rid, exc)
            return COMPLETED, record(job, row, rid, 200, body)
        if isinstance(outcome, (Cancelled, ShuttingDown, DeadlineExceeded, ModelUnavailable)):
            return None  # never ran to the end: swept as cancelled/expired, or run again after a restart
        err = (
            APIError.from_batching(outcome)
            if isinstance(outcome, BatchingError)
            else APIError(500, f"{type(outcome).__name__}: {outcome}")
        )
        return failed(job, row, rid, err)

    async def _enter(self, job: Job, share: Share, served: ServedModel[Any], n: int) -> bool:
        """Take `n` places in the model's batch share, waiting for room; False if the job stops."""
        while share.used and share.used + n > share.limit(served):  # one line always fits
            if job.stop is not None:
                return False
            share.changed.clear()
            await _first(share.changed.wait(), job.stopped.wait())
        share.used += n
        return True

    async def _submit(self, job: Job, run: LineRun, batcher: ServedBatcher, work: Work, rid: str) -> bool:
        """Queue the line's items (`run.items`), retrying refusals at admission; False when
        it cannot be queued any more (the job stops, the window ends, the model goes). A
        refusal retrying cannot help (`RequestTooLarge`) is raised: the line fails with it."""
        delay = RETRY_MIN
        while True:
            budget = job.expires_ts - time.time()
            if job.stop is not None or batcher.closing or budget <= 0:
                return False
            try:
                run.items = await batcher.submit_many(
                    work.payloads,
                    costs=work.costs,
                    budget=budget,
                    priority=Priority.BATCH,
                    request_id=rid,
                    count_rejection=False,
                    tenant=self.host.tenancy.owner_tenant(job.owner),
                )  # retried, not refused
                return True
            except (QueueFull, DeadlineInfeasible, TenantQuota):
                self.admission_retries += 1
                await job.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
            except (ShuttingDown, ModelUnavailable):
                return False


def record(job: Job, row: dict, rid: str, status: int, body: dict) -> str:
    return json_bytes(
        {
            "id": line_id(job.id, row["line"]),
            "custom_id": row["custom_id"],
            "response": {"status_code": status, "request_id": rid, "body": body},
            "error": None,
        }
    ).decode()


def failed(job: Job, row: dict, rid: str, err: APIError) -> Outcome:
    return FAILED, record(job, row, rid, err.status, error_body(err.status, err.message, err.code, err.param))


async def _first(*aws: Any) -> None:
    """Wait until the first of the awaitables is done; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def _gather(batcher: ServedBatcher, items: list[WorkItem]) -> list[Any] | BaseException:
    """Results in order, or the first failure (the line's other items are then cancelled)."""
    futs = [i.result_future for i in items]
    try:
        await asyncio.wait(futs, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for item in items:
            batcher.cancel(item)
        raise
    first = next((f.exception() for f in futs if f.done() and not f.cancelled() and f.exception() is not None), None)
    if first is None:
        return [f.result() for f in futs]
    for item in items:
        batcher.cancel(item)
    for f in futs:  # mark every exception retrieved
        if f.done() and not f.cancelled():
            f.exception()
    return first
