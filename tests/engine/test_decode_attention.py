"""The decode attention kernel (engine/decode_attention.py): SDPA's output over each row's
own columns, never reading a masked cell, with grouped-query heads and strided views; the
engine's greedy tokens through it are those of plain SDPA decode steps (the built-in model
and a GQA Llama); where it cannot be built, SDPA stays."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

import engine.decode_attention as decode_attention
from engine.decode_attention import (
    DecodeAttention,
    decode_attention_kernel,
    kernel_for,
    matches_paged_reference,
    matches_sdpa,
    paged_attention_kernel,
    paged_reference,
    reference,
)
from engine.generation import HFGenerationEngine
from tests.engine.conftest import BLOCK
from tests.engine.test_prefill import Run, greedy, system_prompt


@pytest.fixture(scope="module")
def kernel() -> DecodeAttention:
    built = decode_attention_kernel()
    assert built is not None, "the kernel builds on the test machine (a C++ compiler and ninja are there)"
    return built


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)])
def test_kernel_equals_sdpa_over_the_columns_each_row_keeps(kernel, heads, kv_heads):
    gen = torch.Generator().manual_seed(heads + kv_heads)
    rows, width, dim = 9, 37, 32
    # Views into wider buffers, as the running batch's slots are: more rows, more columns.
    keys = torch.randn(rows + 3, kv_heads, width + 11, dim, generator=gen)[:, :, 5 : 5 + width]
    values = torch.randn(rows + 3, kv_heads, width + 11, dim, generator=gen)[:, :, 5 : 5 + width]
    query = torch.randn(rows, heads, dim, generator=gen)
    lengths = torch.randint(1, width + 1, (rows + 3,), generator=gen)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()  # right-aligned rows
    mask[0, width // 2] = 0  # and holes inside a row
    mask[1, ::3] = 0
    mask[:, -1] = 1
    scale = 0.3
    want = reference(query, keys, values, mask, scale)
    # A masked cell may hold anything (a row that left, memory never written): never read.
    masked = (mask == 0)[:, None, :, None].expand_as(keys)
    keys, values = keys.masked_fill(masked, float("nan")), values.masked_fill(masked, float("inf"))
    got = kernel(query, keys, values, mask, scale)
    assert got.shape == (rows, heads, dim)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dim", [8, 12, 40, 64, 96, 128])
def test_every_head_dimension_through_the_vector_path_or_the_plain_loops(kernel, dim):
    """Multiples of 8 run the vector path (blocks of 64, 32, 16 and 8 columns of the output;
    four keys at a time, the rest one by one), others the plain loops: SDPA's output either way,
    for rows of 1 to 45 kept columns."""
    gen = torch.Generator().manual_seed(dim)
    rows, heads, kv_heads, width = 45, 4, 2, 45
    keys = torch.randn(rows, kv_heads, width + 3, dim, generator=gen)[:, :, 3:]
    values = torch.randn(rows, kv_heads, width + 3, dim, generator=gen)[:, :, 3:]
    query = torch.randn(rows, heads, dim, generator=gen) * 3  # sharp softmaxes too
    mask = (torch.arange(width)[None, :] >= width - 1 - torch.arange(rows)[:, None]).long()  # row r keeps r + 1
    want = reference(query, keys, values, mask, dim**-0.5)
    assert torch.allclose(kernel(query, keys, values, mask, dim**-0.5), want, atol=1e-5, rtol=1e-4)


def test_a_non_finite_query_gives_non_finite_output_not_zeros(kernel):
    keys = values = torch.ones(1, 1, 9, 16)
    query = torch.ones(1, 1, 16)
    query[0, 0, 3] = float("nan")
    out = kernel(query, keys, values, torch.ones(1, 9, dtype=torch.long), 1.0)
    assert torch.isnan(out).all()


def test_a_row_with_no_column_to_attend_gets_zeros(kernel):
    keys = values = torch.ones(2, 1, 4, 8)
    mask = torch.tensor([[0, 0, 0, 0], [1, 1, 0, 1]])
    out = kernel(torch.ones(2, 1, 8), keys, values, mask, 1.0)
    assert out[0].abs().sum() == 0 and torch.allclose(out[1], torch.ones(1, 8))


def test_kernel_refuses_what_it_cannot_read(kernel):
    keys = torch.zeros(1, 1, 4, 8)
    mask = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.zeros(1, 1, 8, dtype=torch.float64), keys.double(), keys.double(), mask, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.zeros(1, 1, 8), keys.transpose(2, 3).contiguous().transpose(2, 3), keys, mask, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        kernel(torch.zeros(1, 3, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), mask, 1.0)


def test_a_kernel_that_disagrees_with_sdpa_is_refused():
    def off_by_a_little(query, keys, values, mask, scale):
        return reference(query, keys, values, mask, scale) + 1e-3

    assert matches_sdpa(reference)
    assert not matches_sdpa(off_by_a_little)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 16), (9, 3, 64), (6, 1, 12)])
def test_paged_kernel_reads_each_row_through_its_blocks(kernel, heads, kv_heads, dim):
    paged = paged_attention_kernel()
    assert paged is not None
    gen = torch.Generator().manual_seed(heads * dim)
    block, pool_blocks = 16, 40
    lengths = torch.tensor([1, 16, 17, 45, 3])
    # Each row's blocks scattered through the pool; every slot no row reads is NaN, so a
    # read past a row's tokens or outside its blocks shows.
    blocks = torch.randperm(pool_blocks, generator=gen)[:15].reshape(5, 3)
    key_pool = torch.full((pool_blocks * block, kv_heads, dim), float("nan"))
    value_pool = torch.full((pool_blocks * block, kv_heads, dim), float("nan"))
    for r, n in enumerate(lengths.tolist()):
        j = torch.arange(n)
        slots = blocks[r, j // block] * block + j % block
        key_pool[slots] = torch.randn(n, kv_heads, dim, generator=gen)
        value_pool[slots] = torch.randn(n, kv_heads, dim, generator=gen)
    query = torch.randn(5, heads, dim, generator=gen)
    with torch.inference_mode():
        out, lse = paged(query, key_pool, value_pool, blocks, lengths, block, dim**-0.5)
        want, want_lse = paged_reference(query, key_pool, value_pool, blocks, lengths, block, dim**-0.5)
    assert torch.isfinite(out).all() and torch.allclose(out, want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(lse, want_lse, atol=1e-5, rtol=1e-4)


def test_paged_kernel_refuses_a_block_outside_its_pool(kernel):
    paged = paged_attention_kernel()
    assert paged is not None
    pool = torch.zeros(32, 1, 8)
    with pytest.raises(RuntimeError, match="outside the pools"):
        paged(torch.zeros(1, 1, 8), pool, pool, torch.tensor([[5]]), torch.tensor([4]), 16, 1.0)
    assert matches_paged_reference(paged)
    assert not matches_paged_reference(lambda *a: tuple(t + 1e-3 for t in paged_reference(*a)))


@pytest.mark.parametrize("layout", ["blocks", "rectangle"])
def test_decode_through_the_kernel_gives_the_tokens_of_sdpa_decode(pair, model_path, kernel, layout):
    on, off = pair  # `off` runs plain SDPA decode steps over the rectangle
    if layout == "rectangle":
        on = HFGenerationEngine(str(model_path), max_running=16, prefix_block=BLOCK, kv_layout="rectangle")
    assert on.kv_layout == layout and on._decode_kernel is kernel and off._decode_kernel is None
    attribute = "_paged_kernel" if layout == "blocks" else "_decode_kernel"
    used = getattr(on, attribute)
    assert used is not None
    calls = []

    def counting(*args):
        calls.append(args[0].shape[0])
        return used(*args)

    # Prompts of different lengths that share no prefix (shared ones take engine/packed.py's
    # shared-prefix attention instead).
    prompts = [system_prompt(on, f"kernelrows{i}", words=12 * i + 3) for i in range(3)] + [on.encode_prompt("short")]

    def script(r: Run) -> None:
        r.add(*(greedy(i + 1, p, max_tokens=9 + 3 * i) for i, p in enumerate(prompts[:2])))
        r.step(3)
        r.add(*(greedy(i + 1, p, max_tokens=8) for i, p in enumerate(prompts[2:], start=2)))
        r.drain()

    setattr(on, attribute, counting)
    try:
        through_kernel = Run(on)
        script(through_kernel)
    finally:
        setattr(on, attribute, used)
    plain = Run(off)
    script(plain)
    assert through_kernel.tokens == plain.tokens
    assert calls and max(calls) == 4  # rows of different lengths decoded together through it


def test_where_it_cannot_be_built_the_engine_keeps_sdpa(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    decode_attention_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="ferry.engine"):
            assert decode_attention.decode_attention_kernel() is None
        assert "no C++ compiler" in caplog.text and "using SDPA" in caplog.text
    finally:
        decode_attention_kernel.cache_clear()  # the next caller loads the built library again


def test_native_attention_off_keeps_sdpa(tiny_chat_dir):
    from engine.generation import HFGenerationEngine

    engine = HFGenerationEngine(str(tiny_chat_dir), max_running=4, native_attention=False)
    assert engine._decode_kernel is None


def test_the_kernel_runs_only_where_wanted_and_it_applies(kernel):
    layer = torch.nn.Linear(2, 2)
    assert kernel_for(layer, True) is kernel
    assert kernel_for(layer, False) is None
    assert kernel_for(layer.double(), True) is None  # float32 only


def test_a_build_lock_left_by_a_killed_build_is_cleared(monkeypatch, tmp_path, caplog):
    from torch.utils.cpp_extension import _get_build_directory

    from engine.decode_attention import STALE_LOCK_S, _clear_stale_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = Path(_get_build_directory("ferry_probe", verbose=False)) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    _clear_stale_lock("ferry_probe")
    assert lock.exists()  # a build may be running: its lock is kept
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="ferry.engine"):
        _clear_stale_lock("ferry_probe")
    assert not lock.exists() and "stale build lock" in caplog.text


@pytest.mark.parametrize(
    ("capability", "name", "vectors"),
    [("AVX2", "ferry_decode_attention_avx2", True), ("NO AVX", "ferry_decode_attention_no_avx", False)],
)
def test_one_library_per_cpu_capability(monkeypatch, capability, name, vectors):
    from engine.decode_attention import _build_flags

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    built, flags = _build_flags()
    assert built == name and ("-mavx2" in flags) is vectors


@pytest.mark.parametrize(
    ("layout", "said"), [("blocks", "rows gathered from now on"), ("rectangle", "SDPA from now on")]
)
def test_a_kernel_that_raises_mid_traffic_is_dropped_for_sdpa(pair, model_path, kernel, caplog, layout, said):
    on, off = pair
    if layout == "rectangle":
        on = HFGenerationEngine(str(model_path), max_running=16, prefix_block=BLOCK, kv_layout="rectangle")
    attribute = "_paged_kernel" if layout == "blocks" else "_decode_kernel"
    used = getattr(on, attribute)

    def broken(*args):
        raise RuntimeError("decode_attention: shapes disagree")

    prompts = [system_prompt(on, f"kernelfails{i}", words=9 * i + 3) for i in range(3)]
    setattr(on, attribute, broken)
    try:
        with caplog.at_level(logging.ERROR, logger="ferry.engine"):
            failing = Run(on)
            failing.add(*(greedy(i + 1, p, max_tokens=6) for i, p in enumerate(prompts)))
            failing.drain()
        assert getattr(on, attribute) is None  # dropped after the first failure, not retried every step
        assert caplog.text.count(said) == 1
    finally:
        setattr(on, attribute, used)
    plain = Run(off)
    plain.add(*(greedy(i + 1, p, max_tokens=6) for i, p in enumerate(prompts)))
    plain.drain()
    assert failing.tokens == plain.tokens  # every sequence finished, the failed step run again plainly
