"""Packed rows' attention through Ferry's kernel against SDPA per row, and what it and a fused
feed-forward activation give the embeddings engine's forward (issue: Batches of like lengths,
"No work on padding where the engine allows it"; engine/rows_attention.py).

Two parts, in-process, one torch thread (as the engine core runs), best of 7 repeats each:

- `kernel`: the attention alone, on packed rows of 17, 200 and 250 tokens and on a mix, at
  all-MiniLM-L6-v2's heads (12 x 32) and BERT-base's (12 x 64): engine/packed_encoder.py's
  TorchScript loop over SDPA against `ferry::rows_attention`, with GFLOP/s;
- `engine`: the embeddings engine on loadtests/length_mix.py's pools, batched as it
  batches them (sorted, at most 2,048 padded tokens), three ways alternated batch by batch: `sdpa` (SDPA per
  row, activations apart: the engine before), `kernel` (`native_attention`), `kernel+fused`
  (the defaults); items/s, medians of `--repeats`, and the ratios to `sdpa`.

    python -m loadtests.rows_attention [--parts kernel,engine] [--repeats 5] [--texts 512]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine.base import EmbeddingResult
from engine.embeddings import HFEmbeddingEngine
from engine.packed_encoder import rows_attention
from engine.rows_attention import rows_attention_kernel

from .length_mix import make_texts, plan_batches, tokenize_all


def best_ms(call: Callable[[], Any], calls: int = 10, repeats: int = 7) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) / calls * 1e3)
    return best


def kernel_part() -> None:
    built = rows_attention_kernel()
    if built is None:
        print("the kernel did not build here (see the log); nothing to compare")
        return
    kernel, width = built
    print(f"attention alone (vectors of {width} floats), one thread, best of 7:")
    for heads, dim in ((12, 32), (12, 64)):
        for lengths in ([17] * 100, [200] * 8, [250] * 8, [5, 40, 17, 250, 1, 64, 33, 180, 120, 9]):
            tokens = sum(lengths)
            fused = torch.randn(1, tokens, 3, heads, dim)
            q, k, v = (fused[:, :, i].transpose(1, 2) for i in range(3))
            bounds = torch.tensor([0, *itertools.accumulate(lengths)])
            scale = dim**-0.5
            args = (q, k, v, bounds, scale)
            with torch.inference_mode():
                diff = (kernel(*args) - rows_attention(*args)).abs().max()
                sdpa = best_ms(functools.partial(rows_attention, *args))
                ours = best_ms(functools.partial(kernel, *args))
            flops = sum(4 * n * n * heads * dim for n in lengths)
            label = f"{len(lengths)} rows of {lengths[0]}" if len(set(lengths)) == 1 else f"{len(lengths)} mixed rows"
            print(
                f"  {heads} x {dim:<3} {label:<18} SDPA per row {sdpa:7.2f} ms ({flops / sdpa / 1e6:5.1f} GFLOP/s)"
                f"  kernel {ours:7.2f} ms ({flops / ours / 1e6:5.1f})  {sdpa / ours:.2f}x  max diff {diff:.1e}"
            )


def _vectors(engine: HFEmbeddingEngine, batch: list[list[int]]) -> Any:
    return np.stack([np.asarray(r.vector) for r in engine.embed(batch) if isinstance(r, EmbeddingResult)])


def engine_part(texts: int, repeats: int) -> None:
    engines = {
        "sdpa": HFEmbeddingEngine(torch_threads=1, native_attention=False, fused_activations=False),
        "kernel": HFEmbeddingEngine(torch_threads=1, fused_activations=False),
        "kernel+fused": HFEmbeddingEngine(torch_threads=1),
    }
    print(f"embeddings engine, one thread, {texts} texts a pool, medians of {repeats}:")
    for name, engine in engines.items():
        print(f"  {name:<13} {engine.rows}, {engine.fused} activations fused")
    for dist in ("longtail", "bimodal"):
        ids = tokenize_all(engines["sdpa"], make_texts(dist, texts))
        batches = [[ids[i] for i in b] for b in plan_batches([len(x) for x in ids], "budget")]
        want = _vectors(engines["sdpa"], batches[-1])
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(repeats):
            spent = dict.fromkeys(engines, 0.0)
            for batch in batches:  # alternated batch by batch: the host's drift falls on all three
                for name, engine in engines.items():
                    t0 = time.perf_counter()
                    engine.embed(batch)
                    spent[name] += time.perf_counter() - t0
            for name in engines:
                rates[name].append(len(ids) / spent[name])
        base = statistics.median(rates["sdpa"])
        for name, engine in engines.items():
            got = _vectors(engine, batches[-1])
            median = statistics.median(rates[name])
            print(
                f"  {dist:<8} {name:<13} {median:7.1f} items/s  {median / base:.3f}x  "
                f"(runs {', '.join(f'{r:.1f}' for r in rates[name])}; max vector diff {abs(got - want).max():.1e})"
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="kernel,engine")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--texts", type=int, default=512)
    a = p.parse_args()
    torch.set_num_threads(1)
    parts = a.parts.split(",")
    if "kernel" in parts:
        kernel_part()
    if "engine" in parts:
        engine_part(a.texts, a.repeats)


if __name__ == "__main__":
    main()
