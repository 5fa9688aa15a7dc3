"""Attention over packed rows through a small C++ kernel (engine/rows_attention.cpp), built
for this machine on first use.

A packed encoder batch (engine/packed_encoder.py) is one row of tokens in which each input
attends over its own tokens only. Through SDPA that is one call per input and layer on a
slice of the projections, then a concatenation and a transpose: on all-MiniLM-L6-v2 (12
heads of 32) SDPA ran 6-12 GFLOP/s on 17-token inputs, where the per-call cost is the
whole cost, and 50-70 on 250-token ones (dim 32 leaves each product small). The kernel
runs every input and head of a layer in one call, reads the projections where they lie and
writes the output in the layout the output projection reads; each (input, head) is a
blocked product of queries by transposed keys with their maxima kept, exponentials a
vector at a time, and the values weighted with the outputs in registers. Measured in
isolation, one thread (`python -m loadtests.rows_attention`): 2.9-3.2x SDPA's time on
17-token inputs, 1.3-1.5x on 200-250-token ones.

Built with torch's JIT extension builder like the decode kernel (engine/decode_attention.py:
its lock and path handling), once per machine and source, into a library of its own; 16-float
vectors where torch found AVX-512, 8 otherwise. Head dims of 1, 2, 4 or 8 vectors (16, 32,
64, 128 with AVX-512; 8-64 with AVX2): others, or a build or check that fails, keep the
TorchScript loop over SDPA, logged once. Float32 on the CPU only; the softmax sums in
another order than SDPA's, so outputs differ from it in the last bits (checked at build
against SDPA, and the packed forward against the padded one at load).
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from .decode_attention import _BUILDING, _clear_stale_lock, _ninja_on_path

log = logging.getLogger("ferry.engine")

SOURCE = Path(__file__).with_name("rows_attention.cpp")

# query, key, value [1, heads, tokens, dim] (last dim contiguous), bounds [rows + 1] int64,
# scale -> [1, tokens, heads, dim]
RowsAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _build_flags() -> tuple[str, list[str], int]:
    """The library's name, its compiler flags and its vector width (floats) for this CPU:
    vector instructions only where torch's own dispatch found them."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", "NO AVX", ...
    # -ffp-contract=fast: the builder compiles ISO C++ (-std=c++17), where GCC would not fuse
    # a multiply and an add into one FMA; every product here is such a pair.
    flags = ["-O3", "-fopenmp", "-ffp-contract=fast"]
    width = 8
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    if capability == "AVX512":
        flags += ["-mavx512f"]
        width = 16
    return "ferry_rows_attention_" + re.sub(r"\W+", "_", capability.lower()), flags, width


@functools.cache
def rows_attention_kernel() -> tuple[RowsAttention, int] | None:
    """The kernel and its vector width, built or loaded on first call and checked against
    SDPA; None (logged once) where it cannot be."""
    with _BUILDING:
        return _build()


def _build() -> tuple[RowsAttention, int] | None:
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        name, flags, width = _build_flags()
        _clear_stale_lock(name)
        load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)
        kernel: RowsAttention = torch.ops.ferry.rows_attention
        if not all(rows_match_sdpa(kernel, 3, width * n) for n in (1, 2)):
            log.warning("packed rows' attention kernel disagrees with SDPA on this host; using SDPA")
            return None
    except Exception as exc:  # no compiler, no ninja, no headers, a cache it cannot write
        log.warning("packed rows' attention kernel unavailable (%s: %s); using SDPA", type(exc).__name__, exc)
        return None
    log.info("packed rows' attention kernel %s loaded", name)
    return kernel, width


def rows_kernel_for(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> RowsAttention | None:
    """The kernel for packed rows of `heads` x `head_dim` where it applies (float32 on the
    CPU, a head dim of 1, 2, 4 or 8 vectors) and gives SDPA's outputs at that shape; None
    keeps SDPA."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    built = rows_attention_kernel()
    if built is None:
        return None
    kernel, width = built
    if head_dim % width or head_dim // width not in (1, 2, 4, 8):
        log.info("packed rows' attention kernel: head dim %d is not 1, 2, 4 or 8 x %d; using SDPA", head_dim, width)
        return None
    return kernel if rows_match_sdpa(kernel, heads, head_dim) else None


def rows_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, scale: float
) -> torch.Tensor:
    """What the kernel computes, through SDPA per row: [1, tokens, heads, dim]."""
    cuts = bounds.tolist()
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], scale=scale
        )
        for lo, hi in itertools.pairwise(cuts)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def rows_match_sdpa(kernel: RowsAttention, heads: int, dim: int) -> bool:
    """The kernel against SDPA on rows of 1 to 70 tokens (partial vector blocks, partial
    query blocks), the projections as strided views of one fused [tokens, 3 x heads x dim]."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 7, 33, 70, 16, 2]
    tokens = sum(lengths)
    fused = torch.randn(1, tokens, 3, heads, dim, generator=gen)
    query, key, value = (fused[:, :, i].transpose(1, 2) for i in range(3))
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)
    scale = dim**-0.5
    with torch.inference_mode():
        got, want = kernel(query, key, value, bounds, scale), rows_reference(query, key, value, bounds, scale)
    return got.shape == want.shape and bool(torch.allclose(got, want, atol=1e-5, rtol=1e-4))
