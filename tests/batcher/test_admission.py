"""Admission (batcher/admission.py): refuse at once what cannot be served in time, judged
from the cost model and one load snapshot, rather than queue work only to let it expire.
First the predictors and `check` as pure functions, then admission as a micro-batcher
applies it.

Expected times are derived from the simulated engine's cost, `cost(n) = FIXED + PER_ITEM * n`
(tests/batcher/conftest.py), which COST predicts exactly."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher import admission
from batcher.cost import Calibration, PackedChunkCost
from batcher.errors import BatchingError, DeadlineInfeasible, QueueFull
from batcher.load import IDLE, Load
from batcher.queue import RequestQueue
from batcher.settings import BatchingSettings
from batcher.types import GenRequest, Priority, WorkItem

from .conftest import COST, Rig, arrivals, cost, drive, exact_rig, run

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH
NOW = 1.0


def item(deadline: float | None = None, priority: Priority = INTERACTIVE, tokens: int = 1) -> WorkItem:
    return WorkItem(payload=None, arrival=NOW, deadline=deadline, priority=priority, cost=tokens)


def queue(*items: WorkItem) -> RequestQueue:
    q = RequestQueue(aging=10)
    for i in items:
        q.push(i)
    return q


def batching(**kw) -> BatchingSettings:
    kw = {"policy": "adaptive", "max_batch_size": 4, "max_wait_ms": 0, "deadline_margin_ms": 0, **kw}
    return BatchingSettings(**kw)


# -- who is ahead -----------------------------------------------------------------------------
def test_items_ahead_are_every_higher_class_item_then_earlier_deadlines_of_its_own_class():
    q = queue(item(1.0), item(3.0), item(0.5, BATCH), item(2.0, BATCH), item(4.0, BATCH))
    assert admission.items_ahead(q, item(2.0)) == 1  # a batch-class deadline, however early, is not ahead
    assert admission.items_ahead(q, item(None)) == 2
    assert admission.items_ahead(q, item(2.5, BATCH)) == 2 + 2
    assert admission.items_ahead(queue(), item(2.0, BATCH)) == 0


def test_batch_size_under_the_reserve():
    s = batching(max_batch_size=32)
    assert admission.batch_size_under(None, s, COST, 1) == s.max_batch_size
    assert admission.batch_size_under(cost(5), s, COST, 1) == 5
    assert admission.batch_size_under(cost(1) / 2, s, COST, 1) == 1  # never below one item
    assert admission.batch_size_under(cost(5), s.updated(policy="fixed"), COST, 1) == s.max_batch_size


# -- one-shot batches: predicted_completion -----------------------------------------------------
def test_on_an_idle_engine_an_item_is_done_after_its_own_batch():
    assert admission.predicted_completion(queue(), item(NOW + 1.0), NOW, batching(), COST, IDLE) == pytest.approx(
        NOW + cost(1)
    )


def test_the_reserve_shortens_batch_class_batches_not_the_interactive_ones():
    """Under a reserve of one item's batch, batch-class work ahead is predicted in batches of
    one; interactive work goes in one batch (the policies never split it for the reserve)."""
    s = batching(max_batch_size=8)
    load = Load(reserve=cost(1))
    q = queue(*[item(NOW + 0.5) for _ in range(3)])
    assert admission.predicted_completion(q, item(NOW + 0.5), NOW, s, COST, load) == pytest.approx(NOW + cost(4))
    b = queue(*[item(NOW + 0.5, BATCH) for _ in range(3)])
    assert admission.predicted_completion(b, item(NOW + 0.5, BATCH), NOW, s, COST, load) == pytest.approx(
        NOW + 4 * cost(1)
    )


def test_an_item_waits_for_the_running_batch_then_full_batches_of_the_items_ahead():
    s = batching(max_batch_size=4)
    q = queue(*[item(NOW + 0.5) for _ in range(9)])  # ahead of it by EDF
    running = 0.030
    load = Load(busy_until=NOW + running)
    # 9 ahead + itself = 10 items: two batches of 4, then its own batch of 2.
    expected = NOW + running + 2 * cost(4) + cost(2)
    assert admission.predicted_completion(q, item(NOW + 1.0), NOW, s, COST, load) == pytest.approx(expected)
    # Its siblings (items of the same request, admitted together) queue ahead of it too.
    assert admission.predicted_completion(queue(), item(NOW + 1.0), NOW, s, COST, load, siblings=9) == pytest.approx(
        expected
    )


def test_a_short_item_behind_long_ones_waits_for_their_batches_cut_to_max_batch_tokens():
    """40 passages of 256 tokens queued ahead: under a budget of 2,048 padded tokens they run
    in batches of 8, not 32, so a 12-token item behind them is done after five such batches
    and its own (priced by the passages' lengths, not its own)."""
    s = batching(max_batch_size=32, max_batch_tokens=2048)
    q = queue(*[item(NOW + 0.5, tokens=256) for _ in range(40)])
    short = item(NOW + 1.0, tokens=12)
    assert admission.predicted_completion(q, short, NOW, s, COST, IDLE) == pytest.approx(NOW + 5 * cost(8) + cost(1))
    assert admission.predicted_in_lane(q, short, NOW, s, COST, NOW) == pytest.approx(NOW + 5 * cost(8) + cost(1))
    # The same queue of 12-token items: one full batch of 32, then the rest with it.
    q = queue(*[item(NOW + 0.5, tokens=12) for _ in range(40)])
    assert admission.predicted_completion(q, short, NOW, s, COST, IDLE) == pytest.approx(NOW + cost(32) + cost(9))


def test_a_request_of_long_inputs_is_predicted_in_batches_its_token_budget_allows():
    s = batching(max_batch_size=32, max_batch_tokens=2048)
    # Its 11 siblings and itself, 500 tokens each: batches of 4.
    assert admission.predicted_completion(
        queue(), item(NOW + 1.0, tokens=500), NOW, s, COST, IDLE, siblings=11
    ) == pytest.approx(NOW + 3 * cost(4))


def test_queued_tokens_follow_pushes_and_removals_by_class():
    long, short, bulk = item(tokens=300), item(tokens=10), item(priority=BATCH, tokens=50)
    q = queue(long, short, bulk)
    assert q.mean_cost(INTERACTIVE) == 155 and q.mean_cost(BATCH) == 120
    q.remove(long)
    long.cost = 1  # a price changed while queued does not unbalance the sums
    assert q.mean_cost(INTERACTIVE) == 10 and q.mean_cost(BATCH) == 30
    q.remove(short), q.remove(bulk)
    assert q.mean_cost(INTERACTIVE) is None and q.mean_cost(BATCH) is None


def test_with_two_threads_draining_the_queue_the_batches_ahead_take_half_as_long():
    s = batching(max_batch_size=4)
    q = queue(*[item(NOW + 5.0, BATCH) for _ in range(9)])
    running = 0.030
    one, two = Load(busy_until=NOW + running), Load(busy_until=NOW + running, workers=2)
    bulk = item(NOW + 10.0, BATCH)
    # Two batches of 4 ahead, on two threads at once; then its own batch of 2, on one.
    assert admission.predicted_completion(q, bulk, NOW, s, COST, one) == pytest.approx(
        NOW + running + 2 * cost(4) + cost(2)
    )
    assert admission.predicted_completion(q, bulk, NOW, s, COST, two) == pytest.approx(
        NOW + running + cost(4) + cost(2)
    )
    # A measured drain rate (items per second of one thread) bounds it at twice that rate.
    slow = 1.0  # items a second per thread: 10 items take 5 s on two threads
    drained = Load(busy_until=NOW + running, workers=2, drain_rate=slow)
    assert admission.predicted_completion(q, bulk, NOW, s, COST, drained) == pytest.approx(NOW + running + 10 / 2)


def test_admission_predicts_an_interactive_batch_filled_to_the_floor():
    """Behind an interactive request wait 9 batch-class items. Alone it would finish in
    cost(1) = 12 ms; in the 6-item batch the load needs, in cost(6) = 22 ms: a 20 ms budget
    is refused."""
    s = BatchingSettings(policy="adaptive", max_batch_size=8, max_wait_ms=0, deadline_margin_ms=0)
    q = RequestQueue(aging=10)
    for _ in range(9):
        q.push(WorkItem(payload=None, arrival=0.0, deadline=10.0, priority=Priority.BATCH))
    budget = 0.020
    assert cost(1) < budget < cost(6)
    it = WorkItem(payload=None, arrival=0.0, deadline=budget, priority=Priority.INTERACTIVE)
    assert admission.predicted_completion(q, it, 0.0, s, COST, IDLE) == pytest.approx(cost(1))
    assert admission.predicted_completion(q, it, 0.0, s, COST, Load(floor=6)) == pytest.approx(cost(6))
    admission.check(q, it, 0.0, s, COST, IDLE)
    with pytest.raises(BatchingError):
        admission.check(q, it, 0.0, s, COST, Load(floor=6))


def test_every_promise_of_a_deadline_aware_policy_allows_for_the_slowdown():
    """Batch-class work too: admitted on the mean drain to the last millisecond of its
    budget, about half of it was served late under overload (bench_latency, 200% batch
    load: 23-46 batch-class requests/s on time; with the slowdown, 93-144/s)."""
    s, load = batching(), Load(slowdown=1.25)
    assert admission.predicted_completion(queue(), item(NOW + 1.0), NOW, s, COST, load) == pytest.approx(
        NOW + cost(1) * 1.25
    )
    assert admission.predicted_completion(queue(), item(NOW + 1.0, BATCH), NOW, s, COST, load) == pytest.approx(
        NOW + cost(1) * 1.25
    )
    fixed = batching(policy="fixed")  # a fixed grid promises what its cost model says
    assert admission.predicted_completion(queue(), item(NOW + 1.0, BATCH), NOW, fixed, COST, load) == pytest.approx(
        NOW + cost(1)
    )


def test_batch_class_work_gets_only_the_capacity_interactive_arrivals_leave():
    s = batching(max_batch_size=4)
    job = item(NOW + 10.0, BATCH)
    rate = 100.0  # interactive items per second, served in batches of 4
    rho = rate * cost(4) / 4  # the share of the engine they take: 0.45
    predicted = admission.predicted_completion(queue(), job, NOW, s, COST, Load(interactive_rate=rate))
    assert predicted == pytest.approx(NOW + cost(1) / (1 - rho))
    # Interactive work itself goes ahead of batch-class work and is not slowed by it.
    assert admission.predicted_completion(
        queue(), item(NOW + 1.0), NOW, s, COST, Load(interactive_rate=rate)
    ) == pytest.approx(NOW + cost(1))
    # When interactive arrivals take (nearly) the whole engine, a batch-class item's turn never comes.
    saturating = Load(interactive_rate=4 / cost(4))
    assert admission.predicted_completion(queue(), job, NOW, s, COST, saturating) == math.inf


def test_a_measured_drain_only_ever_makes_a_prediction_later():
    s = batching(max_batch_size=4)
    q = queue(*[item(NOW + 5.0, BATCH) for _ in range(19)])
    job = item(NOW + 10.0, BATCH)
    by_cost_model = NOW + 5 * cost(4)  # 19 ahead + itself: five full batches
    assert admission.predicted_completion(q, job, NOW, s, COST, IDLE) == pytest.approx(by_cost_model)
    slow_drain = 50.0  # items per second the batches really formed have drained
    assert admission.predicted_completion(q, job, NOW, s, COST, Load(drain_rate=slow_drain)) == pytest.approx(
        NOW + 20 / slow_drain
    )
    fast_drain = 10 * 20 / (5 * cost(4))  # ten times what the cost model says
    assert admission.predicted_completion(q, job, NOW, s, COST, Load(drain_rate=fast_drain)) == pytest.approx(
        by_cost_model
    )


# -- generation: predicted_first_token ------------------------------------------------------
def test_a_prompt_with_a_free_slot_gets_its_first_token_after_its_prefill():
    s = batching(max_batch_size=4)
    prompt = item(NOW + 1.0, tokens=30)  # COST has no per-token term: prefill of one prompt is cost(1)
    assert admission.predicted_first_token(queue(), prompt, NOW, s, COST, Load(free_slots=2)) == pytest.approx(
        NOW + cost(1)
    )


def test_with_token_budgeted_steps_a_long_prompt_waits_a_decode_step_per_further_chunk():
    s = batching(max_batch_size=4)
    prompt = item(NOW + 1.0, tokens=250)
    chunked = Load(free_slots=2, prefill_chunk=100, chunk_step=0.02)
    # 250 tokens in chunks of 100: the first beside the running rows' decode step, two
    # further chunks, each behind a decode step and with its own fixed cost (COST has no
    # per-token term).
    assert admission.predicted_first_token(queue(), prompt, NOW, s, COST, chunked) == pytest.approx(
        NOW + 0.02 + cost(1) + 2 * (0.02 + cost(1))
    )
    short = item(NOW + 1.0, tokens=80)
    assert admission.predicted_first_token(queue(), short, NOW, s, COST, chunked) == pytest.approx(NOW + 0.02 + cost(1))
    # Packed into the decode steps' forwards, the chunks pay no forward of their own.
    packed = Load(free_slots=2, prefill_chunk=100, chunk_step=0.02, chunks_packed=True)
    assert admission.predicted_first_token(queue(), prompt, NOW, s, COST, packed) == pytest.approx(
        NOW + 0.02 + cost(1) - COST.params.fixed + 2 * 0.02
    )


def test_packed_chunks_are_priced_at_what_chunks_were_measured_to_add_a_fixed_part_each_iteration():
    s = batching(max_batch_size=4)
    prompt, short = item(NOW + 1.0, tokens=250), item(NOW + 1.0, tokens=80)
    # Measured: chunks add 15 ms to a packed step and 0.1 ms a token, whatever the prefill
    # model says a prefill forward of its own costs.
    chunks = PackedChunkCost()
    chunks.params = (0.015, 0.0001)
    measured = Load(free_slots=2, prefill_chunk=100, chunk_step=0.02, chunks_packed=True, packed_chunk=chunks)
    assert admission.predicted_first_token(queue(), short, NOW, s, COST, measured) == pytest.approx(
        NOW + 0.02 + 0.015 + 0.0001 * 80
    )
    # Three iterations carry the long prompt's chunks: the fixed part in each of them.
    assert admission.predicted_first_token(queue(), prompt, NOW, s, COST, measured) == pytest.approx(
        NOW + 3 * (0.02 + 0.015) + 0.0001 * 250
    )


def test_a_prompt_waits_for_the_chunks_of_the_prompts_the_engine_is_still_prefilling():
    s = batching(max_batch_size=4)
    short = item(NOW + 1.0, tokens=80)
    # 150 tokens of earlier prompts still to prefill come first: 230 tokens in chunks of
    # 100, the short prompt's last ones in the third iteration.
    behind = Load(free_slots=2, prefill_chunk=100, chunk_step=0.02, prefill_backlog=150)
    assert admission.predicted_first_token(queue(), short, NOW, s, COST, behind) == pytest.approx(
        NOW + 0.02 + cost(1) + 2 * (0.02 + cost(1))
    )
    clear = Load(free_slots=2, prefill_chunk=100, chunk_step=0.02, prefill_backlog=20)
    assert admission.predicted_first_token(queue(), short, NOW, s, COST, clear) == pytest.approx(NOW + 0.02 + cost(1))


def test_a_prompt_in_the_lane_does_not_wait_for_the_running_rows_decode_step():
    s = batching(max_batch_size=4)
    lane = Load(free_slots=2, prefill_chunk=100, chunk_step=0.02, prefill_first=True)
    interactive, batch_class = item(NOW + 1.0, tokens=80), item(NOW + 1.0, BATCH, tokens=80)
    assert admission.predicted_first_token(queue(), interactive, NOW, s, COST, lane) == pytest.approx(NOW + cost(1))
    # Batch-class prompts join the decode steps (and leave the slots kept for interactive ones).
    kept = Load(free_slots=2, prefill_chunk=100, chunk_step=0.02, prefill_first=True, interactive_slots=0)
    assert admission.predicted_first_token(queue(), batch_class, NOW, s, COST, kept) == pytest.approx(
        NOW + 0.02 + cost(1)
    )


def test_a_prompt_without_a_free_slot_waits_for_the_first_slot_to_free():
    s = batching(max_batch_size=4)
    prompt = item(NOW + 1.0)
    busy = Load(free_slots=0, slots_free_at=(NOW + 0.3, NOW + 0.5))
    assert admission.predicted_first_token(queue(), prompt, NOW, s, COST, busy) == pytest.approx(NOW + 0.3 + cost(1))
    assert admission.predicted_first_token(queue(), prompt, NOW, s, COST, Load(free_slots=0)) == math.inf


def test_prompts_ahead_hold_slots_for_a_typical_sequence_and_share_the_prefill():
    s = batching(max_batch_size=4)
    q = queue(item(NOW + 0.5), item(NOW + 0.5))
    seq = 0.2
    load = Load(busy_until=NOW, free_slots=1, slots_free_at=(NOW + 0.5,), sequence_seconds=seq)
    # The two ahead take the free slot one after the other (until NOW + 2 * seq), before the
    # running sequence frees its slot at NOW + 0.5; the prompt then prefills in a group of 3.
    assert admission.predicted_first_token(q, item(NOW + 1.0), NOW, s, COST, load) == pytest.approx(
        NOW + 2 * seq + cost(3)
    )


def test_batch_class_prompts_leave_the_interactive_slots_free():
    s = batching(max_batch_size=4)
    seq = 0.2
    load = Load(busy_until=NOW, free_slots=2, interactive_slots=2, sequence_seconds=seq)
    assert admission.predicted_first_token(queue(), item(NOW + 1.0), NOW, s, COST, load) == pytest.approx(NOW + cost(1))
    # The two slots kept for interactive work count as taken: its slot frees a sequence later.
    assert admission.predicted_first_token(queue(), item(NOW + 1.0, BATCH), NOW, s, COST, load) == pytest.approx(
        NOW + seq + cost(3)
    )


# -- check ------------------------------------------------------------------------------------
def test_a_calibrated_prediction_stretches_the_wait_and_keeps_the_raw_one_on_the_item():
    calibrations = {p: Calibration() for p in Priority}
    calibrations[INTERACTIVE].factor = 1.5
    predict = admission.calibrated(admission.predicted_first_token, calibrations)
    s, prompt = batching(), item(NOW + 1.0, tokens=2)
    raw = admission.predicted_first_token(queue(), prompt, NOW, s, COST, Load(free_slots=1))
    assert predict(queue(), prompt, NOW, s, COST, Load(free_slots=1)) == pytest.approx(NOW + 1.5 * (raw - NOW))
    assert prompt.predicted_wait == pytest.approx(raw - NOW)  # what its first token is compared with
    bulk = item(NOW + 1.0, BATCH, tokens=2)  # another class, its own factor
    raw = admission.predicted_first_token(queue(), bulk, NOW, s, COST, Load(free_slots=1))
    assert predict(queue(), bulk, NOW, s, COST, Load(free_slots=1)) == pytest.approx(raw)
    never = item(NOW + 1.0)
    assert predict(queue(), never, NOW, s, COST, Load(free_slots=0)) == math.inf
    assert never.predicted_wait is None


def test_a_full_queue_is_refused_with_the_time_to_drain_one_batch_as_retry_after():
    s = batching(max_queue=3, max_batch_size=4)
    q = queue(item(), item(), item())
    running = 2.5
    with pytest.raises(QueueFull) as info:
        admission.check(q, item(), NOW, s, COST, Load(busy_until=NOW + running))
    assert info.value.retry_after == math.ceil(running + cost(4))
    with pytest.raises(QueueFull) as info:
        admission.check(q, item(), NOW, s, COST, IDLE)
    assert info.value.retry_after == 1  # never less than a second


def test_the_queue_must_hold_every_item_of_a_request():
    s = batching(max_queue=3)
    q = queue(item())
    assert admission.check(q, item(), NOW, s, COST, IDLE, siblings=1) is False
    with pytest.raises(QueueFull):
        admission.check(q, item(), NOW, s, COST, IDLE, siblings=2)


def test_work_without_a_deadline_is_admitted_whatever_the_load():
    s = batching()
    assert admission.check(queue(), item(None), NOW, s, COST, Load(busy_until=NOW + 1000.0)) is False


def test_a_deadline_is_met_when_the_prediction_plus_the_margin_fits():
    s = batching(deadline_margin_ms=10)
    just_in_time = item(NOW + cost(1) + s.margin)
    assert admission.check(queue(), just_in_time, NOW, s, COST, IDLE) is False
    too_tight = item(NOW + cost(1) + s.margin - 0.001)
    with pytest.raises(DeadlineInfeasible) as info:
        admission.check(queue(), too_tight, NOW, s, COST, IDLE)
    assert "latency budget of 21 ms cannot be met" in str(info.value)  # cost(1) + margin - 1 ms
    assert info.value.retry_after == 1
    # on_infeasible=serve: admitted best-effort instead.
    assert (
        admission.check(queue(), too_tight, NOW, batching(deadline_margin_ms=10, on_infeasible="serve"), COST, IDLE)
        is True
    )


def test_a_requests_own_on_infeasible_overrides_the_models():
    s = batching(deadline_margin_ms=10)
    too_tight = item(NOW + cost(1))
    too_tight.on_infeasible = "serve"
    assert admission.check(queue(), too_tight, NOW, s, COST, IDLE) is True
    too_tight.on_infeasible = "reject"
    with pytest.raises(DeadlineInfeasible):
        admission.check(queue(), too_tight, NOW, batching(deadline_margin_ms=10, on_infeasible="serve"), COST, IDLE)
    feasible = item(NOW + 10.0)
    feasible.on_infeasible = "serve"
    assert admission.check(queue(), feasible, NOW, s, COST, IDLE) is False  # only what would be refused


def test_work_whose_turn_never_comes_is_told_to_retry_in_a_minute():
    s = batching(max_batch_size=4)
    job = item(NOW + 10.0, BATCH)
    with pytest.raises(DeadlineInfeasible) as info:
        admission.check(queue(), job, NOW, s, COST, Load(interactive_rate=4 / cost(4)))
    assert "not in the foreseeable future" in str(info.value)
    assert info.value.retry_after == 60


def test_check_uses_the_predictor_it_is_given():
    s = batching(max_batch_size=4)
    prompt = item(NOW + 1.0)
    no_slot = Load(free_slots=0)  # predicted_completion ignores slots; predicted_first_token does not
    assert admission.check(queue(), prompt, NOW, s, COST, no_slot) is False
    with pytest.raises(DeadlineInfeasible):
        admission.check(queue(), prompt, NOW, s, COST, no_slot, predict=admission.predicted_first_token)


# -- through the micro-batcher ----------------------------------------------------------------
def test_queue_full_rejects_at_once_with_retry_after():
    async def scenario():
        r = Rig(max_batch_size=2, max_wait_ms=100, max_queue=3)
        await r.batcher.start()
        for i in range(3):
            r.batcher.submit(i)
        with pytest.raises(QueueFull) as info:
            r.batcher.submit(99)
        assert info.value.retry_after >= 1
        assert len(r.batcher.queue) == 3
        assert r.value("ferry_rejections_total", model="m", reason="queue_full") == 1
        await r.batcher.stop()

    run(scenario())


def test_multi_item_request_is_admitted_all_or_none():
    async def scenario():
        r = Rig(max_batch_size=2, max_wait_ms=100, max_queue=4)
        await r.batcher.start()
        r.batcher.submit_many([1, 2])
        with pytest.raises(QueueFull):
            r.batcher.submit_many([3, 4, 5])
        assert len(r.batcher.queue) == 2
        await r.batcher.stop()

    run(scenario())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stream=arrivals,
    size=st.integers(1, 8),
    policy=st.sampled_from(["fixed", "deadline", "adaptive"]),
    lane=st.booleans(),
)
def test_admission_rejects_only_what_the_cost_model_says_is_infeasible(stream, size, policy, lane):
    """With the interactive lane, the prediction is the sooner of the engine and the lane."""
    r = exact_rig(lane=lane, policy=policy, max_batch_size=size, max_wait_ms=5, max_queue=1000, default_budget_ms=None)
    items, _, rejected = run(drive(r, stream, check_admission=True))
    assert rejected + len(items) == len(stream)


