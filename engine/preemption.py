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
sequences of a higher number than its own: an interactive prompt makes batch-class rows
yield, a batch-class prompt waits for room, and no interactive row ever yields for a
batch-class one. Only when every row is of one class and the rows themselves outgrow the
memory does a row of that class yield to its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .chunks import Pending, PendingPrefills
from .kv import RunningBatch
from .prefix_cache import PrefixCache
from .sequence import RunningSequence


class Preemption:
    """Keeps an engine's running rows within their KV budget; counts the sequences preempted."""

    def __init__(self, pending: PendingPrefills[RunningSequence], cache: PrefixCache | None) -> None:
        self.pending, self.cache = pending, cache
        self.count = 0  # sequences preempted so far (a counter: the metric reads it)

    def room_for_step(self, batch: RunningBatch[RunningSequence]) -> None:
        """Before a decode step: park rows, the most yielding first, until the next column fits."""
        while batch.rows > 1 and not batch.fits(batch.rows, batch.width + 1):
            victim = _victim(batch.seqs)
            assert victim is not None  # rows > 1
            self.park(batch, victim)

    def joins(self, batch: RunningBatch[RunningSequence]) -> Callable[[Pending[RunningSequence]], bool]:
        """`PendingPrefills.plan`'s `joins` for one step: whether a prompt may join the rows
        after this step's decode column, beside the prompts that join in it; rows of a
        higher priority number than its own are parked to make room. A prompt that may not
        join holds back every later one of its priority number or higher (first come)."""
        joining: list[int] = []  # lengths of the prompts joining in this step
        blocked: list[int] = []  # priority numbers of prompts that could not

        def joins(p: Pending[RunningSequence]) -> bool:
            if any(p.seq.priority >= b for b in blocked):
                return False
            while True:
                rows = batch.rows + len(joining) + 1
                columns = max([batch.width + 1, len(p.prompt), *joining]) + 1
                if batch.fits(rows, columns):
                    joining.append(len(p.prompt))
                    return True
                victim = _victim(batch.seqs, above=p.seq.priority)
                if victim is None:
                    blocked.append(p.seq.priority)
                    return False
                self.park(batch, victim)

        return joins

    def park(self, batch: RunningBatch[RunningSequence], row: int) -> None:
        """Preempt the sequence of row `row`: its full blocks to the prefix cache, its row
        out of the batch, the sequence back among the pending prompts, first."""
        seq = batch.seqs[row]
        known = seq.prompt + seq.tokens[:-1]  # the cache holds every token but the last
        if self.cache is not None:
            kv = batch.row_kv(row)
            if kv and kv[0][0].shape[1] == len(known):
                self.cache.store(known, kv)
        batch.drop({row})
        self.pending.add(seq.seq_id, seq.prompt + seq.tokens, seq, resumed=True)
        self.count += 1


def _victim(seqs: Sequence[RunningSequence], above: int | None = None) -> int | None:
    """The row that yields first: the highest priority number (only those above `above`,
    where given), the newest (highest id) of those."""
    rows = [i for i, s in enumerate(seqs) if above is None or s.priority > above]
    return max(rows, key=lambda i: (seqs[i].priority, seqs[i].seq_id), default=None)
