"""Per-slot KV buffers for continuous batching: every running sequence owns one row.

Buffers are [rows, kv_heads, capacity, head_dim] per attention layer, grown (doubling) with
the running rows and the longest row's length, up to the most rows it may hold and, with a
`budget`, never past that many cells (rows x columns; a growth holds the old buffers and
the new for the moment of its copy): the engine keeps the running rows within it (`fits`)
by preempting rows (engine/preemption.py). Rows
are right-aligned at a shared write column and left-padded, so a decode step writes one
column in place and attends over a view of the used columns; joining copies only the
newcomers' prefill cache, leaving copies only the rows that move. A `RunningBatch`
presents its buffers to transformers as an ordinary `Cache` of `SlotLayer`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch
from transformers.cache_utils import Cache, DynamicLayer

Row = TypeVar("Row")  # what the engine keeps per running sequence; opaque here


class KVFull(RuntimeError):
    """The running rows would need more KV cells than the budget: the caller preempts first."""


class SlotLayer(DynamicLayer):
    """One attention layer's keys and values in preallocated per-slot buffers.

    Running row i lives in slot i and all rows share one write column (`owner.end`), so a
    decode step writes one column in place and attends over a view of columns
    [start, end] instead of concatenating the whole cache, as DynamicLayer does every step.
    """

    # Allocated before the layer is (DynamicLayer's may be None until its first update).
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, owner: RunningBatch, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("slot buffers are allocated by the running batch")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        rows, width = key_states.shape[0], key_states.shape[-2]
        start, end = self.owner.start, self.owner.end
        self.keys[:rows, :, end : end + width] = key_states
        self.values[:rows, :, end : end + width] = value_states
        return self.keys[:rows, :, start : end + width], self.values[:rows, :, start : end + width]

    def get_seq_length(self) -> int:
        return self.owner.end - self.owner.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


class RunningBatch(Generic[Row]):
    """Running sequences in preallocated KV slots.

    Row i of every buffer belongs to `seqs[i]`; rows are kept dense (a leaving row's slot
    is filled by the last row), so the forward sees rows [0, n). Columns [start, end) hold
    the cached tokens, rows right-aligned at `end` and left-padded with mask 0. The
    buffers are compacted to the left (or grown) when the write column reaches the end:
    amortised, nothing is copied per step.
    """

    paged = False  # (engine/blocks.py's PagedBatch keeps rows in blocks)

    def __init__(self, slots: int, budget: int | None = None) -> None:
        self.slots = slots  # the most rows it may hold
        self.budget = budget  # the most cells (rows x columns) its buffers may take; None: no bound
        self.allocated = 0  # rows its buffers have room for: grown with the running rows
        self.seqs: list[Row] = []
        self.start = self.end = 0
        # [allocated, capacity], 1 = real token; nothing until the first admission allocates.
        self.mask = torch.zeros((0, 0), dtype=torch.int64)
        self.layers: list[SlotLayer] = []
        self.cache: Cache | None = None  # transformers Cache over `layers`

    @property
    def rows(self) -> int:
        return len(self.seqs)

    @property
    def width(self) -> int:
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    @property
    def cells(self) -> int:
        """Token cells (rows x columns) its buffers hold now."""
        return self.allocated * self.capacity

    def fits(self, rows: int, columns: int) -> bool:
        """Whether `rows` rows of `columns` cached columns each fit the budget."""
        return self.budget is None or rows * columns <= self.budget

    @property
    def column(self) -> int:
        """The rows' shared write column (engine/sharing.py counts their own starts back from it)."""
        return self.end

    @property
    def used_cells(self) -> int:
        """Token cells the rows attend over: rows x the batch's width, padding included."""
        return self.rows * self.width

    @property
    def usage(self) -> float | None:
        """The rows' share of the budget (None without one)."""
        return self.used_cells / self.budget if self.budget else None

    def step_fits(self) -> bool:
        """Whether the next decode column fits."""
        return self.fits(self.rows, self.width + 1)

    def joining_fits(self, kept: Sequence[int] | None, joining: Sequence[int]) -> bool:
        """Whether rows holding `kept` columns each (None: the rows as they are), after this
        step's column, and rows joining with `joining` columns each fit, with room for the
        next column: rows are right-aligned, so every row is as wide as the widest."""
        rows = (self.rows if kept is None else len(kept)) + len(joining)
        width = self.width if kept is None else max(kept, default=0)
        return self.fits(rows, max([width + 1, *joining]) + 1)

    def reserve(self, rows: int) -> None:
        """Grow the buffers to hold `rows` rows now, as many as the budget allows at their
        present length, so that traffic does not wait for the growth; nothing before the
        first admission (shapes unknown)."""
        if self.budget is not None and self.capacity:
            rows = min(rows, self.budget // self.capacity)
        if self.cache is not None and rows > self.allocated:
            self._grow(max(self.width + 1, self.capacity), rows)

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row `row`'s keys and values per layer, [kv_heads, its tokens, head_dim], padding left out."""
        cols = self.mask[row, self.start : self.end].nonzero().squeeze(1) + self.start
        return [
            (layer.keys[row].index_select(1, cols), layer.values[row].index_select(1, cols)) for layer in self.layers
        ]

    def decode_mask(self) -> torch.Tensor:
        """Open the next column for every row; the 2D mask for a one-token forward."""
        self._ensure_room(self.width + 1)
        self.mask[: self.rows, self.end] = 1
        return self.mask[: self.rows, self.start : self.end + 1]

    def advance(self) -> None:
        """The forward wrote column `end` of every row."""
        self.end += 1

    def admit(
        self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, seqs: list[Row], alive: list[int]
    ) -> None:
        """Copy the alive rows of a prefill into free slots: per layer its keys and values
        [rows, kv_heads, width, head_dim] and its [rows, width] mask. The mask is copied as it
        is, so a row may have padding anywhere (engine/prefill.py packs rows to the right, so
        no columns in the middle cost attention); positions come from the engine, not here."""
        if len(alive) < len(seqs):
            index = torch.tensor(alive, device=mask.device)
            mask = mask.index_select(0, index)
            layers = [(keys.index_select(0, index), values.index_select(0, index)) for keys, values in layers]
        seqs = [seqs[i] for i in alive]
        width = mask.shape[1]
        if self.cache is None:
            rows, capacity = self._shape(len(seqs), width + 1, max(256, 2 * width), self._rows_for(len(seqs)))
            self._allocate(layers, capacity, mask.dtype, rows)
        if not self.seqs:
            self.start = self.end = 0
        # Newcomers end at column `end` like everyone else: the span after joining is the
        # wider of the two, plus one column for the next decode step.
        span = max(self.width, width)
        if span + 1 > self.capacity or self.rows + len(seqs) > self.allocated:
            self._grow(span + 1, self.rows + len(seqs))
        if self.end < width or self.end + 1 > self.capacity:
            self._move_columns(span - self.width)
        lo, hi, first = self.end - width, self.end, self.rows
        last = first + len(seqs)
        start = min(self.start, lo) if self.seqs else lo
        self.mask[first:last].zero_()
        self.mask[first:last, lo:hi] = mask
        for layer, (keys, values) in zip(self.layers, layers, strict=True):
            layer.keys[first:last, :, lo:hi] = keys
            layer.values[first:last, :, lo:hi] = values
            # Attention reads every running row over [start, end): the columns it now reads
            # that nothing wrote (the buffers are not zeroed when allocated) are zeroed.
            for buffer in (layer.keys, layer.values):
                buffer[first:last, :, start:lo].zero_()
                buffer[:first, :, start : self.start].zero_()
        self.start = start
        self.seqs.extend(seqs)

    def join(self, kv: torch.Tensor, seq: Row) -> None:
        """`admit` one sequence whose KV [layers, 2, kv_heads, tokens, head_dim] has no padding."""
        mask = torch.ones((1, kv.shape[3]), dtype=self.mask.dtype, device=kv.device)
        self.admit([(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in kv], mask, [seq], [0])

    def drop(self, leaving: set[int]) -> None:
        """Remove the rows at indices `leaving`; later rows fill their slots."""
        keep = self.rows - len(leaving)
        holes = [i for i in sorted(leaving) if i < keep]
        movers = [i for i in range(keep, self.rows) if i not in leaving]
        for hole, mover in zip(holes, movers, strict=True):
            # The mover's columns from its first real one (rows are right-aligned), view to
            # view: no gathered temporary, and none of the padding before it.
            first = self.start + int(self.mask[mover, self.start : self.end].argmax())
            cols, before = slice(first, self.end), slice(self.start, first)
            for layer in self.layers:
                layer.keys[hole, :, cols].copy_(layer.keys[mover, :, cols])
                layer.values[hole, :, cols].copy_(layer.values[mover, :, cols])
                # Masked, but a weight of 0 times a non-finite value left by the row that
                # left would still be NaN: the columns before the mover's are zeroed.
                layer.keys[hole, :, before].zero_()
                layer.values[hole, :, before].zero_()
            self.mask[hole, self.start : self.end] = 0
            self.mask[hole, cols] = self.mask[mover, cols]
            self.seqs[hole] = self.seqs[mover]
        del self.seqs[keep:]
        if not self.seqs:
            self.start = self.end = 0
            return
        # Padding columns nobody needs any more stop costing attention.
        used = self.mask[:keep, self.start : self.end].any(dim=0)
        self.start += int(used.int().argmax())

    # -- buffers ---------------------------------------------------------------------

    def _rows_for(self, rows: int) -> int:
        """Rows to allocate for `rows` running: the next power of two from 8, at most `slots`,
        so memory follows the running rows rather than the most there may be."""
        return min(self.slots, max(8, 1 << (rows - 1).bit_length()))

    def _allocate(
        self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], capacity: int, dtype: torch.dtype, rows: int
    ) -> None:
        self.layers = [
            SlotLayer(self, slot_buffer(k, rows, capacity), slot_buffer(v, rows, capacity)) for k, v in layers
        ]
        self.mask = torch.zeros((rows, capacity), dtype=dtype, device=layers[0][0].device)
        self.cache = Cache(layers=[*self.layers])
        self.allocated = rows

    def _ensure_room(self, needed: int) -> None:
        """Make columns [start, start + needed) fit: compact to the left, else grow.

        Compaction only when it frees at least a quarter of the buffer, so its copy is
        amortised over that many steps; otherwise double.
        """
        if self.start + needed <= self.capacity:
            return
        if needed <= self.capacity - self.capacity // 4:
            self._move_columns(0)
        else:
            self._grow(needed)

    def _shape(self, rows: int, needed: int, capacity: int, allocated: int) -> tuple[int, int]:
        """(rows, columns) to allocate for `rows` rows of `needed` columns, wished as
        `allocated` x `capacity`: within the budget, spare columns go first, then spare rows."""
        if self.budget is None or allocated * capacity <= self.budget:
            return allocated, capacity
        capacity = max(needed, self.budget // allocated)
        if allocated * capacity > self.budget:  # fewer spare rows, and the columns they leave
            allocated = max(rows, self.budget // capacity)
            capacity = max(needed, self.budget // allocated)
        if allocated * capacity > self.budget:
            raise KVFull(f"{rows} rows of {needed} columns exceed the KV budget of {self.budget} cells")
        return allocated, capacity

    def _grow(self, needed: int, rows: int = 0) -> None:
        """Room for `needed` columns (doubling) and `rows` rows (`_rows_for`), the running
        rows' cached columns moved to the left; within the budget, or `KVFull`."""
        capacity = self.capacity if needed <= self.capacity else max(2 * self.capacity, needed + needed // 2)
        wished = self._rows_for(rows) if rows > self.allocated else self.allocated
        allocated, capacity = self._shape(max(rows, self.rows), needed, capacity, wished)
        if (allocated, capacity) == (self.allocated, self.capacity):
            self._move_columns(0)  # the budget allows no more: the room is in the padding
            return
        width, cols, used = self.width, slice(self.start, self.end), self.rows
        grown_mask = self.mask.new_zeros((allocated, capacity))
        grown_mask[:used, :width] = self.mask[:used, cols]

        def regrown(old: torch.Tensor) -> torch.Tensor:
            new = slot_buffer(old, allocated, capacity)
            new[:used, :, :width] = old[:used, :, cols]
            return new

        grown = [(regrown(layer.keys), regrown(layer.values)) for layer in self.layers]
        # Allocated and copied first: an OOM above leaves the batch as it was.
        for layer, (keys, values) in zip(self.layers, grown, strict=True):
            layer.keys, layer.values = keys, values
        self.mask, self.allocated = grown_mask, allocated
        self.start, self.end = 0, width

    def _move_columns(self, new_start: int) -> None:
        """Shift the cached columns to begin at `new_start`, leaving one free column after."""
        width, rows = self.width, self.rows
        if new_start + width + 1 > self.capacity:
            raise AssertionError("caller must ensure capacity before moving columns")
        if new_start != self.start and rows:
            src, dst = slice(self.start, self.end), slice(new_start, new_start + width)
            # Every copy first (an OOM here changes nothing), then the writes, which do not
            # allocate: a half-moved cache would give running rows misaligned keys.
            moved = [(layer.keys[:rows, :, src].clone(), layer.values[:rows, :, src].clone()) for layer in self.layers]
            mask = self.mask[:rows, src].clone()
            for layer, (keys, values) in zip(self.layers, moved, strict=True):
                layer.keys[:rows, :, dst] = keys
                layer.values[:rows, :, dst] = values
            self.mask[:rows].zero_()
            self.mask[:rows, dst] = mask
        self.start, self.end = new_start, new_start + width


def slot_buffer(like: torch.Tensor, slots: int, capacity: int) -> torch.Tensor:
    """A [slots, kv_heads, capacity, head_dim] buffer shaped after `like` ([rows, kv_heads,
    seq, head_dim]), not zeroed: on the CPU the operating system's pages are taken only where
    rows are written, so slots reserved ahead of traffic and the columns a long row makes
    every row grow cost no memory (and no time: zeroing 128 rows of 1,044 columns of a small
    model took 0.55-3.4 s here) until used; on a GPU, the zeroing's time is what is saved.
    The cells attention reads are written or zeroed first (`admit`, `drop`); tests fill new
    buffers with NaN to prove it."""
    return like.new_empty((slots, like.shape[1], capacity, like.shape[3]))
