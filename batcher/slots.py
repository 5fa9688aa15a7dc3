"""The slots of generation: how many sequences may run at once, how many are free, how
many batch-class prompts leave free for interactive ones, when each running sequence's slot
frees, and how long tokens take. These are what the generation side of the load snapshot
(`Load.free_slots`, `interactive_slots`, `slots_free_at`, `sequence_seconds`,
`prefill_first`) says, and what the generation policies and admission read.

Settings and cost models are passed in on each call: both change live (a PATCH, a refit).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from .cost import CostModel
from .load import Load
from .protocols import SteppingEngine
from .queue import RequestQueue
from .running import RunningSet, max_tokens
from .settings import BatchingSettings
from .types import Priority, WorkItem

# The 99th percentile of a Poisson count with mean m is about m + 2.33 sqrt(m).
POISSON_Z99 = 2.33
SLOT_RATE_MEMORY = 30.0  # seconds over which the interactive slots' rate fades (_slot_rate)
# While interactive prompts arrive, batch-class prompts join only while the decode step fits
# this share of the reserve (LoadTracker.reserve: the tightest interactive budget less the
# prompt's own prefill and margins); the rest is the prefill group's or chunk's beside it.
# An interactive prompt that arrives just as a step starts waits for it: on the real model 128
# batch-class rows made a step as long as a 500 ms budget, and past capacity 41-50% of the
# interactive first tokens came late.
DECODE_SHARE = 0.75
LENGTHS_SEEN = 8  # finished sequences before their lengths replace the token limits in predictions


class Lengths:
    """How sequences really end: the share that finish before their token limit (EOS or a
    stop string), and where those end (a moving mean and spread of their tokens). A real
    instruct model ends most answers long before `max_tokens` (an unset one is the whole
    context left): slots predicted to free only at the token limit refused work that could
    be served on time. Sequences that run to their limit teach nothing about early ends,
    and while most do, the limits stand."""

    def __init__(self, weight: float = 0.05) -> None:
        self.weight, self.seen, self.early_seen = weight, 0, 0
        self.early_share = 0.0
        self.mean, self.var = 0.0, 0.0

    def add(self, tokens: int, limit: int) -> None:
        self.seen += 1
        early = tokens < limit
        self.early_share += max(self.weight, 1.0 / self.seen) * (early - self.early_share)
        if not early:
            return
        self.early_seen += 1
        w = max(self.weight, 1.0 / self.early_seen)  # the plain mean at first, then moving
        delta = tokens - self.mean
        self.mean += w * delta
        self.var = (1.0 - w) * (self.var + w * delta * delta)

    @property
    def known(self) -> bool:
        """Enough sequences seen, most of them ending before their limit."""
        return self.seen >= LENGTHS_SEEN and self.early_seen >= LENGTHS_SEEN // 2 and self.early_share >= 0.5

    def steps_left(self, limit: int, tokens: int) -> int:
        """Decode steps until a sequence with `tokens` generated and at most `limit` frees its
        slot: the limit's, or where sequences end early (the mean plus one spread, about the
        84th percentile); past that, one more spread. Never beyond the limit."""
        left = max(1, limit - tokens)
        if not self.known:
            return left
        spread = math.sqrt(self.var)
        end = self.mean + spread
        # Past where answers end, at least a quarter of a typical answer more: with answers
        # all of one length the spread is 0, and "the next step" every step over-promises.
        expected = end - tokens if tokens < end else max(spread, 0.25 * self.mean)
        return min(left, max(1, math.ceil(expected)))

    def typical(self, limit: float) -> float:
        """Steps a new sequence holds its slot, `limit` the mean of token limits: the early
        ones' mean and the limit, weighed by how many end early."""
        if not self.known:
            return limit
        return self.early_share * min(limit, self.mean) + (1.0 - self.early_share) * limit


