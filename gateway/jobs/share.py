"""Batch work's share of one model, across all jobs: work items queued or running.

At most half the running slots of a generation model, so interactive prompts always find
a slot rather than waiting for batch sequences to finish; for one-shot models, a few
batches' worth, and at most half the queue, so interactive requests never meet a full queue.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..models.kinds import CHAT
from ..models.start import ServedModel

GEN_SHARE = 0.5
ONESHOT_BATCHES = 4


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
