"""Group commit of finished lines: lines finishing together share one store transaction.

A line counts as done only once its result is committed; one not committed when the
process dies is still `pending` and runs again on restart, a committed one never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .store import Store

log = logging.getLogger("ferry.jobs")

Line = tuple[str, int, str, str]  # batch id, line number, line status, output record


class GroupCommit:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._pending: list[tuple[Line, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="ferry-jobs-commit")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def commit(self, batch_id: str, line: int, status: str, record: str) -> bool:
        """Whether the line was recorded now (False: it was not pending any more)."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(((batch_id, line, status, record), fut))
        self._wake.set()
        return await fut

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, []
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
