"""Load estimation (batcher/load.py) and what it drives, on a fake clock with a simulated
engine whose cost the cost model knows exactly (`cost(n) = FIXED + PER_ITEM * n`,
tests/batcher/conftest.py).

- The reserve (the longest batch while interactive requests arrive) and the keep-up floor
  (the smallest batch that carries the load): what counts as load, and what does not.
- The measured drain rate.
- As properties over random histories: after any history, idle spell or live settings
  change, a burst the engine can truly serve within its budget is admitted in full and
  served on time; one that cannot is refused at once, never admitted to expire.
- Interactive first: while interactive requests keep arriving, none is refused or expires,
  whatever batch-class load arrives beside them.
"""

from __future__ import annotations

import contextlib
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher.cost import CostModel, LinearCost
from batcher.errors import BatchingError, QueueFull
from batcher.load import (
    DRAIN_HORIZON,
    DRAIN_MIN_BATCHES,
    RATE_HORIZON,
    RESERVE_HORIZON,
    URGENT_BUDGET,
    LoadTracker,
    efficient_batch,
)
from batcher.queue import RequestQueue
from batcher.settings import BatchingSettings
from batcher.types import Outcome, Priority, WorkItem

from .conftest import COST, Rig, cost, exact_rig, fits, run

MARGIN = BatchingSettings().margin  # the default deadline_margin_ms


def keeps_up(n: int, rate: float) -> bool:
    """A batch of n items carries `rate` items/s: it takes no longer than n arrivals do."""
    return n >= rate * cost(n)


# -- LoadTracker on its own ---------------------------------------------------------------
def test_offered_rate_counts_urgent_offers_over_the_last_rate_horizon():
    t = LoadTracker()
    t.offered(0.0, 3, 0.1, Priority.INTERACTIVE)
    t.offered(0.5, 2, 1.0, Priority.BATCH)
    t.offered(0.5, 5, 2 * URGENT_BUDGET, Priority.BATCH)  # background work is not load
    t.offered(0.5, 5, None, Priority.INTERACTIVE)  # nor is work without a deadline
    assert t.offered_rate(0.9) == (3 + 2) / RATE_HORIZON
    assert t.offered_rate(0.9, Priority.INTERACTIVE) == 3 / RATE_HORIZON
    assert t.offered_rate(0.9, Priority.BATCH) == 2 / RATE_HORIZON
    assert t.offered_rate(0.0 + RATE_HORIZON + 0.1) == 2 / RATE_HORIZON  # the first three left the window


def test_the_reserve_holds_while_interactive_requests_arrive_and_lapses_after_reserve_horizon():
    t = LoadTracker()
    s = BatchingSettings(deadline_margin_ms=5)
    assert t.reserve(0.0, s, COST, keep_up=cost(1)) is None  # no interactive traffic: nothing to protect
    t.offered(0.0, 1, 0.100, Priority.INTERACTIVE)
    t.offered(0.1, 1, 0.050, Priority.INTERACTIVE)
    # The tightest budget seen, less a margin for the running batch and one for its own,
    # less its own batch (one item, which here also keeps up).
    assert t.reserve(0.1, s, COST, keep_up=cost(1)) == pytest.approx(0.050 - 2 * s.margin - cost(1))
    assert t.interactive_rate(0.1) > 0
    later = 0.1 + RESERVE_HORIZON + 0.1
    assert t.reserve(later, s, COST, keep_up=cost(1)) is None and t.interactive_rate(later) == 0


