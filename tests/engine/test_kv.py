"""RunningBatch on plain tensors: each row keeps exactly its own keys and values through
joins, leaves, compaction and growth. A token's key encodes (sequence, position), so a
misaligned copy shows up as a wrong number."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch

from engine import kv as kv_module
from engine.kv import KVFull, RunningBatch

LAYERS = 2


def key(seq: int, pos: int, layer: int) -> float:
    return seq * 10_000 + pos * 10 + layer


Layers = list[tuple[torch.Tensor, torch.Tensor]]


def prefill(prompts: dict[int, int]) -> tuple[Layers, torch.Tensor]:
    """What a left-padded prefill of prompts {seq: length} leaves: its per-layer keys and
    values, and its mask."""
    width = max(prompts.values())
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    layers = []
    for layer in range(LAYERS):
        keys = torch.full((len(prompts), 1, width, 1), -1.0)
        for row, (seq, length) in enumerate(prompts.items()):
            keys[row, 0, width - length :, 0] = torch.tensor([key(seq, p, layer) for p in range(length)])
            mask[row, width - length :] = 1
        layers.append((keys, -keys))
    return layers, mask


def decode(batch: RunningBatch[int], lengths: dict[int, int]) -> None:
    """One step: what a forward does to the cache, then every row is one token longer."""
    batch.decode_mask()
    for layer_no, layer in enumerate(batch.cache.layers):
        new = torch.tensor([key(seq, lengths[seq], layer_no) for seq in batch.seqs]).view(-1, 1, 1, 1)
        layer.update(new, -new)
    batch.advance()
    for seq in batch.seqs:
        lengths[seq] += 1


def assert_rows_exact(batch: RunningBatch[int], lengths: dict[int, int]) -> None:
    assert sorted(batch.seqs) == sorted(lengths)
    if batch.cache is None:  # nothing admitted yet
        return
    cols = slice(batch.start, batch.end)
    for row, seq in enumerate(batch.seqs):
        real = batch.mask[row, cols].bool()
        for layer_no, layer in enumerate(batch.cache.layers):
            expected = [key(seq, p, layer_no) for p in range(lengths[seq])]
            assert layer.keys[row, 0, cols, 0][real].tolist() == expected, (seq, layer_no)
            assert (-layer.values[row, 0, cols, 0][real]).tolist() == expected, (seq, layer_no)
    assert int(batch.mask[: batch.rows].sum()) == sum(lengths[s] for s in batch.seqs)  # nothing outside the span


def test_admit_keeps_only_the_alive_rows_of_a_prefill():
    batch: RunningBatch[int] = RunningBatch(slots=4)
    layers, mask = prefill({1: 3, 2: 5, 3: 2})
    batch.admit(layers, mask, [1, 2, 3], alive=[0, 2])
    assert batch.seqs == [1, 3]
    lengths = {1: 3, 3: 2}
    assert_rows_exact(batch, lengths)
    decode(batch, lengths)
    assert_rows_exact(batch, lengths)


def test_padding_in_the_middle_of_a_row_stays_masked_through_decode_and_leaves():
    """A prefill that reused a cached prefix may leave [pads][prefix][pads][suffix]: admit
    copies the mask as it is, and every later step keeps each row's own tokens exact."""
    layers, mask = prefill({1: 6, 2: 3})
    # Row 2 becomes [pad][pos 0][pad][pad][pos 1, 2].
    for layer_no, (keys, values) in enumerate(layers):
        keys[1, 0, :, 0] = -1.0
        keys[1, 0, [1, 4, 5], 0] = torch.tensor([float(key(2, p, layer_no)) for p in range(3)])
        values[1] = -keys[1]
    mask[1] = torch.tensor([0, 1, 0, 0, 1, 1])
    batch: RunningBatch[int] = RunningBatch(slots=4)
    batch.admit(layers, mask, [1, 2], alive=[0, 1])
    lengths = {1: 6, 2: 3}
    assert_rows_exact(batch, lengths)
    decode(batch, lengths)
    batch.admit(*prefill({3: 2}), [3], alive=[0])
    lengths[3] = 2
    decode(batch, lengths)
    assert_rows_exact(batch, lengths)
    batch.drop({0})
    del lengths[1]
    decode(batch, lengths)
    assert_rows_exact(batch, lengths)


