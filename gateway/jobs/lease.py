"""Which front end runs batch jobs: the store's `worker_lease`.

With several front ends (`--api-workers N`, N >= 2) every front end serves the batch-job
routes from the one store, but only the holder of the lease runs jobs. Each front end tries
to take or renew the lease every `LEASE_RENEW_S` (`tick`); the holder then also adopts what
the others wrote: it launches active jobs it does not run yet (a batch created through
another front end) and stops those another front end marked `cancelling`. A holder that
dies (or stalls past `LEASE_TTL_S`) loses the lease and another front end takes over; lines
are committed once (`... WHERE status = 'pending'`), so a takeover runs again only the lines
that were not committed. A holder that finds its lease taken stops its jobs as on shutdown
(their unrun lines stay pending for the new holder). Alone on its data directory, a front
end always holds it and never asks the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable

from ..errors import APIError
from .metrics import JobMetrics
from .runner import JobRunner
from .store import Store

log = logging.getLogger("ferry.jobs")

# Renewed this often, and lost when not renewed for LEASE_TTL_S (a dead holder's jobs are
# taken over within about that long).
LEASE_RENEW_S = 1.0
LEASE_TTL_S = 5.0


class Lease:
    def __init__(
        self,
        store: Store,
        runner: JobRunner,
        metrics: JobMetrics,
        open_store: Callable[[], Awaitable[None]],
        *,
        shared: bool,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.runner = runner
        self.metrics = metrics
        self.open_store = open_store
        self.clock = clock
        self.shared = shared  # one of several front ends on this data directory
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.holding = not shared  # alone on the directory: always the job worker
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Renew the lease every LEASE_RENEW_S until shutdown."""
        self._task = asyncio.create_task(self._loop(), name="ferry-jobs-lease")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def release(self) -> None:
        """A clean stop gives the lease up: another front end takes over at once."""
        if self.shared and self.holding and self.store.is_open:
            with contextlib.suppress(Exception):
                await self.store.write(self.store.release_lease, self.holder)
            self.holding = False

    async def _loop(self) -> None:
        while not self.runner.paused:
            try:
                await self.tick()
            except Exception:  # a locked or failing store: try again at the next renewal
                log.exception("batch-job lease: renewal failed")
            await asyncio.sleep(LEASE_RENEW_S)

    async def tick(self) -> bool:
        """Take or renew the lease; as its holder, run the active jobs. Returns whether this
        front end holds the lease now."""
        if self.runner.paused:
            return False
        if not self.store.is_open:
            if not self.store.exists():
                return False  # no job was ever created here
            try:
                await self.open_store()
            except APIError as exc:
                log.error("batch jobs: %s", exc.message)
                return False
        held = await self.store.write(self.store.take_lease, self.holder, self.clock(), LEASE_TTL_S)
        if held and not self.holding:
            log.info("batch-job worker: this front end (%s) runs batch jobs now", self.holder)
        elif self.holding and not held:
            log.warning("batch-job worker: lease lost to another front end; stopping this one's jobs")
            self.runner.stop_all()  # unrun lines stay pending for the new holder
        self.holding = self.metrics.counting = held
        # ferry_jobs is the holder's alone, from the store: other front ends move jobs too
        self.metrics.load(await self.store.read(self.store.status_counts) if held else {})
        if held:
            await self._adopt()
        return held

    async def _adopt(self) -> None:
        """Run the active jobs this front end does not run yet; stop those cancelled elsewhere."""
        for row in await self.store.read(self.store.active_batches):
            if self.runner.paused or not self.holding:
                return
            job = self.runner.jobs.get(row["id"])
            if job is None:
                log.info("running batch %s (%s)", row["id"], row["status"])
                self.runner.launch(row)
            elif row["status"] == "cancelling" and job.stop is None:
                job.status = "cancelling"  # the front end that took the cancel counted it
                self.runner.stop(job, "cancel")
