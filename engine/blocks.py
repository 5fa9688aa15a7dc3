"""Running sequences' KV in blocks of one pool: memory follows each sequence.

`RunningBatch` (engine/kv.py) keeps the running rows in one rectangle, rows x the longest
row's columns: four conversations of 1,800 tokens among sixty of 150 make every row 1,800
columns wide, and `--kv-cache-mb` bounds that rectangle, not the tokens. Here a row's keys
and values lie in fixed blocks of `block` tokens taken from one pool per engine
([layers, 2, slots, kv_heads, head_dim], slot = block id x block + offset), listed in the
row's block table: a row takes a block when its tokens cross into one and gives its
blocks back when it leaves, so memory is the sum of the rows' own tokens (rounded up to a
block each), and `--kv-cache-mb` bounds exactly that (vLLM's paged attention).

A decode step writes each row's new token into its slot (`write`) and the attention reads
each row's tokens through its table: engine/decode_attention.cpp's paged kernel on the CPU
(no copy), else the rows gathered into a rectangle for SDPA (`gathered`). Rows stay dense
(row i is `seqs[i]`); a leaving row's place is taken by the last one, which moves its
table, not its KV. Only packed forwards read blocks (engine/packed.py): an engine that
cannot pack its steps keeps the rectangle.

The pool is allocated at the first admission (when the KV's shape is known), not zeroed,
`INITIAL_BLOCKS` blocks (or what that admission needs), and doubles when full, up to
`budget` tokens in whole blocks (none: no bound): memory follows the running rows, and a
doubling copies a pool that was full. Free blocks are taken last freed first, so the pages
in use stay few and warm (on the CPU the operating system gives a page only where a block
is written).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

from .kv import KVFull

Row = TypeVar("Row")  # what the engine keeps per running sequence; opaque here

BLOCK = 16  # tokens per block: the prefix cache's block (engine/prefix_cache.py)
INITIAL_BLOCKS = 256  # a pool starts with this many (4,096 tokens), then doubles up to its budget


def blocks_for(tokens: int, block: int = BLOCK) -> int:
    return -(-tokens // block)


class PagedBatch(Generic[Row]):
    """Running sequences whose KV lies in blocks of one pool (module docstring). Presents
    what the engine asks of `RunningBatch`: `seqs`, `rows`, `admit`, `join`, `drop`,
    `row_kv`, `decode_mask` / `advance` around a step, and the room questions preemption
    asks (`step_fits`, `joining_fits`)."""

    paged = True

    def __init__(self, slots: int, budget: int | None = None, block: int = BLOCK) -> None:
        self.slots = slots  # the most rows it may hold
        self.budget = budget  # the most tokens its pool holds (whole blocks); None: no bound
        self.block = block
        self.seqs: list[Row] = []
        self.pool: torch.Tensor | None = None  # [layers, 2, blocks x block, kv_heads, head_dim]
        self.lengths: list[int] = []  # tokens each row holds
        self._tables: list[list[int]] = []  # each row's block ids, in token order
        self._free: list[int] = []  # free block ids, a stack: the last freed is taken first
        self._table = torch.zeros((0, 0), dtype=torch.long)  # [>= rows, >= most blocks a row has]
        self._lengths = torch.zeros(0, dtype=torch.long)  # `lengths` as a tensor, [>= rows]
        self.write_slots: torch.Tensor | None = None  # the pool slot of each row's token this step
        self._attending: torch.Tensor | None = None  # tokens each row attends this step
        # A step with drafts (engine/speculation.py): the row of each of its queries, the
        # row's last token then its drafts ("virtual rows" sharing the row's table); None
        # when every row feeds one token.
        self._virtual: torch.Tensor | None = None
        self._query_table: torch.Tensor | None = None  # the block table of each query, with drafts
        self._extra: list[int] | None = None  # the drafts each row feeds this step
        self._held: list[list[int]] = []  # block tables of rows out of the steps for now (`holding`)

    # -- what the engine reads ---------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.seqs)

    @property
    def pool_blocks(self) -> int:
        """Blocks the pool has now (it doubles up to the budget)."""
        return self.pool.shape[2] // self.block if self.pool is not None else 0

    column = 0  # no shared write column: a row's own part is its blocks (engine/sharing.py)

    @property
    def width(self) -> int:
        """The most tokens one row holds."""
        return max(self.lengths, default=0)

    @property
    def cells(self) -> int:
        """Token slots the rows' blocks take (the budget bounds this)."""
        return self.used_cells

    @property
    def used_blocks(self) -> int:  # (of rows held out of the steps too)
        return sum(map(len, self._tables)) + sum(map(len, self._held))

    @property
    def used_cells(self) -> int:
        """Token slots the rows' blocks take (their tokens, each row rounded up to a block)."""
        return self.used_blocks * self.block

    @property
    def usage(self) -> float | None:
        """Blocks in use over the pool's (None without a budget)."""
        if self._limit is None:
            return None
        return self.used_blocks / max(1, self._limit)

    def table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids [queries, most blocks a row has], tokens each query attends [queries])
        for this step: a row's own tokens and the one `decode_mask` opened, or with drafts,
        each of the row's queries up to itself."""
        assert self._attending is not None, "decode_mask opens the step"
        if self._query_table is not None:
            return self._query_table, self._attending
        return self._table[: self.rows], self._attending

    def query_rows(self) -> torch.Tensor:
        """The row of each query this step (with drafts, a row's several in a run)."""
        assert self._attending is not None, "decode_mask opens the step"
        if self._virtual is not None:
            return self._virtual
        return torch.arange(self.rows, device=self._table.device)

    # -- room -------------------------------------------------------------------------

    def _fits_blocks(self, blocks: int) -> bool:  # beside the blocks of rows held out
        return self.budget is None or blocks + sum(map(len, self._held)) <= self.budget // self.block

    def step_fits(self, extra: Sequence[int] | None = None, joining: Sequence[int] = ()) -> bool:
        """Whether every row's next token fits, and `extra` drafted tokens each, all taken,
        beside rows joining with `joining` tokens each and room for their next."""
        extra = extra or [0] * self.rows
        rows = sum(blocks_for(n + 1 + e, self.block) for n, e in zip(self.lengths, extra, strict=True))
        return self._fits_blocks(rows + sum(blocks_for(n + 1, self.block) for n in joining))

    def joining_fits(self, kept: Sequence[int] | None, joining: Sequence[int]) -> bool:
        """Whether rows holding `kept` tokens each (None: the rows as they are) after this
        step's token, and rows joining with `joining` tokens each, fit with room for their
        next tokens."""
        kept = self.lengths if kept is None else kept
        blocks = sum(blocks_for(n + 2, self.block) for n in kept) + sum(blocks_for(n + 1, self.block) for n in joining)
        return self._fits_blocks(blocks)

    def reserve(self, rows: int) -> None:
        """Nothing to do: the pool is allocated at the first admission and grows with the rows."""

    # -- rows in and out --------------------------------------------------------------

    def admit(
        self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, seqs: list[Row], alive: list[int]
    ) -> None:
        """Copy the alive rows of a prefill into blocks: per layer its keys and values [rows,
        kv_heads, width, head_dim] and its [rows, width] mask; a row's tokens are its columns
        the mask keeps, in order (padding anywhere is left out)."""
        cols = [mask[row].nonzero().squeeze(1) for row in alive]
        counts = [len(c) for c in cols]
        self._allocate(len(layers), layers[0][0])
        rows = torch.cat(
            [torch.full((n,), row, dtype=torch.long, device=mask.device) for row, n in zip(alive, counts, strict=True)]
        )
        columns = torch.cat(cols)
        dst = self._add_rows([seqs[row] for row in alive], counts, mask.device)
        assert self.pool is not None
        for i, (keys, values) in enumerate(layers):
            # [rows, kv_heads, width, dim][rows, :, columns] -> [tokens, kv_heads, dim]
            self.pool[i, 0].index_copy_(0, dst, keys[rows, :, columns])
            self.pool[i, 1].index_copy_(0, dst, values[rows, :, columns])

    def join(self, kv: torch.Tensor, seq: Row) -> None:
        """One sequence whose KV [layers, 2, kv_heads, tokens, head_dim] has no padding."""
        tokens = int(kv.shape[3])
        self._allocate(int(kv.shape[0]), kv[0, 0].unsqueeze(0))
        dst = self._add_rows([seq], [tokens], kv.device)
        assert self.pool is not None
        self.pool.index_copy_(2, dst, kv.transpose(2, 3))

    def drop(self, leaving: set[int], free: bool = True) -> None:
        """Remove the rows at indices `leaving` (their blocks freed, else the caller's: `holding`);
        later rows take their places."""
        for row in sorted(leaving, reverse=True) if free else ():
            self._free.extend(reversed(self._tables[row]))
        keep = self.rows - len(leaving)
        holes = [i for i in sorted(leaving) if i < keep]
        movers = [i for i in range(keep, self.rows) if i not in leaving]
        for hole, mover in zip(holes, movers, strict=True):
            self.seqs[hole], self._tables[hole], self.lengths[hole] = (
                self.seqs[mover],
                self._tables[mover],
                self.lengths[mover],
            )
            self._table[hole] = self._table[mover]
            self._lengths[hole] = self._lengths[mover]
        del self.seqs[keep:], self._tables[keep:], self.lengths[keep:]
        self._close()

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row `row`'s keys and values per layer, [kv_heads, its tokens, head_dim]."""
        if self.pool is None:
            return []
        slots = self._slots(row, 0, self.lengths[row])
        return [
            (layer[0].index_select(0, slots).transpose(0, 1), layer[1].index_select(0, slots).transpose(0, 1))
            for layer in self.pool
        ]

    # -- a step ---------------------------------------------------------------------

    def decode_mask(self, extra: Sequence[int] | None = None) -> torch.Tensor:
        """Open every row's next token, and `extra` drafted tokens after it per row (None:
        none): blocks for the rows whose blocks they fill, and the slots the step writes
        (`write_slots`); the tokens each query attends. Idempotent until `advance`."""
        rows = self.rows
        extra = list(extra) if extra is not None and any(extra) else None
        feeds = [1 + e for e in extra] if extra is not None else [1] * rows
        wanted = [
            blocks_for(n + f, self.block) - len(t) for n, f, t in zip(self.lengths, feeds, self._tables, strict=True)
        ]
        for r, w in enumerate(wanted):
            for _ in range(-w):  # blocks a step that failed had opened for its drafts
                self._free.append(self._tables[r].pop())
        if (more := sum(w for w in wanted if w > 0)) > 0:
            self._take(more)
            for r, w in enumerate(wanted):
                for _ in range(w):
                    self._append_block(r, self._free.pop())
        lengths = self._lengths[:rows]
        if extra is None:
            index = torch.arange(rows, device=lengths.device)
            positions = lengths
            self._virtual = self._query_table = None
        else:
            counts = torch.tensor(feeds, dtype=torch.long, device=lengths.device)
            index = torch.repeat_interleave(torch.arange(rows, device=lengths.device), counts)
            starts = torch.cumsum(counts, 0) - counts
            offsets = torch.arange(len(index), device=lengths.device) - starts.repeat_interleave(counts)
            positions = lengths.index_select(0, index) + offsets
            self._virtual = index
            self._query_table = self._table.index_select(0, index)  # read by every layer
        self._extra = extra
        self.write_slots = self._table[index, positions // self.block] * self.block + positions % self.block
        self._attending = positions + 1
        return self._attending

    def advance(self, accepted: Sequence[int] | None = None) -> None:
        """The forward wrote every row's token at its slot, and its drafts after it: row r
        keeps the first `accepted[r]` of those (None: none), and the blocks past them are freed."""
        if accepted is None or self._extra is None:
            self.lengths = [n + 1 for n in self.lengths]
            self._lengths[: self.rows] += 1
        else:
            for r, (taken, drafted) in enumerate(zip(accepted, self._extra, strict=True)):
                assert 0 <= taken <= drafted, "a row keeps at most the drafts it fed"
                n = self.lengths[r] = self.lengths[r] + 1 + taken
                table = self._tables[r]
                while len(table) > blocks_for(n, self.block):
                    self._free.append(table.pop())
            self._lengths[: self.rows] = torch.tensor(self.lengths, dtype=torch.long)
        self._close()

    def _close(self) -> None:
        self.write_slots = self._attending = self._virtual = self._query_table = None
        self._extra = None

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """This step's token of every row into its slot: `keys`, `values` [rows, kv_heads, head_dim]."""
        assert self.pool is not None and self.write_slots is not None, "decode_mask opens the step"
        self.pool[layer, 0].index_copy_(0, self.write_slots, keys)
        self.pool[layer, 1].index_copy_(0, self.write_slots, values)

    # -- blocks -----------------------------------------------------------------------

    def _allocate(self, layers: int, like: torch.Tensor) -> None:
        """The pool, at the first admission: `layers` layers shaped after `like` ([rows,
        kv_heads, tokens, head_dim] of one layer), `INITIAL_BLOCKS` within the budget."""
        if self.pool is not None:
            return
        blocks = INITIAL_BLOCKS if self._limit is None else max(1, min(INITIAL_BLOCKS, self._limit))
        self.pool = like.new_empty((layers, 2, blocks * self.block, like.shape[1], like.shape[-1]))
        self._free = list(range(blocks - 1, -1, -1))

    @property
    def _limit(self) -> int | None:
        """The most blocks the pool may have (None: no bound)."""
        return None if self.budget is None else self.budget // self.block

    def _take(self, blocks: int) -> None:
        """At least `blocks` free blocks, the pool grown within its budget; else KVFull."""
        assert self.pool is not None
        while len(self._free) < blocks:
            if self._limit is not None and self.pool_blocks >= self._limit:
                raise KVFull(f"{blocks} blocks wanted, {len(self._free)} free of {self.pool_blocks}")
            self._grow()

    def _grow(self) -> None:
        """Double the pool (within the budget): allocated and copied first, so a failure
        leaves it as it was."""
        assert self.pool is not None
        old = self.pool_blocks
        new = 2 * old if self._limit is None else min(2 * old, self._limit)
        grown = self.pool.new_empty((*self.pool.shape[:2], new * self.block, *self.pool.shape[3:]))
        grown[:, :, : self.pool.shape[2]] = self.pool
        self.pool = grown
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def _add_rows(self, seqs: list[Row], counts: list[int], device: torch.device) -> torch.Tensor:
        """New rows of `counts` tokens each, their blocks taken: the pool slots of their tokens, in order."""
        if (rows := self.rows + len(self._held) + len(seqs)) > self.slots:
            raise KVFull(f"{rows} rows exceed the {self.slots} the batch may hold")
        self._take(sum(blocks_for(n, self.block) for n in counts))
        first = self.rows
        for seq, n in zip(seqs, counts, strict=True):
            self.seqs.append(seq)
            self._tables.append([])
            self.lengths.append(n)
        self._room(self.rows, max(blocks_for(n, self.block) for n in counts), device)
        slots = []
        for r, n in zip(range(first, self.rows), counts, strict=True):
            for _ in range(blocks_for(n, self.block)):
                self._append_block(r, self._free.pop())
            self._lengths[r] = n
            slots.append(self._slots(r, 0, n))
        self._close()
        return torch.cat(slots)

    def _append_block(self, row: int, block: int) -> None:
        table = self._tables[row]
        self._room(self.rows, len(table) + 1, self._table.device)
        self._table[row, len(table)] = block
        table.append(block)

    def _room(self, rows: int, blocks: int, device: torch.device) -> None:
        """The table tensors hold `rows` rows of `blocks` blocks (doubling)."""
        self._table, self._lengths = _grown(self._table, self._lengths, rows, blocks, device)

    def _slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Pool slots of row `row`'s tokens [start, end)."""
        j = torch.arange(start, end, device=self._table.device)
        return self._table[row, j // self.block] * self.block + j % self.block


@contextlib.contextmanager
def holding(batch: PagedBatch[Any] | Any, seq_ids: frozenset[int]) -> Iterator[None]:
    """The rows of sequences `seq_ids` out of `batch`'s steps for one engine call, their KV
    kept: their blocks stay taken (counted against the budget, and their slots) and they come
    back after the rows in the batch, having missed the steps between, nothing else (fair
    shares: batcher/fair_steps.py). Not all of the rows: a step of none is no step. A batch
    that is not in blocks holds none."""
    rows = {i for i, seq in enumerate(batch.seqs) if seq.seq_id in seq_ids} if seq_ids else set()
    if not isinstance(batch, PagedBatch) or not rows or len(rows) == batch.rows:
        yield
        return
    held = [(batch.seqs[r], batch._tables[r], batch.lengths[r]) for r in sorted(rows)]
    batch.drop(rows, free=False)
    batch._held = [table for _, table, _ in held]
    try:
        yield
    finally:  # (after a failed call too: the engine then fails the batch, these rows with it)
        batch._held = []
        for seq, table, n in held:
            row = batch.rows
            batch.seqs.append(seq)
            batch._tables.append([])
            batch.lengths.append(n)
            for block in table:
                batch._append_block(row, block)
            batch._lengths[row] = n
        batch._close()


def gathered(batch: PagedBatch, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' tokens of `batch`'s step as a rectangle, for attention without the paged
    kernel: keys and values [rows, kv_heads, width, head_dim], each row's tokens first,
    and [rows, width] True where a column is one of the row's tokens."""
    assert batch.pool is not None
    table, lengths = batch.table()
    width, queries = int(lengths.max()), int(table.shape[0])
    j = torch.arange(width, device=table.device)
    allowed = j[None, :] < lengths[:, None]
    blocks = table.gather(1, (j // batch.block).clamp(max=table.shape[1] - 1).expand(queries, -1))
    slots = torch.where(allowed, blocks * batch.block + j % batch.block, 0).flatten()
    shape = (queries, width, *batch.pool.shape[3:])
    keys = batch.pool[layer, 0].index_select(0, slots).view(shape).transpose(1, 2)
    values = batch.pool[layer, 1].index_select(0, slots).view(shape).transpose(1, 2)
    # Columns past a row's tokens read slot 0 (anything): zeroed, so a masked weight of 0
    # never meets a non-finite value.
    keys = keys.masked_fill(~allowed[:, None, :, None], 0.0)
    values = values.masked_fill(~allowed[:, None, :, None], 0.0)
    return keys, values, allowed


def _grown(
    table: torch.Tensor, lengths: torch.Tensor, rows: int, blocks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block table and its lengths holding `rows` rows of `blocks` blocks (each at least
    doubled where it grows), what they held kept: the same tensors where they already do."""
    have_rows, have_blocks = table.shape
    if rows <= have_rows and blocks <= have_blocks and table.device == device:
        return table, lengths
    new_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows, 8)
    new_blocks = have_blocks if blocks <= have_blocks else max(blocks, 2 * have_blocks, 8)
    grown = torch.zeros((new_rows, new_blocks), dtype=torch.long, device=device)
    grown[:have_rows, :have_blocks] = table
    longer = torch.zeros(new_rows, dtype=torch.long, device=device)
    longer[:have_rows] = lengths
    return grown, longer
