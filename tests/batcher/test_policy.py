"""The dispatch policies (batcher/policy.py): as properties over random arrival streams on
a fake clock, then as pure functions of (queue, now, settings, cost, load).

Expected times are derived from the simulated engine's cost, `cost(n) = FIXED + PER_ITEM * n`
(10 ms + 2 ms per item, tests/batcher/conftest.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher.cost import CostModel, LinearCost
from batcher.load import Load
from batcher.policy import (
    Dispatch,
    WaitUntil,
    adaptive,
    admit_adaptive,
    admit_deadline,
    admit_fixed,
    deadline,
    fixed,
    prompt_group,
)
from batcher.queue import RequestQueue
from batcher.settings import BatchingSettings
from batcher.types import DispatchReason, Outcome, Priority, WorkItem

from .conftest import COST, FIXED, PER_ITEM, arrivals, cost, drive, exact_rig, run


@pytest.mark.parametrize("lane", [False, True], ids=["one-batch", "lane"])
@pytest.mark.parametrize("policy", ["fixed", "deadline", "adaptive"])
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(stream=arrivals, size=st.integers(1, 8), wait_ms=st.sampled_from([0, 2, 10, 40]))
def test_no_item_reaches_the_engine_after_its_deadline_and_all_end_once(policy, lane, stream, size, wait_ms):
    """With the interactive lane too: only interactive items take it, and the running
    gauge comes back to zero with both batches' items counted."""
    r = exact_rig(
        lane=lane,
        policy=policy,
        max_batch_size=size,
        max_wait_ms=wait_ms,
        max_queue=30,
        default_budget_ms=200,
        on_infeasible="serve",
        aging_ms=50,
    )
    items, finished_at, _ = run(drive(r, stream))
    for item in items:
        assert item.finished and item.id in finished_at
        if item.dispatched_at is not None:
            assert item.dispatched_at < item.deadline
        if item.outcome is Outcome.EXPIRED:
            assert item.dispatched_at is None and finished_at[item.id] >= item.deadline
        if item.reason is DispatchReason.LANE:
            assert item.priority is Priority.INTERACTIVE
    assert sum(r.batcher.outcomes.values()) == len(items)
    assert r.value("ferry_running_sequences", model="m") == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=arrivals, size=st.integers(1, 8), wait_ms=st.sampled_from([0, 5, 20]))
def test_fixed_never_holds_the_oldest_item_longer_than_max_wait(stream, size, wait_ms):
    stream = [(g, None, Priority.INTERACTIVE, False) for g, *_ in stream]
    r = exact_rig(policy="fixed", max_batch_size=size, max_wait_ms=wait_ms, max_queue=1000, default_budget_ms=None)
    items, _, _ = run(drive(r, stream))
    runs = r.engine.runs
    ends = [t + cost(len(p)) for t, p in runs]
    for k, (t, payloads) in enumerate(runs):
        oldest = min(payloads)  # payloads are arrival indices
        engine_free = ends[k - 1] if k else -math.inf
        # Dispatched no later than max_wait after the oldest arrived, or the moment the engine freed.
        assert t <= max(items[oldest].arrival + wait_ms / 1000.0, engine_free) + 1e-9
        waiting_older = [i for i in items if i.arrival <= t and i.dispatched_at > t and int(i.payload) < oldest]
        assert not waiting_older  # FIFO: nobody older was left behind


# -- the policies as pure functions ------------------------------------------------------
def _queue(now: float, specs) -> RequestQueue:
    q = RequestQueue(aging=10)
    for arrival, dl in specs:
        q.push(WorkItem(payload=None, arrival=arrival, deadline=dl))
    return q


# A deadline with room for a batch of three items and not four: a quarter item to spare.
ROOM_FOR_3 = cost(3) + PER_ITEM / 4  # 16.5 ms


def test_deadline_policy_dispatches_early_for_the_tightest_budget():
    s = BatchingSettings(policy="deadline", max_batch_size=8, max_wait_ms=50, deadline_margin_ms=1)
    budget = 0.030
    q = _queue(0.0, [(0.0, budget)])
    latest_start = budget - cost(1) - s.margin  # 17 ms: wait until then, not max_wait's 50 ms
    assert deadline(q, 0.0, s, COST) == WaitUntil(pytest.approx(latest_start))
    assert deadline(q, latest_start, s, COST).reason.value == "deadline"
    assert fixed(q, latest_start, s, COST) == WaitUntil(s.max_wait)


