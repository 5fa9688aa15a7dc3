"""The waiting room: ordered by priority class, then earliest deadline, with aging.

Interactive work goes first, earliest deadline first (EDF). With fair shares between
tenants (`tenants`, batcher/fairness.py), each class serves the tenant with the smallest
virtual token counter first, each tenant's own items earliest deadline first: the order
simulates the counters as the items ahead are served (each adds its input price). Batch-class work fills what
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

from .fairness import Tenants
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


Key = tuple[float, int]


class RequestQueue:
    def __init__(self, aging: float = 2.0, tenants: Tenants | None = None):
        self.aging = aging
        self.tenants = tenants  # fair order within classes when set and enabled
        # dicts keep insertion order, and items are inserted on arrival: arrival order.
        self._all: dict[int, WorkItem] = {}
        self._batch_fifo: dict[int, WorkItem] = {}
        self._edf: dict[Priority, list[tuple[float, int]]] = {p: [] for p in Priority}
        # Each class's items by tenant, EDF (kept whether or not fairness is on: it can be
        # switched live).
        self._by_tenant: dict[Priority, dict[str, list[Key]]] = {p: {} for p in Priority}
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

    def tenant_depths(self) -> dict[str, int]:
        """Queued items by tenant (every class)."""
        out: dict[str, int] = {}
        for lanes in self._by_tenant.values():
            for tenant, keys in lanes.items():
                out[tenant] = out.get(tenant, 0) + len(keys)
        return out

    @property
    def fair(self) -> bool:
        """Fair order within classes: tenants set and enabled, and more than one queued (one
        tenant's fair order is EDF)."""
        return self._fair_with(None)

    def _fair_with(self, tenant: str | None) -> bool:
        if self.tenants is None or not self.tenants.enabled:
            return False
        queued = {t for lanes in self._by_tenant.values() for t in lanes}
        if tenant is not None:
            queued.add(tenant)
        return len(queued) > 1

    def count_before(self, item: WorkItem) -> int:
        """Queued items of the item's own class served before it: EDF, or with fair shares
        the items the counters' order serves first (the item need not be queued)."""
        if not self._fair_with(item.tenant):
            return bisect_right(self._edf[item.priority], _key(item))
        assert self.tenants is not None
        tenants, key = self.tenants, _key(item)
        lanes = self._by_tenant[item.priority]
        turn, ahead = self._own_ahead(item)
        for tenant, keys in lanes.items():
            if tenant == item.tenant:
                continue
            c = tenants.counter(tenant)
            for k in keys:
                if (c, k) >= (turn, key):
                    break
                ahead += 1
                c += tenants.price(tenant, self._all[k[1]].cost, self._all[k[1]].expected_output)
        return ahead

    def fair_turn(self, item: WorkItem) -> float:
        """The item's turn in its class's fair order (needs `tenants`): its tenant's counter
        (lifted, if it returns from idle) plus the price of the tenant's items queued ahead
        of it. Another tenant's items go first while that tenant's counter is below it."""
        return self._own_ahead(item)[0]

    def _own_ahead(self, item: WorkItem) -> tuple[float, int]:
        """(`fair_turn`, the tenant's own items queued ahead of it)."""
        assert self.tenants is not None
        tenants, key = self.tenants, _key(item)
        turn, ahead = tenants.arriving_counter(item.tenant), 0
        for k in self._by_tenant[item.priority].get(item.tenant, []):
            if k >= key:
                break
            turn += tenants.price(item.tenant, self._all[k[1]].cost, self._all[k[1]].expected_output)
            ahead += 1
        return turn, ahead

    def mean_cost(self, priority: Priority) -> float | None:
        """The mean cost (tokens) of the queued items of `priority` and the classes ahead of
        it; None when none is queued."""
        classes = [p for p in Priority if p <= priority]
        count = sum(len(self._edf[p]) for p in classes)
        return sum(self._tokens[p] for p in classes) / count if count else None

    def push(self, item: WorkItem) -> None:
        self._all[item.id] = item
        insort(self._edf[item.priority], _key(item))
        insort(self._by_tenant[item.priority].setdefault(item.tenant, []), _key(item))
        self._pushed[item.id] = item.cost
        self._tokens[item.priority] += item.cost
        if item.priority is Priority.BATCH:
            self._batch_fifo[item.id] = item

    def remove(self, item: WorkItem) -> bool:
        if self._all.pop(item.id, None) is None:
            return False
        edf = self._edf[item.priority]
        del edf[bisect_left(edf, _key(item))]
        lanes = self._by_tenant[item.priority]
        own = lanes[item.tenant]
        del own[bisect_left(own, _key(item))]
        if not own:
            del lanes[item.tenant]
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

    def earliest_promise(self, priority: Priority, tenant: str = "") -> float:
        """The earliest deadline promised to a queued item of `priority` or a class served
        after it (best-effort items were promised nothing): a newcomer of that class shares
        their turn or goes before them. With fair shares, only the promises of its own tenant
        and of tenants served less (by their counters; one back from idle is lifted to the
        busiest's level, a tie): a tenant over its share does not keep one within it out."""
        tenants = self.tenants if self._fair_with(tenant) else None  # the newcomer's tenant counts
        mine = tenants.arriving_counter(tenant) if tenants is not None else 0.0
        earliest = INF
        for p, edf in self._edf.items():
            if p < priority:
                continue
            for deadline, item_id in edf:
                item = self._all[item_id]
                if item.best_effort:
                    continue
                if tenants is not None and item.tenant != tenant and tenants.counter(item.tenant) >= mine:
                    continue
                earliest = min(earliest, deadline)
                break
        return earliest

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
        if self.fair:
            yield from self._fair_order(now, aged)
            return
        for _, item_id in heapq.merge(self._edf[Priority.INTERACTIVE], aged):
            yield self._all[item_id]
        for _, item_id in self._edf[Priority.BATCH]:
            if item_id not in aged_ids:
                yield self._all[item_id]

    def _fair_order(self, now: float, aged: list[Key]) -> Iterator[WorkItem]:
        """Interactive items (and aged batch-class ones, as interactive ones of their tenant
        due at `arrival + aging`), tenants by their counters; then the other batch-class items."""
        first: dict[str, list[Key]] = {t: list(keys) for t, keys in self._by_tenant[Priority.INTERACTIVE].items()}
        for k in aged:
            insort(first.setdefault(self._all[k[1]].tenant, []), k)
        aged_ids = {i for _, i in aged}
        rest = {t: [k for k in keys if k[1] not in aged_ids] for t, keys in self._by_tenant[Priority.BATCH].items()}
        yield from self._by_counters(first)
        yield from self._by_counters(rest)

    def _by_counters(self, lanes: dict[str, list[Key]]) -> Iterator[WorkItem]:
        """The tenant with the smallest counter next, its earliest item; its counter then
        grows by that item's price (simulated: service is charged when it happens)."""
        assert self.tenants is not None
        tenants = self.tenants
        heap = [(tenants.counter(t), keys[0], t, 0) for t, keys in lanes.items() if keys]
        heapq.heapify(heap)
        while heap:
            c, key, t, i = heapq.heappop(heap)
            item = self._all[key[1]]
            yield item
            keys = lanes[t]
            if i + 1 < len(keys):
                heapq.heappush(heap, (c + tenants.price(t, item.cost, item.expected_output), keys[i + 1], t, i + 1))

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
        """The first `n` queued items of one class, earliest deadline first (no aging), or
        with fair shares in the counters' order."""
        if self.fair:
            out: list[WorkItem] = []
            for item in self._by_counters(self._by_tenant[priority]):
                if len(out) >= n:
                    break
                out.append(item)
            return out
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
