"""Dispatch policies: pure functions of (queue, now, settings, cost model, load snapshot).

Each returns `Dispatch(size, reason)` ("send the first `size` items in queue order now")
or `WaitUntil(t)` ("nothing to do before t; None = until something arrives"). Only the
batcher's loop awaits; these functions never do. `POLICIES` decide one-shot batches;
`GENERATION_POLICIES` decide which waiting prompts join a running generation batch.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cost import CostModel
from .load import IDLE, Load
from .queue import INF, RequestQueue
from .settings import BatchingSettings
from .types import DispatchReason, Priority, TokenCount, WorkItem


@dataclass(frozen=True, slots=True)
class Dispatch:
    size: int
    reason: DispatchReason


@dataclass(frozen=True, slots=True)
class WaitUntil:
    t: float | None  # None: until the next arrival


Decision = Dispatch | WaitUntil
Policy = Callable[[RequestQueue, float, BatchingSettings, CostModel, Load], Decision]


def batch_cost(cost: CostModel, items: Sequence[WorkItem]) -> float:
    """Predicted execution time; inputs are padded to the longest member."""
    if not items:
        return 0.0
    return cost.predict(len(items), TokenCount.of([i.cost for i in items]).padded)


def deadline_cap(items: Sequence[WorkItem], now: float, s: BatchingSettings, cost: CostModel, load: Load = IDLE) -> int:
    """How many of `items` (in queue order) to send now.

    Interactive items constrain the batch: it may not grow past the point where one of them
    would miss a deadline it could still meet alone. Within that, the size is the one that
    finishes the most work within its deadlines per second (goodput, each item counted for
    its tokens), so one late batch-class item does not shrink a batch for everyone, and
    under overload batches stay large. Counted in items, the rate favoured short inputs for
    being short: of inputs grouped by length, every longer one lowered it, so batches of a
    long-tailed mix stayed small and the long inputs waited for batches of their own
    (counted in tokens: 1.23x the requests/s on `bench_embeddings`' longtail cell, median of
    six runs a side; inputs of one length are sized as before). `reserve` caps the
    predicted batch time so that an interactive request arriving while the batch runs can
    still make its budget (the engine cannot be preempted).
    Items that would miss even alone constrain nothing: they run best-effort. Neither cuts
    the batch below `floor` items, the smallest batch that keeps up with the load
    (admission has refused the interactive requests that cannot be served that way).
    An interactive request is promised what nine batches in ten deliver (`slowdown`), and
    past the efficient batch (`load.efficient`, batcher/load.py) the items that join its
    batch may not make it late on the slow batch one in a hundred (`tail`) either. Below
    that size riders barely lengthen the batch (a GPU batch of one item takes what a full
    one does), and keeping them out would only cost them a batch of their own.
    """
    best_k, best_rate = 1, -1.0
    reserve, floor = load.reserve, load.floor
    slow, tail = load.slowdown, max(load.tail, load.slowdown)
    longest = 0
    finished_in_time: list[tuple[float, int]] = []  # sorted (deadline, tokens) of the items taken so far
    tightest_interactive = INF
    for k, item in enumerate(items, start=1):
        longest = max(longest, item.cost)
        t = cost.predict(k, longest * k)
        if k > floor and reserve is not None and t > reserve and item.priority is not Priority.INTERACTIVE:
            break
        d = item.deadline if item.deadline is not None else INF
        if item.priority is Priority.INTERACTIVE and now + cost.predict(1, item.cost) * slow + s.margin <= d:
            tightest_interactive = min(tightest_interactive, d)
        if k > floor and now + t * slow + s.margin > tightest_interactive:
            break
        if k > max(floor, load.efficient) and now + t * tail + s.margin > tightest_interactive:
            break
        insort(finished_in_time, (d, item.cost))
        good = sum(c for _, c in finished_in_time[bisect_left(finished_in_time, (now + t + s.margin,)) :])
        rate = good / max(t, 1e-9)
        if rate >= best_rate:
            best_k, best_rate = k, rate
    return best_k


def token_cap(items: Sequence[WorkItem], s: BatchingSettings) -> int:
    """How many of `items` (in order) fit in one batch of at most `batch_tokens` padded
    tokens (rows x longest row); the first always does."""
    longest = 0
    for k, item in enumerate(items, start=1):
        longest = max(longest, item.cost)
        if k > 1 and k * longest > s.batch_tokens:
            return k - 1
    return len(items)


def latest_start(items: Sequence[WorkItem], s: BatchingSettings, cost: CostModel) -> float:
    """Last moment this batch can start and still meet its tightest deadline."""
    deadline = min((i.deadline for i in items if i.deadline is not None), default=INF)
    return deadline - batch_cost(cost, items) - s.margin


def max_wait_due(q: RequestQueue, s: BatchingSettings) -> float:
    """When the oldest queued item will have waited max_wait (the queue is not empty)."""
    oldest = q.oldest_arrival
    assert oldest is not None, "an empty queue has no oldest item"
    return oldest + s.max_wait


def fixed(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, load: Load = IDLE) -> Decision:
    """A full batch at once (`max_batch_size` items, or as many as `max_batch_tokens`
    holds), else whatever waits once the oldest has waited `max_wait_ms`."""
    n = len(q)
    if n == 0:
        return WaitUntil(None)
    fits = token_cap(q.peek(s.max_batch_size, now), s)
    if n >= s.max_batch_size or fits < n:
        return Dispatch(fits, DispatchReason.FULL)
    due = max_wait_due(q, s)
    if now >= due:
        return Dispatch(n, DispatchReason.MAX_WAIT)
    return WaitUntil(due)


def deadline(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, load: Load = IDLE) -> Decision:
    base = fixed(q, now, s, cost, load)
    if len(q) == 0:
        return base
    items = q.peek(s.max_batch_size, now)
    items = items[: token_cap(items, s)]
    cap = deadline_cap(items, now, s, cost, load)
    if isinstance(base, Dispatch):
        return Dispatch(min(base.size, cap), base.reason)
    start_by = latest_start(items[:cap], s, cost)
    if now >= start_by:
        return Dispatch(cap, DispatchReason.DEADLINE)
    return WaitUntil(min(max_wait_due(q, s), start_by))  # base waits until max_wait_due


def adaptive(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, load: Load = IDLE) -> Decision:
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
    items = items[: token_cap(items, s)]
    cap = deadline_cap(items, now, s, cost, load)
    if n >= s.max_batch_size or len(items) < n:  # the batch cannot grow: by count or by tokens
        return Dispatch(cap, DispatchReason.FULL)
    rate = load.offered_rate
    target = fill_target(rate, s, cost)
    if n >= target or cap < n:  # big enough, or a deadline/reserve already binds: waiting cannot help
        return Dispatch(cap, DispatchReason.ADAPTIVE)
    start_by = latest_start(items[:cap], s, cost)
    due = max_wait_due(q, s)
    fill_at = now + (target - n) / rate if rate > 0 else INF
    if now >= start_by:
        return Dispatch(cap, DispatchReason.DEADLINE)
    if now >= due:
        return Dispatch(cap, DispatchReason.MAX_WAIT)
    return WaitUntil(min(fill_at, start_by, due))


def fill_target(rate: float, s: BatchingSettings, cost: CostModel) -> int:
    """What arrives during one batch's fixed overhead: the size `adaptive` waits for."""
    return min(s.max_batch_size, max(1, math.ceil(rate * cost.params.fixed)))