def test_a_drain_slower_than_the_cost_model_refuses_what_it_cannot_carry():
    """The cost model says 32 items take cost(32) = 74 ms, but the batches the policies
    really formed under load drained 50 items/s: the 100th batch-class item in line, with
    a 1 s budget, cannot make it, and is refused now rather than admitted to expire."""
    r = exact_rig(policy="adaptive", max_batch_size=32, max_queue=10_000)
    b = r.batcher
    now = r.clock.now()

    async def go():
        items = [b.submit(i, budget=0.9, priority=Priority.BATCH) for i in range(99)]  # ahead (EDF)
        last = WorkItem(payload="x", arrival=now, deadline=now + 1.0, priority=Priority.BATCH)
        measured = Load(busy_until=now, drain_rate=50.0)
        assert admission.check(b.queue, last, now, b.settings, b.cost, Load(busy_until=now)) is False
        try:
            admission.check(b.queue, last, now, b.settings, b.cost, measured)
        except DeadlineInfeasible:
            pass
        else:
            raise AssertionError("admitted work the measured drain cannot carry")
        for item in items:
            b.cancel(item)

    run(go())


def test_a_queued_prompt_is_priced_again_from_its_price_before_the_cache():
    """However the prefix cache fills and empties, a price is its price before the cache
    less what the cache holds now, never under 1, never above what the caller gave."""
    prompt = GenRequest(list(range(400)), None)
    cached = {"now": 0}
    costs, taken = admission.uncached([400, 1], [384, 384])
    assert (costs, taken) == ([16, 1], [384, 0])
    full, cheap = WorkItem(prompt, 0.0, cost=costs[0]), WorkItem(prompt, 0.0, cost=costs[1])
    full.cached, cheap.cached = taken
    for now, expected in ((0, 400), (384, 16), (399, 1), (0, 400)):
        cached["now"] = now
        admission.reprice([full, cheap], lambda ids: cached["now"])
        assert full.cost == expected and cheap.cost == 1
