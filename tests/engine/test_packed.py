"""Packed steps' attention (engine/packed.py): shared-prefix decode attention equals plain
SDPA over each row's own copy (with grouped-query attention), rows are grouped by the
deepest prompt block they share, and the engine's greedy tokens with shared-prefix
attention are those of plain decode steps, on the built-in model and on a GQA Llama."""

from __future__ import annotations

import pytest
import torch

from engine.packed import (
    MIN_SHARED_BLOCKS,
    SHARE_BLOCK,
    PackedPlan,
    SharedPrefix,
    prefix_groups,
    shared_prefix_attention,
)
from engine.prefix_cache import chain_keys
from tests.engine.test_chunks import ChunkedRun
from tests.engine.test_prefill import Run, greedy, system_prompt, turn

# The engine's buffers are allocated unzeroed: these tests run with them full of NaN.
pytestmark = pytest.mark.usefixtures("nan_empty")


def test_shared_prefix_attention_equals_sdpa_over_each_rows_own_copy():
    torch.manual_seed(0)
    rows, kv_heads, group, dim, width = 6, 2, 4, 16, 40
    heads = kv_heads * group
    keys = torch.randn(rows, kv_heads, width, dim)
    values = torch.randn(rows, kv_heads, width, dim)
    # Rows right-aligned at column 39 (the new token's); lengths 30, 34, 39, 25, 36, 20.
    lengths = [30, 34, 39, 25, 36, 20]
    first = [width - n for n in lengths]
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r, f in enumerate(first):
        mask[r, f:] = True
    # Rows 0, 1, 2 share 16 tokens; rows 3, 4 share 8; row 5 shares nothing.
    for members, tokens in (([0, 1, 2], 16), ([3, 4], 8)):
        source = members[0]
        for r in members[1:]:
            keys[r, :, first[r] : first[r] + tokens] = keys[source, :, first[source] : first[source] + tokens]
            values[r, :, first[r] : first[r] + tokens] = values[source, :, first[source] : first[source] + tokens]
    shared = [
        SharedPrefix(torch.tensor([0, 1, 2]), 0, first[0], 16),
        SharedPrefix(torch.tensor([3, 4]), 3, first[3], 8),
    ]
    own = torch.tensor([first[0] + 16, first[1] + 16, first[2] + 16, first[3] + 8, first[4] + 8, first[5]])
    plan = PackedPlan(rows, [(keys, values)], 0, width - 1, mask[:, None, None, :], [], shared, own)
    query = torch.randn(rows, heads, dim)
    got = shared_prefix_attention(query, plan, 0, dim**-0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2),
        keys.repeat_interleave(group, dim=1),
        values.repeat_interleave(group, dim=1),
        attn_mask=mask[:, None, None, :],
    ).squeeze(2)
    assert torch.allclose(got, expected, atol=1e-5)


