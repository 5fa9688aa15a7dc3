"""Prompt prefixes that running rows share, held once: a row that starts with one keeps
only the columns after it in its slot of the running batch (engine/kv.py), and its decode
attention meets the prefix through `shared_prefix_attention` (engine/packed.py), one
product per group of rows.

Thirty-two conversations of one 700-token system prompt would otherwise each copy the
prompt into their slot when they join, move it when a row leaves and their slot is
refilled, and make every row of the batch as wide as the prompt; held once, joining
copies a row's own tokens only and the batch is as wide as the rows' own parts.

A row takes a prefix when it joins (`take`): the deepest one already held that its
prompt starts with, else the deepest run of whole blocks it shares with another running
or pending prompt (a new held prefix, copied once from its own KV), else none. At most
`MAX_GROUPS` prefixes are held at once; each lives while a running row references it.
Rows that take none keep all of their KV in their slot, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .packed import SharedPrefix

SHARE_BLOCK = 16  # prefixes are shared in whole blocks of this many prompt tokens
MIN_SHARED_BLOCKS = 2  # shorter shared prefixes are not worth a product of their own
MAX_GROUPS = 8  # prefixes held at once: each costs its own product per layer and step


@dataclass(slots=True, eq=False)
class HeldPrefix:
    """The KV [layers, 2, kv_heads, tokens, head_dim] of a prompt prefix that running rows
    reference, named by its last block's key (engine/prefix_cache.py's `chain_keys`)."""

    key: bytes
    kv: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.kv.shape[3])


class SharingRow(Protocol):  # engine/sequence.py's RunningSequence
    seq_id: int
    chain: list[bytes]  # its prompt's block keys of SHARE_BLOCK tokens
    shared: HeldPrefix | None  # the prefix its slot does not hold

    @property
    def total_tokens(self) -> int: ...


Sharing = tuple[list[SharedPrefix], torch.Tensor | None]  # the groups, and each row's own start


class PrefixSharing:
    """The prefixes an engine's running rows share (`take` at a join) and the plan of a
    decode step over them (`plan`)."""

    def __init__(self) -> None:
        self._held: dict[bytes, HeldPrefix] = {}
        self._rows: tuple[tuple[int, int], ...] = ()
        self._groups: list[tuple[torch.Tensor, HeldPrefix]] = []

    @property
    def tokens(self) -> int:
        """Prompt tokens whose KV the held prefixes keep (a snapshot: gauges read it)."""
        return sum(h.tokens for h in tuple(self._held.values()))

    def let_go(self, seqs: Sequence[SharingRow]) -> None:
        """At the end of an engine call: the held prefixes none of `seqs` (the running rows)
        references go. Not sooner: a prompt joining in the call was given room (engine/
        preemption.py) for what a prefix held when its chunks were planned leaves it to hold,
        and a fallback after a failed forward runs them again."""
        if self._held:
            used = {id(s.shared) for s in seqs}
            self._held = {k: h for k, h in self._held.items() if id(h) in used}

    def clear(self) -> None:
        self._held.clear()
        self._rows, self._groups = (), []

    def held(self, chain: list[bytes]) -> HeldPrefix | None:
        """The deepest held prefix a prompt of block keys `chain` starts with."""
        for depth in range(len(chain), MIN_SHARED_BLOCKS - 1, -1):
            if (held := self._held.get(chain[depth - 1])) is not None:
                return held
        return None

    def take(
        self,
        seq: SharingRow,
        prefix: Callable[[int], torch.Tensor],
        others: Callable[[], Iterable[SharingRow]],
        read: HeldPrefix | None = None,
    ) -> int:
        """At `seq`'s join: the prefix it references from now on (set as `seq.shared`), and
        how many of its first tokens its slot therefore need not hold (0: none). `prefix(n)`
        gives a copy of its own KV of its first n tokens; `others()` the other running and
        pending sequences, asked only when no held prefix serves. `read`: the held prefix
        its prompt's chunks read (engine/chunks.py), whose columns its KV does not have:
        held again if it was let go meanwhile."""
        chain = seq.chain
        held = self.held(chain)
        if read is not None and (held is None or held.tokens < read.tokens):
            held = self._held.setdefault(read.key, read)
        seq.shared = held
        if held is not None:
            return held.tokens
        if len(chain) < MIN_SHARED_BLOCKS or len(self._held) >= MAX_GROUPS:
            return 0
        depth = shared_depth(chain, [o.chain for o in others() if o is not seq])
        if depth < MIN_SHARED_BLOCKS:
            return 0
        held = HeldPrefix(chain[depth - 1], prefix(depth * SHARE_BLOCK))
        self._held[held.key] = seq.shared = held
        return held.tokens

    def plan(self, seqs: Sequence[SharingRow], column: int, device: torch.device) -> Sharing:
        """The running rows in batch order, right-aligned to end before `column`: the groups
        of rows by the prefix they reference, and each row's first column (its own part);
        ([], None) if none references one."""
        key = tuple((s.seq_id, id(s.shared)) for s in seqs)
        if key != self._rows:
            groups: dict[int, tuple[list[int], HeldPrefix]] = {}
            for row, s in enumerate(seqs):
                if s.shared is not None:
                    groups.setdefault(id(s.shared), ([], s.shared))[0].append(row)
            self._rows = key
            self._groups = [(torch.tensor(rows, device=device), held) for rows, held in groups.values()]
        if not self._groups:
            return [], None
        # The slot holds all but the last token, less the prefix held apart.
        own = [column - (s.total_tokens - 1 - (s.shared.tokens if s.shared else 0)) for s in seqs]
        return [SharedPrefix(rows, held.kv) for rows, held in self._groups], torch.tensor(own, device=device)


def shared_depth(chain: list[bytes], others: Iterable[list[bytes]]) -> int:
    """The most of `chain`'s first blocks one of `others` starts with too, if at least
    MIN_SHARED_BLOCKS (else 0). A key names its whole prefix: equal keys at a depth mean
    equal prefixes up to it, so only chains that share the MIN_SHARED_BLOCKS-th key are read."""
    if len(chain) < MIN_SHARED_BLOCKS:
        return 0
    anchor, best = chain[MIN_SHARED_BLOCKS - 1], 0
    for other in others:
        if len(other) >= MIN_SHARED_BLOCKS and other[MIN_SHARED_BLOCKS - 1] == anchor:
            depth = MIN_SHARED_BLOCKS
            while depth < min(len(chain), len(other)) and other[depth] == chain[depth]:
                depth += 1
            best = max(best, depth)
    return best
