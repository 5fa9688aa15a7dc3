"""The runner: one task per active job walks its pending lines in order and keeps at most
`LINES_IN_FLIGHT` of them in flight, each run by lines.py and its result committed to the
store by group commit (commit.py) before it counts as done.

Stopping a job (cancel, the completion window ending, server shutdown, the lease lost)
cancels the job's lines whose work items are all still queued (they are never computed)
and lets lines already running finish and be recorded. Once nothing is in flight, a
cancelled or expired job is finalised: its unrun lines are marked cancelled/expired
(listed in the error file), the output/error files are registered and the job takes its
final status. On shutdown nothing is finalised: unrun lines stay pending for the next start
(or for the lease's next holder).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import orjson

from .commit import GroupCommit
from .job import Job, LineRun
from .lines import LineExecutor
from .metrics import JobMetrics
from .store import CANCELLED, EXPIRED, Store

log = logging.getLogger("ferry.jobs")

LINES_IN_FLIGHT = 64  # per job
PAGE = 256  # pending lines read per query
# A stopped job's final status and what its unrun lines become, by why it stopped.
FINAL = {"cancel": ("cancelled", CANCELLED), "expire": ("expired", EXPIRED)}


class JobRunner:
    def __init__(
        self,
        store: Store,
        metrics: JobMetrics,
        lines: LineExecutor,
        commits: GroupCommit,
        *,
        in_flight: int = LINES_IN_FLIGHT,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.lines = lines
        self.commits = commits
        self.in_flight = in_flight
        self.jobs: dict[str, Job] = {}
        self.paused = False  # shutdown began: nothing more is submitted

    # -- starting and stopping jobs ------------------------------------------------------
    def launch(self, row: dict) -> None:
        job = Job(row["id"], row["status"], float(row["expires_ts"]), owner=row.get("owner"))
        if row["status"] == "cancelling":
            job.stop = "cancel"
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._drive(job), name=f"ferry-job-{job.id}")

    def resume(self, rows: list[dict]) -> None:
        """Launch the active jobs of the store (`rows`) not running yet."""
        for row in rows:
            if row["id"] not in self.jobs and not self.paused:
                log.info("resuming batch %s (%s)", row["id"], row["status"])
                self.launch(row)

    def stop(self, job: Job, reason: str) -> None:
        if job.stop is None or (job.stop == "shutdown" and reason == "cancel"):
            job.stop = reason
        self._cancel_queued(job)
        job.stopped.set()
        job.changed.set()

    def stop_all(self) -> None:
        """Stop every job as on shutdown: queued lines go back to pending, not computed now."""
        for job in self.jobs.values():
            self.stop(job, "shutdown")

    def pause(self) -> None:
        """Shutdown begins: stop submitting, give queued lines back (they stay pending)."""
        self.paused = True
        self.stop_all()

    async def finish(self, timeout: float) -> None:
        """Wait up to `timeout` for the jobs' tasks (their running lines), then cancel them."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def set_status(self, job: Job, status: str) -> None:
        # In-memory state and metrics move first; the single writer thread keeps DB order.
        old, job.status = job.status, status
        self.metrics.moved(old, status)
        await self.store.write(self.store.set_status, job.id, status)

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
            self.stop(job, "expire")

    # -- one job -----------------------------------------------------------------------------
    async def _drive(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(max(0.0, job.expires_ts - time.time()), self._expire, job)
        try:
            fresh = await self.store.read(self.store.get_batch, job.id)
            if fresh is not None and fresh["status"] == "cancelling" and job.stop in (None, "shutdown"):
                job.status = "cancelling"
                self.stop(job, "cancel")
            if job.status == "validating":
                await self.set_status(job, "in_progress")
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
            self.stop(job, "cancel")  # queued lines are not computed for a failed job
            with contextlib.suppress(Exception):
                await self._fail(job, exc)
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

    async def _line(self, job: Job, run: LineRun, row: dict) -> None:
        try:
            outcome = await self.lines.execute(job, run, row)
            if outcome is not None:
                status, record = outcome
                if await self.commits.commit(job.id, run.line, status, record):
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

    async def _finalize(self, job: Job) -> None:
        final, unrun = FINAL.get(job.stop or "", ("completed", None))
        await self.set_status(job, "finalizing")
        info = await self.store.write(self.store.finalize, job.id, final, unrun)
        self.metrics.moved(job.status, final)
        job.status = final
        if unrun is not None and info["swept"]:
            self.metrics.lines.labels(unrun).inc(info["swept"])
        log.info("batch %s %s", job.id, final)

    async def _fail(self, job: Job, exc: Exception) -> None:
        """The job failed as a whole (not one of its lines): its unrun lines are cancelled."""
        error = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}", "line": None, "param": None}
        errors = {"object": "list", "data": [error]}
        old, job.status = job.status, "failed"
        await self.store.write(self.store.finalize, job.id, "failed", CANCELLED, orjson.dumps(errors).decode())
        self.metrics.moved(old, "failed")
