"""Latency-aware scheduling rules as properties over random arrival streams (fake clock)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher import admission
from batcher.cost import CostModel, LinearCost
from batcher.errors import BatchingError, QueueFull
from batcher.load import IDLE, Load
from batcher.policy import (Dispatch, WaitUntil, adaptive, admit_adaptive, admit_deadline, admit_fixed, deadline,
                            fixed, prompt_group)
from batcher.queue import RequestQueue
from batcher.settings import BatchingSettings
from batcher.types import DispatchReason, Outcome, Priority, WorkItem

from .conftest import FIXED, PER_ITEM, Rig, exact_rig, run


arrivals = st.lists(
    st.tuples(
        st.floats(0, 0.02),  # gap before this arrival
        st.sampled_from([None, 0.015, 0.03, 0.08, 0.5]),  # budget (s); None = default
        st.sampled_from([Priority.INTERACTIVE, Priority.INTERACTIVE, Priority.BATCH]),
        st.booleans(),  # cancel a random earlier item afterwards
    ),
    min_size=1, max_size=50,
)


async def drive(r: Rig, stream, *, check_admission: bool = False):
    """Feed the stream; returns (items, finish time by item id, rejected count)."""
    await r.batcher.start()
    items: list[WorkItem] = []
    finished_at: dict[int, float] = {}
    rejected = 0
    for gap, budget, prio, cancel in stream:
        await r.clock.advance(gap)
        b = r.batcher
        if check_admission and budget is not None:
            probe = WorkItem(payload=None, arrival=r.clock.now(), deadline=r.clock.now() + budget, priority=prio, id=10**9)
            predicted = admission.predicted_completion(b.queue, probe, r.clock.now(), b.settings, b.cost,
                                                       b.load(r.clock.now()))
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


@pytest.mark.parametrize("policy", ["fixed", "deadline", "adaptive"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(stream=arrivals, size=st.integers(1, 8), wait_ms=st.sampled_from([0, 2, 10, 40]))
def test_no_item_reaches_the_engine_after_its_deadline_and_all_end_once(policy, stream, size, wait_ms):
    r = exact_rig(policy=policy, max_batch_size=size, max_wait_ms=wait_ms, max_queue=30, default_budget_ms=200,
                  on_infeasible="serve", aging_ms=50)
    items, finished_at, _ = run(drive(r, stream))
    for item in items:
        assert item.finished and item.id in finished_at
        if item.dispatched_at is not None:
            assert item.dispatched_at < item.deadline
        if item.outcome is Outcome.EXPIRED:
            assert item.dispatched_at is None and finished_at[item.id] >= item.deadline
    assert sum(r.batcher.outcomes.values()) == len(items)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=arrivals, size=st.integers(1, 8))
def test_earliest_deadline_first_within_a_class(stream, size):
    stream = [(g, b, Priority.INTERACTIVE, c) for g, b, _, c in stream]
    r = exact_rig(policy="deadline", max_batch_size=size, max_wait_ms=5, max_queue=30, default_budget_ms=200,
                  on_infeasible="serve")
    items, finished_at, _ = run(drive(r, stream))
    for x in items:
        if x.dispatched_at is None:
            continue
        t = x.dispatched_at
        for y in items:
            waiting_at_t = y.arrival < t and (y.dispatched_at is None or y.dispatched_at > t) and finished_at[y.id] > t
            assert not (waiting_at_t and y.deadline < x.deadline), "a later deadline was served first"


def test_aging_bounds_how_long_batch_work_waits_behind_interactive_work():
    async def scenario():
        r = exact_rig(policy="fixed", max_batch_size=4, max_wait_ms=0, max_queue=10_000, default_budget_ms=None, aging_ms=100)
        await r.batcher.start()
        job = r.batcher.submit("batch-job", priority=Priority.BATCH, budget=60)
        # Interactive traffic at twice the engine's capacity, each with a generous budget.
        for k in range(400):
            r.batcher.submit(f"i{k}", budget=30)
            await r.clock.advance(0.0025)
            if job.dispatched_at is not None:
                break
        waited = job.dispatched_at - job.arrival
        batch_time = FIXED + 4 * PER_ITEM
        assert waited <= 0.100 + batch_time  # the bound: aging plus the batch already running
        await r.batcher.stop()

    run(scenario())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=arrivals, size=st.integers(1, 8), wait_ms=st.sampled_from([0, 5, 20]))
def test_fixed_never_holds_the_oldest_item_longer_than_max_wait(stream, size, wait_ms):
    stream = [(g, None, Priority.INTERACTIVE, False) for g, *_ in stream]
    r = exact_rig(policy="fixed", max_batch_size=size, max_wait_ms=wait_ms, max_queue=1000, default_budget_ms=None)
    items, _, _ = run(drive(r, stream))
    runs = r.engine.runs
    ends = [t + FIXED + PER_ITEM * len(p) for t, p in runs]
    for k, (t, payloads) in enumerate(runs):
        oldest = min(payloads)  # payloads are arrival indices
        engine_free = ends[k - 1] if k else -math.inf
        # Dispatched no later than max_wait after the oldest arrived, or the moment the engine freed.
        assert t <= max(items[oldest].arrival + wait_ms / 1000.0, engine_free) + 1e-9
        waiting_older = [i for i in items if i.arrival <= t and i.dispatched_at > t and int(i.payload) < oldest]
        assert not waiting_older  # FIFO: nobody older was left behind


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=arrivals, size=st.integers(1, 8), policy=st.sampled_from(["fixed", "deadline", "adaptive"]))
def test_admission_rejects_only_what_the_cost_model_says_is_infeasible(stream, size, policy):
    r = exact_rig(policy=policy, max_batch_size=size, max_wait_ms=5, max_queue=1000, default_budget_ms=None)
    items, _, rejected = run(drive(r, stream, check_admission=True))
    assert rejected + len(items) == len(stream)


# -- the policies as pure functions ------------------------------------------------------
def _queue(now: float, specs) -> RequestQueue:
    q = RequestQueue(aging=10)
    for arrival, dl in specs:
        q.push(WorkItem(payload=None, arrival=arrival, deadline=dl))
    return q


COST = CostModel(LinearCost(0.010, 0.002, 0.0))


def test_deadline_policy_dispatches_early_for_the_tightest_budget():
    s = BatchingSettings(policy="deadline", max_batch_size=8, max_wait_ms=50, deadline_margin_ms=1)
    q = _queue(0.0, [(0.0, 0.030)])
    # Latest start = 0.030 - 0.012 - 0.001 = 0.017: wait until then, not 50 ms.
    assert deadline(q, 0.0, s, COST) == WaitUntil(pytest.approx(0.017))
    assert deadline(q, 0.017, s, COST).reason.value == "deadline"
    assert fixed(q, 0.017, s, COST) == WaitUntil(0.050)


def test_deadline_policy_caps_the_batch_to_meet_the_tightest_deadline():
    s = BatchingSettings(policy="deadline", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = _queue(0.0, [(0.0, 0.0165)] + [(0.0, 1.0)] * 7)
    d = deadline(q, 0.0, s, COST)
    assert isinstance(d, Dispatch) and d.size == 3  # 10 + 3*2 = 16 ms <= 16.5 ms; 4 would be 18 ms


def test_goodput_cap_does_not_shrink_a_batch_for_one_late_batch_item():
    s = BatchingSettings(policy="deadline", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = RequestQueue(aging=10)
    q.push(WorkItem(payload=None, arrival=0.0, deadline=0.0165, priority=Priority.BATCH))
    for _ in range(7):
        q.push(WorkItem(payload=None, arrival=0.0, deadline=1.0, priority=Priority.BATCH))
    d = deadline(q, 0.0, s, COST)
    assert d.size == 8  # 7 on time in 26 ms beats 3 on time in 16 ms


def test_reserve_caps_batch_time_for_interactive_arrivals():
    s = BatchingSettings(policy="adaptive", max_batch_size=32, max_wait_ms=0)
    q = _queue(0.0, [(0.0, 10.0)] * 20)
    assert adaptive(q, 0.0, s, COST).size == 20
    assert adaptive(q, 0.0, s, COST, Load(reserve=0.020)).size == 5  # 10 + 5*2 = 20 ms


def test_background_work_does_not_size_batches_until_it_is_due():
    """A batch job fills spare capacity: 400 items with an hour's budget, arrived and queued,
    leave the reserve where interactive traffic alone puts it (28 ms, 9 items). Its items
    retried after a refusal (count_rejection=False) do not count either. Urgent work that
    is queued and due within a second does count (total throughput first:
    interactive_first=False; interactive first, only interactive work sizes batches)."""

    async def scenario() -> tuple[float, float, float]:
        r = exact_rig(policy="adaptive", max_batch_size=32, max_queue=10_000, deadline_margin_ms=5,
                      interactive_first=False)
        b = r.batcher
        b.submit(0, budget=0.050, priority=Priority.INTERACTIVE)
        b.submit_many(list(range(400)), budget=3600.0, priority=Priority.BATCH, count_rejection=False)
        background = b.load(r.clock.now()).reserve
        r.batcher.update(max_queue=401)
        for _ in range(50):
            with pytest.raises(QueueFull):
                b.submit(0, budget=0.5, priority=Priority.BATCH, count_rejection=False)
        retried = b.load(r.clock.now()).reserve
        b.update(max_queue=10_000)
        b.submit_many(list(range(200)), budget=0.95, priority=Priority.BATCH)
        return background, retried, b.load(r.clock.now()).reserve

    background, retried, urgent = run(scenario())
    assert background == pytest.approx(0.028)
    assert retried == pytest.approx(0.028)
    # 201 urgent offered (with the interactive one) and 201 due within the second:
    # 402 items/s need 21-item batches.
    assert urgent == pytest.approx(0.010 + 0.002 * 21)


def test_interactive_deadlines_do_not_cut_batches_below_the_keep_up_floor():
    """_queue makes interactive items: the first one's 16.5 ms deadline alone allows 3
    items (16 ms); when the load needs batches of 6, the batch keeps 6."""
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = _queue(0.0, [(0.0, 0.0165)] + [(0.0, 1.0)] * 7)
    assert adaptive(q, 0.0, s, COST).size == 3
    assert adaptive(q, 0.0, s, COST, Load(floor=6)).size == 6
    assert adaptive(q, 0.0, s, COST, Load(reserve=0.012, floor=6)).size == 6  # nor does the reserve


def test_admission_predicts_an_interactive_batch_filled_to_the_floor():
    """Behind an interactive request wait 9 batch-class items. Alone it would finish in
    12 ms; in the 6-item batch the load needs, in 22 ms: a 20 ms budget is refused."""
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = RequestQueue(aging=10)
    for _ in range(9):
        q.push(WorkItem(payload=None, arrival=0.0, deadline=10.0, priority=Priority.BATCH))
    item = WorkItem(payload=None, arrival=0.0, deadline=0.020, priority=Priority.INTERACTIVE)
    assert admission.predicted_completion(q, item, 0.0, s, COST, IDLE) == pytest.approx(0.012)
    assert admission.predicted_completion(q, item, 0.0, s, COST, Load(floor=6)) == pytest.approx(0.022)
    admission.check(q, item, 0.0, s, COST, IDLE)
    with pytest.raises(BatchingError):
        admission.check(q, item, 0.0, s, COST, Load(floor=6))


def test_interactive_deadlines_allow_for_the_slowdown():
    """The 25.1 ms deadline fits 7 items (24 ms) by the fit; when one batch in five has
    lately run 1.25x slower than predicted, 5 (20 ms, 25 ms slowed)."""
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = _queue(0.0, [(0.0, 0.0251)] + [(0.0, 1.0)] * 7)
    cost = CostModel(LinearCost(0.010, 0.002, 0.0), refit_every=10**9)
    assert adaptive(q, 0.0, s, cost).size == 7
    for i in range(50):
        n = 1 + i % 6
        cost.observe(n, 0, (0.010 + 0.002 * n) * (1.25 if i % 5 == 0 else 1.0))
    cost.refit()
    assert cost.predict(7) == pytest.approx(0.024)  # the slow tail is not the mean
    assert cost.slowdown == pytest.approx(1.25)
    assert adaptive(q, 0.0, s, cost, Load(slowdown=cost.slowdown)).size == 5


def test_adaptive_dispatches_at_once_at_low_load_and_waits_to_fill_at_high_load():
    s = BatchingSettings(policy="adaptive", max_batch_size=32, max_wait_ms=20)
    q = _queue(0.0, [(0.0, 10.0)])
    assert adaptive(q, 0.0, s, COST, Load(offered_rate=5.0)).reason.value == "adaptive"  # r*a = 0.05 < 1 item
    q = _queue(0.0, [(0.0, 10.0)] * 2)
    wait = adaptive(q, 0.0, s, COST, Load(offered_rate=1000.0))  # r*a = 10 items arrive per fixed overhead
    assert isinstance(wait, WaitUntil) and wait.t == pytest.approx(0.008)  # 8 more at 1000/s
    assert adaptive(_queue(0.0, [(0.0, 10.0)] * 10), 0.0, s, COST, Load(offered_rate=1000.0)).reason.value == "adaptive"
    assert adaptive(q, 0.020, s, COST, Load(offered_rate=1000.0)).reason.value == "max_wait"  # never past max_wait


def test_reserve_never_caps_batches_below_what_keeps_up_with_offered_load_and_backlog():
    """Total throughput first (interactive_first=False). Cost 10 ms + 2 ms/item. A 50 ms interactive budget must cover the batch running when
    an interactive request arrives, then that request's own batch (at least 12 ms alone, and
    at least the smallest batch that keeps up), with the 5 ms margin on each. At 50
    arrivals/s: batches of at most 50 - 12 - 10 = 28 ms. At 200/s the keep-up batch is 4
    items (18 ms): at most 22 ms. At 400/s batches that small would grow the queue without
    bound, so the reserve rises to the smallest batch that keeps up (21 items, 52 ms). A
    backlog due within a second counts as load to drain in it; beyond what any batch can
    carry the reserve stops binding."""

    async def reserve_at(offered: int, keep_queued: bool = False) -> float:
        r = exact_rig(policy="adaptive", max_batch_size=32, max_queue=10_000, deadline_margin_ms=5,
                      interactive_first=False)
        b = r.batcher
        b.submit(0, budget=0.050, priority=Priority.INTERACTIVE)
        for i in range(offered - 1):  # one second of arrivals, all at t=0
            item = b.submit(i + 1, budget=0.9, priority=Priority.BATCH)
            if not keep_queued:
                b.cancel(item)  # offered and gone: only the arrival rate remains
                item.future.exception()
        return b.load(r.clock.now()).reserve

    assert run(reserve_at(50)) == pytest.approx(0.050 - 0.012 - 2 * 0.005)
    assert run(reserve_at(400)) == pytest.approx(0.010 + 0.002 * 21)
    # 200/s is carried by 4-item batches; 200 more queued to drain need 20-item batches.
    assert run(reserve_at(200)) == pytest.approx(0.050 - (0.010 + 0.002 * 4) - 2 * 0.005)
    assert run(reserve_at(200, keep_queued=True)) == pytest.approx(0.010 + 0.002 * 20)
    assert run(reserve_at(2000)) == pytest.approx(0.010 + 0.002 * 32)


def test_refused_requests_count_as_offered_load():
    """Under overload admission refuses what small batches cannot carry; sizing batches by
    the admitted rate alone would keep them small. 400 offered with 10 admitted: the
    reserve is what 410 items/s need (23 items, 56 ms)."""

    async def scenario() -> float:
        r = exact_rig(policy="adaptive", max_batch_size=32, max_queue=10, interactive_first=False)
        b = r.batcher
        b.submit(0, budget=0.050, priority=Priority.INTERACTIVE)
        refused = 0
        for i in range(399):
            try:
                b.submit(i + 1, budget=0.9, priority=Priority.BATCH)
            except QueueFull:
                refused += 1
        assert refused == 390
        return b.load(r.clock.now()).reserve

    assert run(scenario()) == pytest.approx(0.010 + 0.002 * 23)


# -- generation admission as pure functions ----------------------------------------------
def _gen_queue(specs) -> RequestQueue:
    """specs: (arrival, deadline, priority, prompt tokens)."""
    q = RequestQueue(aging=10)
    for arrival, dl, prio, tokens in specs:
        q.push(WorkItem(payload=None, arrival=arrival, deadline=dl, priority=prio, cost=tokens))
    return q


RUNNING = Load(free_slots=8, slots_free_at=(0.5,))  # one sequence runs, eight slots free


def test_generation_policies_join_at_once_when_nothing_runs():
    s = BatchingSettings(max_batch_size=4, max_wait_ms=50)
    q = _gen_queue([(0.0, 10.0, Priority.INTERACTIVE, 30)] * 2)
    for policy in (admit_fixed, admit_deadline, admit_adaptive):
        d = policy(q, 0.0, s, COST, Load(free_slots=8))
        assert d == Dispatch(2, DispatchReason.ADAPTIVE)


def test_generation_fixed_waits_for_size_or_max_wait_while_something_runs():
    s = BatchingSettings(policy="fixed", max_batch_size=4, max_wait_ms=50)
    q = _gen_queue([(0.0, 10.0, Priority.INTERACTIVE, 30)] * 2)
    assert admit_fixed(q, 0.0, s, COST, RUNNING) == WaitUntil(0.050)
    assert admit_fixed(q, 0.050, s, COST, RUNNING) == Dispatch(2, DispatchReason.MAX_WAIT)
    q4 = _gen_queue([(0.0, 10.0, Priority.INTERACTIVE, 30)] * 5)
    assert admit_fixed(q4, 0.0, s, COST, RUNNING) == Dispatch(4, DispatchReason.FULL)
    # Two free slots: the group cannot grow past them, so waiting cannot help.
    assert admit_fixed(q4, 0.0, s, COST, Load(free_slots=2, slots_free_at=(0.5,))) == Dispatch(2, DispatchReason.FULL)


def test_generation_group_respects_the_prefill_token_budget():
    s = BatchingSettings(policy="fixed", max_batch_size=8, max_wait_ms=0, prefill_token_budget=100)
    q = _gen_queue([(0.0, 10.0, Priority.INTERACTIVE, 40)] * 4)
    assert prompt_group(q, 0.0, s, COST, RUNNING) == q.peek(2, 0.0)  # 80 tokens; a third would be 120
    big = _gen_queue([(0.0, 10.0, Priority.INTERACTIVE, 500)])
    assert len(prompt_group(big, 0.0, s, COST, RUNNING)) == 1  # one prompt always fits


def test_generation_deadline_joins_early_for_a_first_token_deadline():
    """Prefill of 2 prompts of 30 tokens: 10 + 2*2 = 14 ms by COST (no per-token term);
    the 40 ms first-token deadline with a 1 ms margin must start by 25 ms."""
    s = BatchingSettings(policy="deadline", max_batch_size=4, max_wait_ms=50, deadline_margin_ms=1)
    q = _gen_queue([(0.0, 0.040, Priority.INTERACTIVE, 30), (0.0, 10.0, Priority.INTERACTIVE, 30)])
    assert admit_deadline(q, 0.0, s, COST, RUNNING) == WaitUntil(pytest.approx(0.025))
    assert admit_deadline(q, 0.025, s, COST, RUNNING) == Dispatch(2, DispatchReason.DEADLINE)
    assert admit_fixed(q, 0.025, s, COST, RUNNING) == WaitUntil(0.050)  # fixed ignores deadlines


def test_generation_adaptive_waits_only_while_company_is_coming():
    """Prefill's fixed cost is 10 ms: at 5 prompts/s nobody joins during it, so a prompt
    joins the running batch at the next iteration; at 400/s four arrive, worth waiting for."""
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=50)
    q = _gen_queue([(0.0, 10.0, Priority.INTERACTIVE, 30)])
    assert admit_adaptive(q, 0.0, s, COST, replace(RUNNING, offered_rate=5.0)) == Dispatch(1, DispatchReason.ADAPTIVE)
    wait = admit_adaptive(q, 0.0, s, COST, replace(RUNNING, offered_rate=400.0))
    assert isinstance(wait, WaitUntil) and wait.t == pytest.approx(3 / 400)


def test_generation_batch_class_prompts_leave_slots_to_interactive_ones():
    """Four free slots, two kept for interactive work: batch-class prompts take two, an
    interactive one any; a batch-class prompt that has aged past aging_ms is not held back."""
    s = BatchingSettings(policy="fixed", max_batch_size=8, max_wait_ms=0)
    load = Load(free_slots=4, interactive_slots=2, slots_free_at=(0.5,))
    batch = _gen_queue([(0.0, 10.0, Priority.BATCH, 30)] * 4)
    assert len(prompt_group(batch, 0.0, s, COST, load)) == 2
    mixed = _gen_queue([(0.0, 10.0, Priority.INTERACTIVE, 30)] + [(0.0, 10.0, Priority.BATCH, 30)] * 4)
    assert len(prompt_group(mixed, 0.0, s, COST, load)) == 2  # the interactive one, then one batch
    assert len(prompt_group(batch, 11.0, s, COST, load)) == 4  # aged: ordered as interactive
    assert len(prompt_group(batch, 0.0, s, COST, replace(load, interactive_slots=4))) == 0
