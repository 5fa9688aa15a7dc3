"""Running rows' KV in blocks (engine/blocks.py): memory follows each row's own tokens,
blocks come back when rows leave and are taken again, a budget bounds the blocks (not a
rectangle), and the engine's greedy tokens in blocks equal those of the rectangle, with
preemption where the blocks run out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.blocks import PagedBatch, blocks_for, gathered, holding
from engine.generation import HFGenerationEngine
from engine.kv import KVFull, RunningBatch
from tests.engine.test_preemption import Bounded, budget, request, unbounded
from tests.engine.test_prefill import Run, greedy, system_prompt, turn

LAYERS, KV_HEADS, DIM = 2, 2, 4


def kv_of(tokens: int, mark: float) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, dim] whose token t holds mark + t everywhere."""
    values = mark + torch.arange(tokens, dtype=torch.float32)
    return values[None, None, None, :, None].expand(LAYERS, 2, KV_HEADS, tokens, DIM).clone()


def test_memory_is_the_rows_own_tokens_not_rows_times_the_longest():
    paged, rect = PagedBatch(8, budget=None), RunningBatch(8, budget=None)
    for batch in (paged, rect):
        batch.join(kv_of(300, 0.0), "long")
        for i in range(5):
            batch.join(kv_of(20, 1000.0 * (i + 1)), f"short{i}")
    assert paged.used_cells == (blocks_for(300) + 5 * blocks_for(20)) * paged.block  # 304 + 5 x 32
    assert rect.used_cells == 6 * 300
    # The budget counts blocks: rows that the rectangle's budget refuses fit in blocks.
    budget = 480
    assert PagedBatch(8, budget).joining_fits([300], [20] * 5)
    assert not RunningBatch(8, budget).joining_fits([300], [20] * 5)


def test_rows_read_back_their_own_tokens_through_their_tables():
    batch = PagedBatch(4, budget=None)
    batch.join(kv_of(17, 0.0), "a")  # two blocks, the second holding one token
    batch.join(kv_of(5, 100.0), "b")
    lengths = batch.decode_mask()
    assert lengths.tolist() == [18, 6]
    new = torch.full((2, KV_HEADS, DIM), -1.0)
    for layer in range(LAYERS):
        batch.write(layer, new, new)
    batch.advance()
    assert batch.lengths == [18, 6]
    keys, _ = batch.row_kv(1)[0]
    assert keys.shape == (KV_HEADS, 6, DIM)
    assert keys[0, :, 0].tolist() == [100.0, 101.0, 102.0, 103.0, 104.0, -1.0]
    keys, _ = batch.row_kv(0)[1]
    assert keys[1, :, 0].tolist() == [*map(float, range(17)), -1.0]
    # The rectangle gathered for attention without the kernel: each row's tokens first.
    batch.decode_mask()
    rect_keys, _, allowed = gathered(batch, 0)
    assert allowed.sum(dim=1).tolist() == [19, 7]
    assert rect_keys[1, 0, :6, 0].tolist() == [100.0, 101.0, 102.0, 103.0, 104.0, -1.0]
    assert torch.isfinite(rect_keys).all()


def test_held_rows_keep_their_blocks_counted_and_come_back_with_their_tokens():
    batch = PagedBatch(3, budget=6 * 16)
    for tokens, mark, seq_id in ((40, 0.0, 1), (5, 100.0, 2), (32, 200.0, 3)):  # 3 + 1 + 2 full blocks: all
        batch.join(kv_of(tokens, mark), SimpleNamespace(seq_id=seq_id))
    with holding(batch, frozenset({1})):
        assert [s.seq_id for s in batch.seqs] == [3, 2] and batch.lengths == [32, 5]  # the last row took its place
        assert batch.used_blocks == 6  # still taken, and counted against the budget
        assert not batch.step_fits()  # 3's next token wants a block, and 1 still holds its own
        with pytest.raises(KVFull):
            batch.join(kv_of(1, 300.0), SimpleNamespace(seq_id=4))  # nor may a row take the held row's slot
    assert [s.seq_id for s in batch.seqs] == [3, 2, 1] and batch.lengths == [32, 5, 40]
    keys, _ = batch.row_kv(2)[1]
    assert keys[0, :, 0].tolist() == [*map(float, range(40))]
    with holding(batch, frozenset({1, 2, 3})):  # never every row: a step of none is no step
        assert batch.rows == 3
    batch.drop({0, 1})
    assert batch.used_blocks == 3 and batch.step_fits()