def test_deadline_policy_caps_the_batch_to_meet_the_tightest_deadline():
    s = BatchingSettings(policy="deadline", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = _queue(0.0, [(0.0, ROOM_FOR_3)] + [(0.0, 1.0)] * 7)
    d = deadline(q, 0.0, s, COST)
    assert isinstance(d, Dispatch) and d.size == 3  # cost(3) = 16 ms fits 16.5 ms; cost(4) = 18 ms would not


def test_goodput_cap_does_not_shrink_a_batch_for_one_late_batch_item():
    s = BatchingSettings(policy="deadline", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = RequestQueue(aging=10)
    q.push(WorkItem(payload=None, arrival=0.0, deadline=ROOM_FOR_3, priority=Priority.BATCH))
    for _ in range(7):
        q.push(WorkItem(payload=None, arrival=0.0, deadline=1.0, priority=Priority.BATCH))
    d = deadline(q, 0.0, s, COST)
    assert d.size == 8  # 7 on time in cost(8) = 26 ms beats 3 on time in cost(3) = 16 ms


def test_goodput_counts_an_items_tokens_so_a_longer_input_joins_when_its_tokens_pay_for_the_padding():
    s = BatchingSettings(policy="deadline", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    per_token = CostModel(LinearCost(0.010, 0.0, 0.001))
    q = RequestQueue(aging=10)
    for tokens in (10, 20):  # the leader, then a longer input
        q.push(WorkItem(payload=None, arrival=0.0, deadline=1.0, priority=Priority.BATCH, cost=tokens))
    # Alone: 10 tokens in 20 ms; together: 30 tokens in 10 + 2 x 20 = 50 ms, 600 tokens/s against
    # 500 (counted in items, 40 a second against 50, and the longer one would wait for a batch of its own).
    assert deadline(q, 0.0, s, per_token).size == 2
    q.push(WorkItem(payload=None, arrival=0.0, deadline=1.0, priority=Priority.BATCH, cost=200))
    # A third of 200 tokens would pad both to 200: 230 tokens in 610 ms, 377 a second.
    assert deadline(q, 0.0, s, per_token).size == 2


def test_reserve_caps_batch_time_for_interactive_arrivals_but_never_splits_interactive_work():
    """The reserve keeps batch-class batches short for the interactive requests still to
    come; the interactive requests already queued go together (cut to one item each,
    every one after the first would wait a whole batch for nothing)."""
    s = BatchingSettings(policy="adaptive", max_batch_size=32, max_wait_ms=0)
    q = RequestQueue(aging=10)
    for _ in range(20):
        q.push(WorkItem(payload=None, arrival=0.0, deadline=10.0, priority=Priority.BATCH))
    assert adaptive(q, 0.0, s, COST).size == 20
    assert adaptive(q, 0.0, s, COST, Load(reserve=cost(5))).size == 5
    for _ in range(8):
        q.push(WorkItem(payload=None, arrival=0.0, deadline=10.0, priority=Priority.INTERACTIVE))
    assert adaptive(q, 0.0, s, COST, Load(reserve=cost(5))).size == 8  # all interactive, no batch-class rider


def test_interactive_deadlines_do_not_cut_batches_below_the_keep_up_floor():
    """_queue makes interactive items: the first one's 16.5 ms deadline alone allows 3
    items (16 ms); when the load needs batches of 6, the batch keeps 6."""
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = _queue(0.0, [(0.0, ROOM_FOR_3)] + [(0.0, 1.0)] * 7)
    assert adaptive(q, 0.0, s, COST).size == 3
    assert adaptive(q, 0.0, s, COST, Load(floor=6)).size == 6
    assert adaptive(q, 0.0, s, COST, Load(reserve=cost(1), floor=6)).size == 6  # nor does the reserve


def test_interactive_deadlines_allow_for_the_slowdown():
    """The 25.1 ms deadline fits 7 items (24 ms) by the fit; when one batch in five has
    lately run 1.25x slower than predicted, 5 (20 ms, 25 ms slowed)."""
    slow = 1.25
    tight = cost(5) * slow + 0.0001  # 25.1 ms: cost(7) fits as predicted; slowed, cost(5) does and cost(6) not
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = _queue(0.0, [(0.0, tight)] + [(0.0, 1.0)] * 7)
    model = CostModel(LinearCost(FIXED, PER_ITEM, 0.0), refit_every=10**9)
    assert adaptive(q, 0.0, s, model).size == 7
    for i in range(50):
        n = 1 + i % 6
        model.observe(n, 0, cost(n) * (slow if i % 5 == 0 else 1.0))
    model.refit()
    assert model.predict(7) == pytest.approx(cost(7))  # the slow tail is not the mean
    assert model.slowdown == pytest.approx(slow)
    assert adaptive(q, 0.0, s, model, Load(slowdown=model.slowdown)).size == 5


def test_riders_on_an_interactive_batch_leave_the_tail_headroom():
    """Promised on the 90th percentile, filled on the 99th: the 30.1 ms deadline fits all 8
    items (26 ms) as predicted, but when one batch in a hundred runs 1.5x slower, batch-class
    items join only while that slow batch would still end on time: 5 (20 ms, 30 ms slowed).
    An interactive item that fits alone only as predicted runs alone, not best-effort in a
    full batch. Where riders barely lengthen a batch (below the efficient batch, as on a
    GPU), they are not kept out for the tail: only the promise bounds them."""
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = _queue(0.0, [(0.0, cost(5) * 1.5 + 0.0001)] + [(0.0, 1.0)] * 7)
    assert adaptive(q, 0.0, s, COST, Load(slowdown=1.0)).size == 8
    assert adaptive(q, 0.0, s, COST, Load(slowdown=1.0, tail=1.5)).size == 5
    alone = _queue(0.0, [(0.0, cost(1) * 1.25)] + [(0.0, 1.0)] * 7)
    assert adaptive(alone, 0.0, s, COST, Load(slowdown=1.0, tail=1.5)).size == 1
    assert adaptive(q, 0.0, s, COST, Load(slowdown=1.0, tail=1.5, efficient=8)).size == 8
    assert adaptive(alone, 0.0, s, COST, Load(slowdown=1.0, tail=1.5, floor=4)).size == 4  # the floor still holds


def test_adaptive_dispatches_at_once_at_low_load_and_waits_to_fill_at_high_load():
    """The target size is r * FIXED: what arrives during one batch's fixed overhead."""
    s = BatchingSettings(policy="adaptive", max_batch_size=32, max_wait_ms=20)
    q = _queue(0.0, [(0.0, 10.0)])
    assert adaptive(q, 0.0, s, COST, Load(offered_rate=5.0)).reason.value == "adaptive"  # 5 * FIXED < 1 item
    q = _queue(0.0, [(0.0, 10.0)] * 2)
    rate = 1000.0
    target = round(rate * FIXED)  # 10 items arrive per fixed overhead
    wait = adaptive(q, 0.0, s, COST, Load(offered_rate=rate))
    assert isinstance(wait, WaitUntil) and wait.t == pytest.approx((target - 2) / rate)  # 8 more at 1000/s
    full = _queue(0.0, [(0.0, 10.0)] * target)
    assert adaptive(full, 0.0, s, COST, Load(offered_rate=rate)).reason.value == "adaptive"
    # Never past max_wait.
    assert adaptive(q, s.max_wait, s, COST, Load(offered_rate=rate)).reason.value == "max_wait"


# -- generation: which waiting prompts join the running batch, as pure functions ----------
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
    assert admit_fixed(q, 0.0, s, COST, RUNNING) == WaitUntil(s.max_wait)
    assert admit_fixed(q, s.max_wait, s, COST, RUNNING) == Dispatch(2, DispatchReason.MAX_WAIT)
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
    """Prefill of 2 prompts of 30 tokens: cost(2) = 14 ms by COST (no per-token term);
    the 40 ms first-token deadline with a 1 ms margin must start by 25 ms."""
    s = BatchingSettings(policy="deadline", max_batch_size=4, max_wait_ms=50, deadline_margin_ms=1)
    first_token = 0.040
    q = _gen_queue([(0.0, first_token, Priority.INTERACTIVE, 30), (0.0, 10.0, Priority.INTERACTIVE, 30)])
    start_by = first_token - cost(2) - s.margin
    assert admit_deadline(q, 0.0, s, COST, RUNNING) == WaitUntil(pytest.approx(start_by))
    assert admit_deadline(q, start_by, s, COST, RUNNING) == Dispatch(2, DispatchReason.DEADLINE)
    assert admit_fixed(q, start_by, s, COST, RUNNING) == WaitUntil(s.max_wait)  # fixed ignores deadlines


def test_generation_deadline_counts_the_iteration_a_prompt_waits_and_shares():
    """With running rows a prompt joins only at an iteration's end (every `chunk_step`), and
    its prefill shares the next iteration with their decode step: it must join one
    iteration before the prefill alone would say, its first token a decode step later."""
    s = BatchingSettings(policy="deadline", max_batch_size=4, max_wait_ms=500, deadline_margin_ms=1)
    first_token = 0.300
    step = 0.100
    q = _gen_queue([(0.0, first_token, Priority.INTERACTIVE, 30), (0.0, 10.0, Priority.INTERACTIVE, 30)])
    stepping = replace(RUNNING, chunk_step=step)
    join_by = first_token - cost(2) - 2 * step - s.margin  # the next chance to join would be too late
    assert admit_deadline(q, 0.0, s, COST, stepping) == WaitUntil(pytest.approx(join_by))
    assert admit_deadline(q, join_by, s, COST, stepping) == Dispatch(2, DispatchReason.DEADLINE)
    assert admit_deadline(q, join_by - 0.01, s, COST, stepping) == WaitUntil(pytest.approx(join_by))


def test_generation_adaptive_waits_only_while_company_is_coming():
    """Prefill's fixed cost is 10 ms: at 5 prompts/s nobody joins during it, so a prompt
    joins the running batch at the next iteration; at 400/s four arrive, worth waiting for."""
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=50)
    q = _gen_queue([(0.0, 10.0, Priority.INTERACTIVE, 30)])
    assert admit_adaptive(q, 0.0, s, COST, replace(RUNNING, offered_rate=5.0)) == Dispatch(1, DispatchReason.ADAPTIVE)
    rate = 400.0
    wait = admit_adaptive(q, 0.0, s, COST, replace(RUNNING, offered_rate=rate))
    # rate * FIXED = 4 arrive during the fixed cost: 3 more to join the one queued.
    assert isinstance(wait, WaitUntil) and wait.t == pytest.approx((rate * FIXED - 1) / rate)


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
