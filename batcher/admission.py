"""Admission control: say no at once rather than queue work that cannot be served.

`check` is the first half of a check-then-act pair: it raises if the item must be refused
and otherwise returns whether it is admitted best-effort. A predictor says when the new item
would be done (`predicted_completion` for one-shot batches: the running batch, the work
ordered ahead of it, then its own batch; `predicted_first_token` for generation: a free
slot, then its prefill), from the cost model and the load snapshot only, and `check`
compares that with the item's deadline.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from .cost import Calibration, CostModel
from .errors import DeadlineInfeasible, QueueFull
from .load import Load
from .queue import INF, RequestQueue
from .settings import BatchingSettings
from .types import Priority, WorkItem

Predictor = Callable[[RequestQueue, WorkItem, float, BatchingSettings, CostModel, Load, int], float]


def items_ahead(q: RequestQueue, item: WorkItem) -> int:
    """Queued items that EDF-within-class ordering would serve before `item`."""
    ahead = sum(q.count(p) for p in Priority if p < item.priority)
    return ahead + q.count_before(item)


def uncached(costs: list[int], cached: list[int]) -> tuple[list[int], list[int]]:
    """A prompt is priced by the tokens its prefill will compute: admission and the
    time-to-first-token prediction then see a cached prefix as the cheap prompt it is.
    The prices, and what each subtracted (at most its cost less one: a price is never
    under 1), for `reprice` to start from."""
    if len(costs) != len(cached):
        return costs, [0] * len(costs)
    taken = [min(k, c - 1) if c > 1 else 0 for c, k in zip(costs, cached, strict=True)]
    return [c - t for c, t in zip(costs, taken, strict=True)], taken


def reprice(items: Iterable[WorkItem], cached_prefix: Callable[[Sequence[int]], int]) -> None:
    """Queued prompts priced again by what the engine's prefix cache holds now: a prompt
    priced when its prefix was not cached yet (32 conversations arriving together with one
    system prompt: the first computes it, the others queue priced in full) joins as the
    cheap prompt it has become, in groups of the cheap, instead of a few at a time at its
    first price. Each starts from its price before the cache (`cost + cached`), so prices
    never drift however the cache fills and empties. `cached_prefix` is the engine's, read
    on the event loop (an estimate)."""
    for item in items:
        full = item.cost + item.cached
        taken = min(cached_prefix(item.payload.prompt_ids), full - 1) if full > 1 else 0
        item.cost, item.cached = full - taken, taken


def batch_size_under(reserve: float | None, s: BatchingSettings, cost: CostModel, tokens: int) -> int:
    """The batch size the policies will form: max_batch_size, or less under the reserve."""
    size = s.max_batch_size
    if reserve is not None and s.policy != "fixed":
        while size > 1 and cost.predict(size, size * tokens) > reserve:
            size -= 1
    return size


def _shaped(item: WorkItem, s: BatchingSettings) -> bool:
    """Interactive work under a deadline-aware policy is promised what the policies promise:
    predictions allow for the slowdown, and its batch is not cut below the floor."""
    return item.priority is Priority.INTERACTIVE and s.policy != "fixed"


def rows_within(s: BatchingSettings, tokens: int) -> int:
    """The rows `max_batch_tokens` lets a one-shot batch of inputs this long hold (one input
    always fits)."""
    return max(1, s.batch_tokens // max(tokens, 1))


def _length_ahead(q: RequestQueue, item: WorkItem, queued_ahead: int, siblings: int) -> int:
    """The typical length of the work ahead of `item`: the queue's mean for the classes
    that go first (their own lengths, not the new item's: a short request behind 40
    passages waits for the passages' batches), the item's own for its siblings."""
    tokens = max(item.cost, 1)
    mean = q.mean_cost(item.priority) if queued_ahead else None
    if mean is None:  # nothing queued ahead: its siblings are of its own length
        return tokens
    return max(math.ceil((mean * queued_ahead + tokens * siblings) / (queued_ahead + siblings)), 1)


def _batches(
    ahead: int, size: int, tokens: int, length: int, s: BatchingSettings, cost: CostModel
) -> tuple[int, float, int, int, int]:
    """The work ahead in batches as the policies form them: (full batches ahead, the cost of
    one, its rows, the rows left over that join the item's own batch, its rows cap). Items
    ahead run in batches of their typical `length`, each cut to `max_batch_tokens`."""
    size_ahead = min(size, rows_within(s, length))
    full, rest = divmod(ahead, size_ahead)
    per_batch = cost.predict(size_ahead, size_ahead * length)
    own_size = min(size, rows_within(s, max(tokens, length) if rest else tokens))
    if rest + 1 > own_size:  # the leftover fills a batch of its own first
        full, rest = full + 1, 0
    return full, per_batch, size_ahead, rest, own_size


def predicted_completion(
    q: RequestQueue, item: WorkItem, now: float, s: BatchingSettings, cost: CostModel, load: Load, siblings: int = 0
) -> float:
    """One-shot batches: the batch running now, then the items ahead in batches of the size
    the policies will form (of the lengths queued ahead, within `max_batch_tokens`), then
    the item's own batch."""
    queued_ahead = items_ahead(q, item)
    ahead = queued_ahead + siblings
    tokens = max(item.cost, 1)
    length = _length_ahead(q, item, queued_ahead, siblings)
    shaped = _shaped(item, s)
    size = s.max_batch_size if shaped else batch_size_under(load.reserve, s, cost, tokens)
    full, per_batch, size_ahead, rest, own_size = _batches(ahead, size, tokens, length, s, cost)
    rows = rest + 1  # its own batch: what is left of the work ahead, and the item
    # Every promise allows for the slowdown under a deadline-aware policy: batch-class work
    # admitted to the last millisecond of its budget on the mean drain was served late.
    slow = load.slowdown if s.policy != "fixed" else 1.0
    if shaped:
        # Its batch is filled from the work queued behind it up to the floor: interactive
        # deadlines do not cut batches below what keeps up with the load.
        rows = max(rows, min(load.floor, own_size, len(q) + siblings + 1 - (ahead - rest)))
    own = cost.predict(rows, rows * (max(tokens, length) if rest else tokens))
    wait = full * per_batch + own
    if load.workers > 1:  # the batches ahead of its own drain on that many threads; its own runs on one
        wait = (wait - own) / load.workers + own
    interactive = item.priority is Priority.INTERACTIVE
    if not interactive and load.interactive_rate > 0:
        # Interactive arrivals keep going ahead of batch-class work: it only gets the
        # capacity they leave, a share of 1 - rho (priority queueing).
        rho = load.interactive_rate * per_batch / size_ahead
        wait = wait / (1.0 - rho) if rho < 0.95 else INF
    if q.tenants is not None and q.tenants.enabled and (queued := wait - own) > 0:
        wait = _with_cut_ins(q, item, now, queued, per_batch / (size_ahead * length)) + own
    if load.drain_rate is not None and not shaped:
        # Under sustained load the batches the policies really form (cut by the reserve and
        # by interactive deadlines) may be smaller than the cost model's: the measured drain
        # rate, less what interactive arrivals take ahead, bounds how fast this item's turn
        # comes. Never more optimistic than the cost model. Not for interactive work under a
        # deadline-aware policy: its own batch is cut for it, whatever the average drain.
        share = load.drain_rate * load.workers - (0.0 if interactive else load.interactive_rate)
        wait = max(wait, (ahead + 1) / share if share > 0 else INF)
    return now + (max(load.busy_until - now, 0.0) + wait) * slow


def predicted_in_lane(
    q: RequestQueue, item: WorkItem, now: float, s: BatchingSettings, cost: CostModel, free_at: float, siblings: int = 0
) -> float:
    """Interactive work in the lane (MicroBatcher): the lane batch running now, then the
    interactive items ahead of it in lane batches of max_batch_size (of their own lengths,
    within `max_batch_tokens`), then its own batch, each allowing for the lane's slowdown
    (`cost` is the lane's own fit: its batches share the cores with the batch beside them)."""
    queued_ahead = q.count_before(item)
    ahead = queued_ahead + siblings
    tokens = max(item.cost, 1)
    length = _length_ahead(q, item, queued_ahead, siblings)
    full, per_batch, _, rest, _ = _batches(ahead, s.max_batch_size, tokens, length, s, cost)
    rows = rest + 1
    wait = full * per_batch + cost.predict(rows, rows * (max(tokens, length) if rest else tokens))
    return now + (max(free_at - now, 0.0) + wait) * cost.slowdown


def predicted_first_token(
    q: RequestQueue, item: WorkItem, now: float, s: BatchingSettings, cost: CostModel, load: Load, siblings: int = 0
) -> float:
    """Generation: when the item's first token comes. It needs a slot: a free one at the
    next iteration boundary, else the one a running sequence frees at its token limit (an
    upper bound: EOS or a stop string ends it sooner). The prompts ahead take slots first,
    each holding it for a typical sequence's time; batch-class prompts also leave
    `interactive_slots` free. Then its prefill, in a group of at most max_batch_size; with
    token-budgeted steps a group over `prefill_chunk` tokens takes a chunk an iteration, each
    further chunk behind a decode step."""
    ahead = items_ahead(q, item) + siblings
    if item.priority is not Priority.INTERACTIVE:
        ahead += load.interactive_slots
    slots = [load.busy_until] * load.free_slots + list(load.slots_free_at)
    if not slots:
        return INF
    heapq.heapify(slots)
    for _ in range(ahead):
        heapq.heappush(slots, heapq.heappop(slots) + load.sequence_seconds)
    group = min(ahead + 1, s.max_batch_size)
    tokens = max(item.cost, 1)
    prefill = cost.predict(group, group * tokens)
    # Chunks go to the prompts ahead of it in the chunk order: its group's tokens come after theirs.
    chunked = prefill_ahead(q, item, load) + group * tokens
    further = 0
    if load.prefill_chunk is not None and chunked > load.prefill_chunk:
        further = math.ceil(chunked / load.prefill_chunk) - 1
    if load.chunk_step and not (load.prefill_first and item.priority is Priority.INTERACTIVE):
        # Its first chunk is computed beside the running rows' decode step (in its forward,
        # where steps are packed: what chunks add to such a step, measured, its fixed part
        # once an iteration; no fixed cost of a prefill forward of its own), and its first
        # token comes when that whole iteration ends.
        if load.chunks_packed:
            added = load.packed_chunk.predict(group * tokens, further + 1) if load.packed_chunk else None
            prefill = (prefill - cost.params.fixed if added is None else added) + load.chunk_step
        else:
            prefill += load.chunk_step
    prefill += further * (load.chunk_step + (0.0 if load.chunks_packed else cost.predict(1, 0)))
    return max(slots[0], now) + prefill


def prefill_ahead(q: RequestQueue, item: WorkItem, load: Load) -> int:
    """Prompt tokens still to prefill whose chunks go before the item's (the scheduler's
    chunk order, `GenerationScheduler.chunk_order`): those of the classes ahead of its own,
    and in its class those of its own tenant and, with fair shares, of tenants whose counters
    are not above its tenant's (without: all of its class)."""
    if not load.prefilling:
        return load.prefill_backlog
    tenants = q.tenants if q.tenants is not None and q.tenants.enabled else None
    mine = tenants.arriving_counter(item.tenant) if tenants is not None else 0.0

    def before(priority: int, tenant: str) -> bool:
        if priority != item.priority:
            return priority < item.priority
        return tenants is None or tenant == item.tenant or tenants.counter(tenant) <= mine

    return sum(tokens for priority, tenant, tokens in load.prefilling if before(priority, tenant))


def _with_cut_ins(q: RequestQueue, item: WorkItem, now: float, queued: float, per_token: float) -> float:
    """`queued` seconds of work ahead of `item`, and what arrivals of tenants below its
    turn in the fair order will put ahead of it meanwhile (`Tenants.cut_ins`: each at its
    recent rate, no more than its counter lets go first), at `per_token` seconds a token."""
    assert q.tenants is not None
    cuts = [(rate, room) for rate, room in q.tenants.cut_ins(item.tenant, q.fair_turn(item), now) if rate > 0]
    if not cuts:
        return queued
    rho = per_token * sum(rate for rate, _ in cuts)
    horizon = queued / (1.0 - rho) if rho < 1.0 else INF
    return queued + per_token * sum(min(rate * horizon, room) for rate, room in cuts)


def calibrated(predict: Predictor, calibrations: Mapping[Priority, Calibration]) -> Predictor:
    """`predict`, its wait stretched by the `factor` of the item's class; the item keeps the
    raw wait (`predicted_wait`), which its observed wait is compared with (never the
    stretched one: that would feed the factor on itself). By class: interactive prompts go
    first, batch-class predictions add the slots kept for them, and their errors differ."""

    def stretched(
        q: RequestQueue, item: WorkItem, now: float, s: BatchingSettings, cost: CostModel, load: Load, siblings: int = 0
    ) -> float:
        done = predict(q, item, now, s, cost, load, siblings)
        if done == INF:
            return done
        item.predicted_wait = max(done - now, 0.0)
        return now + item.predicted_wait * calibrations[item.priority].factor_for(item.predicted_wait)

    return stretched


def serves_infeasible(item: WorkItem, s: BatchingSettings) -> bool:
    """Whether an item judged infeasible is served best-effort rather than refused: its
    request's own `on_infeasible`, else the model's."""
    return (item.on_infeasible or s.on_infeasible) == "serve"


def check(
    q: RequestQueue,
    item: WorkItem,
    now: float,
    s: BatchingSettings,
    cost: CostModel,
    load: Load,
    siblings: int = 0,
    predict: Predictor = predicted_completion,
    promised: float = INF,
) -> bool:
    """Raise QueueFull / DeadlineInfeasible, or return True when admitted best-effort.

    `siblings` counts the other items of the same request, admitted all or none: they are
    queued ahead of the last one, which is the one checked. `promised`: the earliest
    deadline of queued work the item would share its turn with or delay (a prompt joins
    the same prefill iteration as those queued before it, and that iteration's end is
    every one's first token): the item is admitted only if that still holds too.
    """
    if len(q) + siblings >= s.max_queue:
        # Time for the queue to drain by one batch is an honest lower bound to retry after.
        wait = max(load.busy_until - now, 0.0) + cost.predict(s.max_batch_size, s.max_batch_size * max(item.cost, 1))
        raise QueueFull(f"queue is full ({s.max_queue} items waiting)", retry_after=max(1, math.ceil(wait)))
    if item.deadline is None:
        return False
    done = predict(q, item, now, s, cost, load, siblings)
    if done + s.margin <= min(item.deadline, promised):
        return False
    if serves_infeasible(item, s):
        return True
    budget_ms = (item.deadline - item.arrival) * 1000.0
    eta = "not in the foreseeable future" if done == INF else f"in {(done - now) * 1000.0:.0f} ms"
    if done + s.margin <= item.deadline:
        raise DeadlineInfeasible(
            f"admitting this request now would make a queued one miss its budget ({eta} to the first token"
            f" of both, with {len(q)} items queued)",
            retry_after=1,
        )
    raise DeadlineInfeasible(
        f"latency budget of {budget_ms:.0f} ms cannot be met: predicted completion {eta} with {len(q)} items queued",
        retry_after=max(1, math.ceil(min(done - now, 60.0))),
    )
