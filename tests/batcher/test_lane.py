"""The interactive lane: interactive batches run beside the batch in flight instead of
waiting for it (MicroBatcher with `execute_lane`), in simulated time. The properties
(exactly once, nothing after its deadline, admission as predicted) run with and without the
lane in test_policy.py and test_admission.py."""

from __future__ import annotations

import pytest

from batcher.cost import CostModel, LinearCost
from batcher.errors import DeadlineInfeasible, EngineError, ShuttingDown
from batcher.microbatcher import LANE_QUIET
from batcher.types import DispatchReason, Outcome, Priority

from .conftest import PER_ITEM, cost, exact_rig, run

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


def test_interactive_work_runs_at_once_beside_a_batch_in_flight():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=32, max_wait_ms=0)
        await r.batcher.start()
        bulk = r.batcher.submit_many(list(range(32)), priority=BATCH)
        await r.clock.advance(0.005)  # the 32-item batch runs until cost(32) = 74 ms
        arrived = r.clock.now()
        urgent = r.batcher.submit_many(["u1", "u2"], priority=INTERACTIVE, budget=0.05)
        await r.clock.advance(0)
        assert r.lane_batches == [["u1", "u2"]]
        assert r.lane.runs[0][0] == arrived  # no wait for the batch in flight
        assert {i.reason for i in urgent} == {DispatchReason.LANE}
        await r.clock.run_until_idle()
        assert all(i.outcome is Outcome.RESULT for i in bulk + urgent)
        assert r.batches == [list(range(32))]  # the bulk batch was not touched
        assert r.value("ferry_batches_total", model="m", reason="lane") == 1
        await r.batcher.stop()

    run(scenario())


async def almost_done(r, n: int) -> float:
    """A batch-class batch of `n` items dispatched and run until 5 ms before its end; its start."""
    await r.batcher.start()
    t0 = r.clock.now()
    r.batcher.submit_many(list(range(n)), priority=BATCH)
    await r.clock.advance(cost(n) - 0.005)
    return t0


def test_interactive_work_waits_when_the_batch_in_flight_ends_before_a_lane_batch_would():
    """A lane batch of one takes cost(1) = 12 ms; 5 ms before the bulk batch ends, waiting
    for the engine costs nothing: the item joins the next batch, not a batch of its own."""

    async def scenario():
        r = exact_rig(lane=True, max_batch_size=32, max_wait_ms=0)
        t0 = await almost_done(r, 32)
        r.batcher.submit("u", priority=INTERACTIVE)
        await r.clock.run_until_idle()
        assert r.lane_batches == []
        assert r.batches == [list(range(32)), ["u"]]
        assert r.engine.runs[1][0] == pytest.approx(t0 + cost(32))
        await r.batcher.stop()

    run(scenario())


def test_interactive_work_more_than_a_batch_runs_in_the_lane_however_little_is_left_in_flight():
    """5 ms before the bulk batch ends, more interactive work waits than one batch takes
    (max_batch_size 4): the next batch would not take it all, so the lane takes a batch at
    once instead of leaving the second thread idle, and the rest follows on the engine."""

    async def scenario():
        r = exact_rig(lane=True, max_batch_size=4, max_wait_ms=0)
        t0 = await almost_done(r, 4)
        urgent = r.batcher.submit_many([f"u{i}" for i in range(6)], priority=INTERACTIVE, budget=1.0)
        await r.clock.run_until_idle()
        assert r.lane_batches == [["u0", "u1", "u2", "u3"]]
        assert r.lane.runs[0][0] == pytest.approx(t0 + cost(4) - 0.005)  # no wait for the batch in flight
        assert r.batches == [list(range(4)), ["u4", "u5"]]
        assert all(i.outcome is Outcome.RESULT for i in urgent)
        await r.batcher.stop()

    run(scenario())


def test_under_a_backlog_an_item_only_the_engine_would_serve_on_time_stays_for_it():
    """The lane's thread shares the cores, so its fit may be slower than the engine's (30 ms
    + 2 ms an item here, against 10 + 2): an urgent item the engine's next batch ends on
    time and the lane would not, even alone, is left for the engine, and the lane takes the
    backlog behind it. (Before, the lane took it with the others and it ended 10 ms late.)"""

    async def scenario():
        r = exact_rig(lane=True, max_batch_size=4, max_wait_ms=0)
        assert r.lane is not None
        r.lane.fixed = 0.030
        r.batcher.lane_cost = CostModel(LinearCost(0.030, PER_ITEM, 0.0), refit_every=10**9)
        t0 = await almost_done(r, 4)  # the bulk batch ends at t0 + cost(4) = 18 ms
        urgent = r.batcher.submit("a", priority=INTERACTIVE, budget=0.028)  # the engine: 18 + 14 ms
        assert not urgent.best_effort
        rest = r.batcher.submit_many([f"u{i}" for i in range(5)], priority=INTERACTIVE, budget=1.0)
        await r.clock.run_until_idle()
        assert r.lane_batches == [["u0", "u1", "u2"]]  # of the four it looked at, less "a"
        assert r.batches[1] == ["a", "u3", "u4"]
        assert r.engine.runs[1][0] == pytest.approx(t0 + cost(4))
        assert all(i.outcome is Outcome.RESULT for i in [urgent, *rest])
        await r.batcher.stop()

    run(scenario())


