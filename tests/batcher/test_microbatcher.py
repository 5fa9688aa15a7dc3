"""The Foundation rules of the micro-batcher, in simulated time."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher.errors import Cancelled, DeadlineInfeasible, EngineError, QueueFull
from batcher.types import DispatchReason, Outcome

from .conftest import Rig, run


def test_dispatches_when_size_cap_is_reached():
    async def scenario():
        r = Rig(max_batch_size=4, max_wait_ms=1000)
        await r.batcher.start()
        items = [r.batcher.submit(i) for i in range(4)]
        await r.clock.advance(0)
        assert r.batches == [[0, 1, 2, 3]]
        assert {i.reason for i in items} == {DispatchReason.FULL}
        assert r.clock.now() == r.engine.runs[0][0]  # no waiting at all
        await r.clock.run_until_idle()
        assert [i.future.result() for i in items] == [("ok", i) for i in range(4)]
        assert r.value("ferry_batches_total", model="m", reason="full") == 1
        await r.batcher.stop()

    run(scenario())


def test_max_wait_is_measured_from_the_oldest_item():
    async def scenario():
        r = Rig(max_batch_size=8, max_wait_ms=10)
        max_wait = r.batcher.settings.max_wait
        await r.batcher.start()
        t0 = r.clock.now()
        r.batcher.submit("a")
        await r.clock.advance(0.006)
        r.batcher.submit("b")  # arrives 6 ms after the oldest
        await r.clock.advance(0.0039)
        assert r.batches == []  # 9.9 ms: the oldest has not waited 10 ms yet
        await r.clock.advance(0.0001)
        assert r.batches == [["a", "b"]]
        assert r.engine.runs[0][0] == pytest.approx(t0 + max_wait)  # not 6 + 10 ms
        assert r.batcher.batches[0].reason is DispatchReason.MAX_WAIT
        await r.batcher.stop()

    run(scenario())


def test_zero_wait_dispatches_whatever_is_queued_when_engine_is_free():
    async def scenario():
        batch_time = 0.010  # whatever its size
        r = Rig(max_batch_size=8, max_wait_ms=0, fixed=batch_time, per_item=0.0)
        await r.batcher.start()
        r.batcher.submit(1)
        await r.clock.advance(0)
        assert r.batches == [[1]]
        # Arrivals while the engine runs form the next batch, started the moment it frees.
        for i in range(2, 5):
            r.batcher.submit(i)
        await r.clock.advance(batch_time / 2)
        assert len(r.batches) == 1
        await r.clock.advance(batch_time / 2)
        assert r.batches == [[1], [2, 3, 4]]
        assert r.engine.runs[1][0] == pytest.approx(r.engine.runs[0][0] + batch_time)  # no idle gap
        await r.batcher.stop()

    run(scenario())


def test_no_busy_polling_while_idle():
    async def scenario():
        r = Rig(max_batch_size=8, max_wait_ms=50)
        await r.batcher.start()
        await r.clock.settle()
        assert r.clock.next_timer is None  # idle: sleeping on the arrival event, no timer
        r.batcher.submit(1)
        await r.clock.settle()
        assert r.clock.next_timer == pytest.approx(r.clock.now() + r.batcher.settings.max_wait)  # one timer
        await r.batcher.stop()

    run(scenario())


def test_cancelled_before_dispatch_is_never_computed():
    async def scenario():
        r = Rig(max_batch_size=8, max_wait_ms=10)
        await r.batcher.start()
        keep, leave = r.batcher.submit("keep"), r.batcher.submit("leave")
        assert r.batcher.cancel(leave)
        assert not r.batcher.cancel(leave)  # idempotent
        await r.clock.run_until_idle()
        assert r.batches == [["keep"]]
        assert leave.outcome is Outcome.CANCELLED and isinstance(leave.future.exception(), Cancelled)
        assert keep.future.result() == ("ok", "keep")
        assert r.value("ferry_cancellations_total", model="m", phase="queued") == 1
        await r.batcher.stop()

    run(scenario())


def test_engine_exception_fails_only_that_batch_and_batcher_keeps_serving():
    async def scenario():
        r = Rig(max_batch_size=2, max_wait_ms=0)
        r.engine.fail_batches = {0}
        await r.batcher.start()
        first = [r.batcher.submit(i) for i in range(2)]
        await r.clock.run_until_idle()
        second = [r.batcher.submit(i) for i in range(2, 4)]
        await r.clock.run_until_idle()
        assert all(isinstance(i.future.exception(), EngineError) for i in first)
        assert [i.future.result() for i in second] == [("ok", 2), ("ok", 3)]
        assert r.value("ferry_engine_errors_total", model="m", phase="embed") == 1
        await r.batcher.stop()

    run(scenario())


def test_per_item_failure_fails_only_that_item():
    async def scenario():
        r = Rig(max_batch_size=3, max_wait_ms=0)
        r.engine.fail_items = {"bad"}
        await r.batcher.start()
        items = [r.batcher.submit(p) for p in ("a", "bad", "c")]
        await r.clock.run_until_idle()
        assert r.batches == [["a", "bad", "c"]]
        assert items[0].future.result() == ("ok", "a") and items[2].future.result() == ("ok", "c")
        assert isinstance(items[1].future.exception(), EngineError)
        await r.batcher.stop()

    run(scenario())


def test_live_change_applies_from_the_next_batch():
    async def scenario():
        r = Rig(max_batch_size=2, max_wait_ms=0, fixed=0.010, per_item=0.0)
        await r.batcher.start()
        for i in range(6):
            r.batcher.submit(i)
        await r.clock.advance(0)
        r.batcher.update(max_batch_size=4)
        await r.clock.run_until_idle()
        assert r.batches == [[0, 1], [2, 3, 4, 5]]  # queued work kept its order
        assert r.value("ferry_setting_max_batch_size", model="m") == 4
        assert r.value("ferry_config_changes_total", model="m") == 1
        await r.batcher.stop()

    run(scenario())


events = st.lists(
    st.tuples(st.sampled_from(["submit", "cancel", "advance"]), st.integers(0, 30), st.floats(0, 0.02)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=events,
    size=st.integers(1, 6),
    wait_ms=st.sampled_from([0, 1, 5, 20]),
    fail_batch=st.sampled_from([None, 0, 2]),
    budget=st.sampled_from([None, 15.0]),
)
def test_every_item_ends_exactly_once_under_random_interleavings(events, size, wait_ms, fail_batch, budget):
    async def scenario():
        r = Rig(max_batch_size=size, max_wait_ms=wait_ms, max_queue=20, default_budget_ms=budget)
        r.engine.fail_batches = {fail_batch} if fail_batch is not None else set()
        r.engine.fail_items = {7}
        await r.batcher.start()
        items, rejected = [], 0
        for kind, n, dt in events:
            if kind == "submit":
                try:
                    items.append(r.batcher.submit(n))
                except (QueueFull, DeadlineInfeasible):
                    rejected += 1
            elif kind == "cancel" and items:
                r.batcher.cancel(items[n % len(items)])
            else:
                await r.clock.advance(dt)
        await r.clock.run_until_idle()
        resolutions = []
        for item in items:
            item.future.add_done_callback(lambda f, item=item: resolutions.append(item.id))
        await r.clock.settle()
        assert all(i.future.done() and i.finished for i in items)
        assert sorted(resolutions) == sorted(i.id for i in items)  # each future exactly once
        assert sum(r.batcher.outcomes.values()) == len(items)
        computed = [p for batch in r.batches for p in batch]
        # Nothing cancelled or expired while queued reached the engine.
        dispatched = {i.id for i in items if i.dispatched_at is not None}
        assert len(computed) == len(dispatched)
        assert r.batcher.busy is False
        await r.batcher.stop()

    run(scenario())
