"""What every batcher shares: admission, the queue, cancellation, expiry, live settings,
drain, and exactly-once resolution of items with their metrics.

Subclasses (`MicroBatcher` for one-shot models, `GenerationScheduler` for generation)
supply the loop that decides what runs when.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from typing import Any, Callable

from . import admission
from .clock import Clock, MonotonicClock
from .cost import CostModel
from .errors import Cancelled, DeadlineExceeded, EngineError, RequestTooLarge, ShuttingDown
from .metrics import Metrics
from .queue import RequestQueue
from .settings import BatchingSettings
from .types import Outcome, Priority, Stage, WorkItem

log = logging.getLogger("ferry.batcher")

RATE_HORIZON = 1.0  # seconds of arrivals used to estimate the arrival rate
# Work with a longer budget is background work (batch jobs): it fills the capacity urgent
# work leaves and does not size batches; it does once its deadline comes within RATE_HORIZON.
URGENT_BUDGET = 60.0
RESERVE_HORIZON = 2.0  # seconds an interactive budget keeps shaping batch sizes
SERVICE_HORIZON = 2.0  # seconds of completions used to estimate the service rate
# The busiest the engine may be with reserve-sized batches. 1.0: the smallest batch that
# keeps up (bench_latency: 0.9 still cost interactive attainment at 80% load, 95.5%).
KEEP_UP_UTILISATION = 1.0


class QueueingBatcher:
    phase = "embed"

    def __init__(
        self,
        model: str,
        settings: BatchingSettings,
        *,
        clock: Clock | None = None,
        cost: CostModel | None = None,
        metrics: Metrics | None = None,
    ):
        self.model = model
        self.clock = clock or MonotonicClock()
        self.cost = cost or CostModel()
        self.metrics = metrics or Metrics()
        self._settings = settings
        self.queue = RequestQueue(aging=settings.aging_ms / 1000.0)
        self._wake = asyncio.Event()
        self._arrivals: deque[float] = deque()
        self._interactive_budgets: deque[tuple[float, float]] = deque()  # (arrival, budget)
        self._completions: deque[float] = deque()
        self._typical_cost = 1.0  # moving average of item cost (tokens), for keep_up_time
        self._task: asyncio.Task | None = None
        self._closing = False
        self.failed: str | None = None  # set if the loop crashed; the model then answers 503
        self._idle = asyncio.Event()
        self._idle.set()
        self.metrics.publish_settings(model, settings)
        self.outcomes: dict[Outcome, int] = {o: 0 for o in Outcome if o is not Outcome.PENDING}

    # -- settings -----------------------------------------------------------------
    @property
    def settings(self) -> BatchingSettings:
        return self._settings

    def update(self, **changes: Any) -> BatchingSettings:
        """Apply new knobs from the next decision on; queued work keeps its place."""
        new = self._settings.updated(**changes)
        old, self._settings = self._settings, new
        self.queue.aging = new.aging_ms / 1000.0
        self.metrics.publish_settings(self.model, new)
        self.metrics.config_changes.labels(self.model).inc()
        diff = {k: (getattr(old, k), v) for k, v in new.to_dict().items() if getattr(old, k) != v}
        log.info("batching settings changed", extra={"model": self.model, "changes": diff})
        self._wake.set()
        return new

    # -- arrival rate -------------------------------------------------------------
    def arrival_rate(self, now: float) -> float:
        """Urgent items (budget up to URGENT_BUDGET) offered per second lately, admitted or
        refused; a refusal its caller retries (count_rejection=False) counts once, admitted."""
        while self._arrivals and self._arrivals[0] < now - RATE_HORIZON:
            self._arrivals.popleft()
        return len(self._arrivals) / RATE_HORIZON

    def shaping(self, now: float) -> tuple[float | None, int]:
        """(reserve, floor): the longest batch the policies may form, and the fewest items an
        interactive deadline may cut a batch to.

        The reserve protects interactive requests: one arriving just as a batch starts waits
        for it, then runs in a batch of its own, and both must fit in the tightest
        interactive budget seen lately, each prediction keeping the margin. Its own batch
        takes at least one typical item alone, and at least the floor. None: no interactive
        traffic lately.

        The floor is the smallest batch that keeps up with the offered load and drains the
        backlog: batches smaller than that grow a queue in which every budget, interactive
        ones included, is missed. Neither the reserve nor interactive deadlines cut batches
        below it; admission predicts with it, so under overload an interactive request that
        cannot be served alongside the batches the load needs is refused at once instead.
        """
        floor, keep_up = self.keep_up(now)
        q = self._recent_interactive(now)
        if not q:
            return None, floor
        s = self._settings
        alone = self.cost.predict(1, self._typical_tokens)
        # Both batches may run `slowdown` times slower than predicted.
        usable = (min(b for _, b in q) - 2.0 * s.margin) / self.cost.slowdown
        protect = max(usable - max(alone, keep_up), 0.0)
        return max(protect, keep_up), floor

    def reserve(self, now: float) -> float | None:
        return self.shaping(now)[0]

    def admission_slowdown(self) -> float:
        """What admission multiplies interactive predictions by (the policies do the same)."""
        return self.cost.slowdown

    def keep_up(self, now: float) -> tuple[int, float]:
        """(items, predicted seconds) of the smallest batch whose throughput covers the
        offered arrival rate of urgent work plus draining the queued work due within
        RATE_HORIZON, at KEEP_UP_UTILISATION (max_batch_size when none does). Offered, not
        admitted: under overload admission refuses what small batches cannot carry, and
        sizing batches by what was admitted would lock in the small batches.
        """
        s = self._settings
        rate = self.arrival_rate(now) + self.queue.due_within(now + RATE_HORIZON) / RATE_HORIZON
        tokens = self._typical_tokens
        n, t = 1, 0.0
        for n in range(1, s.max_batch_size + 1):
            t = self.cost.predict(n, n * tokens)
            if n >= rate * t / KEEP_UP_UTILISATION:
                break
        return n, t

    @property
    def _typical_tokens(self) -> int:
        return max(1, round(self._typical_cost))

    def _recent_interactive(self, now: float) -> deque[tuple[float, float]]:
        q = self._interactive_budgets
        while q and q[0][0] < now - RESERVE_HORIZON:
            q.popleft()
        return q

    def interactive_rate(self, now: float) -> float:
        return len(self._recent_interactive(now)) / RESERVE_HORIZON

    def service_rate(self, now: float) -> float:
        """Items finished per second lately (the saturated service rate when the queue is long)."""
        c = self._completions
        while c and c[0] < now - SERVICE_HORIZON:
            c.popleft()
        return len(c) / SERVICE_HORIZON

    # -- submit / cancel ----------------------------------------------------------
    def busy_until(self, now: float) -> float:
        """When the engine is predicted to be free of work already dispatched."""
        return now

    def submit(self, payload: Any, **kw: Any) -> WorkItem:
        return self.submit_many([payload], **kw)[0]

    def submit_many(
        self,
        payloads: list[Any],
        *,
        costs: list[int] | None = None,
        cost: int = 1,
        budget: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
        request_id: str = "",
        on_delta: Callable[[Any], None] | None = None,
        count_rejection: bool = True,
    ) -> list[WorkItem]:
        """Queue the items of one request, all or none, or raise at once
        (QueueFull, DeadlineInfeasible, ShuttingDown).

        `budget` is the latency budget in seconds; None uses the configured default.
        Item i gets prompt_index i. `count_rejection=False` is for callers that retry a
        refusal themselves (batch jobs): only their final outcome should count.
        """
        s = self._settings
        now = self.clock.now()
        if self._closing:
            raise ShuttingDown("server is shutting down", retry_after=1)
        if len(payloads) > s.max_queue:
            raise RequestTooLarge(f"request has {len(payloads)} items but this model queues at most {s.max_queue}; "
                                  f"split it into smaller requests")
        if budget is None and s.default_budget_ms is not None:
            budget = s.default_budget_ms / 1000.0
        deadline = None if budget is None else now + budget
        items = [
            WorkItem(payload=p, arrival=now, deadline=deadline, priority=priority,
                     cost=costs[i] if costs is not None else cost, request_id=request_id,
                     prompt_index=i, on_delta=on_delta)
            for i, p in enumerate(payloads)
        ]
        reserve, floor = self.shaping(now)
        urgent = budget is not None and budget <= URGENT_BUDGET
        try:
            best_effort = admission.check(self.queue, items[-1], now, self.busy_until(now), s, self.cost,
                                          siblings=len(items) - 1, service_rate=self.service_rate(now),
                                          reserve=reserve, interactive_rate=self.interactive_rate(now), floor=floor,
                                          slowdown=self.admission_slowdown())
        except Exception as exc:
            if count_rejection:
                self.metrics.rejections.labels(self.model, getattr(exc, "code", "invalid")).inc(len(items))
                if urgent:  # offered load, refused; a caller that retries would count each try
                    self._arrivals.extend([now] * len(items))
            raise
        if urgent:
            self._arrivals.extend([now] * len(items))
        loop = asyncio.get_running_loop()
        for item in items:
            item.best_effort = best_effort
            item.future = loop.create_future()
            self.queue.push(item)
            self._typical_cost += 0.05 * (item.cost - self._typical_cost)
        if priority is Priority.INTERACTIVE and budget is not None:
            self._interactive_budgets.append((now, budget))
        self._publish_depth()
        self._wake.set()
        return items

    def cancel(self, item: WorkItem, *, by_client: bool = True) -> bool:
        """Idempotent: a finished or unknown item is skipped. `by_client=False` withdraws an
        item for the server's own reasons (a sibling failed): it ends cancelled but is not
        counted as a client cancellation."""
        if item.finished:
            return False
        stage = Stage.QUEUED if item in self.queue else Stage.RUNNING
        if stage is Stage.QUEUED:
            self.queue.remove(item)
            self._publish_depth()
        else:
            self._cancel_running(item)
        if by_client:
            self.metrics.cancellations.labels(self.model, stage.value).inc()
        self._finish(item, Outcome.CANCELLED, Cancelled("request cancelled by the client"))
        self._wake.set()
        return True

    def _cancel_running(self, item: WorkItem) -> None:
        """Hook: one-shot batches simply discard the result; generation drops the row."""

    # -- resolution ---------------------------------------------------------------
    def _finish(self, item: WorkItem, outcome: Outcome, value: Any = None) -> bool:
        if not item.finish(outcome, value):
            return False
        self.outcomes[outcome] += 1
        if outcome is Outcome.RESULT:
            self._completions.append(self.clock.now())
        self.metrics.items.labels(self.model, outcome.name.lower()).inc()
        if outcome in (Outcome.RESULT, Outcome.EXPIRED):
            self._record_slo(item, outcome is Outcome.RESULT)
        return True

    def _record_slo(self, item: WorkItem, served: bool) -> None:
        """Once per item: within budget or not (generation with a TTFT budget records it at
        the first token)."""
        if item.deadline is None or item.slo_recorded:
            return
        item.slo_recorded = True
        met = served and self.clock.now() <= item.deadline
        self.metrics.slo.labels(self.model, item.priority.label, "met" if met else "missed").inc()

    def _expire(self, now: float) -> None:
        for item in self.queue.expired(now):
            self.queue.remove(item)
            self.metrics.expired.labels(self.model, item.priority.label).inc()
            waited_ms = (now - item.arrival) * 1000.0
            self._finish(item, Outcome.EXPIRED, DeadlineExceeded(f"latency budget exceeded after waiting {waited_ms:.0f} ms in the queue"))
        self._publish_depth()

    def _take(self, n: int, now: float) -> list[WorkItem]:
        items = self.queue.take(n, now)
        for item in items:
            self.metrics.queue_wait.labels(self.model, item.priority.label).observe(now - item.arrival)
        self._publish_depth()
        return items

    def _publish_depth(self) -> None:
        for p in Priority:
            self.metrics.queue_depth.labels(self.model, p.label).set(self.queue.count(p))

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._guarded_loop(), name=f"ferry-batcher-{self.model}")

    async def _guarded_loop(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug; fail loudly, never hang clients
            log.exception("batcher loop crashed", extra={"model": self.model})
            # Refuse new work from now on: nothing is left to dispatch or expire it.
            self._closing = True
            self.failed = f"batcher loop crashed: {type(exc).__name__}: {exc}"
            self._fail_all(EngineError(self.failed))
            raise

    async def _loop(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def busy(self) -> bool:
        return len(self.queue) > 0

    async def drain(self, timeout: float) -> int:
        """Stop admitting, finish what was accepted within `timeout`, fail the rest.

        Returns how many items had to be failed.
        """
        self._closing = True
        self._wake.set()
        deadline = self.clock.now() + timeout
        while self.busy and self.clock.now() < deadline:
            self._idle.clear()
            await self.clock.wait(self._idle, min(0.05, max(0.0, deadline - self.clock.now())))
        return self._fail_all(ShuttingDown("server shut down before this request could finish"))

    def _fail_all(self, exc: Exception) -> int:
        failed = 0
        for item in list(self.queue.items()):
            self.queue.remove(item)
            failed += self._finish(item, Outcome.ERROR, exc)
        failed += self._fail_running(exc)
        self._publish_depth()
        return failed

    def _fail_running(self, exc: Exception) -> int:
        return 0

    async def stop(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self._fail_all(ShuttingDown("server stopped"))

    @property
    def closing(self) -> bool:
        return self._closing


def seconds_until(t: float, now: float) -> float | None:
    return None if t == math.inf else max(0.0, t - now)
