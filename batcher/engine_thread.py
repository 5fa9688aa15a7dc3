"""Run blocking engine calls off the event loop, on one dedicated worker thread.

One thread per engine: torch work is serialised (the engine needs no locks) and the loop
pays one thread hop per batch, never per request. A call that outlives `timeout` fails
with EngineTimeout and later calls go to a fresh thread, so one hung call cannot stall
every later batch; the stuck thread is abandoned (Python cannot kill it) and its result,
if it ever comes, is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("ferry.batcher")


class EngineTimeout(TimeoutError):
    pass


class EngineThread:
    def __init__(
        self,
        name: str,
        timeout: float | None = None,
        initializer: Callable[[], None] | None = None,
        replace_on_timeout: bool = True,
        nice: int = 0,
    ):
        """`replace_on_timeout=False` for engines with state (generation's running batch and
        KV cache): a second thread must never touch it while the stuck call might still run,
        so the timed-out call fails its items and the next call queues behind it.
        `nice`: the worker thread's niceness relative to the process's (Linux): positive for
        work that yields the cores (batch-class batches), negative for work that should get
        them first (the interactive lane), where the process may raise a priority."""
        self.name, self.timeout, self._initializer = name, timeout, initializer
        self.replace_on_timeout = replace_on_timeout
        self.nice = nice
        self.abandoned = 0
        self._pool = self._new_pool()
        self._companions: list[EngineThread] = []

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ferry-{self.name}", initializer=self._setup)

    def _setup(self) -> None:
        if self.nice:
            # Raising a thread's niceness needs no privilege on Linux; lowering it below the
            # process's needs CAP_SYS_NICE: without it the thread keeps the process's own.
            try:
                base = os.getpriority(os.PRIO_PROCESS, 0)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(-20, min(19, base + self.nice)))
            except (OSError, AttributeError) as exc:
                log.info("engine thread %s keeps the process's priority (nice %+d: %s)", self.name, self.nice, exc)
        if self._initializer is not None:
            self._initializer()

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.start(fn, *args)

    def start(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """Hand `fn(*args)` to the worker thread now; await the result later. Lets the
        caller do event-loop work (deliver the previous step's tokens) while it runs."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        return self._result(fut)

    async def _result(self, fut: asyncio.Future) -> Any:
        if self.timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except asyncio.TimeoutError:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            if self.replace_on_timeout:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
                self.abandoned += 1
            log.error(
                "engine call on %s exceeded %.1f s%s",
                self.name,
                self.timeout,
                "; moved to a fresh worker thread" if self.replace_on_timeout else "",
            )
            raise EngineTimeout(f"engine call exceeded {self.timeout:g} s") from None

    def companion(self, suffix: str, nice: int = 0) -> EngineThread:
        """A second worker thread on the same engine, with the same settings but its own
        niceness, for calls that may run beside this thread's (the interactive lane: the
        engine must be safe to call from two threads at once); `close` closes it too."""
        other = EngineThread(f"{self.name}-{suffix}", self.timeout, self._initializer, self.replace_on_timeout, nice)
        self._companions.append(other)
        return other

    def close(self) -> None:
        for other in self._companions:
            other.close()
        self._pool.shutdown(wait=self.abandoned == 0, cancel_futures=True)
