"""Load estimation: the one home of what a batcher knows about its load.

`LoadTracker` records what was offered (arrivals, admitted or refused, per class), the
interactive budgets seen lately and the typical cost of an item; `snapshot` turns that,
the queue, the settings and the cost model into one frozen `Load` per decision, which the
policies and admission read and never change.

Capacity comes only from the cost model, which is fitted on the time batches actually ran.
Never from items completed per wall-clock second: after a quiet spell that rate measures how
little work arrived, not how fast the engine can go (a burst after idle was refused with
predictions of 20-30 s while the engine served it in under a second).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .cost import CostModel, PackedChunkCost
from .queue import RequestQueue
from .settings import BatchingSettings
from .types import Priority

RATE_HORIZON = 1.0  # seconds of arrivals used to estimate an arrival rate
# Work with a longer budget is background work (batch jobs): it fills the capacity urgent
# work leaves and does not size batches; it does once its deadline comes within RATE_HORIZON.
URGENT_BUDGET = 60.0
RESERVE_HORIZON = 2.0  # seconds an interactive arrival keeps shaping batches
# The busiest the engine may be with reserve-sized batches. 1.0: the smallest batch that
# keeps up (bench_latency: 0.9 still cost interactive attainment at 80% load, 95.5%).
KEEP_UP_UTILISATION = 1.0
# Seconds of backlogged batches that measure how fast the queue drains under the policies'
# own limits (the reserve, interactive deadlines); fewer than DRAIN_MIN_BATCHES: unknown.
DRAIN_HORIZON, DRAIN_MIN_BATCHES = 2.0, 3
# The reserve cuts no batch below the size whose items' work is this share of its fixed cost.
EFFICIENT_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class Load:
    """What one decision knows about the load. The defaults describe an idle engine and no
    traffic, which is what a policy called without a snapshot assumes."""

    busy_until: float = 0.0  # when the engine is predicted free of the work already dispatched
    offered_rate: float = 0.0  # urgent items offered per second lately, admitted or refused
    interactive_rate: float = 0.0  # interactive items offered per second lately
    typical_tokens: int = 1
    # The fewest items the reserve or an interactive deadline may cut a batch to: the
    # smallest batch that keeps up with the load that sizes batches (see LoadTracker.floor).
    floor: int = 1
    # The longest predicted batch time while interactive work arrives; None: none lately.
    reserve: float | None = None
    # What promises to interactive work multiply predictions by (CostModel.slowdown).
    slowdown: float = 1.0
    # What batches an interactive request waits for or shares are sized against (CostModel.tail).
    tail: float = 1.0
    # Neither the reserve nor the tail cuts a batch below this many items (efficient_batch).
    efficient: int = 1
    # Items per second of engine time, measured on recent batches that left work queued
    # behind them; None: no such batches lately (then the cost model alone predicts).
    drain_rate: float | None = None
    # Engine threads draining the queue at once: 2 while the lane's thread runs work of any
    # class beside the batch in flight (MicroBatcher, LANE_QUIET), else 1.
    workers: int = 1
    # Generation: slots free now, slots batch-class prompts must leave free for interactive
    # ones, when each running sequence's slot is predicted to free (sorted), and how long a
    # typical sequence holds a slot. `prefill_first`: interactive prompts at the head of the
    # queue join now in a prefill of their own, without the decode step (the lane's rule).
    free_slots: int = 0
    interactive_slots: int = 0
    slots_free_at: tuple[float, ...] = ()
    sequence_seconds: float = 0.0
    prefill_first: bool = False
    # Token-budgeted steps: the prompt tokens one iteration prefills beside its decode step
    # (None: whole prompts), and that decode step, which each further chunk of a longer
    # prompt waits for.
    prefill_chunk: int | None = None
    chunk_step: float = 0.0
    chunks_packed: bool = False  # further chunks ride in the decode step's forward: no forward of their own
    # What chunks add to such a packed step, measured; None (or not measured yet): the
    # prefill model's price less the fixed cost of a forward of its own stands in.
    packed_chunk: PackedChunkCost | None = None
    # Prompt tokens the engine has taken and not yet prefilled when the iteration in flight
    # ends: the chunks of the next iterations go to them first.
    prefill_backlog: int = 0
    # The prompts still prefilling, as (priority, tenant, their share of `prefill_backlog`):
    # whose chunks go before a newcomer's (`admission.prefill_ahead`).
    prefilling: tuple[tuple[int, str, int], ...] = ()


IDLE = Load()


def efficient_batch(s: BatchingSettings, cost: CostModel, tokens: int) -> tuple[int, float]:
    """(items, predicted seconds) of the smallest batch whose items' own work is a tenth of
    its fixed cost: cutting a batch below it saves less than a tenth of its time, for a
    large loss of throughput. On a GPU, where one item costs about what 32 do, that is
    `max_batch_size`: the reserve never cuts there (it could not shorten the wait). On
    this host's CPU (9-22 ms a batch, 2-4.5 ms an item) it is one or two items."""
    p = cost.params
    slope = p.per_item + p.per_token * tokens
    n = s.max_batch_size if slope <= 0 else min(s.max_batch_size, max(1, math.ceil(EFFICIENT_SHARE * p.fixed / slope)))
    return n, cost.predict(n, n * tokens)


