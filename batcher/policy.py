"""Dispatch policies: pure functions of (queue, now, settings, cost model).

Each returns `Dispatch(size, reason)` ("send the first `size` items in queue order now")
or `WaitUntil(t)` ("nothing to do before t; None = until something arrives"). Only the
batcher's loop awaits; these functions never do.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Callable, Sequence

from .cost import CostModel
from .queue import RequestQueue
from .settings import BatchingSettings
from .types import DispatchReason, Priority, WorkItem

INF = math.inf


@dataclass(frozen=True, slots=True)
class Dispatch:
    size: int
    reason: DispatchReason


@dataclass(frozen=True, slots=True)
class WaitUntil:
    t: float | None  # None: until the next arrival


Decision = Dispatch | WaitUntil
Policy = Callable[..., Decision]


def batch_cost(cost: CostModel, items: Sequence[WorkItem]) -> float:
    """Predicted execution time; inputs are padded to the longest member."""
    if not items:
        return 0.0
    return cost.predict(len(items), max(i.cost for i in items) * len(items))


def deadline_cap(items: Sequence[WorkItem], now: float, s: BatchingSettings, cost: CostModel,
                 reserve: float | None = None, floor: int = 1) -> int:
    """How many of `items` (in queue order) to send now.

    Interactive items constrain the batch: it may not grow past the point where one of them
    would miss a deadline it could still meet alone. Within that, the size is the one that
    finishes the most items within their deadlines per second (goodput), so one late
    batch-class item does not shrink a batch for everyone, and under overload batches stay
    large. `reserve` caps the predicted batch time so that an interactive request arriving
    while the batch runs can still make its budget (the engine cannot be preempted).
    Items that would miss even alone constrain nothing: they run best-effort. Neither cuts
    the batch below `floor` items, the smallest batch that keeps up with the load
    (admission has refused the interactive requests that cannot be served that way).
    """
    best_k, best_rate = 1, -1.0
    slow = cost.slowdown  # interactive deadlines are promised what nine batches in ten deliver
    longest = 0
    finished_in_time: list[float] = []  # sorted deadlines of the items taken so far
    tightest_interactive = INF
    for k, item in enumerate(items, start=1):
        longest = max(longest, item.cost)
        t = cost.predict(k, longest * k)
        if k > floor and reserve is not None and t > reserve:
            break
        d = item.deadline if item.deadline is not None else INF
        if item.priority is Priority.INTERACTIVE and now + cost.predict(1, item.cost) * slow + s.margin <= d:
            tightest_interactive = min(tightest_interactive, d)
        if k > floor and now + t * slow + s.margin > tightest_interactive:
            break
        insort(finished_in_time, d)
        good = len(finished_in_time) - bisect_left(finished_in_time, now + t + s.margin)
        rate = good / max(t, 1e-9)
        if rate >= best_rate:
            best_k, best_rate = k, rate
    return best_k


def latest_start(items: Sequence[WorkItem], s: BatchingSettings, cost: CostModel) -> float:
    """Last moment this batch can start and still meet its tightest deadline."""
    deadline = min((i.deadline for i in items if i.deadline is not None), default=INF)
    return deadline - batch_cost(cost, items) - s.margin


def fixed(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, rate: float = 0.0,
          reserve: float | None = None, floor: int = 1) -> Decision:
    n = len(q)
    if n == 0:
        return WaitUntil(None)
    if n >= s.max_batch_size:
        return Dispatch(s.max_batch_size, DispatchReason.FULL)
    due = q.oldest_arrival + s.max_wait
    if now >= due:
        return Dispatch(n, DispatchReason.MAX_WAIT)
    return WaitUntil(due)


def deadline(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, rate: float = 0.0,
             reserve: float | None = None, floor: int = 1) -> Decision:
    base = fixed(q, now, s, cost, rate)
    if len(q) == 0:
        return base
    items = q.peek(s.max_batch_size, now)
    cap = deadline_cap(items, now, s, cost, reserve, floor)
    if isinstance(base, Dispatch):
        return Dispatch(min(base.size, cap), base.reason)
    start_by = latest_start(items[:cap], s, cost)
    if now >= start_by:
        return Dispatch(cap, DispatchReason.DEADLINE)
    return WaitUntil(min(base.t, start_by))


def adaptive(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, rate: float = 0.0,
             reserve: float | None = None, floor: int = 1) -> Decision:
    """Wait only while waiting raises throughput, and never past a deadline or max_wait.

    With batch time a + b*n and arrivals at rate r, the throughput of a batch that waits w
    more seconds, (n + r*w) / (w + a + b*(n + r*w)), grows with w exactly when r*a > n.
    So the target size is r*a items (what arrives during one batch's fixed overhead):
    at low load that is one item and the policy dispatches at once; as load grows the
    target grows with it, up to max_batch_size.
    """
    n = len(q)
    if n == 0:
        return WaitUntil(None)
    items = q.peek(s.max_batch_size, now)
    cap = deadline_cap(items, now, s, cost, reserve, floor)
    if n >= s.max_batch_size:
        return Dispatch(cap, DispatchReason.FULL)
    target = min(s.max_batch_size, max(1, math.ceil(rate * cost.params.fixed)))
    if n >= target or cap < n:  # big enough, or a deadline/reserve already binds: waiting cannot help
        return Dispatch(cap, DispatchReason.ADAPTIVE)
    start_by = latest_start(items[:cap], s, cost)
    due = q.oldest_arrival + s.max_wait
    fill_at = now + (target - n) / rate if rate > 0 else INF
    if now >= start_by:
        return Dispatch(cap, DispatchReason.DEADLINE)
    if now >= due:
        return Dispatch(cap, DispatchReason.MAX_WAIT)
    return WaitUntil(min(fill_at, start_by, due))


POLICIES: dict[str, Policy] = {"fixed": fixed, "deadline": deadline, "adaptive": adaptive}


def get_policy(name: str) -> Policy:
    return POLICIES[name]