@given(
    st.lists(
        st.tuples(st.floats(0.0, 1.5), st.floats(0.02, 2.0), st.sampled_from(list(Priority))),
        min_size=1,
        max_size=60,
    )
)
def test_the_reserve_follows_the_tightest_interactive_budget_still_in_the_window(offers):
    """Checked against a scan of every offer: arrivals come in time order, and the tightest
    budget lapses RESERVE_HORIZON after its arrival, then the next tightest counts."""
    t, s, keep_up = LoadTracker(), BatchingSettings(deadline_margin_ms=5), cost(1)
    now, seen = 0.0, []
    for gap, budget, priority in offers:
        now += gap
        t.offered(now, 1, budget, priority)
        seen.append((now, budget, priority))
        window = [b for a, b, p in seen if p is Priority.INTERACTIVE and a >= now - RESERVE_HORIZON]
        if not window:
            assert t.reserve(now, s, COST, keep_up=keep_up) is None
            continue
        usable = (min(window) - 2.0 * s.margin) / COST.tail
        expected = max(max(usable - max(cost(1), keep_up), 0.0), keep_up, EFFICIENT)
        assert t.reserve(now, s, COST, keep_up=keep_up) == pytest.approx(expected)
        assert t.interactive_rate(now) == pytest.approx(len(window) / RESERVE_HORIZON)


# The efficient batch of the exact rigs' engine (10 ms a batch, 2 ms an item): one item.
EFFICIENT = cost(1)


def test_the_reserve_never_cuts_below_the_efficient_batch():
    """Cutting a batch below the size whose items' work is a tenth of its fixed cost saves
    little of its time; where batch time does not grow with items (a GPU), the reserve never
    cuts at all."""
    s = BatchingSettings(max_batch_size=32, deadline_margin_ms=5)
    assert efficient_batch(s, COST, 1) == (1, pytest.approx(cost(1)))
    heavy = CostModel(LinearCost(0.020, 0.0005, 0.0))  # 20 ms a batch, 0.5 ms an item
    assert efficient_batch(s, heavy, 1) == (4, pytest.approx(0.022))
    t = LoadTracker()
    t.offered(0.0, 1, 0.040, Priority.INTERACTIVE)  # 40 - 10 ms, less 20.5 ms alone: 9.5 ms, below any batch
    assert t.reserve(0.0, s, heavy, keep_up=heavy.predict(1)) == pytest.approx(0.022)
    gpu = CostModel(LinearCost(0.030, 0.0, 0.0))
    assert efficient_batch(s, gpu, 1) == (32, pytest.approx(0.030))
    assert t.reserve(0.0, s, gpu, keep_up=0.030) == pytest.approx(0.030)  # every size fits: no cut
    tokens = CostModel(LinearCost(0.010, 0.0, 0.0001))  # 0.1 ms a token, 10 tokens an item
    assert efficient_batch(s, tokens, 10)[0] == 1


def test_typical_tokens_follow_the_admitted_costs():
    t = LoadTracker()
    assert t.typical_tokens == 1
    for _ in range(200):
        t.admitted([40])
    assert t.typical_tokens == 40


def test_with_interactive_first_only_interactive_load_sets_the_floor():
    t = LoadTracker()
    t.offered(0.0, 1, 0.05, Priority.INTERACTIVE)
    t.offered(0.0, 200, 0.9, Priority.BATCH)
    q = RequestQueue()
    assert t.floor(0.0, q, BatchingSettings(interactive_first=True), COST) == (1, pytest.approx(cost(1)))
    assert keeps_up(4, 201) and not keeps_up(3, 201)
    assert t.floor(0.0, q, BatchingSettings(interactive_first=False), COST) == (4, pytest.approx(cost(4)))


@given(
    offered=st.integers(0, 3000),
    fixed=st.floats(0.0, 0.05),
    per_item=st.floats(0.0, 0.01),
    per_token=st.floats(0.0, 0.0005),
    tokens=st.integers(1, 64),
    cap=st.integers(1, 64),
)
def test_the_floor_is_the_smallest_batch_that_keeps_up_as_a_scan_finds_it(
    offered, fixed, per_item, per_token, tokens, cap
):
    """The floor is solved in closed form; checked against trying every size in turn."""
    model = CostModel(LinearCost(fixed, per_item, per_token))
    t = LoadTracker()
    t.offered(0.0, offered, 0.5, Priority.BATCH)
    for _ in range(200):
        t.admitted([tokens])
    s = BatchingSettings(max_batch_size=cap, interactive_first=False)
    rate = offered / RATE_HORIZON
    expected = next(
        (n for n in range(1, cap + 1) if n >= rate * model.predict(n, n * t.typical_tokens)),
        cap,
    )
    assert t.floor(0.0, RequestQueue(), s, model) == (
        expected,
        pytest.approx(model.predict(expected, expected * t.typical_tokens)),
    )


