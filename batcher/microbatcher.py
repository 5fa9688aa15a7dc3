"""Dynamic micro-batching for one-shot models (embeddings, classifiers).

The loop: expire what is late, ask the policy, dispatch or sleep until the policy's time
or the next arrival. While the engine runs a batch, arrivals keep queuing and the next
batch forms from them; there is no polling: the loop wakes on an arrival, a batch ending,
a settings change, or the next deadline.

The interactive lane (`interactive_lane`, with an `execute_lane`): while a batch runs,
queued interactive items go at once in a batch of their own on a second engine thread,
beside it, instead of waiting for it to end. The engine cannot be preempted, but the
operating system shares the cores between the two threads, so an interactive request no
longer waits for a long batch-class batch; and batch-class batches need not be cut short
for interactive budgets (the reserve, batcher/load.py), which is what cost interactive
first most of its batch-class throughput on a CPU. When no interactive work has been
offered for LANE_QUIET seconds, the policy's batches of any class run beside the batch in
flight, one at a time, on a third thread (`execute_beside`): bulk work uses both cores.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import admission
from .cost import CostModel
from .errors import EngineError, ShuttingDown
from .load import Load, efficient_batch
from .policy import Dispatch, batch_cost, deadline_cap, get_policy, token_cap
from .protocols import Execute
from .queue import LengthGrouping, RequestQueue, by_length
from .queueing import QueueingBatcher, seconds_until
from .settings import BatchingSettings
from .types import Batch, DispatchReason, Outcome, Priority, TokenCount, WorkItem

log = logging.getLogger("ferry.batcher")

# Seconds after the last interactive offer that the lane stops being kept for interactive
# work: batches of any class then run beside the batch in flight (on `execute_beside`), where
# work of the batch class alone kept one of two engine threads idle (bench: 0.6x the requests/s of
# the same inputs sent as interactive). Long enough that interactive traffic a few requests
# a minute still finds the lane free; an interactive request arriving after a quiet spell may
# find both threads busy, and admission predicts its wait with the lane's batch in it.
LANE_QUIET = 10.0


class MicroBatcher(QueueingBatcher):
    """Runs each dispatched batch through `execute` (see batcher.protocols.Execute), and
    interactive batches beside it through `execute_lane` (None: no lane); while the lane is
    spare (`_lane_spare`), the policy's batches beside it through `execute_beside` (a thread
    as nice as the main one, so they do not run ahead of the event loops; None: the lane's)."""

    def __init__(
        self,
        model: str,
        execute: Execute,
        settings: BatchingSettings,
        *,
        phase: str = "embed",
        execute_lane: Execute | None = None,
        execute_beside: Execute | None = None,
        pads: Callable[[], bool] = lambda: True,
        **kw: Any,
    ) -> None:
        super().__init__(model, settings, **kw)
        self.pads = pads  # False now: the engine packs a batch's rows, computing no padding
        self.execute = execute
        self.execute_lane = execute_lane
        self.execute_beside = execute_beside or execute_lane
        self.phase = phase
        self.metrics.init_phases(model, phase)
        self._inflight: asyncio.Task | None = None
        self._inflight_batch: Batch | None = None
        self._busy_until = 0.0
        self._may_run_until = 0.0  # the batch in flight at its 99th percentile (the cost model's tail)
        self._lane: asyncio.Task | None = None
        self._lane_batch: Batch | None = None
        self._lane_busy_until = 0.0
        # Lane batches share the cores with the batch beside them: their own fit, from the
        # main one's to start with.
        self.lane_cost = CostModel(self.cost.params, quadratic=self.cost.quadratic)
        self.batches: list[Batch] = []  # recent batches, for tests and introspection
        self._keep_batches = 256

    def busy_until(self, now: float) -> float:
        return self._busy_until if self._inflight is not None else now

    @property
    def busy(self) -> bool:
        return len(self.queue) > 0 or self._inflight is not None or self._lane is not None

    @property
    def lane_open(self) -> bool:
        """Interactive work may run beside the batch in flight (`interactive_lane`)."""
        return self.execute_lane is not None and self.settings.interactive_lane

    @property
    def cost_models(self) -> dict[str, CostModel]:
        lane = {"lane": self.lane_cost} if self.execute_lane is not None else {}
        return {self.phase: self.cost, **lane}

    def load(self, now: float) -> Load:
        """With the lane open, no reserve: interactive work does not wait for the batch in
        flight, so batch-class batches are not cut for its budgets; while the lane is spare,
        two threads drain the queue."""
        load = self.tracker.snapshot(
            now, self.queue, self.settings, self.cost, self.busy_until(now), reserve=not self.lane_open
        )
        if not (self.lane_open and self._lane_spare(now)):
            return load
        # Two threads drain the queue from when the later of them is free (conservative).
        second = self._lane_busy_until if self._lane is not None else now
        return replace(load, workers=2, busy_until=max(load.busy_until, second))

    def predict(
        self,
        q: RequestQueue,
        item: WorkItem,
        now: float,
        s: BatchingSettings,
        cost: CostModel,
        load: Load,
        siblings: int = 0,
    ) -> float:
        """An interactive item is done by the sooner of its turn on the engine and in the lane."""
        done = admission.predicted_completion(q, item, now, s, cost, load, siblings)
        if item.priority is not Priority.INTERACTIVE or not self.lane_open:
            return done
        free_at = self._lane_busy_until if self._lane is not None else now
        lane = admission.predicted_in_lane(q, item, now, s, self.lane_cost, free_at, siblings)
        return min(done, lane)

    async def _loop(self) -> None:
        while True:
            now = self.clock.now()
            self._expire(now)
            wake_at = self.queue.min_deadline
            # The engine's thread if free, else the lane's: for interactive work, or any
            # while the lane is spare (`_lane_spare`).
            dispatch = None
            if self._inflight is None:
                dispatch = self._dispatch
            elif self._lane is None and self.lane_open and self.queue.count(Priority.INTERACTIVE):
                lane_items = self._lane_items(now)
                if lane_items:
                    self._dispatch_lane(lane_items, now)
                    continue
            elif self._lane is None and self.lane_open and len(self.queue):
                if self._lane_spare(now):
                    dispatch = self._dispatch_beside
                else:  # when the lane becomes spare, the work queued behind the batch in flight may take it
                    wake_at = min(wake_at, self.tracker.last_interactive + LANE_QUIET)
            if dispatch is not None:
                decision = self._decide(now)
                if isinstance(decision, Dispatch):
                    dispatch(decision, now)
                    continue
                if decision.t is not None:
                    wake_at = min(wake_at, decision.t)
            if not self.busy:
                self._idle.set()
            self._wake.clear()
            await self.clock.wait(self._wake, seconds_until(wake_at, now))

    def _decide(self, now: float):
        s = self.settings
        # Grouped by length for this decision and the take that may follow it (same `now`).
        self.queue.grouping = self._grouping(now) if s.group_by_length else None
        if self._closing and len(self.queue):
            fits = token_cap(self.queue.peek(s.max_batch_size, now), s)
            return Dispatch(fits, DispatchReason.DRAIN)
        return get_policy(s.policy)(self.queue, now, s, self.cost, self.load(now))

    def _grouping(self, now: float) -> LengthGrouping:
        """A window of four batches; an item is urgent (keeps its place) when two full
        batches at their slow pace would end after its deadline."""
        s = self.settings
        full = self.cost.predict(s.max_batch_size, s.batch_tokens) * self.cost.slowdown
        return LengthGrouping(window=4 * s.max_batch_size, urgent_before=now + 2 * full + s.margin)

    def _dispatch(self, decision: Dispatch, now: float) -> None:
        items = self._take(decision.size, now)
        self.queue.grouping = None
        batch = self._batch(items, now, decision.reason)
        predicted = batch_cost(self.cost, batch.items)
        self._busy_until = now + predicted
        self._may_run_until = now + predicted * max(self.cost.tail, 1.0)
        # Work left queued behind it: the policies, not the arrivals, chose this size.
        backlogged = len(self.queue) > 0
        self._inflight_batch = batch
        self._inflight = asyncio.create_task(self._run_batch(batch, backlogged))
        self._inflight.add_done_callback(lambda task: self._batch_done(task, batch))

    def _lane_items(self, now: float) -> list[WorkItem]:
        """The queued interactive items, earliest deadline first, as many as make none of
        them late (as `deadline_cap` sizes any batch with interactive work); none unless
        the batch in flight may still run, at its 99th percentile (`tail`: a batch running
        late is when the lane matters most), longer than the deadline margin and than the
        lane's batch: otherwise waiting for the engine costs them next to nothing, and they
        join the next batch instead of paying a batch of their own (with a near-free engine
        every batch ends before a second could start, and a lane batch only added a
        hand-off: 0.71x the requests per second of no lane under `bench_gateway`). Unless
        more interactive work waits than this batch may take: then the next batch will not
        take it all either, and the lane runs its batch at once, however little is left in
        flight (all-interactive saturation: 1.13x requests/s, docs/benchmarks.md), without
        any item only the engine's next batch would end on time (`engine_not_lane`)."""
        s = self.settings
        left = self._may_run_until - now
        if s.group_by_length:  # like the main batches: of like lengths, within max_batch_tokens
            g = self._grouping(now)
            waiting = by_length(self.queue.peek_class(Priority.INTERACTIVE, g.window), now, 0.0, g.urgent_before)
        else:
            waiting = self.queue.peek_class(Priority.INTERACTIVE, s.max_batch_size)
        waiting = waiting[: s.max_batch_size]
        waiting = waiting[: token_cap(waiting, s)]
        lane = self.lane_cost
        # More interactive work waits than this batch takes (by count or by tokens): the next
        # main batch will not take it all either, so the lane's batch need not end before
        # the one in flight; but an item the engine's next batch would serve on time and the
        # lane (slower: it shares the cores) would not, even alone, stays for the engine.
        backlog = self.queue.count(Priority.INTERACTIVE) > len(waiting)
        if backlog:
            main = (self.cost, max(self._busy_until, now))
            waiting = [i for i in waiting if not engine_not_lane(i, now, s, lane, *main)]
        if not waiting or (not backlog and (left <= s.margin or lane.predict(1, waiting[0].cost) >= left)):
            return []  # not even one item would end in time
        # No floor and no reserve (nothing waits for a lane batch); the lane's own fit times
        # it, the engine's (the main fit) says its efficient batch.
        efficient = efficient_batch(s, self.cost, self.tracker.typical_tokens)[0]
        lane_load = Load(slowdown=lane.slowdown, tail=lane.tail, efficient=efficient)
        items = waiting[: deadline_cap(waiting, now, s, lane, lane_load)]
        return items if backlog or batch_cost(self.lane_cost, items) < left else []

    def _lane_spare(self, now: float) -> bool:
        """The lane's thread may run work of any class: no interactive work has been offered
        for LANE_QUIET seconds (none waits, so none is kept waiting by it)."""
        # The same sum as the loop's wake-up time, so that waking then finds the lane spare.
        return now >= self.tracker.last_interactive + LANE_QUIET and not self.queue.count(Priority.INTERACTIVE)

    def _dispatch_beside(self, decision: Dispatch, now: float) -> None:
        """A batch the policy chose, beside the batch in flight while the lane is spare (`_lane_spare`)."""
        items = self._take(decision.size, now)
        self.queue.grouping = None
        self._start_lane(items, now, decision.reason, backlogged=len(self.queue) > 0)

    def _dispatch_lane(self, items: list[WorkItem], now: float) -> None:
        for item in items:
            self.queue.remove(item)
        self._start_lane(self._taken(items, now), now, DispatchReason.LANE)

    def _start_lane(self, items: list[WorkItem], now: float, reason: DispatchReason, backlogged: bool = False) -> None:
        batch = self._batch(items, now, reason)
        self._lane_busy_until = now + batch_cost(self._second_thread(batch)[1], batch.items)
        self._lane_batch = batch
        self._lane = asyncio.create_task(self._run_batch(batch, backlogged, lane=True))
        self._lane.add_done_callback(lambda task: self._batch_done(task, batch, lane=True))

    def _second_thread(self, batch: Batch) -> tuple[Execute | None, CostModel]:
        """Where a batch beside the one in flight runs and which fit times it: an interactive
        lane batch on the lane's thread, by the lane's fit; a batch the policy formed while
        the lane is spare on `execute_beside`, by the main fit (it is a main batch that
        happens to run beside another, as main batches do then)."""
        if batch.reason is DispatchReason.LANE:
            return self.execute_lane, self.lane_cost
        return self.execute_beside, self.cost

    def _batch(self, items: list[WorkItem], now: float, reason: DispatchReason) -> Batch:
        batch = Batch(items, now, reason)
        for item in items:
            item.dispatched_at, item.batch_size, item.reason = now, len(items), reason
        self.batches.append(batch)
        if len(self.batches) > self._keep_batches:
            del self.batches[: -self._keep_batches]
        self.metrics.batches.labels(self.model, reason.value).inc()
        return batch

    def _batch_done(self, task: asyncio.Task, batch: Batch, lane: bool = False) -> None:
        """Whatever happened to the task (cancelled before its first step, a bug after the
        engine call), no item of its batch is left without an outcome."""
        if lane:
            self._lane, self._lane_batch = None, None
        else:
            self._inflight, self._inflight_batch = None, None
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

    async def _run_batch(self, batch: Batch, backlogged: bool = False, lane: bool = False) -> None:
        # A client may have left between dispatch and now; never compute for it.
        items = [i for i in batch.items if not i.finished]
        if not items:
            return
        m, model, phase = self.metrics, self.model, self.phase
        execute, cost = self._second_thread(batch) if lane else (self.execute, self.cost)
        assert execute is not None, "a lane batch needs execute_lane"
        tokens = TokenCount.of([i.cost for i in items])
        m.batch_size.labels(model, phase).observe(len(items))
        m.batch_tokens.labels(model, phase).observe(tokens.real)
        m.padding.labels(model, phase).observe(tokens.padding_ratio if self.pads() else 0.0)
        start = self.clock.now()
        running = m.running.labels(model)
        running.inc(len(items))
        try:
            results = await execute([i.payload for i in items])
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
            running.dec(len(items))
        for item, result in zip(items, results, strict=True):
            if isinstance(result, Exception):
                m.engine_errors.labels(model, phase).inc()
                self._finish(item, Outcome.ERROR, EngineError(f"model execution failed for this input: {result}"))
            else:
                self._finish(item, Outcome.RESULT, result)
        m.cost_error.labels(model, phase).observe(cost.observe(len(items), tokens.padded, elapsed))
        if cost is self.cost:  # the main fit's batches (a batch beside too): the drain per thread
            self.tracker.served(self.clock.now(), len(items), elapsed, backlogged)
            m.slowdown.labels(model, phase).set(self.cost.slowdown)

    def _fail_running(self, exc: Exception) -> int:
        running = 0
        for task, batch in ((self._inflight, self._inflight_batch), (self._lane, self._lane_batch)):
            if task is not None:
                running += sum(1 for i in batch.items if not i.finished) if batch is not None else 0
                task.cancel()  # its done-callback fails the batch's items
        return running


def engine_not_lane(
    item: WorkItem, now: float, s: BatchingSettings, lane: CostModel, main: CostModel, free: float
) -> bool:
    """Whether the engine's next batch (from `free`) would end `item` on time alone, where
    the lane would not (as `deadline_cap` judges on time: at the fit's slowdown, within the margin)."""
    if item.deadline is None:
        return False
    in_lane = now + lane.predict(1, item.cost) * lane.slowdown + s.margin
    on_main = free + main.predict(1, item.cost) * main.slowdown + s.margin
    return in_lane > item.deadline >= on_main
