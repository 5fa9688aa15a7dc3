"""A padding-free encoder forward against length-bucketed padding, measured (issue: Batches of
like lengths, "No work on padding where the engine allows it").

The same windows of texts (loadtests/length_mix.py's seeded pools), cut into the same
batches (sorted by length, at most 2,048 padded tokens: the engine's default), through the
embeddings engine three ways:

- `padded`: `packed=False`, the TorchScript graph with each batch padded to its longest row
  (the engine before packing; `--no-packed-embeddings`);
- `packed`: the engine's defaults, every batch's rows packed into one row of tokens with no
  padding, each with its own position ids, attention per row (engine/packed_encoder.py),
  traced;
- `packed eager`: the same in eager PyTorch (`--no-torchscript`).

Prints items/s, the padding share of each plan, and checks that the packed embeddings
equal the padded ones. In-process, one torch thread (as the engine core runs).

`--dtype bfloat16` (or float16) runs the three in that precision and adds `float32 packed`
(the default engine) to the same loop, so the half-precision gain is a ratio of one run;
half-precision vectors are checked by cosine (0.999) against the float32 engine's.

    python -m loadtests.padding_free [--dist longtail,bimodal] [--texts 1024] [--repeats 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from engine.base import EmbeddingResult
from engine.embeddings import HFEmbeddingEngine

from .length_mix import make_texts, padded_tokens, padding_share, plan_batches, tokenize_all


def _vectors(engine: HFEmbeddingEngine, rows: list[list[int]]) -> Any:
    return np.stack([np.asarray(r.vector) for r in engine.embed(rows) if isinstance(r, EmbeddingResult)])


def items_per_second(embed: Any, ids: list[list[int]], batches: list[list[int]]) -> float:
    t0 = time.perf_counter()
    for b in batches:
        embed([ids[i] for i in b])
    return sum(len(b) for b in batches) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dist", default="longtail,bimodal")
    p.add_argument("--texts", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    a = p.parse_args()
    torch.set_num_threads(1)
    graph = HFEmbeddingEngine(torch_threads=1, packed=False, dtype=a.dtype)
    packed = HFEmbeddingEngine(torch_threads=1, dtype=a.dtype)
    eager = HFEmbeddingEngine(torch_threads=1, torchscript=False, dtype=a.dtype)
    full = HFEmbeddingEngine(torch_threads=1) if a.dtype != "float32" else None
    assert packed.packed and eager.packed, "the default model runs packed"
    print(f"embeddings engine ({a.dtype}): padded {graph.graph}, packed {packed.graph}; one torch thread")
    for dist in a.dist.split(","):
        ids = tokenize_all(graph, make_texts(dist, a.texts))
        lengths = [len(x) for x in ids]
        batches = plan_batches(lengths, "budget")
        real, padded = padded_tokens(lengths, batches)
        # Same vectors either way (the first batches of each length class).
        for b in (batches[0], batches[len(batches) // 2], batches[-1]):
            rows = [ids[i] for i in b]
            if full is None:
                want = _vectors(graph, rows)
                for engine in (packed, eager):
                    assert np.allclose(_vectors(engine, rows), want, atol=1e-4), "packed embeddings differ"
            else:
                want = _vectors(full, rows)
                for engine in (graph, packed, eager):
                    got = _vectors(engine, rows)
                    cosine = (
                        (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
                    ).min()
                    assert cosine > 0.999, f"{a.dtype} embeddings differ from float32 ones (cosine {cosine:.5f})"
        engines = {"padded": graph, "packed": packed, "packed eager": eager}
        if full is not None:
            engines["float32 packed"] = full
        runs: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(a.repeats):
            for k, engine in engines.items():
                runs[k].append(items_per_second(engine.embed, ids, batches))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(
            f"{dist}: {len(ids)} texts in {len(batches)} batches, padding {padding_share(real, padded):.0%} "
            f"of {padded} padded tokens"
        )
        for k, v in runs.items():
            print(f"  {k:13s} {med[k]:7.1f} items/s (runs {', '.join(f'{x:.1f}' for x in v)})")
        print(
            f"  packed / padded: {med['packed'] / med['padded']:.2f}x; packed eager / padded: "
            f"{med['packed eager'] / med['padded']:.2f}x"
            + (f"; {a.dtype} packed / float32 packed: {med['packed'] / med['float32 packed']:.2f}x" if full else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