# -- the reserve and the keep-up floor, through a micro-batcher's snapshot --------------------
# Total throughput first (interactive_first=False): every urgent item sizes batches. A 50 ms
# interactive budget, a 5 ms margin.
BUDGET, RESERVE_MARGIN_MS = 0.050, 5
RESERVE_MARGIN = RESERVE_MARGIN_MS / 1000


def throughput_first_rig(**kw) -> Rig:
    kw = {
        "policy": "adaptive",
        "max_batch_size": 32,
        "max_queue": 10_000,
        "deadline_margin_ms": RESERVE_MARGIN_MS,
        "interactive_first": False,
        **kw,
    }
    return exact_rig(**kw)


def test_reserve_never_caps_batches_below_what_keeps_up_with_offered_load_and_backlog():
    """The 50 ms interactive budget must cover the batch running when an interactive
    request arrives, then that request's own batch (at least cost(1) = 12 ms alone, and at
    least the smallest batch that keeps up), with the margin on each. At 50 arrivals/s:
    batches of at most 50 - 12 - 10 = 28 ms. At 200/s the keep-up batch is 4 items
    (18 ms): at most 22 ms. At 400/s batches that small would grow the queue without bound,
    so the reserve rises to the smallest batch that keeps up (21 items, 52 ms). A backlog
    due within a second counts as load to drain in it; beyond what any batch can carry the
    reserve stops binding. (The interactive request itself is queued and due within the
    second: one more item/s of load.)"""

    async def reserve_at(offered: int, keep_queued: bool = False) -> float:
        r = throughput_first_rig()
        b = r.batcher
        b.submit(0, budget=BUDGET, priority=Priority.INTERACTIVE)
        for i in range(offered - 1):  # one second of arrivals, all at t=0
            item = b.submit(i + 1, budget=0.9, priority=Priority.BATCH)
            if not keep_queued:
                b.cancel(item)  # offered and gone: only the arrival rate remains
                item.future.exception()
        return b.load(r.clock.now()).reserve

    usable = BUDGET - 2 * RESERVE_MARGIN
    assert keeps_up(1, 50 + 1)
    assert run(reserve_at(50)) == pytest.approx(usable - cost(1))
    assert keeps_up(21, 400 + 1) and not keeps_up(20, 400 + 1)
    assert run(reserve_at(400)) == pytest.approx(cost(21))
    # 200/s is carried by 4-item batches; 200 more queued to drain need 20-item batches.
    assert keeps_up(4, 200 + 1) and not keeps_up(3, 200 + 1)
    assert run(reserve_at(200)) == pytest.approx(usable - cost(4))
    assert keeps_up(20, 200 + 200) and not keeps_up(19, 200 + 200)
    assert run(reserve_at(200, keep_queued=True)) == pytest.approx(cost(20))
    assert not keeps_up(32, 2000 + 1)  # no batch keeps up: the largest
    assert run(reserve_at(2000)) == pytest.approx(cost(32))


def test_background_work_does_not_size_batches_until_it_is_due():
    """A batch job fills spare capacity: 400 items with an hour's budget, arrived and queued,
    leave the reserve where interactive traffic alone puts it (28 ms, 9 items). Its items
    retried after a refusal (count_rejection=False) do not count either. Urgent work that
    is queued and due within a second does count (total throughput first:
    interactive_first=False; interactive first, only interactive work sizes batches)."""

    async def scenario() -> tuple[float, float, float]:
        r = throughput_first_rig()
        b = r.batcher
        b.submit(0, budget=BUDGET, priority=Priority.INTERACTIVE)
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
    # What the interactive request alone leaves: the budget less both margins and its own
    # batch, cost(1) (the batch that keeps up with it is one item).
    interactive_alone = BUDGET - 2 * RESERVE_MARGIN - cost(1)  # 28 ms
    assert fits(interactive_alone) == 9
    assert background == pytest.approx(interactive_alone)
    assert retried == pytest.approx(interactive_alone)
    # 201 urgent offered (with the interactive one) and 201 due within the second:
    # 402 items/s need 21-item batches.
    assert keeps_up(21, 402) and not keeps_up(20, 402)
    assert urgent == pytest.approx(cost(21))


