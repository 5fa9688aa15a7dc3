"""The batcher's test rigs: a micro-batcher on a fake clock over a simulated engine whose
cost is known exactly, and random arrival streams to feed it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from batcher.clock import FakeClock
from batcher.cost import CostModel, LinearCost
from batcher.errors import BatchingError
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher
from batcher.settings import BatchingSettings
from batcher.types import Priority, WorkItem
from engine.fake import SimulatedExecutor

# The simulated engine of the rigs: a batch of n items takes FIXED + PER_ITEM * n seconds.
# Tests derive their expected times from these, through `cost`.
FIXED, PER_ITEM = 0.010, 0.002


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class Rig:
    """A micro-batcher on a fake clock with a simulated engine (latency a + b*n)."""

    def __init__(self, fixed: float = FIXED, per_item: float = PER_ITEM, lane: bool = False, **settings: Any):
        """`lane`: interactive batches may run beside the batch in flight, on `self.lane`
        (a second simulated engine thread of the same cost)."""
        settings.setdefault("default_budget_ms", None)
        settings.setdefault("policy", "fixed")
        self.clock = FakeClock()
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.engine = SimulatedExecutor(self.clock, fixed, per_item)
        self.lane = SimulatedExecutor(self.clock, fixed, per_item) if lane else None
        self.batcher = MicroBatcher(
            "m",
            self.engine,
            BatchingSettings(**settings),
            clock=self.clock,
            metrics=self.metrics,
            execute_lane=self.lane,
        )

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    @property
    def batches(self) -> list[list[Any]]:
        return [payloads for _, payloads in self.engine.runs]

    @property
    def lane_batches(self) -> list[list[Any]]:
        return [payloads for _, payloads in self.lane.runs] if self.lane is not None else []


def cost(n: int) -> float:
    """Seconds a batch of n items takes on the exact rigs' engine (and COST predicts)."""
    return FIXED + PER_ITEM * n


def fits(seconds: float, most: int = 32) -> int:
    """The most items (up to `most`) whose batch takes at most `seconds`; 0 if none."""
    return max((n for n in range(1, most + 1) if cost(n) <= seconds + 1e-12), default=0)


# A cost model that knows that engine exactly, for the policies and admission as pure functions.
COST = CostModel(LinearCost(FIXED, PER_ITEM, 0.0))


def exact_rig(**kw: Any) -> Rig:
    """A rig whose cost models know the simulated engine exactly and never refit."""
    r = Rig(fixed=FIXED, per_item=PER_ITEM, **kw)
    r.batcher.cost = CostModel(LinearCost(FIXED, PER_ITEM, 0.0), refit_every=10**9)
    r.batcher.lane_cost = CostModel(LinearCost(FIXED, PER_ITEM, 0.0), refit_every=10**9)
    return r


# -- random arrival streams, fed to a rig -------------------------------------------------
arrivals = st.lists(
    st.tuples(
        st.floats(0, 0.02),  # gap before this arrival
        st.sampled_from([None, 0.015, 0.03, 0.08, 0.5]),  # budget (s); None = default
        st.sampled_from([Priority.INTERACTIVE, Priority.INTERACTIVE, Priority.BATCH]),
        st.booleans(),  # cancel a random earlier item afterwards
    ),
    min_size=1,
    max_size=50,
)


async def drive(r: Rig, stream, *, check_admission: bool = False):
    """Feed the stream; returns (items, finish time by item id, rejected count).
    `check_admission`: each refusal (or best-effort admission) must be what the cost model
    predicts, through the batcher's `predict` (admission.predicted_completion, or the lane's)."""
    await r.batcher.start()
    items: list[WorkItem] = []
    finished_at: dict[int, float] = {}
    rejected = 0
    for gap, budget, prio, cancel in stream:
        await r.clock.advance(gap)
        b = r.batcher
        if check_admission and budget is not None:
            probe = WorkItem(
                payload=None, arrival=r.clock.now(), deadline=r.clock.now() + budget, priority=prio, id=10**9
            )
            predicted = b.predict(b.queue, probe, r.clock.now(), b.settings, b.cost, b.load(r.clock.now()))
            infeasible = predicted + b.settings.margin > probe.deadline
        try:
            item = b.submit(len(items), budget=budget, priority=prio)
        except BatchingError:
            rejected += 1
            if check_admission:
                assert budget is not None and infeasible, "rejected although the cost model said feasible"
            continue
        if check_admission and budget is not None:
            assert not infeasible or item.best_effort
        item.future.add_done_callback(lambda f, i=item: finished_at.setdefault(i.id, r.clock.now()))
        items.append(item)
        if cancel and len(items) > 1:
            b.cancel(items[(len(items) * 7) % (len(items) - 1)])
    await r.clock.run_until_idle()
    await r.batcher.stop()
    return items, finished_at, rejected


@pytest.fixture
def rig_factory():
    return Rig
