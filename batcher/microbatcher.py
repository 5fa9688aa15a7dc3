"""Dynamic micro-batching for one-shot models (embeddings, classifiers).

The loop: expire what is late, ask the policy, dispatch or sleep until the policy's time
or the next arrival. While the engine runs a batch, arrivals keep queuing and the next
batch forms from them; there is no polling: the loop wakes on an arrival, a batch ending,
a settings change, or the next deadline.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .errors import EngineError, ShuttingDown
from .policy import Dispatch, batch_cost, get_policy
from .protocols import Execute
from .queueing import QueueingBatcher, seconds_until
from .settings import BatchingSettings
from .types import Batch, DispatchReason, Outcome, TokenCount

log = logging.getLogger("ferry.batcher")


class MicroBatcher(QueueingBatcher):
    """Runs each dispatched batch through `execute` (see batcher.protocols.Execute)."""

    def __init__(
        self, model: str, execute: Execute, settings: BatchingSettings, *, phase: str = "embed", **kw: Any
    ) -> None:
        super().__init__(model, settings, **kw)
        self.execute = execute
        self.phase = phase
        self.metrics.init_phases(model, phase)
        self._inflight: asyncio.Task | None = None
        self._busy_until = 0.0
        self.batches: list[Batch] = []  # recent batches, for tests and introspection
        self._keep_batches = 256

    def busy_until(self, now: float) -> float:
        return self._busy_until if self._inflight is not None else now

    @property
    def busy(self) -> bool:
        return len(self.queue) > 0 or self._inflight is not None

    async def _loop(self) -> None:
        while True:
            now = self.clock.now()
            self._expire(now)
            wake_at = self.queue.min_deadline
            if self._inflight is None:
                decision = self._decide(now)
                if isinstance(decision, Dispatch):
                    self._dispatch(decision, now)
                    continue
                if decision.t is not None:
                    wake_at = min(wake_at, decision.t)
                if not self.busy:
                    self._idle.set()
            self._wake.clear()
            await self.clock.wait(self._wake, seconds_until(wake_at, now))

    def _decide(self, now: float):
        s = self.settings
        if self._closing and len(self.queue):
            return Dispatch(min(len(self.queue), s.max_batch_size), DispatchReason.DRAIN)
        return get_policy(s.policy)(self.queue, now, s, self.cost, self.load(now))

    def _dispatch(self, decision: Dispatch, now: float) -> None:
        items = self._take(decision.size, now)
        batch = Batch(items, now, decision.reason)
        for item in items:
            item.dispatched_at, item.batch_size, item.reason = now, len(items), decision.reason
        self.batches.append(batch)
        if len(self.batches) > self._keep_batches:
            del self.batches[: -self._keep_batches]
        self._busy_until = now + batch_cost(self.cost, items)
        self.metrics.batches.labels(self.model, decision.reason.value).inc()
        # Work left queued behind it: the policies, not the arrivals, chose this size.
        backlogged = len(self.queue) > 0
        self._inflight = asyncio.create_task(self._run_batch(batch, backlogged))
        self._inflight.add_done_callback(lambda task: self._batch_done(task, batch))

    def _batch_done(self, task: asyncio.Task, batch: Batch) -> None:
        """Whatever happened to the task (cancelled before its first step, a bug after the
        engine call), no item of its batch is left without an outcome."""
        self._inflight = None
        self._wake.set()
        if task.cancelled():
            exc: Exception = ShuttingDown("server stopped while this batch ran")
        elif task.exception() is not None:
            log.error("batch task failed", exc_info=task.exception(), extra={"model": self.model})
            exc = EngineError(f"batch failed: {type(task.exception()).__name__}: {task.exception()}")
        else:
            return
        for item in batch.items:
            self._finish(item, Outcome.ERROR, exc)

    async def _run_batch(self, batch: Batch, backlogged: bool = False) -> None:
        # A client may have left between dispatch and now; never compute for it.
        items = [i for i in batch.items if not i.finished]
        if not items:
            return
        m, model, phase = self.metrics, self.model, self.phase
        tokens = TokenCount.of([i.cost for i in items])
        m.batch_size.labels(model, phase).observe(len(items))
        m.batch_tokens.labels(model, phase).observe(tokens.real)
        m.padding.labels(model, phase).observe(tokens.padding_ratio)
        start = self.clock.now()
        m.running.labels(model).set(len(items))
        try:
            results = await self.execute([i.payload for i in items])
            if len(results) != len(items):
                raise RuntimeError(f"engine returned {len(results)} results for {len(items)} inputs")
        except asyncio.CancelledError:
            for item in items:
                self._finish(item, Outcome.ERROR, ShuttingDown("server stopped while this batch ran"))
            raise
        except Exception as exc:
            log.exception("engine failed a batch of %d", len(items), extra={"model": model})
            m.engine_errors.labels(model, phase).inc()
            err = EngineError(f"model execution failed: {type(exc).__name__}: {exc}")
            for item in items:
                self._finish(item, Outcome.ERROR, err)
            return
        finally:
            elapsed = self.clock.now() - start
            m.batch_seconds.labels(model, phase).observe(elapsed)
            m.running.labels(model).set(0)
        for item, result in zip(items, results, strict=True):
            if isinstance(result, Exception):
                m.engine_errors.labels(model, phase).inc()
                self._finish(item, Outcome.ERROR, EngineError(f"model execution failed for this input: {result}"))
            else:
                self._finish(item, Outcome.RESULT, result)
        m.cost_error.labels(model, phase).observe(self.cost.observe(len(items), tokens.padded, elapsed))
        self.tracker.served(self.clock.now(), len(items), elapsed, backlogged)
        m.slowdown.labels(model, phase).set(self.cost.slowdown)

    def _fail_running(self, exc: Exception) -> int:
        if self._inflight is None:
            return 0
        running = sum(1 for i in self.batches[-1].items if not i.finished) if self.batches else 0
        self._inflight.cancel()  # its done-callback fails the batch's items
        return running
