"""Admission and priority under load, as properties over random histories (fake clock,
simulated engine whose cost the cost model knows exactly).

- After any history, idle spell or live settings change, a burst the engine can truly
  serve within its budget is admitted in full and served on time; one that cannot is
  refused at once, never admitted to expire.
- Interactive first: while interactive requests keep arriving, none is refused or expires,
  whatever batch-class load arrives beside them.
"""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher.errors import BatchingError
from batcher.load import RESERVE_HORIZON
from batcher.types import Outcome, Priority, WorkItem

from .conftest import FIXED, PER_ITEM, Rig, exact_rig, run

MARGIN = 0.010  # the default deadline_margin_ms


def true_cost(n: int) -> float:
    return FIXED + PER_ITEM * n


history = st.lists(
    st.tuples(
        st.floats(0, 3.0),  # gap before this arrival
        st.integers(1, 4),  # items in the request
        st.sampled_from([None, 0.2, 1.0, 10.0, 3600.0]),  # budget (s); None = no deadline
        st.sampled_from(list(Priority)),
    ),
    max_size=20,
)


async def submit_all(r: Rig, n: int, budget: float | None, priority: Priority) -> tuple[list[WorkItem], int]:
    """n single-item requests at the same instant; (admitted items, refused count)."""
    admitted, refused = [], 0
    for i in range(n):
        try:
            admitted.append(r.batcher.submit(i, budget=budget, priority=priority))
        except BatchingError:
            refused += 1
    return admitted, refused


async def burst_after(r: Rig, past, idle: float, new_size: int | None, n: int, budget: float):
    b = r.batcher
    await b.start()
    for gap, count, bud, prio in past:
        await r.clock.advance(gap)
        try:
            b.submit_many(list(range(count)), budget=bud, priority=prio)
        except BatchingError:
            pass
    await r.clock.run_until_idle()
    await r.clock.advance(idle)
    if new_size is not None:
        b.update(max_batch_size=new_size)
    start = r.clock.now()
    items, refused = await submit_all(r, n, budget, Priority.INTERACTIVE)
    await r.clock.run_until_idle()
    finished = [i for i in items if i.outcome is Outcome.RESULT]
    expired = [i for i in items if i.outcome is Outcome.EXPIRED]
    await b.stop()
    return start, items, refused, finished, expired


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(past=history, idle=st.sampled_from([0.0, 0.5, 1.5, 5.0, 60.0, 8 * 3600.0]),
       size=st.integers(1, 16), new_size=st.sampled_from([None, 1, 4, 32]),
       policy=st.sampled_from(["fixed", "deadline", "adaptive"]), slack=st.floats(1.0, 3.0))
def test_a_burst_the_engine_can_serve_is_admitted_in_full_after_any_history(past, idle, size, new_size,
                                                                              policy, slack):
    """Four times max_batch_size at once. Served one at a time it would take n * cost(1):
    whatever batch sizes the policy picks (at least one item), it is done by then."""
    r = exact_rig(policy=policy, max_batch_size=size, max_wait_ms=5, max_queue=10_000, default_budget_ms=None)
    n = 4 * (new_size or size)
    budget = n * true_cost(1) * slack + 2 * MARGIN
    start, items, refused, finished, expired = run(burst_after(r, past, idle, new_size, n, budget))
    assert refused == 0, "a burst that the engine serves within its budget was refused"
    assert len(finished) == n and not expired
    for t, payloads in r.engine.runs:
        if t >= start:
            assert t + true_cost(len(payloads)) <= start + budget


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(past=history, idle=st.sampled_from([0.0, 0.5, 5.0, 3600.0]), size=st.integers(1, 16),
       policy=st.sampled_from(["deadline", "adaptive"]), fraction=st.floats(0.05, 0.95))
def test_a_burst_the_engine_cannot_serve_is_refused_at_once_not_left_to_expire(past, idle, size, policy, fraction):
    """The budget is a fraction of the fastest possible service of the whole burst (full
    batches back to back): some items must be refused, and every admitted one is on time."""
    r = exact_rig(policy=policy, max_batch_size=size, max_wait_ms=5, max_queue=10_000, default_budget_ms=None)
    n = 4 * size
    fastest = math.ceil(n / size) * true_cost(size)
    budget = fastest * fraction
    start, items, refused, finished, expired = run(burst_after(r, past, idle, None, n, budget))
    assert refused >= 1 and refused + len(items) == n
    assert not expired, "admitted, then expired: admission should have refused it at once"
    assert len(finished) == len(items)


