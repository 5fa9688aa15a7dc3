"""A batch job as the runner holds it while it runs, and its lines in flight.

`stop` says why the job stops, and so what its unrun lines become once it is finalised:
"cancel" (cancelled), "expire" (its completion window ended: expired) or "shutdown" (the
server stops or loses the lease: nothing is finalised, unrun lines stay pending)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batcher.types import WorkItem

if TYPE_CHECKING:
    from ..models.served import ServedBatcher


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
    owner: str | None = None  # the creator's key, as `endpoint.key_owner` names it: its lines' tenant
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
