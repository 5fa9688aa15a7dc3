"""Batches of like lengths (embeddings): the queue groups what a batch takes by length, the
items that cannot wait keep their place, interactive work stays ahead of batch-class work,
and `max_batch_tokens` caps rows x longest row."""

from __future__ import annotations

import math

from batcher.policy import Dispatch, fixed, token_cap
from batcher.queue import LengthGrouping, RequestQueue
from batcher.settings import EMBED_BATCH_TOKENS, BatchingSettings
from batcher.types import DispatchReason, Priority, WorkItem

from .conftest import COST, exact_rig, run

NEVER_URGENT = LengthGrouping(window=16, urgent_before=-math.inf)


def queued(*costs: int, priority: Priority = Priority.INTERACTIVE, deadlines=None) -> list[WorkItem]:
    deadlines = deadlines or [None] * len(costs)
    return [
        WorkItem(payload=i, arrival=0.0, deadline=d, priority=priority, id=i, cost=c)
        for i, (c, d) in enumerate(zip(costs, deadlines, strict=True))
    ]


def queue_of(items: list[WorkItem], grouping: LengthGrouping | None = NEVER_URGENT) -> RequestQueue:
    q = RequestQueue(aging=10.0)
    for item in items:
        q.push(item)
    q.grouping = grouping
    return q


def costs(items: list[WorkItem]) -> list[int]:
    return [i.cost for i in items]


def test_the_leader_takes_the_items_nearest_its_length():
    q = queue_of(queued(50, 10, 12, 48, 11, 9, 52))
    assert costs(q.peek(4, 0.0)) == [50, 48, 52, 12]
    q.grouping = None
    assert costs(q.peek(4, 0.0)) == [50, 10, 12, 48]  # dispatch order, ungrouped
    q.grouping = NEVER_URGENT
    assert costs(q.take(3, 0.0)) == [50, 48, 52] and costs(q.peek(8, 0.0)) == [10, 11, 9, 12]


def test_items_that_cannot_wait_for_another_batch_keep_their_place_behind_the_leader():
    items = queued(10, 11, 200, 12, 9, deadlines=[0.4, 1.0, 0.5, 1.0, 1.0])
    q = queue_of(items, LengthGrouping(window=16, urgent_before=0.6))
    assert costs(q.peek(3, 0.0)) == [10, 200, 11]


def test_interactive_items_stay_ahead_of_batch_class_ones_of_a_nearer_length():
    bulk = WorkItem(payload=9, arrival=0.0, deadline=None, priority=Priority.BATCH, id=9, cost=40)
    q = queue_of([*queued(40, 300, priority=Priority.INTERACTIVE), bulk])
    assert [i.id for i in q.peek(3, 0.0)] == [0, 1, 9]


def test_an_urgent_batch_class_item_does_not_go_ahead_of_interactive_ones():
    """A batch-class item due soon follows the interactive items of the window, as it does in
    dispatch order; urgent interactive ones still lead their class."""
    bulk = WorkItem(payload=9, arrival=0.0, deadline=0.5, priority=Priority.BATCH, id=9, cost=400)
    interactive = queued(15, 15, 300, 15, deadlines=[1.0, 1.0, 0.4, 1.0])
    q = queue_of([*interactive, bulk], LengthGrouping(window=16, urgent_before=0.6))
    assert [i.id for i in q.peek(5, 0.0)] == [2, 0, 1, 3, 9]  # before the fix: [2, 9, 0, 1, 3]
    # Aged, it is among the interactive ones, and urgent there.
    q.aging = 0.45
    assert [i.id for i in q.peek(5, 0.45)] == [2, 9, 0, 1, 3]


def test_max_batch_tokens_caps_rows_times_the_longest_row():
    s = BatchingSettings(max_batch_tokens=150)
    assert token_cap(queued(10, 10, 100), s) == 2  # 3 x 100 > 150
    assert token_cap(queued(400, 10), s) == 1  # one input always fits
    assert BatchingSettings().batch_tokens == EMBED_BATCH_TOKENS
    # A batch the token budget fills goes at once, as a full one does.
    q = queue_of(queued(60, 60, 60), grouping=None)
    assert fixed(q, 0.0, BatchingSettings(max_batch_size=8, max_batch_tokens=150), COST) == Dispatch(
        2, DispatchReason.FULL
    )


def test_batches_of_like_lengths_from_a_mixed_queue():
    async def scenario(group: bool) -> list[list[int]]:
        r = exact_rig(max_batch_size=4, group_by_length=group)
        for i in range(8):
            r.batcher.submit(("long" if i % 2 else "short", i), cost=100 if i % 2 else 10)
        await r.batcher.start()
        await r.clock.run_until_idle()
        await r.batcher.stop()
        return [sorted(i for _, i in batch) for batch in r.batches]

    assert run(scenario(True)) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert run(scenario(False)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_long_input_whose_budget_cannot_wait_joins_the_first_batch():
    async def scenario() -> list[list[int]]:
        r = exact_rig(max_batch_size=4)
        for i in range(5):
            r.batcher.submit(("short", i), cost=10)
        r.batcher.submit(("long", 5), cost=200, budget=0.04)
        await r.batcher.start()
        await r.clock.run_until_idle()
        await r.batcher.stop()
        return [sorted(i for _, i in batch) for batch in r.batches]

    batches = run(scenario())
    assert 5 in batches[0] and 0 in batches[0]


def test_a_lane_batch_is_of_like_lengths_and_within_the_token_budget_too():
    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        r = exact_rig(lane=True, max_batch_size=4, max_wait_ms=0, max_batch_tokens=250)
        await r.batcher.start()
        r.batcher.submit_many(list(range(4)), priority=Priority.BATCH)  # in flight: cost(4)
        await r.clock.advance(0.001)
        for i, tokens in enumerate((10, 100, 12, 100, 11, 9)):
            r.batcher.submit(100 + i, cost=tokens, priority=Priority.INTERACTIVE, budget=1.0)
        await r.clock.run_until_idle()
        await r.batcher.stop()
        return r.batches, r.lane_batches

    main, lane = run(scenario())
    # Little of the bulk batch is left, but more interactive work waits than one batch
    # takes (the next main batch would not take it all either), so the lane takes a batch
    # at once: the leader (10 tokens) and its like (12, 11, 9); the next main batch the two
    # 100-token inputs (200 padded tokens, within 250).
    assert [sorted(b) for b in lane] == [[100, 102, 104, 105]]
    assert sorted(main[1]) == [101, 103]
