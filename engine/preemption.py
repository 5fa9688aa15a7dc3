"""When KV memory runs out, running sequences yield it: preemption by recompute.

The running rows' KV buffers never take more than their budget (`RunningBatch.budget`, the
`kv_cache_mb` knob in cells). Before a decode step needs one more column than fits, and
before a prompt that would not fit joins, a running sequence is preempted (parked): the KV
of its full blocks goes to the prefix cache, its row leaves the batch, and it waits among
the pending prompts, ahead of new ones, as a prompt of its prompt and every token it
generated. When there is room again its prefill takes what the prefix cache still holds
(usually all of it), computes the rest, and its last chunk samples its next token: its
sampler, logit rules, grammar and text go on as if it had never stopped (vLLM's recompute
preemption; with the prefix cache the recompute is mostly a copy).

Who yields: the highest `priority` number first (the batcher sends 0 for interactive, 1 for
batch class), the newest of those first. A prompt waiting to join may preempt only
sequences of a higher number than its own, and only when parking them all would make room:
an interactive prompt makes batch-class rows yield, a batch-class prompt waits for room,
and no interactive row ever yields for a batch-class one. Only when every row is of one
class and the rows themselves outgrow the memory does a row of that class yield to its
own. A prompt that could not join now does not start computing (its KV would sit outside
the budget), one that started and finds no room at its last chunk lets go of its KV
(engine/chunks.py), and a preempted sequence goes ahead of new prompts of its class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import PrefillStep
from .blocks import PagedBatch
from .chunks import Chunk, Pending, PendingPrefills
from .kv import RunningBatch
from .prefix_cache import PrefixCache
from .sequence import RunningSequence
from .sharing import PrefixSharing

Rows = RunningBatch[RunningSequence] | PagedBatch[RunningSequence]  # the running rows, in either layout


class Preemption:
    """Keeps an engine's running rows within their KV budget; counts the sequences preempted."""

    def __init__(
        self, pending: PendingPrefills[RunningSequence], cache: PrefixCache | None, sharing: PrefixSharing | None = None
    ) -> None:
        self.pending, self.cache = pending, cache
        self.sharing = sharing or PrefixSharing()  # the engine's: a prefix held once takes no row's columns
        self.count = 0  # sequences preempted so far (a counter: the metric reads it)

    def room_for_step(self, batch: Rows) -> None:
        """Before a decode step: park rows, the most yielding first, until the next column fits."""
        while batch.rows > 1 and not batch.step_fits():
            victim = _victim(batch.seqs)
            assert victim is not None  # rows > 1
            self.park(batch, victim)

    def first(self, first: Sequence[int]) -> list[int]:
        """The prompts to prefill first, class by class (the most urgent first): its resumed
        sequences, then its prompts in `first` (the caller's order: interactive prompts, or
        every prompt in tenants' fair order), so a preempted sequence is never overtaken by
        new ones of its class."""
        waiting = self.pending.waiting()
        if not any(p.resumed for p in waiting):
            return list(first)
        classes = {p.seq_id: p.seq.priority for p in waiting}
        order: list[int] = []
        for priority in sorted(set(classes.values())):
            order += [p.seq_id for p in waiting if p.resumed and p.seq.priority == priority]
            order += [i for i in first if classes.get(i) == priority]
        return order + [i for i in first if i not in classes]

    def plan(
        self, batch: Rows, budget: int | None, first: Sequence[int], step: PrefillStep
    ) -> list[Chunk[RunningSequence]]:
        """`PendingPrefills.plan` of one step beside `batch`, in the room its KV budget leaves."""
        return self.pending.plan(budget, self.first(first), step, StepRoom(self, batch))

    def park(self, batch: Rows, row: int) -> None:
        """Preempt the sequence of row `row`: its full blocks to the prefix cache, its row
        out of the batch, the sequence back among the pending prompts, first."""
        seq = batch.seqs[row]
        known = seq.prompt + seq.tokens[:-1]  # the cache holds every token but the last
        if self.cache is not None:
            kv = batch.row_kv(row)
            if seq.shared is not None:  # the prefix its slot does not hold (engine/sharing.py)
                held = seq.shared.kv
                kv = [(torch.cat((held[i, 0], k), 1), torch.cat((held[i, 1], v), 1)) for i, (k, v) in enumerate(kv)]
            if kv and kv[0][0].shape[1] == len(known):
                self.cache.store(known, kv)
        seq.shared = None
        batch.drop({row})
        self.pending.add(seq.seq_id, seq.prompt + seq.tokens, seq, resumed=True)
        self.count += 1


class StepRoom:
    """Whether pending prompts may start and join in one step, after its decode column,
    beside the prompts that join in it. A prompt may count on the room of the rows of a
    higher priority number than its own (they would yield to it) and no other; a prompt
    that may not start or join holds back every later one of its number or higher (first
    come), so a long prompt is not overtaken for ever by short ones."""

    def __init__(self, preemption: Preemption, batch: Rows) -> None:
        self.preemption, self.batch = preemption, batch
        self.joining: list[int] = []  # lengths of the prompts joining in this step
        self.blocked: list[int] = []  # priority numbers of prompts that could not

    def may_start(self, p: Pending[RunningSequence]) -> bool:
        if self._held(p) or not self._could_fit(p):
            self.blocked.append(p.seq.priority)
            return False
        return True

    def joins(self, p: Pending[RunningSequence]) -> bool:
        """`may_start`'s test, then the rows that must yield parked, the newest first."""
        if not self.may_start(p):
            return False
        batch = self.batch
        while not batch.joining_fits(None, self._joining(p)):
            victim = _victim(batch.seqs, above=p.seq.priority)
            if victim is None:  # (the estimate in _could_fit was short: a row had padding)
                self.blocked.append(p.seq.priority)
                return False
            self.preemption.park(batch, victim)
        held = self.preemption.sharing.held(p.seq.chain)
        self.joining.append(len(p.prompt) - (held.tokens if held else 0))
        return True

    def _held(self, p: Pending[RunningSequence]) -> bool:
        return any(p.seq.priority >= b for b in self.blocked)

    def _could_fit(self, p: Pending[RunningSequence]) -> bool:
        """Whether `p` would fit with every row of a higher number than its own parked."""
        batch = self.batch
        kept = [s for s in batch.seqs if s.priority <= p.seq.priority]
        columns = None if len(kept) == batch.rows else [_held_columns(s) for s in kept]
        return batch.joining_fits(columns, self._joining(p))

    def _joining(self, p: Pending[RunningSequence]) -> list[int]:
        """The columns of the prompts joining in this step, `p` last. A prompt that starts
        with a prefix held once (engine/sharing.py) needs columns for the rest only."""
        held = self.preemption.sharing.held(p.seq.chain)
        return [*self.joining, len(p.prompt) - (held.tokens if held else 0)]


def _victim(seqs: Sequence[RunningSequence], above: int | None = None) -> int | None:
    """The row that yields first: the highest priority number (only those above `above`,
    where given), the newest (highest id) of those."""
    rows = [i for i, s in enumerate(seqs) if above is None or s.priority > above]
    return max(rows, key=lambda i: (seqs[i].priority, seqs[i].seq_id), default=None)


def _held_columns(seq: RunningSequence) -> int:
    """Columns a running row holds in its slot: all its tokens but the last, less a prefix
    held apart."""
    return seq.total_tokens - 1 - (seq.shared.tokens if seq.shared else 0)