interactive_gaps = st.lists(st.floats(0.02, 0.5), min_size=5, max_size=40)
batch_waves = st.lists(st.tuples(st.floats(0.0, 0.3), st.integers(1, 60)), min_size=1, max_size=30)


async def mixed(r: Rig, gaps: list[float], waves: list[tuple[float, int]], budget: float):
    """Interactive requests at the given gaps (one at t=0 first) and batch-class waves of
    1 s budget in between, interleaved on one simulated timeline."""
    b = r.batcher
    await b.start()
    events = []
    t = 0.0
    for g in gaps:
        t += g
        events.append((t, "interactive", 1))
    t = 0.0
    for g, count in waves:
        t += g
        events.append((t, "batch", count))
    events.sort(key=lambda e: (e[0], e[1] == "batch"))
    interactive: list[WorkItem] = []
    refused_interactive = 0
    batch_refused = 0
    batch_items: list[WorkItem] = []
    interactive.append(b.submit("warm", budget=budget))
    t0 = r.clock.now()
    for when, kind, count in events:
        await r.clock.advance(max(0.0, t0 + when - r.clock.now()))
        if kind == "interactive":
            try:
                interactive.append(b.submit("i", budget=budget))
            except BatchingError:
                refused_interactive += 1
        else:
            got, refused = await submit_all(r, count, 1.0, Priority.BATCH)
            batch_items += got
            batch_refused += refused
    await r.clock.run_until_idle()
    await b.stop()
    return interactive, refused_interactive, batch_items, batch_refused


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gaps=interactive_gaps, waves=batch_waves, size=st.sampled_from([8, 16, 32]),
       budget=st.sampled_from([0.06, 0.1, 0.2]), policy=st.sampled_from(["deadline", "adaptive"]))
def test_interactive_first_no_interactive_request_is_refused_or_late_whatever_batch_load(gaps, waves, size,
                                                                                        budget, policy):
    """Interactive requests keep arriving (gaps well under RESERVE_HORIZON) at most 50/s,
    a fraction of what the engine carries; batch-class waves of up to 60 items come at any
    rate. Batch-class work absorbs the shortfall: it waits, is refused or expires by its own
    budget; every interactive request is admitted and finishes within its budget."""
    assert max(gaps) < RESERVE_HORIZON
    r = exact_rig(policy=policy, max_batch_size=size, max_wait_ms=5, max_queue=10_000, default_budget_ms=None,
                  interactive_first=True)
    interactive, refused, batch_items, batch_refused = run(mixed(r, gaps, waves, budget))
    assert refused == 0, "an interactive request was refused while batch-class work was served"
    done_at = {}
    for t, payloads in r.engine.runs:
        for p in payloads:
            done_at.setdefault(p, []).append(t + true_cost(len(payloads)))
    for item in interactive:
        assert item.outcome is Outcome.RESULT, f"interactive item ended {item.outcome.name}"
        finished = item.dispatched_at + true_cost(item.batch_size)
        assert finished <= item.deadline + 1e-9
    for item in batch_items:
        assert item.finished  # served, or expired by its own budget; exactly once
    assert sum(r.batcher.outcomes.values()) == len(interactive) + len(batch_items)


def test_total_throughput_first_lets_batch_class_load_size_batches():
    """The one setting that prefers throughput: with interactive_first off, batch-class load
    sizes batches past what an interactive budget allows (and interactive requests are
    refused at once when that leaves them no room); on, batches stay within the reserve."""

    async def largest_batch(first: bool) -> int:
        r = exact_rig(policy="adaptive", max_batch_size=32, max_queue=10_000, default_budget_ms=None,
                      interactive_first=first)
        b = r.batcher
        await b.start()
        for k in range(40):  # 400 batch-class items/s, 1 s budget, an interactive one each 100 ms
            try:
                b.submit("i", budget=0.06)
            except BatchingError:
                pass  # throughput first: no room left for it, refused at once
            for _ in range(10):
                b.submit("b", budget=1.0, priority=Priority.BATCH)
            await r.clock.advance(0.025)
        await r.clock.run_until_idle()
        await b.stop()
        return max(len(p) for _, p in r.engine.runs)

    # 60 ms budget: (60 - 2 * 10) ms usable - 12 ms alone = 28 ms = 9 items at most.
    assert run(largest_batch(True)) <= 9
    assert run(largest_batch(False)) > 9


