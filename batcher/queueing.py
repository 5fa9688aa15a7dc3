"""What every batcher shares: admission, the queue, cancellation, expiry, live settings,
drain, and exactly-once resolution of items with their metrics.

Subclasses (`MicroBatcher` for one-shot models, `GenerationScheduler` for generation)
supply the loop that decides what runs when.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

from . import admission
from .admission import Predictor
from .clock import Clock, MonotonicClock
from .cost import Calibration, CostModel
from .errors import Cancelled, DeadlineExceeded, EngineError, RequestTooLarge, ShuttingDown
from .fairness import DEFAULT, TenantPolicy, Tenants
from .load import Load, LoadTracker
from .metrics import Metrics
from .queue import INF, RequestQueue
from .settings import BatchingSettings
from .types import Outcome, Priority, Stage, WorkItem

log = logging.getLogger("ferry.batcher")


class QueueingBatcher:
    phase = "embed"
    predict: Predictor = staticmethod(admission.predicted_completion)

    def __init__(
        self,
        model: str,
        settings: BatchingSettings,
        *,
        clock: Clock | None = None,
        cost: CostModel | None = None,
        metrics: Metrics | None = None,
        tenants: Tenants | None = None,
    ):
        self.model = model
        self.clock = clock or MonotonicClock()
        self.cost = cost or CostModel()
        self.metrics = metrics or Metrics()
        self._settings = settings
        # Fair shares between tenants (batcher/fairness.py): on by default; a batcher of its
        # own has one tenant, "default", until its callers name others.
        self.tenants = tenants if tenants is not None else Tenants()
        self.tenants.configure(settings.fairness == "on", settings.fair_input_weight, settings.fair_output_weight)
        self.queue = RequestQueue(aging=settings.aging_ms / 1000.0, tenants=self.tenants)
        self._wake = asyncio.Event()
        self.tracker = LoadTracker()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.failed: str | None = None  # set if the loop crashed; the model then answers 503
        self._idle = asyncio.Event()
        self._idle.set()
        self.metrics.publish_settings(model, settings)
        self.outcomes: dict[Outcome, int] = {o: 0 for o in Outcome if o is not Outcome.PENDING}
        # Generation: first-token promises by class, calibrated (cost.Calibration); none here.
        self.first_tokens: dict[Priority, Calibration] = {}

    # -- settings -----------------------------------------------------------------
    @property
    def settings(self) -> BatchingSettings:
        return self._settings

    def set_tenants(self, policies: dict[str, TenantPolicy]) -> None:
        """New weights and quotas by tenant, live (the others get weight 1 and no quota)."""
        self.tenants.set_policies(policies)
        log.info("tenant policies changed", extra={"model": self.model, "tenants": sorted(policies)})
        self._wake.set()

    def tenant_report(self) -> dict[str, dict[str, Any]]:
        """Each tenant's weight, counter, items and service (the admin API's view)."""
        return self.tenants.report(self.clock.now(), self.queue.tenant_depths())

    def update(self, **changes: Any) -> BatchingSettings:
        """Apply new knobs from the next decision on; queued work keeps its place. A
        `tenants` entry ({name: {weight, tokens_per_minute, max_concurrent}}) replaces the
        tenants' weights and quotas (the admin API's `PATCH /admin/tenants`)."""
        if (policies := changes.pop("tenants", None)) is not None:
            self.set_tenants({name: TenantPolicy(**p) for name, p in policies.items()})
            if not changes:
                return self._settings
        new = self._settings.updated(**changes)
        old, self._settings = self._settings, new
        self.queue.aging = new.aging_ms / 1000.0
        self.tenants.configure(new.fairness == "on", new.fair_input_weight, new.fair_output_weight)
        self.tracker.forget_drain()
        self.metrics.publish_settings(self.model, new)
        self.metrics.config_changes.labels(self.model).inc()
        diff = {k: (getattr(old, k), v) for k, v in new.to_dict().items() if getattr(old, k) != v}
        log.info("batching settings changed", extra={"model": self.model, "changes": diff})
        self._wake.set()
        return new

    # -- load ---------------------------------------------------------------------
    def load(self, now: float) -> Load:
        """The snapshot the next decision (dispatch or admission) reads."""
        return self.tracker.snapshot(now, self.queue, self._settings, self.cost, self.busy_until(now))

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
        itl_target: float | None = None,
        tenant: str = DEFAULT,
        on_infeasible: str | None = None,
    ) -> list[WorkItem]:
        """Queue the items of one request, all or none, or raise at once
        (QueueFull, DeadlineInfeasible, TenantQuota, ShuttingDown).

        `budget` is the latency budget in seconds; None uses the configured default.
        `itl_target`: the request's inter-token target in seconds (generation; a one-shot
        model has no tokens after the first and ignores it).
        `tenant`: whose work it is (fair order within classes, quotas: batcher/fairness.py).
        `on_infeasible`: the request's own "reject" or "serve" for a budget admission judges
        it cannot meet (None: the model's setting).
        Item i gets prompt_index i. `count_rejection=False` is for callers that retry a
        refusal themselves (batch jobs): only their final outcome should count.
        """
        s = self._settings
        now = self.clock.now()
        if self._closing:
            raise ShuttingDown("server is shutting down", retry_after=1)
        if len(payloads) > s.max_queue:
            raise RequestTooLarge(
                f"request has {len(payloads)} items but this model queues at most {s.max_queue}; "
                f"split it into smaller requests"
            )
        if budget is None and s.default_budget_ms is not None:
            budget = s.default_budget_ms / 1000.0
        deadline = None if budget is None else now + budget
        items = [
            WorkItem(
                payload=p,
                arrival=now,
                deadline=deadline,
                priority=priority,
                cost=costs[i] if costs is not None else cost,
                request_id=request_id,
                prompt_index=i,
                on_delta=on_delta,
                itl_target=itl_target,
                tenant=tenant,
                expected_output=self.expected_output(p),
                on_infeasible=on_infeasible,
            )
            for i, p in enumerate(payloads)
        ]
        try:
            self.tenants.check_quota(tenant, len(items), now)
            best_effort = admission.check(
                self.queue,
                items[-1],
                now,
                s,
                self.cost,
                self.load(now),
                siblings=len(items) - 1,
                predict=self.predict,
                promised=self.promised(priority, tenant),
            )
            best_effort = self.check_itl(items[-1], len(items) - 1) or best_effort
        except Exception as exc:
            if count_rejection:
                reason = getattr(exc, "code", "invalid")
                self.metrics.rejections.labels(self.model, reason).inc(len(items))
                self.metrics.tenant_refused(self.model, self.tenants, tenant, reason, len(items), now)
                # Offered load, refused; a caller that retries would count each try.
                self.tracker.offered(now, len(items), budget, priority)
            raise
        self.tracker.offered(now, len(items), budget, priority)
        self.tracker.admitted([i.cost for i in items])
        loop = asyncio.get_running_loop()
        self.tenants.arrive(tenant, len(items))
        for item in items:
            item.best_effort = best_effort
            item.future = loop.create_future()
            self.queue.push(item)
        self._publish_depth(priority)  # the other classes' depths did not change
        self._wake.set()
        return items

    def promised(self, priority: Priority, tenant: str = "") -> float:
        """The earliest deadline of queued work a newcomer of `priority` must not make late
        (admission.check's `promised`): none here, a one-shot batch's prediction already
        counts the work queued before it, and what it delays comes after its own deadline."""
        return INF

    def expected_output(self, payload: Any) -> float:
        """Tokens an item is expected to generate after its input (fair order's price):
        none for a one-shot model; generation overrides."""
        return 0.0

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
        self.tenants.left(item.tenant)
        self.outcomes[outcome] += 1
        self.metrics.items.labels(self.model, outcome.name.lower()).inc()
        if outcome in (Outcome.RESULT, Outcome.EXPIRED):
            self._record_slo(item, outcome is Outcome.RESULT)
        if outcome is Outcome.EXPIRED and item.predicted_wait is not None and item.priority in self.first_tokens:
            # Expired before its first token: the wait so far is a lower bound of the one its
            # promise is judged by; left out, the latest promises at overload would not count.
            # News only where it already exceeds the prediction (a best-effort item, predicted
            # past its budget, expires sooner than predicted, which says nothing of either).
            waited = self.clock.now() - item.arrival
            if waited >= item.predicted_wait:
                self.first_tokens[item.priority].observe(item.predicted_wait, waited)
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
            self._finish(
                item,
                Outcome.EXPIRED,
                DeadlineExceeded(f"latency budget exceeded after waiting {waited_ms:.0f} ms in the queue"),
            )
        self._publish_depth()

    def check_itl(self, item: WorkItem, siblings: int) -> bool:
        """Admission of an inter-token target (generation overrides): raise
        DeadlineInfeasible, or return True when admitted best-effort. One-shot models have
        no inter-token gaps: nothing to check."""
        return False

    def _take(self, n: int, now: float) -> list[WorkItem]:
        return self._taken(self.queue.take(n, now), now)

    def _taken(self, items: list[WorkItem], now: float) -> list[WorkItem]:
        """Items just taken off the queue: their queue wait observed, their input tokens
        charged to their tenants, the depth published."""
        for item in items:
            self.metrics.queue_wait.labels(self.model, item.priority.label).observe(now - item.arrival)
            self.serve_tokens(item.tenant, now, input_tokens=item.cost)
        self._publish_depth()
        return items

    def serve_tokens(self, tenant: str, now: float, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """Tokens computed for a tenant: its counter, and the metric."""
        self.tenants.charge(tenant, now, input_tokens, output_tokens)
        self.metrics.tenant_served(self.model, self.tenants, tenant, input_tokens, output_tokens, now)

    def _publish_depth(self, *priorities: Priority) -> None:
        """The queue depth gauge of the given classes (all when none are given), and each
        tenant's."""
        for p in priorities or Priority:
            self.metrics.queue_depth.labels(self.model, p.label).set(self.queue.count(p))
        self.metrics.publish_tenants(self.model, self.tenants, self.queue.tenant_depths(), self.clock.now())

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

    def stop_sequence(self, item: WorkItem) -> bool:
        """End a running sequence as stopped by its caller (generation); a one-shot batcher
        has none, and a finished item is skipped: False."""
        return False

    @property
    def cost_models(self) -> dict[str, CostModel]:  # pragma: no cover - abstract
        """The fitted cost models by phase, for admin and the live page to show."""
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
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        self._fail_all(ShuttingDown("server stopped"))

    @property
    def closing(self) -> bool:
        return self._closing


def seconds_until(t: float, now: float) -> float | None:
    return None if t == math.inf else max(0.0, t - now)
