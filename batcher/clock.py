"""Time for the batcher: `time.monotonic()` in production, a fake in tests.

The batcher never calls `time` or `asyncio.sleep` directly; it asks its clock, so tests
can drive every scheduling rule in simulated time without wall-clock assertions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any, Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        """Wait for `event` at most `timeout` seconds; True if the event was set."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        if timeout is None:
            await event.wait()
            return True
        if timeout <= 0:
            await asyncio.sleep(0)  # always yield: a caller looping on a zero timeout must not starve the loop
            return event.is_set()
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class FakeClock:
    """Simulated time. Sleepers wake only when a test calls `advance`."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._timers: list[tuple[float, int, asyncio.Future]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def _timer(self, seconds: float) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self._now + max(0.0, seconds), next(self._seq), fut))
        return fut

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        await self._timer(seconds)

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        if timeout is not None and timeout <= 0:
            return False
        waiter = asyncio.ensure_future(event.wait())
        pending: set[asyncio.Future[Any]] = {waiter}
        timer = None
        if timeout is not None:
            timer = self._timer(timeout)
            pending.add(timer)
        try:
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if timer is not None and not timer.done():
                timer.cancel()
        return event.is_set()

    @property
    def next_timer(self) -> float | None:
        while self._timers and self._timers[0][2].done():
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    async def settle(self, rounds: int = 30) -> None:
        """Let every ready task run until the loop is quiet."""
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking each timer in due order and letting tasks react."""
        target = self._now + seconds
        await self.settle()
        while (due := self.next_timer) is not None and due <= target:
            _, _, fut = heapq.heappop(self._timers)
            self._now = max(self._now, due)
            fut.set_result(None)
            await self.settle()
        self._now = target
        await self.settle()

    async def run_until_idle(self, limit: float = 3600.0) -> None:
        """Advance timer by timer until nothing is sleeping (bounded by `limit`)."""
        end = self._now + limit
        await self.settle()
        while (due := self.next_timer) is not None and due <= end:
            await self.advance(due - self._now)