POLICIES: dict[str, Policy] = {"fixed": fixed, "deadline": deadline, "adaptive": adaptive}


def get_policy(name: str) -> Policy:
    return POLICIES[name]


# -- generation: when waiting prompts join the running batch, and which ------------------
# The same three rules, applied to admission into a running batch. `cost` is the prefill
# cost model; `load.free_slots` and `load.slots_free_at` say what runs. A Dispatch's size
# counts prompts from the head of the queue, as for one-shot batches.
def prompt_group(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, load: Load) -> list[WorkItem]:
    """The prompts that may join at the next iteration, in queue order: at most the free
    slots and `max_batch_size`; at most `prefill_token_budget` prompt tokens (one prompt
    always fits); a predicted prefill within the reserve while interactive work arrives
    (it delays that work's first token as a one-shot batch would); and, interactive first,
    batch-class prompts only into slots beyond `load.interactive_slots`, unless aged. With
    `load.prefill_first`, interactive prompts at the head of the queue go alone: their
    prefill is the whole iteration, and the prompts behind them join the next."""
    limit = min(load.free_slots, s.max_batch_size)
    batch_room = load.free_slots - load.interactive_slots
    group: list[WorkItem] = []
    tokens = longest = 0
    for item in q.peek(limit, now):
        k = len(group) + 1
        alone = load.prefill_first and group and group[0].priority is Priority.INTERACTIVE
        if alone and item.priority is not Priority.INTERACTIVE:
            break
        longest = max(longest, item.cost)
        if group and tokens + item.cost > s.prefill_token_budget:
            break
        if group and load.reserve is not None and cost.predict(k, k * longest) > load.reserve:
            break
        if item.priority is Priority.BATCH and item.arrival + q.aging > now and k > batch_room:
            break
        group.append(item)
        tokens += item.cost
    return group