def test_a_leaving_row_is_filled_by_the_last_and_unneeded_padding_stops_being_attended():
    batch: RunningBatch[int] = RunningBatch(slots=4)
    lengths = {1: 9, 2: 2, 3: 4}
    batch.admit(*prefill(lengths), [1, 2, 3], alive=[0, 1, 2])
    decode(batch, lengths)
    batch.drop({0})
    del lengths[1]
    assert batch.seqs == [3, 2]
    assert batch.width == max(lengths.values())  # the long row's padding columns are gone
    assert_rows_exact(batch, lengths)


def assert_read_cells_finite(batch: RunningBatch[int]) -> None:
    """Every cell attention reads (each running row over [start, end)) holds a number: a
    masked weight of 0 times NaN is still NaN."""
    if batch.cache is None or not batch.rows:
        return
    for layer in batch.cache.layers:
        for buffer in (layer.keys, layer.values):
            assert torch.isfinite(buffer[: batch.rows, :, batch.start : batch.end]).all()


@pytest.fixture
def nan_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """New slot buffers full of NaN: what `slot_buffer` hands out is never zeroed, so no
    cell of it may be read before it is written."""

    def nan_buffer(like: torch.Tensor, slots: int, capacity: int) -> torch.Tensor:
        return like.new_full((slots, like.shape[1], capacity, like.shape[3]), float("nan"))

    monkeypatch.setattr(kv_module, "slot_buffer", nan_buffer)


def churn(rng: random.Random, steps: int, length: Callable[[int], int]) -> Iterator[RunningBatch[int]]:
    """Groups joining (each prompt `length(step)` tokens long), rows leaving, every row
    decoding, for `steps` steps: each row exact and every cell attention reads a number
    after each step; yields the batch after each."""
    batch: RunningBatch[int] = RunningBatch(slots=8)
    lengths: dict[int, int] = {}
    next_seq = 1
    for step in range(steps):
        free = batch.slots - batch.rows
        if free and rng.random() < 0.3:
            group = {next_seq + i: length(step) for i in range(rng.randint(1, free))}
            next_seq += len(group)
            batch.admit(*prefill(group), list(group), alive=list(range(len(group))))
            lengths.update(group)
        if batch.rows and rng.random() < 0.15:
            leaving = {i for i in range(batch.rows) if rng.random() < 0.4}
            for i in leaving:
                del lengths[batch.seqs[i]]
            batch.drop(leaving)
        assert_read_cells_finite(batch)
        if batch.rows:
            decode(batch, lengths)
        assert_rows_exact(batch, lengths)
        assert_read_cells_finite(batch)
        yield batch


def test_churn_through_compaction_and_growth_keeps_every_row_exact(nan_buffers: None) -> None:
    rng = random.Random(5)
    capacities, starts = set(), set()
    for batch in churn(rng, 600, lambda step: 400 if step == 450 else rng.randint(1, 30)):
        capacities.add(batch.capacity)
        starts.add(batch.start)
    assert len(capacities) > 1, "the 400-token prompt should have grown the buffers"
    assert max(starts) > 0 and min(starts) == 0, "the write column should have wrapped by compaction"


def test_buffers_grow_with_the_running_rows_not_the_most_there_may_be():
    batch: RunningBatch[int] = RunningBatch(slots=64)
    lengths: dict[int, int] = {}
    for seq in range(1, 4):
        layers, mask = prefill({seq: 5 + seq})
        batch.admit(layers, mask, [seq], [0])
        lengths[seq] = 5 + seq
    assert batch.allocated == 8 and batch.cache is not None
    assert batch.cache.layers[0].keys.shape[0] == 8  # not 64
    decode(batch, lengths)
    for seq in range(4, 21):  # past 8 and 16 rows: grown twice, every row kept exact
        layers, mask = prefill({seq: 3 + seq % 5})
        batch.admit(layers, mask, [seq], [0])
        lengths[seq] = 3 + seq % 5
        decode(batch, lengths)
        assert_rows_exact(batch, lengths)
    assert batch.allocated == 32 and batch.mask.shape[0] == 32
    many: RunningBatch[int] = RunningBatch(slots=12)
    layers, mask = prefill(dict.fromkeys(range(100, 112), 4))
    many.admit(layers, mask, list(range(100, 112)), list(range(12)))
    assert many.allocated == 12  # never more than its slots


