"""Token-budgeted prefill (chunked prefill): prompts wait in the engine's pending set and
are prefilled a chunk at a time, at most a token budget per engine step, so that one long
prompt never stalls the streams already decoding (vLLM's `max_num_batched_tokens`).

A pending prompt keeps the KV of the part of it computed so far; its next chunk is fed
from there, exactly as a prompt is fed from the end of its cached prefix
(`Prefiller.extend`). Its first look at the prefix cache is at its first chunk, not when it
joins, so a prompt that shares a prefix with one prefilling ahead of it waits until that
prefix is stored, then takes it from the cache: 32 conversations with one system prompt
compute it once, whatever the budget. Who goes first is the caller's (the scheduler puts
interactive prompts first); the rest go in the order they joined.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from .base import PrefillStep
from .blocks import PagedBatch
from .kv import RunningBatch
from .packed import PackedPlan, Segment
from .prefill import Prefilled, Prefiller
from .prefix_cache import chain_keys
from .sharing import SHARE_BLOCK, HeldPrefix, PrefixSharing, Sharing

Row = TypeVar("Row")  # the engine's own state of the sequence; opaque here


@dataclass(slots=True, eq=False)
class Pending(Generic[Row]):
    seq_id: int
    prompt: list[int]
    seq: Row
    keys: list[bytes]  # the prompt's usable prefix-cache chain (empty without a cache)
    done: int = 0  # prompt tokens whose KV is in `kv`
    kv: torch.Tensor | None = None  # [layers, 2, kv_heads, done, head_dim]
    # Once its look-up served a prefix or a chunk has run: [layers, 2, kv_heads, prompt
    # length, head_dim], `kv` its first `done` columns, so each chunk copies in only its own.
    buffer: torch.Tensor | None = None
    cached: int = 0  # tokens its first look-up found in the prefix cache (0 for a resumed sequence)
    started: bool = False  # it has looked the prefix cache up
    # A running sequence preempted for KV memory: `prompt` is its prompt and every token it
    # generated; its last chunk samples its next token (not a first one).
    resumed: bool = False
    # It started, then found no room to join at its last chunk: its KV was let go (its
    # blocks are in the prefix cache, where there is one) and it starts again when there
    # is room; `cached` stays what its first look-up found.
    held_back: bool = False
    # A prefix held once for running rows (engine/sharing.py) that its prompt starts with:
    # it gives the first `held.tokens` of the `done` tokens, whose columns of `buffer` are
    # not filled (`filled` fills them where anything else needs them there).
    held: HeldPrefix | None = None

    @property
    def left(self) -> int:
        return len(self.prompt) - self.done


@dataclass(slots=True)
class Chunk(Generic[Row]):
    pending: Pending[Row]
    start: int  # prompt tokens whose KV is known before it
    tokens: int  # fed now

    @property
    def end(self) -> int:
        return self.start + self.tokens

    @property
    def completes(self) -> bool:
        return self.end == len(self.pending.prompt)


class Room(Protocol[Row]):
    """What KV memory allows a pending prompt in one step (engine/preemption.py)."""

    def may_start(self, pending: Pending[Row]) -> bool:
        """Whether a prompt not started yet may start computing: it could join now."""

    def joins(self, pending: Pending[Row]) -> bool:
        """Whether its last chunk may run now, its sequence joining the running rows."""


class PendingPrefills(Generic[Row]):
    """The prompts an engine has taken but not yet fully prefilled, in the order they joined."""

    def __init__(self, prefiller: Prefiller, sharing: PrefixSharing | None = None) -> None:
        self.prefiller = prefiller
        self.sharing = sharing  # the engine's prefixes held for running rows, which chunks read too
        self._pending: dict[int, Pending[Row]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._pending

    @property
    def ids(self) -> list[int]:
        return list(self._pending)

    def waiting(self) -> list[Pending[Row]]:
        return list(self._pending.values())

    @property
    def backlog(self) -> int:
        """Prompt tokens the pending prompts have still to compute (what a prefix cache will
        serve of a prompt not started yet counted too: an upper bound)."""
        return sum(len(p.prompt) - p.done for p in tuple(self._pending.values()))

    @property
    def kv_tokens(self) -> int:
        """Prompt tokens whose KV the pending prompts hold."""
        # A snapshot: the event loop reads this (a gauge) while the worker thread changes the set.
        return sum(p.done for p in tuple(self._pending.values()))

    def add(self, seq_id: int, prompt: list[int], seq: Row, resumed: bool = False) -> None:
        """Take a prompt, after those taken before; a `resumed` sequence goes ahead of them."""
        cache = self.prefiller.prefix_cache
        keys = [] if cache is None else chain_keys(prompt, cache.block, cache.usable_blocks(len(prompt)))
        pending = Pending(seq_id, list(prompt), seq, keys, resumed=resumed)
        if resumed:
            self._pending = {seq_id: pending, **self._pending}
        else:
            self._pending[seq_id] = pending

    def discard(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._pending.pop(seq_id, None)

    def clear(self) -> None:
        self._pending.clear()

    def plan(
        self,
        budget: int | None,
        first: Sequence[int],
        step: PrefillStep,
        room: Room[Row] | None = None,
    ) -> list[Chunk[Row]]:
        """This step's chunks: at most `budget` tokens in all (None: every pending prompt
        whole), `first` ids ahead of the rest. A prompt starts by taking what the prefix
        cache holds for it, unless a prompt prefilling ahead of it is about to compute the
        next block it needs: then it waits for that block to be stored. With a KV `room`,
        a prompt starts only if it could join the running rows now, and its last chunk
        runs only when it may join; else it lets go of its KV where the prefix cache holds
        its blocks, and starts again when there is room (without that, it keeps its KV and
        waits). Look-ups after a sequence's first are not counted again as queries."""
        cache = self.prefiller.prefix_cache
        ahead = [self._pending[i] for i in dict.fromkeys(first) if i in self._pending]
        order = ahead + [p for p in self._pending.values() if p not in ahead]
        # Blocks that prompts already started will compute (and store) in this or a later step.
        # (An empty cache is falsy: `is not None`, or the first prompts' blocks go unclaimed.)
        claimed = set()
        if cache is not None:
            claimed = {key for p in order if p.started for key in p.keys[p.done // cache.block :]}
        left = budget if budget is not None else sum(p.left for p in order)
        chunks: list[Chunk[Row]] = []
        for p in order:
            if left <= 0:
                break
            if not p.started:
                if room is not None and not room.may_start(p):
                    continue
                if cache is not None:
                    have = cache.cached_blocks(p.prompt, p.keys)
                    if have < len(p.keys) and p.keys[have] in claimed:
                        continue  # another prompt computes this block first: wait, then take it
                    first_look = not (p.resumed or p.held_back)
                    # A prefix held for running rows is read where it is, not copied in.
                    p.held = self.sharing.held(p.keys) if self.sharing and cache.block == SHARE_BLOCK else None
                    skip = p.held.tokens if p.held else 0
                    hit, p.buffer = cache.lookup_into(p.prompt, len(p.prompt), p.keys, count=first_look, skip=skip)
                    p.done = max(hit, skip)
                    p.kv = None if p.buffer is None else p.buffer[:, :, :, : p.done]
                    if first_look:
                        p.cached = p.done
                        step.queried_tokens += len(p.prompt)
                        step.cached_tokens += p.done
                    claimed.update(p.keys[p.done // cache.block :])
                p.started = True
            n = min(p.left, left)
            if n == p.left and room is not None and not room.joins(p):
                if (
                    cache is not None
                    and cache.cached_blocks(p.prompt, p.keys) * cache.block >= p.done - p.done % cache.block
                ):
                    _hold_back(p)  # no room to join: its work is in the prefix cache, it holds no KV while it waits
                    continue
                n = p.left - 1  # no cache holds its work: it keeps its KV and joins when there is room
                if n <= 0:
                    continue
            chunks.append(Chunk(p, p.done, n))
            left -= n
        return chunks

    def run_isolated(self, chunks: Sequence[Chunk[Row]], step: PrefillStep) -> list[tuple[list[Chunk[Row]], Prefilled]]:
        """`run`, and when a forward raises, each half of its chunks again, down to the
        chunk that fails alone: its prompt is dropped, its error in `step.failed`. The
        groups that ran, each with its result."""
        if not chunks:
            return []
        try:
            return [(list(chunks), self.run(chunks, step))]
        except Exception as exc:
            if len(chunks) == 1:
                self.discard([chunks[0].pending.seq_id])
                step.failed[chunks[0].pending.seq_id] = exc
                return []
            mid = (len(chunks) + 1) // 2
            return self.run_isolated(chunks[:mid], step) + self.run_isolated(chunks[mid:], step)

    def pack(
        self,
        batch: RunningBatch | PagedBatch,
        last: list[tuple[int, int]],
        chunks: Sequence[Chunk[Row]],
        sharing: Sharing,
        device: torch.device,
        empty: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, PackedPlan, torch.Tensor]:
        """A packed forward (engine/packed.py) of one token of each row of `batch` ((token,
        position) each, in `last`) and then `chunks`: its input ids and position ids [1,
        tokens], its plan (the rows' shared prefixes `sharing`), and the indices of the tokens
        whose logits it needs (each row's, each completing chunk's last), on `device`. Opens
        the batch's next column for the rows."""
        segments = packed_segments(chunks, len(last), empty)
        ids, positions = [t for t, _ in last], [p for _, p in last]
        for c in chunks:
            ids += c.pending.prompt[c.start : c.end]
            positions += range(c.start, c.end)
        ends = [g.offset + g.tokens - 1 for g, c in zip(segments, chunks, strict=True) if c.completes]
        if isinstance(batch, PagedBatch):  # the rows' KV in blocks (engine/blocks.py)
            if last and batch.write_slots is None:  # (opened already where rows feed drafts)
                batch.decode_mask()
            plan = PackedPlan(len(last), [], 0, 0, None, segments, *sharing)
            plan.paged = batch if last else None
        else:
            mask = batch.decode_mask() if last else None  # may grow or compact the buffers: read them after
            slots = [(layer.keys, layer.values) for layer in batch.layers] if last else []
            decode_mask = None if mask is None else mask.bool()[:, None, None, :]
            plan = PackedPlan(len(last), slots, batch.start, batch.end, decode_mask, segments, *sharing)
            plan.row_mask = None if mask is None else mask.long()  # the kernel reads int64 (no copy when it is already)
        keep = list(range(len(last))) + ends
        # (int64 even when empty: no row decodes and no chunk completes its prompt)
        keep_ids = torch.tensor(keep, dtype=torch.long, device=device)
        return _tensor([ids], device), _tensor([positions], device), plan, keep_ids

    def packed_done(self, chunks: Sequence[Chunk[Row]], step: PrefillStep) -> None:
        """After a packed forward over `chunks` (`packed_segments`) succeeded: every full
        block of each prompt so far into the prefix cache, each prompt's state moved on, the
        finished ones out of the pending set (their KV stays in their buffers)."""
        cache = self.prefiller.prefix_cache
        for c in chunks:
            p = c.pending
            assert p.buffer is not None, "packed_segments allocates every chunk's buffer"
            if cache is not None and p.held and cache.cached_blocks(p.prompt, p.keys) * cache.block < p.held.tokens:
                filled(p)  # (evicted since: the store reads the held prefix's columns)
            if cache is not None:
                cache.store(
                    p.prompt[: c.end], [(layer[0, :, : c.end], layer[1, :, : c.end]) for layer in p.buffer], p.keys
                )
            p.kv, p.done = p.buffer[:, :, :, : c.end], c.end
            if c.completes:
                self._pending.pop(p.seq_id, None)
        step.rows += len(chunks)
        fed = sum(c.tokens for c in chunks)
        step.padded_tokens += fed  # packed: no padding
        step.computed_tokens += fed

    def run(self, chunks: Sequence[Chunk[Row]], step: PrefillStep) -> Prefilled:
        """One forward over `chunks`. Afterwards each unfinished prompt keeps its KV so far;
        a finished one leaves the pending set (its KV is in the result, right-aligned, for
        the running batch). A forward that raises changes nothing."""
        prompts = [c.pending.prompt[: c.end] for c in chunks]
        for c in chunks:
            filled(c.pending)  # the padded forward reads every known column from the buffer
        done = self.prefiller.extend(prompts, [(c.start, c.pending.kv) for c in chunks])
        width = done.mask.shape[1]
        # Every unfinished prompt's KV kept first (an allocation may fail), then the state
        # moves on for all at once: a failure leaves every prompt where it was.
        kept = {row: _kept(c, row, done.layers, width) for row, c in enumerate(chunks) if not c.completes}
        for row, c in enumerate(chunks):
            p = c.pending
            if c.completes:
                self._pending.pop(p.seq_id, None)
            else:
                p.buffer, p.kv = kept[row]
            p.done = c.end
        step.rows += len(chunks)
        step.padded_tokens += len(chunks) * max(c.tokens for c in chunks)
        step.computed_tokens += sum(c.tokens for c in chunks)
        return done


def _hold_back(p: Pending) -> None:
    """Let go of a started prompt's KV: it starts again, from the prefix cache, when there is room."""
    p.buffer = p.kv = p.held = None
    p.done, p.started, p.held_back = 0, False, True


def filled(p: Pending) -> None:
    """A prompt's buffer with the columns of its held prefix filled in: it holds all of its
    known KV and reads the held prefix no more."""
    if p.held is None:
        return
    if p.buffer is None:
        p.buffer = p.held.kv.new_empty((*p.held.kv.shape[:3], len(p.prompt), p.held.kv.shape[4]))
    p.buffer[:, :, :, : p.held.tokens] = p.held.kv
    p.kv, p.held = p.buffer[:, :, :, : p.done], None


def _tensor(data: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(data, device=device)


def packed_segments(chunks: Sequence[Chunk], offset: int, empty: torch.Tensor) -> list[Segment]:
    """Each chunk as a segment of a packed forward (engine/packed.py), its tokens placed
    from `offset` on in chunk order. The forward writes the chunk's keys and values into its
    prompt's buffer, allocated here the first time after `empty` (an empty prompt buffer of
    the model, [layers, 2, kv_heads, 0, head_dim]) with what is known (the prefix cache's
    part) copied in."""
    segments = []
    for c in chunks:
        p = c.pending
        if p.buffer is None:
            p.buffer = empty.new_empty((*empty.shape[:3], len(p.prompt), empty.shape[4]))
            if p.kv is not None:
                p.buffer[:, :, :, : p.done] = p.kv
            p.kv = p.buffer[:, :, :, : p.done]
        segments.append(Segment(offset, c.start, c.tokens, p.buffer, held=None if p.held is None else p.held.kv))
        offset += c.tokens
    return segments


def _kept(
    c: Chunk, row: int, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `row`'s KV of its prompt's first `c.end` tokens (right-aligned in `layers`, `width`
    wide) in the prompt's own buffer, and the view of what is filled: the columns of this
    chunk are written (past what the prompt's `kv` views, so that stays as it was), or all of
    them into a new buffer the first time (they may have come from the prefix cache)."""
    p = c.pending
    buffer, lo = p.buffer, c.start
    if buffer is None:
        keys = layers[0][0]
        buffer = keys.new_empty((len(layers), 2, keys.shape[1], len(p.prompt), keys.shape[3]))
        lo = 0
    for i, (k, v) in enumerate(layers):
        buffer[i, 0, :, lo : c.end] = k[row, :, width - c.end + lo :]
        buffer[i, 1, :, lo : c.end] = v[row, :, width - c.end + lo :]
    return buffer, buffer[:, :, :, : c.end]
