"""Decode attention through a small C++ kernel (engine/decode_attention.cpp), built for this
machine on first use.

At a decode step every running row has one query and attends over its own cached tokens.
Through SDPA the rows are one padded rectangle (the running batch's columns, engine/kv.py)
and torch's CPU kernel runs one tiny product per row and head: at 64 rows of up to 124
columns on the built-in model it took 5-6 ms of a 24 ms step over its 4 layers, far below
the host's memory bandwidth. The kernel reads each row's own columns only (the ones its
mask keeps, so padding costs nothing and a column that was never written is never read),
one (row, KV head) per task over torch's intra-op threads, the keys once for every query
head they serve (grouped-query attention): 2.3 ms there (docs/benchmarks.md). Where torch
found AVX2 and FMA and the head dimension is a multiple of 8, its inner loops are vector
code (four keys' dot products at a time, the exponentials eight at a time, the output held
in registers across the columns): at 256 and more columns a step's attention is then bound
by reading the keys and values, not by arithmetic (`python -m loadtests.decode_kernel`).

Built with torch's JIT extension builder (a C++ compiler and ninja), once per machine and
source: the library is cached under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions),
so later loads take a fraction of a second. Each build is checked against SDPA before it is
used. Where it cannot be built or the check fails, the engine logs why and keeps SDPA: the
kernel is a speed-up, never a requirement. Float32 on the CPU only; softmax in float32 with
another summation order than SDPA's, so outputs differ from it in the last bits.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("ferry.engine")

SOURCE = Path(__file__).with_name("decode_attention.cpp")

# query [rows, heads, dim], keys and values [rows, kv_heads, width, dim] (the last dim
# contiguous), mask [rows, width] int64 (nonzero = attend), scale -> [rows, heads, dim]
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# query [rows, heads, dim], key and value pools [slots, kv_heads, dim], blocks [rows, n] and
# lengths [rows] int64, block size, scale -> (out [rows, heads, dim], log-sum-exp [rows, heads]):
# each row attends its first `lengths` tokens, token j in slot blocks[r, j // block] * block + j % block
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
    tuple[torch.Tensor, torch.Tensor],
]


def _build_flags() -> tuple[str, list[str]]:
    """The library's name and compiler flags for this CPU: vector instructions only where
    torch's own dispatch found them, so a cached build never meets a CPU without them."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", "NO AVX", ...
    flags = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's intra-op threads
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return "ferry_decode_attention_" + re.sub(r"\W+", "_", capability.lower()), flags


STALE_LOCK_S = 600.0  # a build takes ~15 s: a lock this old outlived the process that took it


def _clear_stale_lock(name: str) -> None:
    """torch's builder takes a lock file in the build folder and waits for it with no
    timeout, even to load a library built before; a process killed mid-build (a server
    stopped during its first start) leaves it behind, and every later start would wait
    forever. One older than any build is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale build lock %s (%.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the ninja package (a dependency) puts it beside
    the interpreter, in the venv's bin, which a server started as .venv/bin/ferry does not
    have on its PATH."""
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


_BUILDING = threading.Lock()  # engines loading side by side build it once


@functools.cache
def decode_attention_kernel() -> DecodeAttention | None:
    """The kernel, built or loaded on first call and checked against SDPA; None (logged
    once) where it cannot be."""
    with _BUILDING:
        return _build()


def _build() -> DecodeAttention | None:
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        name, flags = _build_flags()
        _clear_stale_lock(name)
        load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)
        kernel: DecodeAttention = torch.ops.ferry.decode_attention
        if not matches_sdpa(kernel):
            log.warning("decode attention kernel disagrees with SDPA on this host; using SDPA")
            return None
    except Exception as exc:  # no compiler, no ninja, no headers, a cache it cannot write
        log.warning("decode attention kernel unavailable (%s: %s); using SDPA", type(exc).__name__, exc)
        return None
    log.info("decode attention kernel %s loaded", name)
    return kernel


@functools.cache
def paged_attention_kernel() -> PagedAttention | None:
    """The kernel's form for KV kept in blocks (engine/blocks.py), from the same library,
    checked against `paged_reference`; None (logged) where the library is not there or the
    check fails."""
    if decode_attention_kernel() is None:
        return None
    kernel: PagedAttention = torch.ops.ferry.paged_decode_attention
    try:
        ok = matches_paged_reference(kernel)
    except RuntimeError as exc:
        log.warning("paged decode attention kernel unavailable (%s); attention over blocks gathered", exc)
        return None
    if not ok:
        log.warning("paged decode attention kernel disagrees with SDPA on this host; attention over blocks gathered")
        return None
    return kernel