def _admit(
    q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, load: Load, target: int
) -> tuple[Decision, list[WorkItem]]:
    """The rules all three share: join at once when nothing runs (waiting can only add
    latency), when the group cannot grow (`full`), or when the oldest has waited
    `max_wait_ms`; and the group to send. `target`: a group this large goes at once.
    Interactive prompts that go first in a prefill of their own (`load.prefill_first`) go
    at once (`lane`)."""
    group = prompt_group(q, now, s, cost, load)
    k = len(group)
    if not k:
        return WaitUntil(None), group  # woken when a slot frees or work arrives
    if load.prefill_first and group[0].priority is Priority.INTERACTIVE:
        return Dispatch(k, DispatchReason.LANE), group  # waiting for company would cost their first token
    if not load.slots_free_at:
        return Dispatch(k, DispatchReason.ADAPTIVE), group
    if k == min(load.free_slots, s.max_batch_size) or k < len(q):
        return Dispatch(k, DispatchReason.FULL), group
    if now >= max_wait_due(q, s):
        return Dispatch(k, DispatchReason.MAX_WAIT), group
    if k >= target:
        return Dispatch(k, DispatchReason.ADAPTIVE), group
    return WaitUntil(max_wait_due(q, s)), group


def _by_first_token_deadline(
    decision: Decision, group: list[WorkItem], now: float, s: BatchingSettings, cost: CostModel, load: Load
) -> Decision:
    """Join early (`deadline`) when the group's prefill, allowing for the slowdown, would
    otherwise miss the tightest first-token deadline in it. While sequences run, a prompt
    can join only at an iteration's end, and its prefill shares the next iteration with
    their decode step (`load.chunk_step`): waiting for company costs a whole iteration, and
    the first token comes after the decode step too."""
    if not isinstance(decision, WaitUntil) or not group:
        return decision
    tightest = min((i.deadline for i in group if i.deadline is not None), default=INF)
    step = load.chunk_step
    # The last boundary it may join at: one iteration before it would have to start.
    join_by = tightest - batch_cost(cost, group) * load.slowdown - 2 * step - s.margin
    if now >= join_by:
        return Dispatch(len(group), DispatchReason.DEADLINE)
    return WaitUntil(join_by if decision.t is None else min(decision.t, join_by))


def admit_fixed(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, load: Load) -> Decision:
    """Join when `max_batch_size` prompts wait or the oldest has waited `max_wait_ms`."""
    return _admit(q, now, s, cost, load, target=s.max_batch_size)[0]


def admit_deadline(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, load: Load) -> Decision:
    """`admit_fixed`, plus join early for the tightest first-token deadline."""
    decision, group = _admit(q, now, s, cost, load, target=s.max_batch_size)
    return _by_first_token_deadline(decision, group, now, s, cost, load)


def admit_adaptive(q: RequestQueue, now: float, s: BatchingSettings, cost: CostModel, load: Load) -> Decision:
    """Wait for company only while it pays: a prefill group costs a + b*tokens, so as for
    one-shot batches the group worth waiting for is what arrives during one prefill's fixed
    overhead; at low load a prompt joins at the next iteration."""
    rate = load.offered_rate
    target = fill_target(rate, s, cost)
    decision, group = _admit(q, now, s, cost, load, target=target)
    decision = _by_first_token_deadline(decision, group, now, s, cost, load)
    if isinstance(decision, WaitUntil) and group and rate > 0:
        fill_at = now + (target - len(group)) / rate
        decision = WaitUntil(fill_at if decision.t is None else min(decision.t, fill_at))
    return decision


GENERATION_POLICIES: dict[str, Policy] = {"fixed": admit_fixed, "deadline": admit_deadline, "adaptive": admit_adaptive}
