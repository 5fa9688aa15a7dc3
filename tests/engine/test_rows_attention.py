"""The packed rows' attention kernel (engine/rows_attention.py): SDPA's output for each row over
its own tokens only, for rows of any length (partial vector and query blocks), every head dim
it takes, the projections as strided views; a NaN stays in its row; bad inputs are refused;
where it cannot be built or does not apply, SDPA stays."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import engine.rows_attention as rows_attention
from engine.rows_attention import rows_attention_kernel, rows_kernel_for, rows_reference


@pytest.fixture(scope="module")
def built():
    kernel = rows_attention_kernel()
    assert kernel is not None, "the kernel builds on the test machine (a C++ compiler and ninja are there)"
    return kernel


def projections(lengths, heads, dim, seed=0, sharp=1.0):
    """query, key, value [1, heads, tokens, dim] as views of one fused projection (the
    layout a fused or separate linear leaves after transformers' view and transpose)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    fused = torch.randn(1, tokens, 3, heads, dim, generator=gen) * sharp
    q, k, v = (fused[:, :, i].transpose(1, 2) for i in range(3))
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)
    return q, k, v, bounds


LENGTHS = [1, 2, 15, 16, 17, 31, 33, 64, 70, 129, 3]


@pytest.mark.parametrize("vectors", [1, 2, 4, 8])
def test_each_row_attends_over_its_own_tokens_as_sdpa_does(built, vectors):
    kernel, width = built
    dim = width * vectors
    heads = 3
    for sharp in (1.0, 4.0):  # sharp softmaxes too
        q, k, v, bounds = projections(LENGTHS, heads, dim, seed=vectors, sharp=sharp)
        got = kernel(q, k, v, bounds, dim**-0.5)
        want = rows_reference(q, k, v, bounds, dim**-0.5)
        assert got.shape == (1, sum(LENGTHS), heads, dim) and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_contiguous_separate_projections_and_one_row(built):
    kernel, width = built
    dim, heads = 2 * width, 2
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, heads, 40, dim, generator=gen) for _ in range(3))
    bounds = torch.tensor([0, 40])
    torch.testing.assert_close(kernel(q, k, v, bounds, 0.2), rows_reference(q, k, v, bounds, 0.2), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bits", [0x7FC00000, 0x7FC12345, 0xFFD00F00, 0x7F800001])
def test_a_nan_stays_in_its_row(built, bits):
    """A NaN in one row's query, whatever its payload, gives NaN there (not zeros, not a
    finite guess) and leaves the other rows exact."""
    kernel, width = built
    dim = 2 * width
    q, k, v, bounds = projections([5, 9, 20], 2, dim, seed=7)
    q = q.clone()
    nan = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)[0]
    assert torch.isnan(nan)
    q[0, 1, 7, 3] = nan  # token 7: the second row (tokens 5..13), head 1
    got, want = kernel(q, k, v, bounds, 0.3), rows_reference(q, k, v, bounds, 0.3)
    assert torch.isnan(got[0, 7, 1]).all()
    keep = torch.ones(sum([5, 9, 20]), dtype=torch.bool)
    keep[7] = False
    torch.testing.assert_close(got[0, keep], want[0, keep], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("bounds_short", "bounds must run from 0 to tokens"),
        ("bounds_down", "must not decrease"),
        ("double", "float32 only"),
        ("odd_dim", "head dim"),
    ],
)
def test_bad_inputs_are_refused(built, change, message):
    kernel, width = built
    q, k, v, bounds = projections([4, 6], 2, 2 * width)
    if change == "bounds_short":
        bounds = torch.tensor([0, 4, 9])
    elif change == "bounds_down":
        bounds = torch.tensor([0, 6, 4, 10])
    elif change == "double":
        q, k, v = q.double(), k.double(), v.double()
    else:
        q, k, v = (t[..., : width + 3] for t in (q, k, v))
    with pytest.raises(RuntimeError, match=message):
        kernel(q, k, v, bounds, 0.5)


def test_the_kernel_runs_only_where_it_applies(built):
    kernel, width = built
    cpu = torch.device("cpu")
    assert rows_kernel_for(12, 2 * width, torch.float32, cpu) is kernel
    assert rows_kernel_for(12, 2 * width, torch.bfloat16, cpu) is None  # float32 only
    assert rows_kernel_for(12, width + width // 2, torch.float32, cpu) is None  # not a whole number of vectors
    assert rows_kernel_for(12, 3 * width, torch.float32, cpu) is None  # 3 vectors: not 1, 2, 4 or 8
    assert rows_kernel_for(12, 16 * width, torch.float32, cpu) is None  # 16 vectors: beyond its registers


def test_where_it_cannot_be_built_sdpa_stays(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    rows_attention_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="ferry.engine"):
            assert rows_attention.rows_attention_kernel() is None
            assert rows_kernel_for(12, 32, torch.float32, torch.device("cpu")) is None
        assert "no C++ compiler" in caplog.text and "using SDPA" in caplog.text
    finally:
        rows_attention_kernel.cache_clear()  # the next caller loads the built library again


@pytest.mark.parametrize(
    ("capability", "name", "flag", "width"),
    [
        ("AVX512", "ferry_rows_attention_avx512", "-mavx512f", 16),
        ("AVX2", "ferry_rows_attention_avx2", "-mavx2", 8),
        ("NO AVX", "ferry_rows_attention_no_avx", None, 8),
    ],
)
def test_one_library_per_cpu_capability(monkeypatch, capability, name, flag, width):
    from engine.rows_attention import _build_flags

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    built, flags, w = _build_flags()
    assert built == name and w == width and "-ffp-contract=fast" in flags
    assert (flag in flags) if flag else not any(f.startswith("-mavx") for f in flags)