# -- the measured drain rate ---------------------------------------------------------------
def test_drain_rate_counts_only_recent_backlogged_batches_and_forgets_on_settings_change():
    from batcher.load import DRAIN_HORIZON, DRAIN_MIN_BATCHES, LoadTracker

    t = LoadTracker()
    for k in range(DRAIN_MIN_BATCHES - 1):
        t.served(1.0 + k * 0.1, 4, 0.05, backlogged=True)
    t.served(1.3, 32, 0.05, backlogged=False)  # arrivals, not the policies, sized it
    assert t.drain_rate(1.4) is None  # too few backlogged batches to say
    t.served(1.4, 4, 0.05, backlogged=True)
    assert math.isclose(t.drain_rate(1.4), 4 / 0.05)
    assert t.drain_rate(1.4 + DRAIN_HORIZON + 0.2) is None  # a quiet spell ends the measurement
    for k in range(DRAIN_MIN_BATCHES):
        t.served(10.0 + k * 0.1, 4, 0.05, backlogged=True)
    t.forget_drain()
    assert t.drain_rate(10.5) is None


def test_a_drain_slower_than_the_cost_model_refuses_what_it_cannot_carry():
    """The cost model says 32 items take 74 ms, but the batches the policies really formed
    under load drained 50 items/s: the 100th batch-class item in line, with a 1 s budget,
    cannot make it, and is refused now rather than admitted to expire."""
    from batcher import admission
    from batcher.errors import DeadlineInfeasible
    from batcher.load import Load

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


def poisson_mix(r: Rig, rate: float, interactive_share: float, seconds: float, seed: int):
    """Open-loop Poisson arrivals of single items on the fake clock: interactive ones with a
    100 ms budget, batch-class ones with 1 s. Returns {class: Counter of endings}."""
    import random
    from collections import Counter

    rng = random.Random(seed)
    b = r.batcher
    ends = {Priority.INTERACTIVE: Counter(), Priority.BATCH: Counter()}

    def record(item: WorkItem, budget: float) -> None:
        def done(fut) -> None:
            fut.exception()  # retrieved: expiries are counted below, not logged
            on_time = item.outcome is Outcome.RESULT and r.clock.now() <= item.arrival + budget + 1e-9
            ends[item.priority]["on_time" if on_time else item.outcome.name.lower()] += 1
        item.future.add_done_callback(done)

    async def go():
        await b.start()
        t = start = r.clock.now()
        while t < start + seconds:
            t += rng.expovariate(rate)
            await r.clock.advance(t - r.clock.now())
            prio = Priority.INTERACTIVE if rng.random() < interactive_share else Priority.BATCH
            budget = 0.1 if prio is Priority.INTERACTIVE else 1.0
            try:
                record(b.submit(0, budget=budget, priority=prio), budget)
            except BatchingError:
                ends[prio]["refused"] += 1
        await r.clock.run_until_idle()
        await b.stop()

    run(go())
    return ends


def test_interactive_first_under_mixed_overload_keeps_interactive_on_time_and_throughput_up():
    """The latency benchmark's mix on the fake clock: 30% interactive (100 ms), 70%
    batch-class (1 s), Poisson at 150% of capacity. The engine cannot be preempted, so
    batches stay within the interactive reserve; the drain those smaller batches really
    achieve is what batch-class admission counts on. Interactive work is served on time,
    the shortfall falls on batch-class work (refused at once, mostly), and what is served
    in time stays most of what the engine can do."""
    r = exact_rig(policy="adaptive", max_batch_size=32, max_queue=10_000, default_budget_ms=None)
    assert r.batcher.settings.interactive_first  # the default
    capacity = 32 / true_cost(32)
    ends = poisson_mix(r, 1.5 * capacity, 0.3, seconds=8.0, seed=3)
    inter, batch = ends[Priority.INTERACTIVE], ends[Priority.BATCH]
    assert inter["on_time"] >= 0.99 * sum(inter.values())
    assert inter["refused"] == 0
    # Refused at once, mostly, rather than admitted to miss: counting on the cost model's
    # full-size batches instead of the measured drain, 19% of batch-class offers were
    # admitted and then missed (expired or late), and goodput fell to 0.84 of capacity.
    missed = batch["expired"] + batch["result"]
    assert missed <= 0.12 * sum(batch.values())
    assert inter["on_time"] + batch["on_time"] >= 0.87 * capacity * 8.0
