"""Admission control: say no at once rather than queue work that cannot be served.

`check` is the first half of a check-then-act pair: it raises if the item must be refused
and otherwise returns whether it is admitted best-effort. It predicts when the new item
would finish (the running batch, then the work ordered ahead of it, then its own batch)
using the cost model, and compares that with the item's deadline.
"""
from __future__ import annotations

import math

from .cost import CostModel
from .errors import DeadlineInfeasible, QueueFull
from .queue import INF, RequestQueue
from .settings import BatchingSettings
from .types import Priority, WorkItem


def items_ahead(q: RequestQueue, item: WorkItem) -> int:
    """Queued items that EDF-within-class ordering would serve before `item`."""
    ahead = sum(q.count(p) for p in Priority if p < item.priority)
    return ahead + q.count_before(item)


def batch_size_under(reserve: float | None, s: BatchingSettings, cost: CostModel, tokens: int) -> int:
    """The batch size the policies will form: max_batch_size, or less under the reserve."""
    size = s.max_batch_size
    if reserve is not None and s.policy != "fixed":
        while size > 1 and cost.predict(size, size * tokens) > reserve:
            size -= 1
    return size


def predicted_completion(q: RequestQueue, item: WorkItem, now: float, busy_until: float, s: BatchingSettings,
                         cost: CostModel, siblings: int = 0, service_rate: float = 0.0,
                         reserve: float | None = None, interactive_rate: float = 0.0, floor: int = 1,
                         slowdown: float = 1.0) -> float:
    ahead = items_ahead(q, item) + siblings
    tokens = max(item.cost, 1)
    size = batch_size_under(reserve, s, cost, tokens)
    full, rest = divmod(ahead + 1, size)
    shaped = item.priority is Priority.INTERACTIVE and s.policy != "fixed"
    # Promise interactive work what the policies promise: predictions allow for the slowdown.
    slow = slowdown if shaped else 1.0
    if rest and shaped:
        # Its batch is filled from the work queued behind it up to the floor: interactive
        # deadlines do not cut batches below what keeps up with the load.
        rest = max(rest, min(floor, size, len(q) + siblings + 1 - full * size))
    per_batch = cost.predict(size, size * tokens) * slow
    if len(q) >= size and service_rate > 0:
        # Saturated: batches may be smaller than max_batch_size (deadline caps, the
        # interactive reserve), so trust the rate items actually finish at when it is slower
        # (a measured rate: the slowdown is in it already).
        per_batch = max(per_batch, size / service_rate)
    wait = full * per_batch + (cost.predict(rest, rest * tokens) * slow if rest else 0.0)
    if item.priority is not Priority.INTERACTIVE and interactive_rate > 0:
        # Interactive arrivals keep going ahead of batch-class work: it only gets the
        # capacity they leave, a share of 1 - rho (priority queueing).
        rho = interactive_rate * per_batch / size
        wait = wait / (1.0 - rho) if rho < 0.95 else INF
    return now + max(busy_until - now, 0.0) * slow + wait


def check(q: RequestQueue, item: WorkItem, now: float, busy_until: float, s: BatchingSettings, cost: CostModel,
          siblings: int = 0, service_rate: float = 0.0, reserve: float | None = None,
          interactive_rate: float = 0.0, floor: int = 1, slowdown: float = 1.0) -> bool:
    """Raise QueueFull / DeadlineInfeasible, or return True when admitted best-effort.

    `siblings` counts the other items of the same request, admitted all or none: they are
    queued ahead of the last one, which is the one checked.
    """
    if len(q) + siblings >= s.max_queue:
        # Time for the queue to drain by one batch is an honest lower bound to retry after.
        wait = max(busy_until - now, 0.0) + cost.predict(s.max_batch_size, s.max_batch_size * max(item.cost, 1))
        raise QueueFull(f"queue is full ({s.max_queue} items waiting)", retry_after=max(1, math.ceil(wait)))
    if item.deadline is None:
        return False
    done = predicted_completion(q, item, now, busy_until, s, cost, siblings, service_rate, reserve, interactive_rate,
                                floor, slowdown)
    if done + s.margin <= item.deadline:
        return False
    if s.on_infeasible == "serve":
        return True
    budget_ms = (item.deadline - item.arrival) * 1000.0
    eta = "not in the foreseeable future" if done == INF else f"in {(done - now) * 1000.0:.0f} ms"
    raise DeadlineInfeasible(
        f"latency budget of {budget_ms:.0f} ms cannot be met: predicted completion {eta} with {len(q)} items queued",
        retry_after=max(1, math.ceil(min(done - now, 60.0))),
    )
