"""RequestQueue: interactive work first, earliest deadline first (EDF) within a class, and
aging, so that batch-class work cannot starve; the counts admission and load estimation
read; expiry. First as a data structure, then as the order a micro-batcher serves in."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher.queue import RequestQueue
from batcher.types import Priority, WorkItem

from .conftest import arrivals, cost, drive, exact_rig, run

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


def item(arrival: float = 0.0, deadline: float | None = None, priority: Priority = INTERACTIVE) -> WorkItem:
    return WorkItem(payload=None, arrival=arrival, deadline=deadline, priority=priority)


def queue(*items: WorkItem, aging: float = 10.0) -> RequestQueue:
    q = RequestQueue(aging=aging)
    for i in items:
        q.push(i)
    return q


# -- the queue as a data structure ----------------------------------------------------------
def test_interactive_work_goes_first_then_earliest_deadline_within_each_class():
    late, soon, whenever = item(deadline=5.0), item(deadline=2.0), item(deadline=None)
    job_late, job_soon = item(deadline=1.0, priority=BATCH), item(deadline=0.5, priority=BATCH)
    q = queue(job_late, late, whenever, job_soon, soon)
    # A batch-class deadline earlier than every interactive one still waits behind them;
    # no deadline sorts last within its class.
    assert list(q.ordered(0.0)) == [soon, late, whenever, job_soon, job_late]


def test_equal_deadlines_are_served_in_arrival_order():
    first, second, third = item(deadline=1.0), item(deadline=1.0), item(deadline=1.0)
    q = queue(first, second, third)
    assert list(q.ordered(0.0)) == [first, second, third]
    assert list(q.items()) == [first, second, third]


def test_batch_work_that_has_waited_aging_is_ordered_as_if_due_at_arrival_plus_aging():
    aging = 1.0
    old_job = item(arrival=0.0, deadline=100.0, priority=BATCH)
    new_job = item(arrival=0.8, deadline=100.0, priority=BATCH)
    due_sooner = item(arrival=0.5, deadline=1.2)  # after the old job's aged deadline, 0.0 + aging
    due_later = item(arrival=0.5, deadline=2.0)
    q = queue(old_job, due_sooner, due_later, new_job, aging=aging)
    assert list(q.ordered(0.5)) == [due_sooner, due_later, old_job, new_job]  # nobody aged yet
    # At arrival + aging the old job competes with interactive work for the deadline 1.0,
    # ahead of the 1.2 one; the newer job has not waited that long and stays behind.
    assert list(q.ordered(0.0 + aging)) == [old_job, due_sooner, due_later, new_job]


def test_aged_batch_work_keeps_its_arrival_order():
    aging = 1.0
    jobs = [item(arrival=0.1 * k, deadline=10.0 - k, priority=BATCH) for k in range(3)]  # later ones due sooner
    q = queue(*jobs, aging=aging)
    assert list(q.ordered(0.0)) == jobs[::-1]  # EDF while none has aged
    assert list(q.ordered(0.2 + aging)) == jobs  # all aged: the one that waited longest first


def test_peek_leaves_the_items_queued_and_take_removes_them():
    a, b, c = item(deadline=1.0), item(deadline=2.0), item(deadline=3.0)
    q = queue(a, b, c)
    assert q.peek(2, 0.0) == [a, b] and q.peek(2, 0.0) == [a, b]
    assert q.peek(0, 0.0) == [] and q.peek(-1, 0.0) == []
    assert q.peek(10, 0.0) == [a, b, c]
    assert q.take(2, 0.0) == [a, b]
    assert len(q) == 1 and a not in q and c in q
    assert q.take(5, 0.0) == [c] and len(q) == 0


def test_remove_is_idempotent():
    a, b = item(deadline=1.0), item(deadline=1.0, priority=BATCH)
    q = queue(a, b)
    assert q.remove(b) is True
    assert q.remove(b) is False  # a second cancel of the same item is harmless
    assert list(q.ordered(0.0)) == [a] and q.count(BATCH) == 0
    assert q.remove(item()) is False  # never queued


def test_counts_that_admission_and_load_estimation_read():
    i1, i2, i3 = item(arrival=0.0, deadline=0.5), item(arrival=0.1, deadline=1.5), item(arrival=0.2, deadline=None)
    j1, j2 = item(arrival=0.3, deadline=0.8, priority=BATCH), item(arrival=0.4, deadline=3.0, priority=BATCH)
    q = queue(i1, i2, i3, j1, j2)
    assert (len(q), q.count(INTERACTIVE), q.count(BATCH)) == (5, 3, 2)
    # Queued items of its own class that EDF puts before it.
    assert q.count_before(item(deadline=1.0)) == 1
    assert q.count_before(item(deadline=1.0, priority=BATCH)) == 1
    assert q.count_before(item(deadline=None)) == 3
    # Deadline at or before t; no deadline is never due.
    assert q.due_within(1.5) == 3
    assert q.due_within(1.5, INTERACTIVE) == 2 and q.due_within(1.5, BATCH) == 1
    assert q.due_within(0.4) == 0
    assert q.min_deadline == 0.5
    assert q.oldest_arrival == 0.0
    q.remove(i1)
    assert q.min_deadline == 0.8 and q.oldest_arrival == 0.1


def test_an_empty_queue():
    q = RequestQueue()
    assert len(q) == 0 and list(q.ordered(0.0)) == [] and q.peek(3, 0.0) == []
    assert q.oldest_arrival is None and q.min_deadline == math.inf
    assert q.expired(1e9) == [] and q.due_within(1e9) == 0


def test_expired_lists_what_is_past_its_deadline_in_every_class_and_removes_nothing():
    gone, due_now = item(deadline=0.5), item(deadline=1.0, priority=BATCH)
    alive, no_deadline = item(deadline=1.5), item(deadline=None, priority=BATCH)
    q = queue(gone, due_now, alive, no_deadline)
    assert {i.id for i in q.expired(1.0)} == {gone.id, due_now.id}  # a deadline at `now` has passed
    assert len(q) == 4
    assert q.expired(0.4) == []
    assert {i.id for i in q.expired(1e9)} == {gone.id, due_now.id, alive.id}  # no deadline never expires


# -- the order a micro-batcher serves in ----------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=arrivals, size=st.integers(1, 8))
def test_earliest_deadline_first_within_a_class(stream, size):
    stream = [(g, b, Priority.INTERACTIVE, c) for g, b, _, c in stream]
    r = exact_rig(
        policy="deadline",
        max_batch_size=size,
        max_wait_ms=5,
        max_queue=30,
        default_budget_ms=200,
        on_infeasible="serve",
    )
    items, finished_at, _ = run(drive(r, stream))
    for x in items:
        if x.dispatched_at is None:
            continue
        t = x.dispatched_at
        for y in items:
            waiting_at_t = y.arrival < t and (y.dispatched_at is None or y.dispatched_at > t) and finished_at[y.id] > t
            assert not (waiting_at_t and y.deadline < x.deadline), "a later deadline was served first"


def test_aging_bounds_how_long_batch_work_waits_behind_interactive_work():
    aging, size = 0.100, 4

    async def scenario():
        r = exact_rig(
            policy="fixed",
            max_batch_size=size,
            max_wait_ms=0,
            max_queue=10_000,
            default_budget_ms=None,
            aging_ms=aging * 1000,
        )
        await r.batcher.start()
        job = r.batcher.submit("batch-job", priority=Priority.BATCH, budget=60)
        # Interactive traffic at 400/s, about twice the size / cost(size) = 222/s the engine
        # serves, each with a generous budget.
        for k in range(400):
            r.batcher.submit(f"i{k}", budget=30)
            await r.clock.advance(0.0025)
            if job.dispatched_at is not None:
                break
        waited = job.dispatched_at - job.arrival
        assert waited <= aging + cost(size)  # the bound: aging plus the batch already running
        await r.batcher.stop()

    run(scenario())