class KernelError(RuntimeError):
    """The kernel raised inside a forward (engine/packed.py)."""


def kernel_after(exc: BaseException, kernel: DecodeAttention | None, model: str) -> DecodeAttention | None:
    """The kernel an engine keeps after a failed forward: none once the kernel itself
    raised (SDPA from then on, said once), rather than a failed packed step and a plain one
    at every step after."""
    if kernel is not None and isinstance(exc, KernelError):
        log.error("decode attention kernel failed for %s; SDPA from now on", model)
        return None
    return kernel


def kernel_for(model: torch.nn.Module, wanted: bool) -> DecodeAttention | None:
    """The kernel for `model`'s decode steps where it is wanted and applies (float32 on the
    CPU), built on first use; None keeps SDPA."""
    weight = next(model.parameters(), None)
    if not wanted or weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return decode_attention_kernel()


def reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """What the kernel computes, through SDPA: [rows, heads, dim]."""
    rows, heads, _ = query.shape
    group = heads // keys.shape[1]
    k, v = keys[:rows].repeat_interleave(group, 1), values[:rows].repeat_interleave(group, 1)
    allowed = (mask[:rows] != 0)[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=allowed, scale=scale)
    return out.squeeze(2)


def matches_sdpa(kernel: DecodeAttention) -> bool:
    """The kernel against SDPA on rows of different lengths with holes in their masks, in
    strided views of wider buffers, with grouped-query heads."""
    gen = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, width, dim = 5, 4, 2, 19, 16
    keys = torch.randn(rows + 2, kv_heads, width + 7, dim, generator=gen)[:, :, 3 : 3 + width]
    values = torch.randn(rows + 2, kv_heads, width + 7, dim, generator=gen)[:, :, 3 : 3 + width]
    query = torch.randn(rows, heads, dim, generator=gen)
    mask = (torch.rand(rows + 2, width, generator=gen) > 0.3).long()
    mask[:, -1] = 1  # every row attends at least to its newest token, as in a decode step
    scale = dim**-0.5
    with torch.inference_mode():
        got, want = kernel(query, keys, values, mask, scale), reference(query, keys, values, mask, scale)
    return bool(torch.allclose(got, want, atol=1e-5, rtol=1e-4))


def paged_reference(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    blocks: torch.Tensor,
    lengths: torch.Tensor,
    block: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the paged kernel computes, in plain products: ([rows, heads, dim], [rows, heads])."""
    rows, heads, _ = query.shape
    outs, lses = [], []
    for r in range(rows):
        n = int(lengths[r])
        j = torch.arange(n)
        slots = blocks[r, j // block] * block + j % block
        k = key_pool.index_select(0, slots).transpose(0, 1)  # [kv_heads, n, dim]
        v = value_pool.index_select(0, slots).transpose(0, 1)
        group = heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", query[r].float(), k.float()) * scale
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.einsum("hn,hnd->hd", torch.exp(scores - lse[:, None]), v.float()))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def matches_paged_reference(kernel: PagedAttention) -> bool:
    """The paged kernel against `paged_reference` on rows of different lengths (one of a
    single token, one ending mid-block) over blocks scattered through a pool, grouped-query heads."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    lengths = torch.tensor([1, 7, 12, 9])
    pool_blocks = 16
    order = torch.randperm(pool_blocks, generator=gen)
    blocks = order[: 4 * 3].reshape(4, 3)
    key_pool = torch.randn(pool_blocks * block, kv_heads, dim, generator=gen)
    value_pool = torch.randn(pool_blocks * block, kv_heads, dim, generator=gen)
    query = torch.randn(4, heads, dim, generator=gen)
    scale = dim**-0.5
    with torch.inference_mode():
        got = kernel(query, key_pool, value_pool, blocks, lengths, block, scale)
        want = paged_reference(query, key_pool, value_pool, blocks, lengths, block, scale)
    return all(bool(torch.allclose(g, w, atol=1e-5, rtol=1e-4)) for g, w in zip(got, want, strict=True))