async def bulk_then_more(r, bulk: list[int], more: list[int]):
    """Batch-class `bulk` (a full batch) dispatched, then `more` 1 ms into it; 1 ms later."""
    first = r.batcher.submit_many(bulk, priority=BATCH)
    await r.clock.advance(0.001)
    then = r.batcher.submit_many(more, priority=BATCH)
    await r.clock.advance(0.001)
    return first, then


def test_batch_class_work_does_not_take_the_lane_kept_for_interactive_work():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=4, max_wait_ms=0)
        await r.batcher.start()
        r.batcher.submit("u", priority=INTERACTIVE)  # interactive work seen: the lane is kept for it
        await r.clock.run_until_idle()
        await bulk_then_more(r, [1, 2, 3, 4], [5, 6])
        assert r.lane_batches == []  # they wait for the engine
        await r.clock.run_until_idle()
        assert r.batches == [["u"], [1, 2, 3, 4], [5, 6]]
        await r.batcher.stop()

    run(scenario())


def test_without_interactive_work_lately_batches_of_any_class_run_on_both_threads():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=4, max_wait_ms=0)
        await r.batcher.start()
        assert r.batcher.load(r.clock.now()).workers == 2  # admission counts both threads
        first, beside = await bulk_then_more(r, [1, 2, 3, 4], [5, 6])
        assert r.lane_batches == [[5, 6]]  # at once, beside the batch in flight
        assert r.lane.runs[0][0] == r.clock.now() - 0.001
        assert DispatchReason.LANE not in {i.reason for i in beside}  # the policy's batch, not a lane batch
        assert r.value("ferry_batches_total", model="m", reason="lane") == 0
        await r.clock.run_until_idle()
        assert all(i.outcome is Outcome.RESULT for i in first + beside)
        # Interactive work offered: for LANE_QUIET seconds the lane is kept for it again.
        r.batcher.submit("u", priority=INTERACTIVE)
        await r.clock.run_until_idle()
        assert r.batcher.load(r.clock.now()).workers == 1
        await bulk_then_more(r, [7, 8, 9, 10], [11])
        assert r.lane_batches == [[5, 6]]
        await r.clock.run_until_idle()
        await r.clock.advance(LANE_QUIET)
        await bulk_then_more(r, [12, 13, 14, 15], [16])
        assert r.lane_batches == [[5, 6], [16]]
        await r.clock.run_until_idle()
        await r.batcher.stop()

    run(scenario())


def test_with_the_lane_off_interactive_work_waits_for_the_batch_in_flight():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=32, max_wait_ms=0)
        r.batcher.update(interactive_lane=False)  # live
        await r.batcher.start()
        t0 = r.clock.now()
        r.batcher.submit_many(list(range(32)), priority=BATCH)
        await r.clock.advance(0.005)
        r.batcher.submit("u", priority=INTERACTIVE)
        await r.clock.run_until_idle()
        assert r.lane_batches == []
        assert r.batches == [list(range(32)), ["u"]]
        assert r.engine.runs[1][0] == pytest.approx(t0 + cost(32))  # it waited for the bulk batch
        await r.batcher.stop()

    run(scenario())


def test_one_lane_batch_at_a_time_and_later_interactive_work_follows_it():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=32, max_wait_ms=0)
        await r.batcher.start()
        t0 = r.clock.now()
        r.batcher.submit_many(list(range(32)), priority=BATCH)
        await r.clock.advance(0.001)
        r.batcher.submit("a", priority=INTERACTIVE)
        await r.clock.advance(0.001)
        r.batcher.submit("b", priority=INTERACTIVE)  # the lane is busy with "a"
        await r.clock.advance(0)
        assert r.lane_batches == [["a"]]
        await r.clock.run_until_idle()
        assert r.lane_batches == [["a"], ["b"]]
        assert r.lane.runs[1][0] == pytest.approx(t0 + 0.001 + cost(1))  # the moment "a" ended
        await r.batcher.stop()

    run(scenario())


