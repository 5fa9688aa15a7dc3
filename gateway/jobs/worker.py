"""The batch-job executor.

One task per active job walks its pending lines in order and keeps at most
`LINES_IN_FLIGHT` of them in flight. Each line is translated like a direct request
(gateway/translate/) and submitted with `submit_many(priority=Priority.BATCH)` to the same
micro-batcher interactive requests use, so batch work fills the capacity interactive work
leaves and never pushes interactive requests past their budgets. A refusal at admission
(queue full, deadline infeasible) is not a failure: the line waits and tries again.

Each finished line is committed to the store (group commit: lines finishing together
share one transaction) before it counts as done; a line not committed when the process
dies is still `pending` and runs again on restart, a committed one never does.

Stopping a job (cancel, the completion window ending, server shutdown) cancels the
job's lines whose work items are all still queued (they are never computed) and lets
lines already running finish and be recorded. Once nothing is in flight, a cancelled or
expired job is finalised: its unrun lines are marked cancelled/expired (listed in the
error file), the output/error files are registered and the job takes its final status.
On shutdown nothing is finalised: unrun lines stay pending for the next start.

With several front ends (`--api-workers N`, N >= 2) every front end serves the batch-job
routes from the one store, but only the holder of the store's `worker_lease` runs jobs.
Each front end tries to take or renew the lease every `LEASE_RENEW_S` (`tick`); the holder
then also adopts what the others wrote: it launches active jobs it does not run yet (a
batch created through another front end) and stops those another front end marked
`cancelling`. A holder that dies (or stalls past `LEASE_TTL_S`) loses the lease and another
front end takes over; lines are committed once (`... WHERE status = 'pending'`), so a
takeover runs again only the lines that were not committed. A holder that finds its lease
taken stops its jobs as on shutdown (their unrun lines stay pending for the new holder).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from batcher.errors import (
    BatchingError,
    Cancelled,
    DeadlineExceeded,
    DeadlineInfeasible,
    ModelUnavailable,
    QueueFull,
    ShuttingDown,
)
from batcher.types import Priority, WorkItem

from ..errors import APIError, error_body
from ..models.kinds import CHAT
from ..models.start import ServedModel
from ..responses import json_bytes, json_response
from ..translate.chat import GenerationWork
from ..translate.structured import compile_structures
from . import store as st
from .metrics import JobMetrics
from .validate import MAX_REPORTED, BatchCreate, LineError, check_create, prepare, validate_file

if TYPE_CHECKING:
    from ..models.served import ServedBatcher
    from ..state import GatewayState

log = logging.getLogger("ferry.jobs")

LINES_IN_FLIGHT = 64  # per job
# Batch work's share of one model, across all jobs (work items queued or running): at most
# half the running slots of a generation model, so interactive prompts always find a slot
# rather than waiting for batch sequences to finish; for one-shot models, a few batches'
# worth, and at most half the queue, so interactive requests never meet a full queue.
GEN_SHARE = 0.5
ONESHOT_BATCHES = 4
PAGE = 256  # pending lines read per query
RETRY_MIN, RETRY_MAX = 0.01, 0.5  # seconds between admission retries
# The job-worker lease of several front ends: renewed this often, and lost when not renewed
# for LEASE_TTL_S (a dead holder's jobs are taken over within about that long).
LEASE_RENEW_S = 1.0
LEASE_TTL_S = 5.0


class InvalidFile(APIError):
    """422 listing every faulty line of an input file."""

    def __init__(self, file_id: str, errors: list[LineError]):
        shown = "; ".join(f"line {e.line}: {e.message}" for e in errors[:10])
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        super().__init__(
            422,
            f"input file {file_id} has {len(errors)} invalid line(s): {shown}{more}",
            code="invalid_batch_file",
            param="input_file_id",
        )
        self.errors = errors

    def response(self, headers: dict[str, str] | None = None):
        body = error_body(self.status, self.message, self.code, self.param)
        body["error"]["lines"] = [e.line for e in self.errors]
        body["error"]["errors"] = {"object": "list", "data": [e.to_dict() for e in self.errors[:MAX_REPORTED]]}
        return json_response(body, self.status, headers)


@dataclass(eq=False)
class LineRun:
    line: int
    batcher: ServedBatcher | None = None
    items: list[WorkItem] = field(default_factory=list)
    task: asyncio.Task | None = None


@dataclass(eq=False)
class Job:
    id: str
    status: str
    expires_ts: float
    stop: str | None = None  # cancel | expire | shutdown
    running: dict[int, LineRun] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    async def wait(self) -> None:
        self.changed.clear()
        await self.changed.wait()

    async def sleep(self, seconds: float) -> None:
        """Sleep, or less if the job stops."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopped.wait(), seconds)