class LoadTracker:
    """Arrivals and interactive budgets over sliding windows, and a moving typical cost."""

    def __init__(self) -> None:
        self._arrivals: dict[Priority, deque[float]] = {p: deque() for p in Priority}
        self._interactive_arrivals: deque[float] = deque()
        # (arrival, budget), budgets strictly increasing: the window's tightest budget is the
        # first, kept in O(1) per arrival (a scan of the window cost O(arrivals/s) per request).
        self._tightest: deque[tuple[float, float]] = deque()
        self._typical_cost = 1.0
        self.last_interactive = -math.inf  # when interactive work was last offered, with a budget or not
        self._drained: deque[tuple[float, int, float]] = deque()  # (finished, items, seconds)
        # Running totals of the window: a sum over it per admission cost O(batches per second).
        self._drained_items, self._drained_seconds = 0, 0.0

    # -- recording ----------------------------------------------------------------
    def offered(self, now: float, n: int, budget: float | None, priority: Priority) -> None:
        """`n` items of one request were offered (admitted, or refused for good)."""
        if priority is Priority.INTERACTIVE:
            self.last_interactive = now
        if budget is None:
            return
        if budget <= URGENT_BUDGET:
            self._arrivals[priority].extend([now] * n)
        if priority is Priority.INTERACTIVE:
            self._interactive_arrivals.append(now)
            t = self._tightest
            while t and t[-1][1] >= budget:
                t.pop()  # a later arrival with a budget as tight outlives it in the window
            t.append((now, budget))

    def admitted(self, costs: list[int]) -> None:
        for c in costs:
            self._typical_cost += 0.05 * (c - self._typical_cost)

    def served(self, now: float, n: int, seconds: float, backlogged: bool) -> None:
        """A batch of `n` items ran for `seconds`. Backlogged (work was still queued when it
        left): its size was the policies' choice, not the arrivals', so it measures how
        fast the queue drains under their limits. Batches after a quiet spell never count."""
        if backlogged and seconds > 0:
            self._drained.append((now, n, seconds))
            self._drained_items += n
            self._drained_seconds += seconds

    def forget_drain(self) -> None:
        """Settings changed: batches formed under the old ones say nothing of the new."""
        self._drained.clear()
        self._drained_items, self._drained_seconds = 0, 0.0

    # -- reading --------------------------------------------------------------------
    @property
    def typical_tokens(self) -> int:
        return max(1, round(self._typical_cost))

    def offered_rate(self, now: float, priority: Priority | None = None) -> float:
        """Urgent items (budget up to URGENT_BUDGET) offered per second over RATE_HORIZON."""
        total = 0
        for p, q in self._arrivals.items():
            while q and q[0] < now - RATE_HORIZON:
                q.popleft()
            if priority is None or p is priority:
                total += len(q)
        return total / RATE_HORIZON

    def _recent_interactive(self, now: float) -> int:
        """Interactive arrivals within RESERVE_HORIZON; drops older ones from both windows."""
        q, t, since = self._interactive_arrivals, self._tightest, now - RESERVE_HORIZON
        while q and q[0] < since:
            q.popleft()
        while t and t[0][0] < since:
            t.popleft()
        return len(q)

    def interactive_rate(self, now: float) -> float:
        return self._recent_interactive(now) / RESERVE_HORIZON

    def drain_rate(self, now: float) -> float | None:
        """Items per second of engine time over recent backlogged batches."""
        q = self._drained
        while q and q[0][0] < now - DRAIN_HORIZON:
            _, n, t = q.popleft()
            self._drained_items -= n
            self._drained_seconds -= t
        if not q:
            self._drained_seconds = 0.0  # no rounding left over from the subtractions
        if len(q) < DRAIN_MIN_BATCHES:
            return None
        return self._drained_items / self._drained_seconds

    def floor(self, now: float, queue: RequestQueue, s: BatchingSettings, cost: CostModel) -> tuple[int, float]:
        """(items, predicted seconds) of the smallest batch whose throughput covers the load
        that sizes batches, at KEEP_UP_UTILISATION (max_batch_size when none does).

        That load is the offered arrival rate plus draining the queued work due within
        RATE_HORIZON. Offered, not admitted: under overload admission refuses what small
        batches cannot carry, and sizing by what was admitted would lock in small batches.
        With `interactive_first` only interactive work counts: batch-class work absorbs the
        shortfall and never makes batches too long for an interactive budget. Without it
        (the default), every urgent item counts (total throughput first).
        """
        cls = Priority.INTERACTIVE if s.interactive_first else None
        rate = self.offered_rate(now, cls) + queue.due_within(now + RATE_HORIZON, cls) / RATE_HORIZON
        tokens = self.typical_tokens
        cap = s.max_batch_size

        def keeps_up(n: int) -> bool:
            return n >= rate * cost.predict(n, n * tokens) / KEEP_UP_UTILISATION

        # Batch time is linear in n (a + b*n): n >= r*(a + b*n)/U solves in closed form, and
        # a step either side settles the rounding. (A scan of every size ran per admission.)
        p = cost.params
        a, b = rate * p.fixed / KEEP_UP_UTILISATION, rate * (p.per_item + p.per_token * tokens) / KEEP_UP_UTILISATION
        n = min(cap, max(1, math.ceil(a / (1.0 - b)))) if b < 1.0 else cap
        while n > 1 and keeps_up(n - 1):
            n -= 1
        while n < cap and not keeps_up(n):
            n += 1
        return n, cost.predict(n, n * tokens)

    def reserve(self, now: float, s: BatchingSettings, cost: CostModel, keep_up: float) -> float | None:
        """The longest batch the policies may form while interactive requests arrive.

        One arriving just as a batch starts waits for it, then runs in a batch of its own,
        and both must fit in the tightest interactive budget seen lately, each prediction
        keeping the margin and allowing for the slow batch one in a hundred (`tail`). Its
        own batch takes at least one typical item alone, and at least the keep-up batch.
        The reserve never cuts below the keep-up batch, nor below the efficient batch
        (`efficient_batch`). None: no interactive traffic lately.
        """
        if not self._recent_interactive(now):
            return None
        tokens = self.typical_tokens
        alone = cost.predict(1, tokens)
        usable = (self._tightest[0][1] - 2.0 * s.margin) / cost.tail
        protect = max(usable - max(alone, keep_up), 0.0)
        return max(protect, keep_up, efficient_batch(s, cost, tokens)[1])

    def snapshot(
        self,
        now: float,
        queue: RequestQueue,
        s: BatchingSettings,
        cost: CostModel,
        busy_until: float,
        *,
        shape: bool = True,
        reserve: bool = True,
    ) -> Load:
        """One frozen view for one decision. `shape=False` (generation) leaves out the floor;
        its reserve then caps a prefill group, not a whole batch. `reserve=False`: no
        interactive request waits for the batch in flight (the interactive lane), so none."""
        floor, keep_up = self.floor(now, queue, s, cost) if shape else (1, 0.0)
        return Load(
            busy_until=busy_until,
            offered_rate=self.offered_rate(now),
            interactive_rate=self.interactive_rate(now),
            typical_tokens=self.typical_tokens,
            floor=floor,
            reserve=self.reserve(now, s, cost, keep_up) if reserve else None,
            slowdown=cost.slowdown,
            tail=cost.tail,
            efficient=efficient_batch(s, cost, self.typical_tokens)[0],
            drain_rate=self.drain_rate(now),
        )
