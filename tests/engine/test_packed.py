"""Packed steps' attention (engine/packed.py) and shared prefixes (engine/sharing.py):
shared-prefix decode attention over a held prefix equals plain SDPA over each row's whole
sequence (with grouped-query attention), a joining row takes the deepest prefix held or
shared, and the engine's greedy tokens with shared prefixes held apart are those of plain
decode steps, on the built-in model and on a GQA Llama."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.packed import PackedPlan, Segment, SharedPrefix, packed_attention, shared_prefix_attention
from engine.prefix_cache import chain_keys
from engine.sharing import MAX_GROUPS, MIN_SHARED_BLOCKS, SHARE_BLOCK, HeldPrefix, PrefixSharing
from tests.engine.test_chunks import ChunkedRun
from tests.engine.test_prefill import Run, greedy, system_prompt, turn

# The engine's buffers are allocated unzeroed: these tests run with them full of NaN.
pytestmark = pytest.mark.usefixtures("nan_empty")


def test_shared_prefix_attention_equals_sdpa_over_each_rows_whole_sequence():
    """Rows 0-2 reference one held prefix of 16 tokens, rows 3-4 another of 8, row 5 none:
    their slots hold only what follows their prefix; the result is SDPA over each row's
    prefix and own part together."""
    torch.manual_seed(0)
    rows, kv_heads, group, dim, width = 6, 2, 4, 16, 40
    heads = kv_heads * group
    prefixes = [torch.randn(1, 2, kv_heads, 16, dim), torch.randn(1, 2, kv_heads, 8, dim)]
    held_by = [0, 0, 0, 1, 1, None]
    own = [14, 18, 23, 17, 28, 20]  # own tokens in the slot, right-aligned at column 39
    keys = torch.full((rows, kv_heads, width, dim), float("nan"))
    values = torch.full((rows, kv_heads, width, dim), float("nan"))
    mask = torch.zeros(rows, width, dtype=torch.bool)
    whole_k, whole_v = [], []
    for r, n in enumerate(own):
        keys[r, :, width - n :] = torch.randn(kv_heads, n, dim)
        values[r, :, width - n :] = torch.randn(kv_heads, n, dim)
        keys[r, :, : width - n] = 0  # the engine zeroes what attention may read
        values[r, :, : width - n] = 0
        mask[r, width - n :] = True
        k, v = keys[r, :, width - n :], values[r, :, width - n :]
        if held_by[r] is not None:
            held = prefixes[held_by[r]][0]
            k, v = torch.cat((held[0], k), 1), torch.cat((held[1], v), 1)
        whole_k.append(k)
        whole_v.append(v)
    shared = [SharedPrefix(torch.tensor([0, 1, 2]), prefixes[0]), SharedPrefix(torch.tensor([3, 4]), prefixes[1])]
    own_start = torch.tensor([width - n for n in own])
    plan = PackedPlan(rows, [(keys, values)], 0, width - 1, mask[:, None, None, :], [], shared, own_start)
    query = torch.randn(rows, heads, dim)
    got = shared_prefix_attention(query, plan, 0, dim**-0.5)
    for r in range(rows):
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[r].unsqueeze(1),
            whole_k[r].repeat_interleave(group, dim=0),
            whole_v[r].repeat_interleave(group, dim=0),
        ).squeeze(1)
        assert torch.allclose(got[r], expected, atol=1e-5)


def test_chunks_over_a_held_prefix_equal_sdpa_over_their_whole_prompts():
    """Two prompts start with one held prefix of 12 tokens (their buffers hold none of it,
    NaN there), a third holds all of itself: each chunk's tokens attend their own prompt
    causally, the prefix included, as SDPA over the whole prompt does."""
    torch.manual_seed(1)
    kv_heads, group, dim, first = 2, 2, 8, 12
    heads = kv_heads * group
    held = torch.randn(1, 2, kv_heads, first, dim)
    ends, starts = [20, 31, 15], [12, 25, 9]  # each chunk runs [start, end) of its prompt
    segments, whole, offset = [], [], 0
    for n, (start, end) in enumerate(zip(starts, ends, strict=True)):
        kv = torch.randn(1, 2, kv_heads, end, dim)
        full = kv.clone()
        if n < 2:
            full[:, :, :, :first] = held
            kv[:, :, :, :first] = float("nan")
        segments.append(Segment(offset, start, end - start, kv, held=held if n < 2 else None))
        whole.append(full)
        offset += end - start
    plan = PackedPlan(0, [], 0, 0, None, segments)
    query = torch.randn(1, heads, offset, dim)
    module = torch.nn.Module()
    module.layer_idx = 0  # type: ignore[assignment]
    module.num_key_value_groups = group  # type: ignore[assignment]
    got, _ = packed_attention(module, query, query, query, None, ferry_plan=plan, scaling=dim**-0.5)
    for s, full in zip(segments, whole, strict=True):
        q = query[0, :, s.offset : s.offset + s.tokens]  # [heads, tokens, dim]
        k, v = (full[0, j, :, : s.end].repeat_interleave(group, dim=0) for j in (0, 1))
        mask = torch.arange(s.end)[None, :] <= torch.arange(s.start, s.end)[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.allclose(got[0, s.offset : s.offset + s.tokens], expected.transpose(0, 1), atol=1e-5)


def test_prompts_joining_beside_rows_of_a_held_prefix_read_it_and_give_the_tokens_of_plain_decode(pair, monkeypatch):
    import engine.chunks as chunks

    on, off = pair
    system = system_prompt(on, "heldchunks", words=120)
    prompts = [system + turn(on, f" crossing {i} at the pier") for i in range(6)]
    read: list[bool] = []
    packed_segments = chunks.packed_segments

    def script(r: Run | ChunkedRun) -> None:
        r.add(*(greedy(i + 1, p, max_tokens=12) for i, p in enumerate(prompts[:2])))
        r.step(2)
        r.add(*(greedy(i + 1, p, max_tokens=8 + i) for i, p in enumerate(prompts[2:], start=2)))
        r.drain()

    def spy(*args):  # type: ignore[no-untyped-def]
        segments = packed_segments(*args)
        read.extend(s.held is not None for s in segments)
        return segments

    monkeypatch.setattr(chunks, "packed_segments", spy)
    shared = ChunkedRun(on, budget=None, packed=True)
    script(shared)
    plain = Run(off)
    script(plain)
    assert shared.tokens == plain.tokens
    assert any(read)  # the later prompts' chunks read the held prefix, not a copy of it
    assert on.kv_tokens == 0 and on._sharing.tokens == 0  # all let go once the rows left


@dataclass(eq=False)
class Row:
    seq_id: int
    chain: list[bytes]
    length: int
    shared: HeldPrefix | None = None

    @property
    def total_tokens(self) -> int:
        return self.length


def _chain(prompt: list[int]) -> list[bytes]:
    return chain_keys(prompt, SHARE_BLOCK, (len(prompt) - 1) // SHARE_BLOCK)


def _kv(tokens: int) -> torch.Tensor:
    return torch.arange(float(tokens)).reshape(1, 1, 1, tokens, 1).expand(2, 2, 1, tokens, 1).clone()


def test_a_joining_row_takes_the_deepest_prefix_held_or_shared_with_another():
    system = list(range(1, 5 * SHARE_BLOCK + 1))
    sharing = PrefixSharing()
    a = Row(1, _chain(system + [900 + i for i in range(20)]), 101)
    b = Row(2, _chain(system + [800 + i for i in range(20)]), 101)
    alone = Row(3, _chain([300 + i for i in range(80)]), 80)
    asked = []

    def prefix(n: int) -> torch.Tensor:
        asked.append(n)
        return _kv(n)

    # Nobody else shares: nothing held, nothing taken.
    assert sharing.take(a, prefix, lambda: [alone]) == 0 and a.shared is None and asked == []
    # b shares the five system blocks with a: a prefix of 80 tokens is copied once from b's KV.
    assert sharing.take(b, prefix, lambda: [a, alone]) == 5 * SHARE_BLOCK
    assert asked == [80] and b.shared is not None and b.shared.tokens == 80
    # a (rejoining, say) takes the held one without asking anyone or copying anything.
    assert sharing.take(a, prefix, lambda: pytest.fail("others asked")) == 80 and a.shared is b.shared
    assert asked == [80] and sharing.tokens == 80
    # Fewer than MIN_SHARED_BLOCKS shared: no prefix of its own.
    short = system[: (MIN_SHARED_BLOCKS - 1) * SHARE_BLOCK]
    c, d = Row(4, _chain(short + [1] * 40), 60), Row(5, _chain(short + [2] * 40), 60)
    assert sharing.take(c, prefix, lambda: [d]) == 0 and c.shared is None


def test_at_most_max_groups_prefixes_are_held():
    sharing = PrefixSharing()
    rows = []
    for g in range(MAX_GROUPS + 1):
        prompt = [1000 * (g + 1) + i for i in range(3 * SHARE_BLOCK + 1)]
        first, second = Row(2 * g, _chain(prompt), 60), Row(2 * g + 1, _chain(prompt), 60)
        rows.append(sharing.take(second, _kv, lambda first=first: [first]))
    assert rows == [3 * SHARE_BLOCK] * MAX_GROUPS + [0]


def test_the_plan_groups_rows_by_the_prefix_they_reference_and_unused_ones_are_let_go():
    system = list(range(1, 4 * SHARE_BLOCK + 1))
    sharing = PrefixSharing()
    a = Row(1, _chain(system + [7] * 10), 80)
    b = Row(2, _chain(system + [8] * 10), 90)
    plain = Row(3, _chain([5] * 30), 30)
    sharing.take(b, _kv, lambda: [a])
    sharing.take(a, _kv, lambda: [b])
    groups, own = sharing.plan([plain, a, b], column=100, device=torch.device("cpu"))
    assert len(groups) == 1 and groups[0].rows.tolist() == [1, 2] and groups[0].kv.shape[3] == 64
    # Each row's slot holds all but its last token, less the held prefix: right-aligned before 100.
    assert own is not None and own.tolist() == [100 - 29, 100 - (79 - 64), 100 - (89 - 64)]
    assert sharing.plan([plain], column=100, device=torch.device("cpu")) == ([], None)
    # Held until the step's joins are done (the room they were given counted on it), then let go.
    assert sharing.tokens == 64
    sharing.let_go([plain])
    assert sharing.tokens == 0 and sharing.held(a.chain) is None


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
    groups: list[int] = []
    widths: list[int] = []
    plan = on._sharing.plan

    def spy(seqs, column, device):
        out = plan(seqs, column, device)
        groups.append(len(out[0]))
        if out[0]:  # the rows' slots hold only what follows the prefix held for them
            widths.append(on._batch.width)
        return out

    on._sharing.plan = spy  # type: ignore[method-assign]
    try:
        script(shared)
    finally:
        del on._sharing.plan
    script(plain)
    assert shared.tokens == plain.tokens
    assert max(groups) >= 1  # shared-prefix attention ran
    assert widths and max(widths) < len(system) - 2 * SHARE_BLOCK


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


def test_a_failed_packed_step_over_held_prefixes_runs_apart_and_gives_the_plain_tokens(pair, monkeypatch):
    """Rows reference a held system prompt and a prompt of it is planned to read it; the
    step's packed forward raises once: the rows decode and the chunk runs apart (padded,
    its held columns filled in), with the plain tokens, and the held prefix is let go only
    after the call (the room the prompt was given counted on it)."""
    on, off = pair
    system = system_prompt(on, "heldfallback", words=90)
    prompts = [system + turn(on, f" a ticket for boat {i}") for i in range(3)]
    let_go_calls: list[int] = []
    let_go = on._sharing.let_go

    def script(r: Run | ChunkedRun) -> None:
        r.add(*(greedy(i + 1, p, max_tokens=10) for i, p in enumerate(prompts[:2])))
        r.step(2)
        r.add(greedy(3, prompts[2], max_tokens=6))
        r.drain()

    shared = ChunkedRun(on, budget=None, packed=True)
    shared.add(*(greedy(i + 1, p, max_tokens=10) for i, p in enumerate(prompts[:2])))
    shared.step(2)
    assert on._sharing.tokens > 0  # the two rows reference one held prefix
    shared.add(greedy(3, prompts[2], max_tokens=6))
    packed = on._forward.packed
    failures = [RuntimeError("packed forward failed once")]

    def failing_once(*args):  # type: ignore[no-untyped-def]
        if failures and args[2].segments:
            raise failures.pop()
        return packed(*args)

    monkeypatch.setattr(on._forward, "packed", failing_once)
    monkeypatch.setattr(on._sharing, "let_go", lambda seqs: (let_go_calls.append(len(seqs)), let_go(seqs)))
    shared.step()
    assert not failures and let_go_calls == [3]  # once, at the end of the call, all three rows running
    shared.drain()
    plain = Run(off)
    script(plain)
    assert shared.tokens == plain.tokens
