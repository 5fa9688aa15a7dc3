"""What a generation scheduler predicts of itself for admission (batcher/scheduler.py's
`GenerationScheduler` derives from this): when a newcomer can join (`busy_until`), the load
it would join (`load`: the decode step its prefill chunk rides, the prompt tokens still to
prefill ahead of it), the deadlines promised to the prompts it would join (`promised`), an
inter-token target against the step it would join (`check_itl`), and what an iteration is
predicted to take (`_predicted_iteration`)."""

from __future__ import annotations

import math
from typing import Any

from .admission import serves_infeasible
from .cost import CostModel, PackedChunkCost
from .errors import DeadlineInfeasible
from .iteration import chunk_budget, packs
from .load import Load
from .protocols import SteppingEngine
from .queueing import QueueingBatcher
from .running import RunningSet
from .slots import Slots
from .types import Priority, WorkItem


class GenerationLoad(QueueingBatcher):
    """The predictions of a generation scheduler, over the state it keeps."""

    engine: SteppingEngine
    prefill_cost: CostModel
    decode_cost: CostModel
    _running: RunningSet
    _slots: Slots
    _chunked: bool
    _iteration_ends: float | None  # when the iteration in flight is predicted to end
    _tokens_a_step: float  # what the last decode step gave each row, on average
    packed_chunk: PackedChunkCost  # what prompt chunks add to a packed step

    def busy_until(self, now: float) -> float:
        """The next iteration boundary: when a free slot can take a newcomer. The iteration
        in flight ends when it was predicted to at its start (an overrun: now); between
        iterations the boundary is now. Not `now` plus a whole step: a request lands
        anywhere in an iteration, and a wait known to the millisecond keeps the error of
        the first-token prediction to the cost models' (a whole step was ~300 ms of a 500 ms
        budget on the real model, stretched by the calibration into refusals)."""
        ends = self._iteration_ends
        return now if ends is None else max(ends, now)

    def expected_output(self, payload: Any) -> float:
        return self._slots.expected_output(payload)

    def promised(self, priority: Priority, tenant: str = "") -> float:
        """Prompts queued before a newcomer join the same prefill iteration, and its tokens
        make that iteration longer: each one's first token comes when it ends. A newcomer is
        admitted only if the earliest of their deadlines still holds (measured on the real
        model at twice its capacity: about one admitted request in four was late without it,
        all in the seconds a burst of arrivals lengthened the iteration they had been promised).
        With fair shares, a tenant over its share does not keep one within it out
        (`RequestQueue.earliest_promise`)."""
        return self.queue.earliest_promise(priority, tenant)

    def load(self, now: float) -> Load:
        """The tracker's snapshot plus what runs and the slots kept for interactive prompts
        (`Slots.load`)."""
        s = self.settings
        base = self.tracker.snapshot(now, self.queue, s, self.prefill_cost, self.busy_until(now), shape=False)
        # The lane's prefill-alone iterations stay on with chunks: measured, turning them off
        # cost interactive first tokens (on time 86-93% where 98% with them, bench_latency's
        # chat priority cells, docs/benchmarks-history.md "Token-budgeted steps").
        running = len(self._running)
        if not self._chunked or (not running and s.max_batch_tokens is None):
            return self._slots.load(base, now, s, self.queue, self.decode_cost)
        chunk = chunk_budget(s, running, self.prefill_cost, self.decode_cost, packed := packs(self.engine))
        # The step a newcomer's prefill shares: the running rows and the queue joining with it.
        joining = min(running + len(self.queue) + 1, self._slots.limit(s, self.decode_cost))
        # (A token's time, as many as the last step gave a row: with drafts, steps are longer.)
        step = self.decode_cost.predict(joining) * self._tokens_a_step if running else 0.0
        extra = {
            "prefill_chunk": chunk,
            "chunk_step": step,
            "chunks_packed": packed,
            "packed_chunk": self.packed_chunk,
        }
        backlog, prefilling = self._prefill_backlog(chunk)
        return self._slots.load(
            base, now, s, self.queue, self.decode_cost, prefill_backlog=backlog, prefilling=prefilling, **extra
        )

    def _prefill_backlog(self, chunk: int | None) -> tuple[int, tuple[tuple[int, str, int], ...]]:
        """Prompt tokens the engine will still have to prefill when the iteration in flight
        ends (it computes up to `chunk` of them): the engine's count, read from the event
        loop (an estimate), where the engine keeps one; and the prompts still prefilling as
        (priority, tenant, tokens), the count shared out by their prompts' prices."""
        backlog = int(getattr(self.engine, "prefill_backlog", 0))
        if self._iteration_ends is not None and chunk is not None:
            backlog -= chunk
        backlog = max(backlog, 0)
        waiting = self._running.prefilling()
        total = sum(i.cost for i in waiting)
        if not backlog or not total:
            return backlog, ()
        return backlog, tuple((int(i.priority), i.tenant, i.cost * backlog // total) for i in waiting)

    def check_itl(self, item: WorkItem, siblings: int) -> bool:
        """A request's inter-token target against the predicted decode step at the
        occupancy it would join: the running sequences and the queue ahead (at most every
        slot the targets allow), itself and its siblings included. Refused at once
        (`429 deadline_infeasible`) when that step is slower than the target; admitted, its
        target then bounds the running batch while it runs (`Slots.limit`)."""
        target = item.itl_target
        if target is None:
            return False
        slots = self._slots.limit(self.settings, self.decode_cost)
        occupancy = max(1, min(slots, len(self._running) + len(self.queue) + siblings + 1))
        step = self.decode_cost.predict(occupancy)
        if step <= target:
            return False
        if serves_infeasible(item, self.settings):
            return True
        alone = self.decode_cost.predict(1)
        if alone > target:
            why = f"a decode step of this model alone is predicted at {alone * 1000.0:.1f} ms"
            retry = 60  # not a matter of load: this replica cannot meet it
        else:
            why = f"a decode step is predicted at {step * 1000.0:.1f} ms with {occupancy} sequences"
            retry = max(1, math.ceil(self.load(self.clock.now()).sequence_seconds))  # a typical sequence ends
        raise DeadlineInfeasible(
            f"inter-token target of {target * 1000.0:.0f} ms cannot be met: {why}", retry_after=retry
        )

    def _predicted_iteration(self, admitted: list[WorkItem], decoding: int) -> float:
        """What the iteration starting now is predicted to take: its decode step, and the
        prefill of the prompts joining (whole, or the chunk budget's worth), their tokens
        as priced (what the prefix cache serves left out). The decode model predicts a
        token's time: a step whose rows take drafts gives (and takes) more, as many as the
        last one gave."""
        step = self.decode_cost.predict(decoding) * self._tokens_a_step
        tokens = sum(i.cost for i in admitted)
        if not tokens:
            return step
        packed = packs(self.engine)
        chunk = chunk_budget(self.settings, decoding, self.prefill_cost, self.decode_cost, packed)
        if self._chunked and chunk is not None:
            tokens = min(tokens, chunk)
        prefill = self.prefill_cost.predict(len(admitted), tokens)
        if packed and decoding:
            # The chunks ride in the decode step's forward: what they add to such a step
            # (cost.PackedChunkCost), not a forward of their own.
            added = self.packed_chunk.predict(tokens)
            prefill = prefill - self.prefill_cost.params.fixed if added is None else added
        return step + prefill
