"""The decode attention kernel (engine/decode_attention.cpp) against SDPA as the engine runs
it with `--no-native-attention` (the rows' rectangle of columns, a boolean mask, grouped-
query heads through `enable_gqa`), as a decode step meets them: one query per running row
over its own columns, layer after layer of buffers too large to stay in the core's cache,
on the built-in model's shape (4 heads, head_dim 64) and a grouped-query one (32 heads over
8, head_dim 128). One torch thread, as the engine core runs. Prints ms per step (all
layers) and the kernel's speed-up over SDPA.

    python -m loadtests.decode_kernel
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from engine.decode_attention import decode_attention_kernel

SHAPES = {  # name: (layers, heads, kv_heads, head_dim)
    "tiny-chat": (4, 4, 4, 64),
    "gqa 32/8 x 128": (4, 32, 8, 128),
}


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
Layers = list[tuple[torch.Tensor, torch.Tensor]]


def sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float):
    allowed = (mask != 0)[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2), keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def step(attend: Attend, query: torch.Tensor, layers: Layers, lo: int, mask: torch.Tensor) -> None:
    """One decode step's attention: every layer's, over the columns from `lo` on."""
    scale = query.shape[-1] ** -0.5
    for keys, values in layers:
        attend(query, keys[:, :, lo:], values[:, :, lo:], mask, scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--widths", default="64,256,768")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    kernel = decode_attention_kernel()
    assert kernel is not None, "the kernel did not build here"
    gen = torch.Generator().manual_seed(0)
    print(f"{'shape':<16} {'width':>6} {'SDPA ms':>8} {'kernel ms':>9} {'speed-up':>8}")
    for name, (depth, heads, kv_heads, dim) in SHAPES.items():
        for width in (int(w) for w in a.widths.split(",")):
            rows, capacity = a.rows, width + width // 2  # buffers wider than the used columns, as in the engine
            lo = capacity - width
            shape = (rows, kv_heads, capacity, dim)
            layers = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(depth)]
            # Rows right-aligned, their lengths spread over the window (rows joined at different steps).
            lengths = torch.randint(width // 4, width + 1, (rows,), generator=gen)
            mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
            query = torch.randn(rows, heads, dim, generator=gen)
            plain = _time(functools.partial(step, sdpa, query, layers, lo, mask), a.repeats)
            native = _time(functools.partial(step, kernel, query, layers, lo, mask), a.repeats)
            print(f"{name:<16} {width:>6} {plain:>8.2f} {native:>9.2f} {plain / native:>7.2f}x")


if __name__ == "__main__":
    main()