class Slots:
    def __init__(self, engine: SteppingEngine, running: RunningSet) -> None:
        self._engine = engine
        self._running = running
        self._targeted: list[WorkItem] = []  # unfinished items with an inter-token target (few)
        self._typical_steps = 16.0  # moving average of max_tokens, for how long a slot is held
        self._interactive_steps = 16.0  # the same over interactive requests (the slots kept for them)
        self.lengths = Lengths()  # what sequences really generate: slots free sooner than their limits
        self.skipped_decode = False  # the last iteration was interactive prompts' prefill alone
        # Seconds between two decode steps, measured (a moving average): what a running
        # sequence waits per token, prefill groups and prefill-only iterations included.
        self._token_interval = 0.0
        self._slow_rate, self._slot_rate_at = 0.0, 0.0  # see _slot_rate
        self._last_decode_at: float | None = None

    def submitted(self, items: list[WorkItem]) -> None:
        """A request's items were queued: their token limits and inter-token target."""
        for item in items:
            self._typical_steps += 0.05 * (max_tokens(item) - self._typical_steps)
            if item.priority is Priority.INTERACTIVE:
                self._interactive_steps += 0.05 * (max_tokens(item) - self._interactive_steps)
        if items[0].itl_target is not None:
            self._targeted.extend(items)

    def expected_output(self, payload: Any) -> float:
        """Tokens a prompt is expected to generate: its limit, or where answers end
        (`Lengths.typical`), for the fair order's price."""
        return self.lengths.typical(int(getattr(payload.params, "max_tokens", 1) or 1))

    def finished(self, tokens: int, limit: int) -> None:
        """A sequence of token limit `limit` finished having generated `tokens`."""
        self.lengths.add(tokens, limit)

    def engine_slots(self, s: BatchingSettings) -> int:
        """max_running, bounded by the engine's own slot count (it bounds a live PATCH)."""
        return min(s.max_running, getattr(self._engine, "max_running", s.max_running))

    def kv_usage(self, s: BatchingSettings) -> float:
        """The share of the KV cache the engine may use that is in use, 0 to 1: the engine's
        own (`kv_usage`: its running rows' share of its KV budget) where it says it, else
        the running rows' cache tokens over one full context (`max_context`) for each
        sequence that may run (`engine_slots`). 0 for an engine that says neither."""
        if (usage := getattr(self._engine, "kv_usage", None)) is not None:
            return min(1.0, usage)
        context = getattr(self._engine, "max_context", None)
        if not context:
            return 0.0
        return min(1.0, self._engine.kv_tokens / (self.engine_slots(s) * context))

    def limit(self, s: BatchingSettings, decode: CostModel) -> int:
        """Most sequences that may run at once: the engine's slots (`engine_slots`), and what
        keeps a decode step under max_itl_ms and under the inter-token target of every
        queued or running sequence that has one."""
        cap = self.engine_slots(s)
        target = self.itl_target(s)
        return cap if target is None else self.rows_within(target, cap, decode)

    def itl_target(self, s: BatchingSettings) -> float | None:
        """The tightest inter-token target in seconds: max_itl_ms and every queued or running
        sequence's own (queued ones too: the batch shrinks to what their targets allow, so
        they can join, and a group admitted with one of them respects it from its first
        step). None: no target."""
        if self._targeted:
            self._targeted = [i for i in self._targeted if not i.finished]
        targets = [i.itl_target for i in self._targeted if i.itl_target is not None]
        if s.max_itl_ms is not None:
            targets.append(s.max_itl_ms / 1000.0)
        return min(targets, default=None)

    def step_ceiling(self, s: BatchingSettings, reserve: float | None) -> float | None:
        """The longest a decode step may take with optional work (an engine's drafts to
        verify): within the tightest inter-token target, and while interactive prompts
        arrive, within the share of the reserve a decode step may take (`DECODE_SHARE`: an
        interactive prompt may arrive just as the step starts and waits it out). None: no
        bound."""
        bounds = [b for b in (self.itl_target(s), None if reserve is None else DECODE_SHARE * reserve) if b is not None]
        return min(bounds, default=None)

    @staticmethod
    def rows_within(seconds: float, slots: int, decode: CostModel) -> int:
        """The most rows (at least one, at most `slots`) whose decode step is predicted
        within `seconds`."""
        rows = slots
        while rows > 1 and decode.predict(rows) > seconds:
            rows -= 1
        return rows

    def free(self, s: BatchingSettings, decode: CostModel) -> int:
        """Slots free now (none in static mode while a group runs)."""
        if s.mode == "static" and self._running:
            return 0
        return max(0, self.limit(s, decode) - len(self._running))

    def load(
        self, base: Load, now: float, s: BatchingSettings, queue: RequestQueue, decode: CostModel, **more: Any
    ) -> Load:
        """The tracker's snapshot `base` plus what runs: free slots, when each running
        sequence's slot frees (at its token limit, or sooner where the sequences seen so far
        ended sooner: `Lengths`), and how long a typical sequence holds one.
        Decode steps are predicted at the occupancy the queue will bring (at most every
        slot). A sequence's tokens come one a decode step, at least the predicted step apart
        and at least as far apart as measured lately (prefills share the iterations).
        Interactive first: batch-class prompts leave free the slots interactive ones need
        by Little's law (their arrival rate, `_slot_rate`, times a typical interactive
        sequence's time is the mean in use), with room for Poisson arrivals above the mean
        (their 99th percentile), plus one: one always, or the first interactive prompt
        after batch-class work filled every slot would wait for a whole sequence to end.

        The reserve bounds a whole iteration, which an interactive prompt may arrive just
        after: the decode step now takes its share, a prefill group the rest, and
        batch-class prompts join only while the decode step fits `DECODE_SHARE` of it (its
        rows beyond are kept for interactive prompts: `interactive_slots`). With the
        interactive lane, interactive prompts then go first in a prefill of their own
        (`prefill_first`) while batch-class work runs or waits: their first token no
        longer waits for a decode step of everyone's, at most one such iteration between
        two decode steps (the running sequences wait for one prefill)."""
        slots = self.limit(s, decode)
        step = decode.predict(max(1, min(slots, len(self._running) + len(queue))))
        step = max(step, self._token_interval)
        lengths = self.lengths
        frees = tuple(sorted([now + lengths.steps_left(q.limit, q.tokens) * step for q in self._running.values()]))
        held = lengths.typical(self._typical_steps) * step
        reserved = 0
        free = self.free(s, decode)
        if s.interactive_first:  # one slot even before the first interactive arrival is seen
            in_use = self._slot_rate(now, base.interactive_rate) * lengths.typical(self._interactive_steps) * step
            reserved = min(slots - 1, math.ceil(in_use + POISSON_Z99 * math.sqrt(in_use)) + 1)
            if base.reserve is not None and s.mode == "continuous":
                # Batch-class rows only while the decode step fits its share of the reserve:
                # the interactive prompts' own slots stay free beyond it.
                batch_rows = self.rows_within(DECODE_SHARE * base.reserve, slots, decode)
                reserved = max(reserved, free - max(batch_rows - len(self._running), 0))
        reserve = base.reserve
        if reserve is not None and self._running:
            reserve = max(reserve - decode.predict(len(self._running)), 0.0)
        first = (
            s.mode == "continuous"  # static mode (the baseline) runs whole groups, whatever their class
            and s.interactive_first
            and s.interactive_lane
            and not self.skipped_decode
            and (bool(queue.count(Priority.BATCH)) or self._running.has_batch_class())
        )
        return replace(
            base,
            reserve=reserve,
            free_slots=free,
            interactive_slots=reserved,
            slots_free_at=frees,
            sequence_seconds=held,
            prefill_first=first,
            **more,
        )

    def _slot_rate(self, now: float, rate: float) -> float:
        """The interactive arrival rate the slots are kept for: the last 2 s's, or what it
        was lately, fading over SLOT_RATE_MEMORY. A slot is held for a whole sequence, and
        a lull of a few seconds in Poisson arrivals says little about the next second."""
        dt, self._slot_rate_at = max(0.0, now - self._slot_rate_at), now
        self._slow_rate = max(rate, self._slow_rate * math.exp(-dt / SLOT_RATE_MEMORY))
        return self._slow_rate

    def decode_step(self, now: float, tokens: float = 1.0) -> None:
        """A decode step starts now: the interval since the last one (back to back only), a
        token's: the last step gave its rows `tokens` each on average (more than one where
        they took drafts)."""
        last, self._last_decode_at = self._last_decode_at, now
        if last is None:
            return
        gap = (now - last) / max(tokens, 1.0)
        self._token_interval += 0.1 * (gap - self._token_interval) if self._token_interval else gap

    def pause(self) -> None:
        """The loop waits: the next step's interval is not a token's."""
        self._last_decode_at = None