def test_refused_requests_count_as_offered_load():
    """Under overload admission refuses what small batches cannot carry; sizing batches by
    the admitted rate alone would keep them small. 400 offered with 10 admitted: the
    reserve is what 410 items/s need (23 items, 56 ms)."""

    async def scenario() -> float:
        r = exact_rig(policy="adaptive", max_batch_size=32, max_queue=10, interactive_first=False)
        b = r.batcher
        b.submit(0, budget=BUDGET, priority=Priority.INTERACTIVE)
        refused = 0
        for i in range(399):
            try:
                b.submit(i + 1, budget=0.9, priority=Priority.BATCH)
            except QueueFull:
                refused += 1
        assert refused == 390
        return b.load(r.clock.now()).reserve

    assert keeps_up(23, 410) and not keeps_up(22, 410)
    assert run(scenario()) == pytest.approx(cost(23))


# -- the measured drain rate ---------------------------------------------------------------
def test_drain_rate_counts_only_recent_backlogged_batches_and_forgets_on_settings_change():
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


@given(
    st.lists(
        st.tuples(st.floats(0.0, 1.5), st.integers(1, 64), st.floats(0.001, 0.5), st.booleans(), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_drain_rate_is_the_ratio_of_the_window_sums(batches):
    """Kept as running sums; checked against summing the window, also across forget_drain."""
    t, now, window = LoadTracker(), 0.0, []
    for gap, n, seconds, backlogged, forget in batches:
        now += gap
        if forget:
            t.forget_drain()
            window.clear()
        t.served(now, n, seconds, backlogged)
        if backlogged:
            window.append((now, n, seconds))
        recent = [(n, s) for f, n, s in window if f >= now - DRAIN_HORIZON]
        rate = t.drain_rate(now)
        if len(recent) < DRAIN_MIN_BATCHES:
            assert rate is None
        else:
            assert rate == pytest.approx(sum(n for n, _ in recent) / sum(s for _, s in recent))


# -- after any history: bursts ------------------------------------------------------------
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
        with contextlib.suppress(BatchingError):
            b.submit_many(list(range(count)), budget=bud, priority=prio)
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
@given(
    past=history,
    idle=st.sampled_from([0.0, 0.5, 1.5, 5.0, 60.0, 8 * 3600.0]),
    size=st.integers(1, 16),
    new_size=st.sampled_from([None, 1, 4, 32]),
    policy=st.sampled_from(["fixed", "deadline", "adaptive"]),
    slack=st.floats(1.0, 3.0),
)
def test_a_burst_the_engine_can_serve_is_admitted_in_full_after_any_history(past, idle, size, new_size, policy, slack):
    """Four times max_batch_size at once. Served one at a time it would take n * cost(1):
    whatever batch sizes the policy picks (at least one item), it is done by then."""
    r = exact_rig(policy=policy, max_batch_size=size, max_wait_ms=5, max_queue=10_000, default_budget_ms=None)
    n = 4 * (new_size or size)
    budget = n * cost(1) * slack + 2 * MARGIN
    start, _items, refused, finished, expired = run(burst_after(r, past, idle, new_size, n, budget))
    assert refused == 0, "a burst that the engine serves within its budget was refused"
    assert len(finished) == n and not expired
    for t, payloads in r.engine.runs:
        if t >= start:
            assert t + cost(len(payloads)) <= start + budget


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    past=history,
    idle=st.sampled_from([0.0, 0.5, 5.0, 3600.0]),
    size=st.integers(1, 16),
    policy=st.sampled_from(["deadline", "adaptive"]),
    fraction=st.floats(0.05, 0.95),
)
def test_a_burst_the_engine_cannot_serve_is_refused_at_once_not_left_to_expire(past, idle, size, policy, fraction):
    """The budget is a fraction of the fastest possible service of the whole burst (full
    batches back to back): some items must be refused, and every admitted one is on time."""
    r = exact_rig(policy=policy, max_batch_size=size, max_wait_ms=5, max_queue=10_000, default_budget_ms=None)
    n = 4 * size
    fastest = math.ceil(n / size) * cost(size)
    budget = fastest * fraction
    _start, items, refused, finished, expired = run(burst_after(r, past, idle, None, n, budget))
    assert refused >= 1 and refused + len(items) == n
    assert not expired, "admitted, then expired: admission should have refused it at once"
    assert len(finished) == len(items)


# -- interactive first ------------------------------------------------------------------
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
@given(
    gaps=interactive_gaps,
    waves=batch_waves,
    size=st.sampled_from([8, 16, 32]),
    budget=st.sampled_from([0.06, 0.1, 0.2]),
    policy=st.sampled_from(["deadline", "adaptive"]),
)
def test_interactive_first_no_interactive_request_is_refused_or_late_whatever_batch_load(
    gaps, waves, size, budget, policy
):
    """Interactive requests keep arriving (gaps well under RESERVE_HORIZON) at most 50/s,
    a fraction of what the engine carries; batch-class waves of up to 60 items come at any
    rate. Batch-class work absorbs the shortfall: it waits, is refused or expires by its own
    budget; every interactive request is admitted and finishes within its budget."""
    assert max(gaps) < RESERVE_HORIZON
    r = exact_rig(
        policy=policy,
        max_batch_size=size,
        max_wait_ms=5,
        max_queue=10_000,
        default_budget_ms=None,
        interactive_first=True,
    )
    interactive, refused, batch_items, _batch_refused = run(mixed(r, gaps, waves, budget))
    assert refused == 0, "an interactive request was refused while batch-class work was served"
    done_at = {}
    for t, payloads in r.engine.runs:
        for p in payloads:
            done_at.setdefault(p, []).append(t + cost(len(payloads)))
    for item in interactive:
        assert item.outcome is Outcome.RESULT, f"interactive item ended {item.outcome.name}"
        finished = item.dispatched_at + cost(item.batch_size)
        assert finished <= item.deadline + 1e-9
    for item in batch_items:
        assert item.finished  # served, or expired by its own budget; exactly once
    assert sum(r.batcher.outcomes.values()) == len(interactive) + len(batch_items)


def test_total_throughput_first_lets_batch_class_load_size_batches():
    """The one setting that prefers throughput: with interactive_first off, batch-class load
    sizes batches past what an interactive budget allows (and interactive requests are
    refused at once when that leaves them no room); on, batches stay within the reserve."""

    budget, tick = 0.060, 0.025

    async def largest_batch(first: bool) -> int:
        r = exact_rig(
            policy="adaptive", max_batch_size=32, max_queue=10_000, default_budget_ms=None, interactive_first=first
        )
        b = r.batcher
        await b.start()
        for _k in range(40):  # one second: an interactive request and 10 batch-class items (1 s budget) a tick
            # Throughput first: no room left for it, refused at once.
            with contextlib.suppress(BatchingError):
                b.submit("i", budget=budget)
            for _ in range(10):
                b.submit("b", budget=1.0, priority=Priority.BATCH)
            await r.clock.advance(tick)
        await r.clock.run_until_idle()
        await b.stop()
        return max(len(p) for _, p in r.engine.runs)

    # 60 ms budget: (60 - 2 * 10) ms usable - 12 ms alone = 28 ms = 9 items at most.
    most = fits(budget - 2 * MARGIN - cost(1))
    assert most == 9
    assert run(largest_batch(True)) <= most
    assert run(largest_batch(False)) > most


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
    capacity = 32 / cost(32)
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
