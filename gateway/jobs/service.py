"""The batch-job service: what the routes of /v1/files and /v1/batches call (upload, get a
file or its content, create, get, list and cancel batches), and the life of the jobs
(resume after a start, pause at the drain, close).

It composes the parts: the store (store.py), the runner that runs jobs' lines through the
served batchers (runner.py, lines.py) with group commit of their results (commit.py), and
the lease that says which front end runs them (lease.py). Jobs know the gateway only as a
`JobsHost` (host.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from ..errors import APIError, not_ready, shutting_down
from .commit import GroupCommit
from .host import JobsHost
from .lease import Lease
from .lines import LineExecutor
from .metrics import JobMetrics
from .runner import LINES_IN_FLIGHT, JobRunner
from .store import Store, StoreLocked
from .validate import BatchCreate, InvalidFile, check_create, validate_file

log = logging.getLogger("ferry.jobs")

T = TypeVar("T")


class BatchJobs:
    def __init__(
        self,
        host: JobsHost,
        *,
        in_flight: int = LINES_IN_FLIGHT,
        shared: bool | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.host = host
        # shared: one of several front ends on this data directory (run jobs only with the lease)
        shared = host.config.api_workers > 1 if shared is None else shared
        self.store = Store(host.config.data_dir, exclusive=not shared)
        self.metrics = JobMetrics(host.metrics)
        self.commits = GroupCommit(self.store)
        self.runner = JobRunner(self.store, self.metrics, LineExecutor(host), self.commits, in_flight=in_flight)
        self.lease = Lease(self.store, self.runner, self.metrics, self.ensure_open, shared=shared, clock=clock)
        self.metrics.counting = self.lease.holding
        self._open_lock = asyncio.Lock()
        self._resumer: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, loader: asyncio.Task | None = None) -> None:
        """Resume unfinished jobs once the models are loaded (called from the lifespan)."""
        self._resumer = asyncio.create_task(self._resume_after(loader), name="ferry-jobs-resume")

    async def _resume_after(self, loader: asyncio.Task | None) -> None:
        if loader is not None:
            await loader
        if not self.host.ready:
            return
        if self.lease.shared:
            self.lease.start()
            return
        if not self.store.exists():
            return
        try:
            await self.ensure_open()
        except APIError as exc:
            log.error("batch jobs not resumed: %s", exc.message)
            return
        self.runner.resume(await self.store.read(self.store.active_batches))

    async def ensure_open(self) -> None:
        if self.store.is_open:
            return
        if self.runner.paused:
            raise shutting_down()
        async with self._open_lock:
            if self.store.is_open:
                return
            try:
                await self.store.open()
            except StoreLocked as exc:
                raise APIError(503, str(exc), code="data_dir_locked") from None
            except OSError as exc:
                log.exception("cannot open the job store in %s", self.store.dir)
                raise APIError(500, f"cannot open the job store: {exc}", code="store_error") from None
            if self.lease.holding:
                self.metrics.load(await self.store.read(self.store.status_counts))
            self.commits.start()

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        await self.ensure_open()
        return await self.store.read(fn, *args)

    def pause(self) -> None:
        """Shutdown begins: stop submitting, give queued lines back (they stay pending)."""
        self.runner.pause()

    async def close(self, timeout: float = 10.0) -> None:
        self.pause()
        if self._resumer is not None:
            self._resumer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._resumer
        await self.lease.stop()
        await self.runner.finish(timeout)
        await self.commits.stop()
        await self.lease.release()
        if self.store.is_open:
            await self.store.close()

    # -- files -----------------------------------------------------------------------------
    # `owner`: the caller's API key as `endpoint.key_owner` names it; a file or batch is
    # seen (and cancelled) only with the key that made it. None: the server has no keys.
    async def upload(self, content: bytes, filename: str, purpose: str, owner: str | None = None) -> dict:
        await self.ensure_open()
        row = {
            "id": "file-" + uuid.uuid4().hex,
            "purpose": purpose,
            "filename": filename,
            "bytes": len(content),
            "created_at": int(time.time()),
            "kind": "upload",
            "owner": owner,
        }
        await self.store.write(self.store.insert_file, row, content)
        return row

    async def get_file(self, file_id: str, owner: str | None = None) -> dict:
        row = await self._read(self.store.get_file, file_id)
        if row is None or not _owns(owner, row):
            raise APIError(404, f"No such file: {file_id}", code="file_not_found", param="file_id")
        return row

    async def delete_file(self, file_id: str, owner: str | None = None) -> dict:
        """An upload deleted, its content with it: batches made from it run on (their lines
        hold their requests). A batch's output and error files are read from its lines and
        live as long as it does."""
        row = await self.get_file(file_id, owner)
        if row["kind"] != "upload":
            raise APIError(
                400,
                f"{file_id} is a batch's {row['kind']} file, read from the batch's results; only uploads are deleted",
                code="file_not_deletable",
                param="file_id",
            )
        if not await self.store.write(self.store.delete_upload, file_id):
            raise APIError(404, f"No such file: {file_id}", code="file_not_found", param="file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    async def file_content(self, file_id: str, owner: str | None = None) -> bytes:
        await self.get_file(file_id, owner)
        content = await self.store.read(self.store.file_content, file_id)
        return content or b""

    # -- batches ---------------------------------------------------------------------------
    async def create(self, body: BatchCreate, owner: str | None = None) -> dict:
        window = check_create(body)
        f = await self._read(self.store.get_file, body.input_file_id)
        if f is None or f["kind"] != "upload" or not _owns(owner, f):
            raise _no_input_file(body.input_file_id)
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
            raise _no_input_file(body.input_file_id)
        good, errors = await asyncio.to_thread(validate_file, self.host, content, body.endpoint)
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
            "owner": owner,
        }
        await self.store.write(self.store.create_batch, row, [(v.line, v.custom_id, v.url, v.body) for v in good])
        self.metrics.moved(None, "in_progress")
        if self.lease.holding:
            self.runner.launch(row)  # else the lease's holder adopts it at its next renewal
        log.info("batch %s created: %d requests, window %s", row["id"], len(good), body.completion_window)
        return await self.get(row["id"], owner)

    async def get(self, batch_id: str, owner: str | None = None) -> dict:
        row = await self._read(self.store.get_batch, batch_id)
        if row is None or not _owns(owner, row):
            raise APIError(404, f"No such batch: {batch_id}", code="batch_not_found", param="batch_id")
        return row

    async def list(self, after: str | None, limit: int, owner: str | None = None) -> tuple[list[dict], bool]:
        page = await self._read(self.store.list_batches, after, limit, owner)
        if page is None:
            raise APIError(404, f"No such batch: {after}", code="batch_not_found", param="after")
        return page

    async def cancel(self, batch_id: str, owner: str | None = None) -> dict:
        row = await self.get(batch_id, owner)
        runner = self.runner
        job = runner.jobs.get(batch_id)
        if job is not None and job.stop in (None, "shutdown") and job.status in ("validating", "in_progress"):
            runner.stop(job, "cancel")  # queued lines are cancelled now, before any await
            await runner.set_status(job, "cancelling")
        elif job is None and row["status"] in ("validating", "in_progress"):
            # Not running here yet (models still loading): the resume finalises it as cancelled.
            if await self.store.write(self.store.set_status, batch_id, "cancelling", ("validating", "in_progress")):
                self.metrics.moved(row["status"], "cancelling")
            job = runner.jobs.get(batch_id)
            if job is not None:  # launched meanwhile from an older read
                runner.stop(job, "cancel")
        elif row["status"] in ("failed", "completed", "expired"):
            raise APIError(
                400,
                f"cannot cancel batch {batch_id}: it is already {row['status']}",
                code="batch_not_cancellable",
                param="batch_id",
            )
        return await self.get(batch_id, owner)

    def _check_ready(self) -> None:
        if self.host.draining or self.runner.paused:
            raise shutting_down()
        if not self.host.ready:
            raise not_ready(self.host.load_error)


def _owns(owner: str | None, row: dict) -> bool:
    """Whether the caller (`owner`; None: the server has no keys) may see `row`. A file or
    batch made before the server had keys belongs to no key."""
    return owner is None or row.get("owner") == owner


def _no_input_file(file_id: str) -> APIError:
    return APIError(404, f"No such file: {file_id}", code="file_not_found", param="input_file_id")