def test_admission_counts_on_the_lane_for_interactive_work():
    """A 40 ms budget cannot wait for a 74 ms batch in flight, but fits a batch of its own
    beside it: refused without the lane, admitted (and on time) with it."""

    async def scenario(lane: bool):
        r = exact_rig(lane=lane, max_batch_size=32, max_wait_ms=0, deadline_margin_ms=1)
        await r.batcher.start()
        r.batcher.submit_many(list(range(32)), priority=BATCH)
        await r.clock.advance(0.001)
        arrived = r.clock.now()
        try:
            (item,) = r.batcher.submit_many(["u"], priority=INTERACTIVE, budget=0.040)
        except DeadlineInfeasible:
            await r.batcher.stop()
            return None
        done = []
        item.future.add_done_callback(lambda f: done.append(r.clock.now()))
        await r.clock.run_until_idle()
        await r.batcher.stop()
        return done[0] - arrived

    assert run(scenario(False)) is None
    assert run(scenario(True)) == pytest.approx(cost(1))


def test_the_reserve_does_not_cut_batch_class_batches_while_the_lane_is_open():
    async def scenario(lane: bool):
        r = exact_rig(lane=lane, policy="adaptive", max_batch_size=32, max_wait_ms=0)
        await r.batcher.start()
        r.batcher.submit("u", priority=INTERACTIVE, budget=0.05)  # interactive traffic lately
        await r.clock.run_until_idle()
        now = r.clock.now()
        reserve = r.batcher.load(now).reserve
        r.batcher.submit_many(list(range(32)), priority=BATCH, budget=1.0)
        await r.clock.run_until_idle()
        await r.batcher.stop()
        return reserve, [len(b) for b in r.batches[1:]]

    reserve, sizes = run(scenario(False))
    assert reserve is not None and max(sizes) < 32  # cut so an interactive arrival could wait
    reserve, sizes = run(scenario(True))
    assert reserve is None and sizes == [32]


def test_an_engine_failure_in_the_lane_fails_only_the_lane_batch():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=8, max_wait_ms=0)
        r.lane.fail_batches = {0}
        await r.batcher.start()
        bulk = r.batcher.submit_many([1, 2, 3, 4], priority=BATCH)
        await r.clock.advance(0.001)
        urgent = r.batcher.submit("u", priority=INTERACTIVE)
        await r.clock.run_until_idle()
        assert all(i.outcome is Outcome.RESULT for i in bulk)
        assert urgent.outcome is Outcome.ERROR and isinstance(urgent.future.exception(), EngineError)
        await r.batcher.stop()

    run(scenario())


def test_stop_ends_both_batches_in_flight():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=8, max_wait_ms=0)
        await r.batcher.start()
        bulk = r.batcher.submit_many([1, 2, 3], priority=BATCH)
        await r.clock.advance(0.001)
        urgent = r.batcher.submit("u", priority=INTERACTIVE)
        await r.clock.advance(0.001)
        assert r.lane_batches == [["u"]]
        await r.batcher.stop()
        await r.clock.settle()  # the cancelled batches' tasks end
        for item in [*bulk, urgent]:
            assert item.outcome is Outcome.ERROR and isinstance(item.future.exception(), ShuttingDown)
        assert r.value("ferry_running_sequences", model="m") == 0

    run(scenario())


def test_an_interactive_request_after_a_quiet_spell_is_promised_the_wait_for_the_batch_beside():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=4, max_wait_ms=0, deadline_margin_ms=0)
        await r.batcher.start()
        t0 = r.clock.now()
        # The engine's thread busy until cost(4), the lane's until 1 ms + cost(2).
        bulk, beside = await bulk_then_more(r, [1, 2, 3, 4], [5, 6])
        lane_free = t0 + 0.001 + cost(2)
        # Alone on a free lane it would be done in cost(1) = 12 ms; the lane is free only at 15 ms.
        with pytest.raises(DeadlineInfeasible):
            r.batcher.submit("late", priority=INTERACTIVE, budget=lane_free - r.clock.now() + cost(1) - 0.001)
        urgent = r.batcher.submit("u", priority=INTERACTIVE, budget=lane_free - r.clock.now() + cost(1) + 0.001)
        await r.clock.run_until_idle()
        assert all(i.outcome is Outcome.RESULT for i in bulk + beside + [urgent])
        await r.batcher.stop()

    run(scenario())


def test_an_engine_failure_beside_the_batch_in_flight_fails_only_that_batch():
    async def scenario():
        r = exact_rig(lane=True, max_batch_size=4, max_wait_ms=0)
        r.lane.fail_batches = {0}
        await r.batcher.start()
        bulk, beside = await bulk_then_more(r, [1, 2, 3, 4], [5, 6])
        await r.clock.run_until_idle()
        assert r.lane_batches == [[5, 6]]
        assert all(i.outcome is Outcome.RESULT for i in bulk)
        assert all(i.outcome is Outcome.ERROR and isinstance(i.future.exception(), EngineError) for i in beside)
        await r.batcher.stop()

    run(scenario())