class Share:
    """Batch-class items in flight on one model, across jobs."""

    def __init__(self) -> None:
        self.used = 0
        self.changed = asyncio.Event()

    @staticmethod
    def limit(served: ServedModel[Any]) -> int:
        s = served.batcher.settings
        if served.kind == CHAT:
            return max(1, int(s.max_running * GEN_SHARE))
        return max(1, min(ONESHOT_BATCHES * s.max_batch_size, s.max_queue // 2))

    def release(self, n: int) -> None:
        self.used -= n
        self.changed.set()


class BatchJobWorker:
    def __init__(
        self,
        ferry: GatewayState,
        *,
        in_flight: int = LINES_IN_FLIGHT,
        shared: bool | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.ferry = ferry
        # shared: one of several front ends on this data directory (run jobs only with the lease)
        self.shared = ferry.config.api_workers > 1 if shared is None else shared
        self.store = st.Store(ferry.config.data_dir, exclusive=not self.shared)
        self.clock = clock
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.holding = not self.shared  # alone on the directory: always the job worker
        self._leaser: asyncio.Task | None = None
        self.metrics = JobMetrics(ferry.metrics)
        self.metrics.counting = self.holding
        self.in_flight = in_flight
        self.jobs: dict[str, Job] = {}
        self.shares: dict[str, Share] = {}
        self.admission_retries = 0
        self._open_lock = asyncio.Lock()
        self._commits: list[tuple[tuple[str, int, str, str], asyncio.Future]] = []
        self._commit_wake = asyncio.Event()
        self._committer: asyncio.Task | None = None
        self._resumer: asyncio.Task | None = None
        self._paused = False
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, loader: asyncio.Task | None = None) -> None:
        """Resume unfinished jobs once the models are loaded (called from the lifespan)."""
        self._resumer = asyncio.create_task(self._resume_after(loader), name="ferry-jobs-resume")

    async def _resume_after(self, loader: asyncio.Task | None) -> None:
        if loader is not None:
            await loader
        if not self.ferry.ready:
            return
        if self.shared:
            self._leaser = asyncio.create_task(self._lease_loop(), name="ferry-jobs-lease")
            return
        if not self.store.exists():
            return
        try:
            await self.ensure_open()
        except APIError as exc:
            log.error("batch jobs not resumed: %s", exc.message)
            return
        rows = await self.store.read(self.store.active_batches)
        for row in rows:
            if row["id"] not in self.jobs and not self._paused:
                log.info("resuming batch %s (%s)", row["id"], row["status"])
                self._launch(row)

    async def ensure_open(self) -> None:
        if self.store.is_open:
            return
        if self._closed or self._paused:
            raise APIError(503, "server is shutting down", code="shutting_down", retry_after=1)
        async with self._open_lock:
            if self.store.is_open:
                return
            try:
                await self.store.open()
            except st.StoreLocked as exc:
                raise APIError(503, str(exc), code="data_dir_locked") from None
            except OSError as exc:
                log.exception("cannot open the job store in %s", self.store.dir)
                raise APIError(500, f"cannot open the job store: {exc}", code="store_error") from None
            if self.holding:
                self.metrics.load(await self.store.read(self.store.status_counts))
            self._committer = asyncio.create_task(self._commit_loop(), name="ferry-jobs-commit")

    # -- the lease (several front ends) ------------------------------------------------------
    async def _lease_loop(self) -> None:
        while not self._paused:
            try:
                await self.tick()
            except Exception:  # a locked or failing store: try again at the next renewal
                log.exception("batch-job lease: renewal failed")
            await asyncio.sleep(LEASE_RENEW_S)

    async def tick(self) -> bool:
        """Take or renew the lease; as its holder, run the active jobs. Returns whether this
        front end holds the lease now."""
        if self._paused or self._closed:
            return False
        if not self.store.is_open:
            if not self.store.exists():
                return False  # no job was ever created here
            try:
                await self.ensure_open()
            except APIError as exc:
                log.error("batch jobs: %s", exc.message)
                return False
        held = await self.store.write(self.store.take_lease, self.holder, self.clock(), LEASE_TTL_S)
        if held and not self.holding:
            log.info("batch-job worker: this front end (%s) runs batch jobs now", self.holder)
        elif self.holding and not held:
            log.warning("batch-job worker: lease lost to another front end; stopping this one's jobs")
            for job in self.jobs.values():
                self._stop(job, "shutdown")  # unrun lines stay pending for the new holder
        self.holding = self.metrics.counting = held
        # ferry_jobs is the holder's alone, from the store: other front ends move jobs too
        self.metrics.load(await self.store.read(self.store.status_counts) if held else {})
        if held:
            await self._adopt()
        return held

    async def _adopt(self) -> None:
        """Run the active jobs this front end does not run yet; stop those cancelled elsewhere."""
        for row in await self.store.read(self.store.active_batches):
            if self._paused or not self.holding:
                return
            job = self.jobs.get(row["id"])
            if job is None:
                log.info("running batch %s (%s)", row["id"], row["status"])
                self._launch(row)
            elif row["status"] == "cancelling" and job.stop is None:
                job.status = "cancelling"  # the front end that took the cancel counted it
                self._stop(job, "cancel")

    def pause(self) -> None:
        """Shutdown begins: stop submitting, give queued lines back (they stay pending)."""
        self._paused = True
        for job in self.jobs.values():
            self._stop(job, "shutdown")

    async def close(self, timeout: float = 10.0) -> None:
        self.pause()
        self._closed = True
        for task in (self._resumer, self._leaser):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._committer is not None:
            self._committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._committer
        if self.shared and self.holding and self.store.is_open:
            with contextlib.suppress(Exception):  # another front end takes over at once
                await self.store.write(self.store.release_lease, self.holder)
            self.holding = False
        if self.store.is_open:
            await self.store.close()

    # -- API operations ---------------------------------------------------------------------
    async def upload(self, content: bytes, filename: str, purpose: str) -> dict:
        await self.ensure_open()
        row = {
            "id": "file-" + uuid.uuid4().hex,
            "purpose": purpose,
            "filename": filename,
            "bytes": len(content),
            "created_at": int(time.time()),
            "kind": "upload",
        }
        await self.store.write(self.store.insert_file, row, content)
        return row

    async def get_file(self, file_id: str) -> dict:
        await self.ensure_open()
        row = await self.store.read(self.store.get_file, file_id)
        if row is None:
            raise APIError(404, f"No such file: {file_id}", code="file_not_found", param="file_id")
        return row

    async def file_content(self, file_id: str) -> bytes:
        await self.get_file(file_id)
        content = await self.store.read(self.store.file_content, file_id)
        return content or b""

    async def create(self, body: BatchCreate) -> dict:
        window = check_create(body)
        await self.ensure_open()
        f = await self.store.read(self.store.get_file, body.input_file_id)
        if f is None or f["kind"] != "upload":
            raise APIError(404, f"No such file: {body.input_file_id}", code="file_not_found", param="input_file_id")
        if f["purpose"] != "batch":
            raise APIError(
                422,
                f"file {body.input_file_id} has purpose {f['purpose']!r}; batches need purpose 'batch'",
                code="invalid_value",
                param="input_file_id",
            )
        self._check_ready()
        content = await self.store.read(self.store.file_content, body.input_file_id)
        if content is None:  # deleted since the check above
            raise APIError(404, f"No such file: {body.input_file_id}", code="file_not_found", param="input_file_id")
        good, errors = await asyncio.to_thread(validate_file, self.ferry, content, body.endpoint)
        if errors:
            raise InvalidFile(body.input_file_id, errors)
        self._check_ready()
        now = time.time()
        row: dict[str, Any] = {
            "id": "batch_" + uuid.uuid4().hex,
            "input_file_id": body.input_file_id,
            "endpoint": body.endpoint,
            "completion_window": body.completion_window,
            "expires_ts": now + window,
            "metadata": None if body.metadata is None else orjson.dumps(body.metadata).decode(),
            "status": "in_progress",
            "created_at": int(now),
            "in_progress_at": int(now),
            "total": len(good),
        }
        await self.store.write(self.store.create_batch, row, [(v.line, v.custom_id, v.url, v.body) for v in good])
        self.metrics.moved(None, "in_progress")
        if self.holding:
            self._launch(row)  # else the lease's holder adopts it at its next renewal
        log.info("batch %s created: %d requests, window %s", row["id"], len(good), body.completion_window)
        return await self.get(row["id"])

    async def get(self, batch_id: str) -> dict:
        await self.ensure_open()
        row = await self.store.read(self.store.get_batch, batch_id)
        if row is None:
            raise APIError(404, f"No such batch: {batch_id}", code="batch_not_found", param="batch_id")
        return row

    async def list(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        await self.ensure_open()
        page = await self.store.read(self.store.list_batches, after, limit)
        if page is None:
            raise APIError(404, f"No such batch: {after}", code="batch_not_found", param="after")
        return page

    async def cancel(self, batch_id: str) -> dict:
        row = await self.get(batch_id)
        job = self.jobs.get(batch_id)
        if job is not None and job.stop in (None, "shutdown") and job.status in ("validating", "in_progress"):
            self._stop(job, "cancel")  # queued lines are cancelled now, before any await
            await self._set_status(job, "cancelling")
        elif job is None and row["status"] in ("validating", "in_progress"):
            # Not running here yet (models still loading): the resume finalises it as cancelled.
            if await self.store.write(self.store.set_status, batch_id, "cancelling", ("validating", "in_progress")):
                self.metrics.moved(row["status"], "cancelling")
            job = self.jobs.get(batch_id)
            if job is not None:  # launched meanwhile from an older read
                self._stop(job, "cancel")
        elif row["status"] in ("failed", "completed", "expired"):
            raise APIError(
                400,
                f"cannot cancel batch {batch_id}: it is already {row['status']}",
                code="batch_not_cancellable",
                param="batch_id",
            )
        return await self.get(batch_id)

    def _check_ready(self) -> None:
        ferry = self.ferry
        if ferry.draining or self._paused:
            raise APIError(503, "server is shutting down", code="shutting_down", retry_after=1)
        if not ferry.ready:
            raise APIError(
                503,
                "models are still loading" if ferry.load_error is None else f"model loading failed: {ferry.load_error}",
                code="not_ready",
                retry_after=2,
            )

    # -- running jobs --------------------------------------------------------------------------
    def _launch(self, row: dict) -> None:
        job = Job(row["id"], row["status"], float(row["expires_ts"]))
        if row["status"] == "cancelling":
            job.stop = "cancel"
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._drive(job), name=f"ferry-job-{job.id}")

    def _stop(self, job: Job, reason: str) -> None:
        if job.stop is None or (job.stop == "shutdown" and reason == "cancel"):
            job.stop = reason
        self._cancel_queued(job)
        job.stopped.set()
        job.changed.set()

    def _cancel_queued(self, job: Job) -> None:
        """Lines whose items are all still queued are cancelled (never computed); a line
        any of whose items has started runs to completion."""
        for run in job.running.values():
            b = run.batcher
            if b is not None and run.items and all(not i.finished and i in b.queue for i in run.items):
                for item in run.items:
                    b.cancel(item)

    def _expire(self, job: Job) -> None:
        if job.stop is None:
            log.info("batch %s: completion window ended", job.id)
            self._stop(job, "expire")

    async def _set_status(self, job: Job, status: str) -> None:
        # In-memory state and metrics move first; the single writer thread keeps DB order.
        old, job.status = job.status, status
        self.metrics.moved(old, status)
        await self.store.write(self.store.set_status, job.id, status)

    async def _drive(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(max(0.0, job.expires_ts - time.time()), self._expire, job)
        try:
            fresh = await self.store.read(self.store.get_batch, job.id)
            if fresh is not None and fresh["status"] == "cancelling" and job.stop in (None, "shutdown"):
                job.status = "cancelling"
                self._stop(job, "cancel")
            if job.status == "validating":
                await self._set_status(job, "in_progress")
            passes = 0
            while True:
                await self._run_pending(job)
                while job.running:
                    await job.wait()
                if job.stop is not None:
                    break
                if not await self.store.read(self.store.pending_lines, job.id, 0, 1):
                    break
                # Lines left pending (window edge, store error): another pass, backing off.
                passes += 1
                await job.sleep(min(0.05 * 2**passes, 5.0))
            if job.stop == "shutdown":
                return
            await self._finalize(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("batch %s failed", job.id)
            self._stop(job, "cancel")  # queued lines are not computed for a failed job
            with contextlib.suppress(Exception):
                errors = {
                    "object": "list",
                    "data": [
                        {
                            "code": "internal_error",
                            "message": f"{type(exc).__name__}: {exc}",
                            "line": None,
                            "param": None,
                        }
                    ],
                }
                old, job.status = job.status, "failed"
                await self.store.write(
                    self.store.finalize, job.id, "failed", st.CANCELLED, orjson.dumps(errors).decode()
                )
                self.metrics.moved(old, "failed")
        finally:
            timer.cancel()
            if self.jobs.get(job.id) is job:
                del self.jobs[job.id]

    async def _run_pending(self, job: Job) -> None:
        cursor = 0
        while job.stop is None:
            rows = await self.store.read(self.store.pending_lines, job.id, cursor, PAGE)
            if not rows:
                return
            for row in rows:
                while len(job.running) >= self.in_flight and job.stop is None:
                    await job.wait()
                if job.stop is not None:
                    return
                cursor = row["line"]
                run = LineRun(row["line"])
                job.running[run.line] = run
                run.task = asyncio.create_task(self._line(job, run, row))

    async def _finalize(self, job: Job) -> None:
        final, unrun = {"cancel": ("cancelled", st.CANCELLED), "expire": ("expired", st.EXPIRED)}.get(
            job.stop or "", ("completed", None)
        )
        await self._set_status(job, "finalizing")
        info = await self.store.write(self.store.finalize, job.id, final, unrun)
        self.metrics.moved(job.status, final)
        job.status = final
        if unrun is not None and info["swept"]:
            self.metrics.lines.labels(unrun).inc(info["swept"])
        log.info("batch %s %s", job.id, final)

    async def _line(self, job: Job, run: LineRun, row: dict) -> None:
        try:
            outcome = await self._execute(job, run, row)
            if outcome is not None:
                status, record = outcome
                if await self._commit(job.id, run.line, status, record):
                    self.metrics.lines.labels(status).inc()
        except asyncio.CancelledError:
            for item in run.items:
                if run.batcher is not None:
                    run.batcher.cancel(item)
            raise
        except Exception:
            log.exception("batch %s line %d: not recorded (it stays pending)", job.id, run.line)
        finally:
            job.running.pop(run.line, None)
            job.changed.set()

    async def _execute(self, job: Job, run: LineRun, row: dict) -> tuple[str, str] | None:
        """(status, output record), or None when the line did not run (it stays pending)."""
        rid = uuid.uuid4().hex
        try:
            served, work = prepare(self.ferry, row["url"], row["body"])
            if isinstance(work, GenerationWork):
                await compile_structures(work.structures, served.engine)
        except APIError as exc:
            if exc.status == 503:
                return None
            return st.FAILED, self._record(
                job, row, rid, exc.status, error_body(exc.status, exc.message, exc.code, exc.param)
            )
        batcher = run.batcher = served.batcher
        share = self.shares.setdefault(served.name, Share())
        n = len(work.payloads)
        while share.used and share.used + n > share.limit(served):  # one line always fits
            if job.stop is not None:
                return None
            share.changed.clear()
            await _first(share.changed.wait(), job.stopped.wait())
        share.used += n
        try:
            delay = RETRY_MIN
            while True:
                budget = job.expires_ts - time.time()
                if job.stop is not None or batcher.closing or budget <= 0:
                    return None
                try:
                    run.items = await batcher.submit_many(
                        work.payloads,
                        costs=work.costs,
                        budget=budget,
                        priority=Priority.BATCH,
                        request_id=rid,
                        count_rejection=False,
                    )  # retried, not refused
                    break
                except (QueueFull, DeadlineInfeasible):
                    self.admission_retries += 1
                    await job.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX)
                except (ShuttingDown, ModelUnavailable):
                    return None
            outcome = await _gather(batcher, run.items)
        finally:
            share.release(n)
        if not isinstance(outcome, BaseException):
            return st.COMPLETED, self._record(job, row, rid, 200, work.response(outcome))
        if isinstance(outcome, (Cancelled, ShuttingDown, DeadlineExceeded, ModelUnavailable)):
            return None  # never ran to the end: swept as cancelled/expired, or run again after a restart
        err = (
            APIError.from_batching(outcome)
            if isinstance(outcome, BatchingError)
            else APIError(500, f"{type(outcome).__name__}: {outcome}")
        )
        return st.FAILED, self._record(
            job, row, rid, err.status, error_body(err.status, err.message, err.code, err.param)
        )

    @staticmethod
    def _record(job: Job, row: dict, rid: str, status: int, body: dict) -> str:
        return json_bytes(
            {
                "id": st.line_id(job.id, row["line"]),
                "custom_id": row["custom_id"],
                "response": {"status_code": status, "request_id": rid, "body": body},
                "error": None,
            }
        ).decode()

    # -- group commit ------------------------------------------------------------------------------
    async def _commit(self, batch_id: str, line: int, status: str, record: str) -> bool:
        fut = asyncio.get_running_loop().create_future()
        self._commits.append(((batch_id, line, status, record), fut))
        self._commit_wake.set()
        return await fut

    async def _commit_loop(self) -> None:
        while True:
            await self._commit_wake.wait()
            self._commit_wake.clear()
            pending, self._commits = self._commits, []
            if not pending:
                continue
            try:
                flags = await self.store.write(self.store.commit_lines, [p[0] for p in pending])
            except asyncio.CancelledError:
                for _, fut in pending:
                    if not fut.done():
                        fut.cancel()
                raise
            except Exception as exc:
                log.exception("committing %d batch lines failed", len(pending))
                for _, fut in pending:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), ok in zip(pending, flags, strict=True):
                if not fut.done():
                    fut.set_result(ok)


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