def test_rows_are_grouped_by_the_deepest_block_they_share():
    system = list(range(1, 5 * SHARE_BLOCK + 1))

    def chain(prompt: list[int]) -> list[bytes]:
        return chain_keys(prompt, SHARE_BLOCK, (len(prompt) - 1) // SHARE_BLOCK)

    a = chain(system + [900 + i for i in range(20)])
    b = chain(system + [900 + i for i in range(20)] + [7])  # shares all of a's blocks
    c = chain(system[: 3 * SHARE_BLOCK] + [500 + i for i in range(40)])  # shares 3 blocks
    d = chain(system[: 3 * SHARE_BLOCK] + [600 + i for i in range(40)])
    alone = chain([300 + i for i in range(80)])
    groups = prefix_groups([a, b, c, d, alone])
    assert sorted((rows, blocks) for rows, blocks in groups) == [([0, 1], 6), ([2, 3], 3)]
    # Fewer than half the rows sharing: not worth it.
    assert prefix_groups([a, b, alone, chain([400 + i for i in range(80)]), chain([700 + i for i in range(80)])]) == []
    # Less than MIN_SHARED_BLOCKS shared: no group.
    short = system[: (MIN_SHARED_BLOCKS - 1) * SHARE_BLOCK]
    assert prefix_groups([chain(short + [1] * 40), chain(short + [2] * 40)]) == []


def test_decode_with_shared_prefixes_gives_the_tokens_of_plain_decode(pair):
    on, off = pair  # off runs plain decode steps, each row over its own copy
    system = system_prompt(on, "sharedattn", words=150)
    prompts = [system + turn(on, f" question {i} about the harbour") for i in range(5)]
    prompts.append(system_prompt(on, "sharedattnalone", words=60))

    def script(r: Run | ChunkedRun) -> None:
        r.add(*(greedy(i + 1, p, max_tokens=14 + i) for i, p in enumerate(prompts[:3])))
        r.step(2)
        r.add(*(greedy(i + 1, p, max_tokens=10) for i, p in enumerate(prompts[3:], start=3)))
        r.drain()

    shared, plain = ChunkedRun(on, budget=64, packed=True), Run(off)
    groups = []
    plan = on._sharing.plan

    def spy(seqs, column, device):
        out = plan(seqs, column, device)
        groups.append(len(out[0]))
        return out

    on._sharing.plan = spy  # type: ignore[method-assign]
    try:
        script(shared)
    finally:
        del on._sharing.plan
    script(plain)
    assert shared.tokens == plain.tokens
    assert max(groups) >= 1  # shared-prefix attention ran


def test_shared_prefix_attention_holds_when_the_columns_move(pair, monkeypatch):
    """The write column reaches the buffers' end with rows left behind by a finished one:
    the step compacts or grows them, and the groups' columns are read after it."""
    from engine.kv import RunningBatch

    on, off = pair
    moved = []
    ensure = RunningBatch._ensure_room

    def spy(self, needed):
        before = self.start
        ensure(self, needed)
        if self.start != before and self is on._batch:
            moved.append(before)

    monkeypatch.setattr(RunningBatch, "_ensure_room", spy)
    for engine in (on, off):  # fresh buffers (an earlier test's may be wider than this one needs)
        engine._batch = RunningBatch(engine.max_running)
    system = system_prompt(on, "movingcols", words=45)
    long_own = system + turn(on, " a much longer question " * 12)

    def script(r: Run) -> None:
        r.add(*(greedy(i, system + turn(on, f" short {i}"), max_tokens=180) for i in (1, 2, 3)))
        r.add(greedy(4, long_own, max_tokens=3))  # the widest row, gone after three tokens
        r.drain()

    shared, plain = Run(on), Run(off)
    script(shared)
    script(plain)
    assert moved and max(moved) > 0  # columns moved while rows had been left behind
    assert shared.tokens == plain.tokens


def test_a_failure_after_a_packed_forward_is_not_run_again(pair, monkeypatch):
    on, _ = pair
    on.add([greedy(1, turn(on, "running on"), max_tokens=20)])
    on.enqueue([greedy(2, system_prompt(on, "afterforward", words=30), max_tokens=5)])
    forwards = []
    packed = on._forward.packed

    def counting(*args):
        forwards.append(1)
        return packed(*args)

    def broken_sample(*args):
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(on._forward, "packed", counting)
    monkeypatch.setattr(on._next, "sample", broken_sample)
    with pytest.raises(RuntimeError, match="sampling failed"):
        on.step_with_prefill(None)
    assert forwards == [1]  # not retried apart: the rows had advanced
    assert on.running == 0 and on.kv_tokens == 0


def test_a_model_whose_attention_never_sees_the_plan_runs_its_steps_apart(pair):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.packed import IMPLEMENTATION, packed_attention

    on, _ = pair
    assert on._forward.packed_works(on.device)

    def deaf(module, query, key, value, attention_mask, ferry_plan=None, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(IMPLEMENTATION, deaf)
    try:
        assert not on._forward.packed_works(on.device)
    finally:
        AttentionInterface.register(IMPLEMENTATION, packed_attention)