def test_buffers_stay_within_a_budget_trading_spare_rows_and_columns():
    """With a budget of cells, growth never allocates past it; a row that needs more columns
    takes them from spare rows; what cannot fit at all is refused before anything changes."""
    batch: RunningBatch[int] = RunningBatch(slots=64, budget=600)
    lengths = dict.fromkeys(range(1, 9), 20)
    batch.admit(*prefill(lengths), list(lengths), alive=list(range(8)))
    assert batch.cells <= 600 and batch.allocated >= 8
    for _ in range(40):  # 8 rows growing to 60 columns: 480 cells, within 600
        decode(batch, lengths)
        assert batch.cells <= 600
    assert_rows_exact(batch, lengths)
    assert batch.fits(8, batch.width + 1) and not batch.fits(8, 600 // 8 + 1)
    batch.drop(set(range(1, 8)))  # one row left: it may grow to 600 columns, fewer rows
    lengths = {batch.seqs[0]: lengths[batch.seqs[0]]}
    for _ in range(300):
        decode(batch, lengths)
        assert batch.cells <= 600
    assert_rows_exact(batch, lengths)
    before = (batch.allocated, batch.capacity, batch.width)
    with pytest.raises(KVFull):
        batch.admit(*prefill({99: 400}), [99], alive=[0])  # 2 rows x 401 columns: over 600
    assert (batch.allocated, batch.capacity, batch.width) == before and batch.seqs == list(lengths)
    assert_rows_exact(batch, lengths)


def test_row_kv_is_a_rows_own_tokens_without_padding():
    batch: RunningBatch[int] = RunningBatch(slots=4)
    lengths = {1: 7, 2: 3}
    batch.admit(*prefill(lengths), [1, 2], alive=[0, 1])
    decode(batch, lengths)
    for row, seq in enumerate(batch.seqs):
        kv = batch.row_kv(row)
        for layer_no, (keys, _) in enumerate(kv):
            assert keys.shape[1] == lengths[seq]
            assert [float(k) for k in keys[0, :, 0]] == [float(key(seq, p, layer_no)) for p in range(lengths[seq])]


def test_reserve_grows_the_rows_now_and_a_shrink_for_columns_keeps_the_columns_it_frees():
    batch: RunningBatch[int] = RunningBatch(slots=64, budget=40 * 300)
    lengths = {1: 5, 2: 6}
    batch.reserve(32)
    assert batch.cache is None  # nothing to shape buffers after yet
    batch.admit(*prefill(lengths), [1, 2], alive=[0, 1])
    batch.reserve(32)
    assert batch.allocated == 32 and batch.cells <= batch.budget
    assert_rows_exact(batch, lengths)
    batch.drop({1})
    del lengths[2]
    for _ in range(400):  # one row outgrows 32 rows' share of the budget: rows give way to columns
        decode(batch, lengths)
    assert_rows_exact(batch, lengths)
    assert batch.cells <= batch.budget and batch.allocated < 32
    assert batch.capacity == batch.budget // batch.allocated  # the columns the fewer rows leave
    small: RunningBatch[int] = RunningBatch(slots=64, budget=600)
    small.admit(*prefill({1: 5, 2: 6}), [1, 2], alive=[0, 1])
    small.reserve(64)  # as many rows as 600 cells hold at its length, and no KVFull
    assert small.cells <= 600 and small.allocated >= 2


@pytest.mark.parametrize("seed", [7, 13, 15])
def test_every_cell_attention_reads_is_written_first_whatever_the_churn(nan_buffers: None, seed: int) -> None:
    """Short and long prompts joining rows that decode and leave: newcomers' padding and the
    columns a wider newcomer opens for the rows already running are zeroed, never left as
    whatever the unzeroed buffers held (NaN here)."""
    rng = random.Random(seed)
    for _ in churn(rng, 300, lambda _: rng.choice([rng.randint(1, 30), rng.randint(30, 120)])):
        pass
