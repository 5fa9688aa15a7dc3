"""The waiting room: ordered by priority class, then earliest deadline, with aging.

Interactive work goes first, earliest deadline first (EDF). Batch-class work fills what
interactive work leaves, but an item that has waited `aging` seconds is ordered among the
interactive items as if its deadline were `arrival + aging`, so it cannot starve.

With `grouping` set (embeddings, `group_by_length`), what a batch takes is grouped by
length (`LengthGrouping`): the head of that order leads, then the rest of a window of the
next items, each class in turn (interactive or aged first): its items that cannot wait for
another batch, then its others by how close their length is to the leader's. Inputs are padded to the
longest of their batch, so mixed lengths compute mostly padding.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from dataclasses import dataclass

from .types import Priority, WorkItem

INF = math.inf


@dataclass(frozen=True, slots=True)
class LengthGrouping:
    """How `peek` groups by length: over the first `window` items of dispatch order, the
    ones with a deadline before `urgent_before` keep their place behind the leader."""

    window: int
    urgent_before: float


def _key(item: WorkItem) -> tuple[float, int]:
    return (item.deadline if item.deadline is not None else INF, item.id)


class RequestQueue:
    def __init__(self, aging: float = 2.0):
        self.aging = aging
        # dicts keep insertion order, and items are inserted on arrival: arrival order.
        self._all: dict[int, WorkItem] = {}
        self._batch_fifo: dict[int, WorkItem] = {}
        self._edf: dict[Priority, list[tuple[float, int]]] = {p: [] for p in Priority}
        # Each class's queued tokens (items' costs as pushed: a generation prompt repriced
        # while queued keeps its first price here), for admission's lengths of the work ahead.
        self._pushed: dict[int, int] = {}
        self._tokens: dict[Priority, int] = dict.fromkeys(Priority, 0)
        self.grouping: LengthGrouping | None = None  # set by the batcher around one decision

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, item: WorkItem) -> bool:
        return item.id in self._all

    def count(self, priority: Priority) -> int:
        return len(self._edf[priority])

    def count_before(self, item: WorkItem) -> int:
        """Queued items of the item's own class that EDF orders before it."""
        return bisect_right(self._edf[item.priority], _key(item))

    def mean_cost(self, priority: Priority) -> float | None:
        """The mean cost (tokens) of the queued items of `priority` and the classes ahead of
        it; None when none is queued."""
        classes = [p for p in Priority if p <= priority]
        count = sum(len(self._edf[p]) for p in classes)
        return sum(self._tokens[p] for p in classes) / count if count else None

    def push(self, item: WorkItem) -> None:
        self._all[item.id] = item
        insort(self._edf[item.priority], _key(item))
        self._pushed[item.id] = item.cost
        self._tokens[item.priority] += item.cost
        if item.priority is Priority.BATCH:
            self._batch_fifo[item.id] = item

    def remove(self, item: WorkItem) -> bool:
        if self._all.pop(item.id, None) is None:
            return False
        edf = self._edf[item.priority]
        del edf[bisect_left(edf, _key(item))]
        self._tokens[item.priority] -= self._pushed.pop(item.id)
        self._batch_fifo.pop(item.id, None)
        return True

    def items(self) -> Iterator[WorkItem]:
        """Arrival order."""
        return iter(self._all.values())

    @property
    def oldest_arrival(self) -> float | None:
        for item in self._all.values():
            return item.arrival
        return None

    def due_within(self, t: float, priority: Priority | None = None) -> int:
        """Queued items (of one class, or of all) whose deadline is at or before t."""
        return sum(bisect_right(edf, (t, INF)) for p, edf in self._edf.items() if priority is None or p is priority)

    @property
    def min_deadline(self) -> float:
        heads = [edf[0][0] for edf in self._edf.values() if edf]
        return min(heads, default=INF)

    def ordered(self, now: float) -> Iterator[WorkItem]:
        """Dispatch order at time `now`."""
        aged: list[tuple[float, int]] = []
        for item in self._batch_fifo.values():
            if item.arrival + self.aging > now:
                break
            aged.append((item.arrival + self.aging, item.id))
        aged_ids = {i for _, i in aged}
        for _, item_id in heapq.merge(self._edf[Priority.INTERACTIVE], aged):
            yield self._all[item_id]
        for _, item_id in self._edf[Priority.BATCH]:
            if item_id not in aged_ids:
                yield self._all[item_id]

    def peek(self, n: int, now: float) -> list[WorkItem]:
        """The first `n` items a batch would take now: dispatch order, grouped by length
        when `grouping` says so."""
        out: list[WorkItem] = []
        if n <= 0:
            return out
        g = self.grouping
        want = n if g is None else max(n, g.window)
        for item in self.ordered(now):
            out.append(item)
            if len(out) >= want:
                break
        if g is not None and len(out) > 1:
            out = by_length(out, now, self.aging, g.urgent_before)
        return out[:n]

    def peek_class(self, priority: Priority, n: int) -> list[WorkItem]:
        """The first `n` queued items of one class, earliest deadline first (no aging)."""
        return [self._all[item_id] for _, item_id in self._edf[priority][:n]]

    def take(self, n: int, now: float) -> list[WorkItem]:
        out = self.peek(n, now)
        for item in out:
            self.remove(item)
        return out

    def expired(self, now: float) -> list[WorkItem]:
        """Items whose deadline has passed (they must never reach the engine)."""
        out = []
        for edf in self._edf.values():
            for deadline, item_id in edf:
                if deadline > now:
                    break
                out.append(self._all[item_id])
        return out


def by_length(items: list[WorkItem], now: float, aging: float, urgent_before: float) -> list[WorkItem]:
    """`items` (dispatch order) regrouped: the first leads; then interactive (and aged)
    items, those due before `urgent_before` in order, the others by the distance of their
    length (`cost`) from the leader's, ties in order; then batch-class items the same way.
    Grouping never puts a batch-class item ahead of an interactive one: the dispatch order
    does not, and an urgent batch-class item is no more urgent than it was there."""
    lead, rest = items[0], items[1:]

    def first(item: WorkItem) -> bool:
        return item.priority is Priority.INTERACTIVE or item.arrival + aging <= now

    def key(pair: tuple[int, WorkItem]) -> tuple[int, int, int, int]:
        position, item = pair
        urgent = item.deadline is not None and item.deadline <= urgent_before
        # Urgent ones keep their order (their distance does not count).
        return (0 if first(item) else 1, 0 if urgent else 1, 0 if urgent else abs(item.cost - lead.cost), position)

    return [lead, *(i for _, i in sorted(enumerate(rest), key=key))]