def test_a_leaving_rows_blocks_are_taken_again_and_the_last_row_takes_its_place():
    batch = PagedBatch(4, budget=64)  # four blocks of 16
    batch.join(kv_of(20, 0.0), "a")  # 2 blocks
    batch.join(kv_of(10, 50.0), "b")  # 1 block
    with pytest.raises(KVFull):
        batch.join(kv_of(20, 9.0), "too many")  # 2 more than the 1 free
    assert batch.seqs == ["a", "b"] and batch.used_blocks == 3  # the refusal changed nothing
    batch.drop({0})
    assert batch.seqs == ["b"] and batch.lengths == [10] and batch.used_blocks == 1
    assert batch.row_kv(0)[0][0][0, :, 0].tolist() == [50.0 + t for t in range(10)]  # moved by its table
    batch.join(kv_of(48, 7.0), "c")  # 3 full blocks: the two 'a' gave back and the free one
    assert batch.used_blocks == 4 and batch.usage == 1.0
    assert batch.row_kv(1)[1][1][0, :, 0].tolist() == [7.0 + t for t in range(48)]
    assert not batch.step_fits()  # c's 49th token needs a fifth block
    batch.drop({1})
    assert batch.step_fits() and batch.usage == 0.25


@pytest.mark.parametrize(("budget", "most"), [(None, 8), (20, 5)])
def test_the_pool_grows_with_the_rows_within_its_budget_and_keeps_what_it_held(monkeypatch, budget, most):
    import engine.blocks as blocks

    monkeypatch.setattr(blocks, "INITIAL_BLOCKS", 2)
    batch = PagedBatch(4, budget=budget, block=4)
    batch.join(kv_of(6, 0.0), "a")
    assert batch.pool_blocks == 2  # memory follows the rows
    batch.join(kv_of(9, 30.0), "b")  # 3 more blocks than the 2 it started with
    assert batch.pool_blocks == (8 if budget is None else 5)
    assert batch.row_kv(0)[0][0][0, :, 0].tolist() == [float(t) for t in range(6)]
    assert batch.row_kv(1)[0][0][0, :, 0].tolist() == [30.0 + t for t in range(9)]
    if budget is not None:
        with pytest.raises(KVFull):  # the budget's 5 blocks, all taken
            batch.join(kv_of(1, 0.0), "c")
        assert batch.pool_blocks == most and batch.usage == 1.0


@pytest.fixture(scope="module")
def rectangle(model_path) -> HFGenerationEngine:
    return HFGenerationEngine(str(model_path), max_running=16, prefix_block=16, kv_layout="rectangle")


def test_blocks_are_the_default_where_steps_pack_and_give_the_rectangles_tokens(pair, rectangle):
    on, off = pair
    assert on.kv_layout == "blocks" and isinstance(on._batch, PagedBatch)
    assert off.kv_layout == "rectangle"  # no packed steps: only packed forwards read blocks
    prompts = [system_prompt(on, f"blocksrows{i}", words=14 * i + 2) for i in range(4)] + [turn(on, "hi")]

    def script(r: Run) -> None:
        r.add(*(greedy(i + 1, p, max_tokens=20 + 3 * i) for i, p in enumerate(prompts[:3])))
        r.step(5)
        r.add(*(greedy(i + 1, p, max_tokens=18) for i, p in enumerate(prompts[3:], start=3)))
        r.drain()

    runs = []
    for engine in (on, rectangle):
        run = Run(engine)
        script(run)
        runs.append(run.tokens)
        assert engine.running == 0
    assert runs[0] == runs[1]
    assert on._batch.used_blocks == 0  # every block back in the pool


class Counted(Bounded):
    """`Bounded`, recording the most rows decoding together beside a row of 250 tokens or more."""

    most = 0

    def step(self) -> None:
        super().step()
        seqs = self.engine._batch.seqs
        if any(s.total_tokens >= 250 for s in seqs):
            self.most = max(self.most, len(seqs))


@pytest.mark.usefixtures("nan_empty")
def test_one_long_row_leaves_room_for_the_short_ones_in_blocks(pair, rectangle):
    """A budget in which the rectangle holds the long row beside one short one at most (every
    row as wide as the long one) holds all eight together in blocks, with no preemption and
    the same tokens."""
    on, off = pair
    long_prompt = system_prompt(on, "onelong", words=150)[:300]
    prompts = [long_prompt] + [turn(on, f"short question {i}") for i in range(7)]
    want = unbounded(off, prompts)
    runs = {}
    for engine in (on, rectangle):
        with budget(engine, 720) as bounded:
            before = bounded.preemptions
            run = Counted(bounded, packed=True)
            run.add(*[request(i, p, priority=0) for i, p in enumerate(prompts)])
            run.drain()
            runs[engine.kv_layout] = (bounded.preemptions - before, run.most, run.tokens)
    assert runs["blocks"][:2] == (0, 8)
    assert runs["rectangle"][1] <= 2
    assert runs["blocks"][2] == runs["rectangle"][2] == want
