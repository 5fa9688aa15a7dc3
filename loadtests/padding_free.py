"""A padding-free encoder forward against length-bucketed padding, measured (issue: Batches of
like lengths, "No work on padding where the engine allows it").

The same windows of texts (loadtests/length_mix.py's seeded pools), cut into the same
batches (sorted by length, at most 2,048 padded tokens: the engine's default), through:

- `padded`: the embeddings engine as it runs (TorchScript graph, each batch padded to its
  longest row);
- `padded eager`: the same forward in eager PyTorch;
- `packed`: every batch's rows packed into one row of tokens with no padding, each with
  its own position ids, and attention per row (block-diagonal) through transformers' SDPA
  function, registered as an attention implementation for the packed forward alone.

Prints items/s, the padding share of each plan, and checks that the packed embeddings
equal the padded ones. In-process, one torch thread (as the engine core runs).

    python -m loadtests.padding_free [--dist longtail,bimodal] [--texts 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.base import EmbeddingResult
from engine.embeddings import HFEmbeddingEngine

from .length_mix import make_texts, padded_tokens, padding_share, plan_batches, tokenize_all

PACKED = "ferry_packed_encoder"


def _packed_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.pop("ferry_rows")
    parts = []
    for lo, hi in bounds:
        out, _ = sdpa_attention_forward(
            module, query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], None, is_causal=False, **kwargs
        )
        parts.append(out)
    return torch.cat(parts, dim=1), None


class PackedEncoder:
    """The engine's model run on packed rows (no padding), mean-pooled per row."""

    def __init__(self, engine: HFEmbeddingEngine) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(PACKED, _packed_attention)
        self.model = engine.model
        self.model.set_attn_implementation(PACKED)
        self._mask = torch.ones((1, 1, 1, 1), dtype=torch.bool)  # a 4D mask passes through unbuilt

    def embed(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        ids = torch.tensor([[t for row in batch for t in row]])
        positions = torch.tensor([[p for row in batch for p in range(len(row))]])
        bounds, lo = [], 0
        for row in batch:
            bounds.append((lo, lo + len(row)))
            lo += len(row)
        with torch.inference_mode():
            hidden = self.model(
                input_ids=ids,
                position_ids=positions,
                token_type_ids=torch.zeros_like(ids),
                attention_mask=self._mask,
                ferry_rows=bounds,
            ).last_hidden_state[0]
            pooled = torch.stack([hidden[a:b].mean(0) for a, b in bounds])
            return torch.nn.functional.normalize(pooled, p=2, dim=1)


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
    a = p.parse_args()
    torch.set_num_threads(1)
    graph = HFEmbeddingEngine(torch_threads=1)
    eager = HFEmbeddingEngine(torch_threads=1, torchscript=False)
    packed = PackedEncoder(HFEmbeddingEngine(torch_threads=1, torchscript=False))
    print(f"embeddings engine: {graph.graph}; one torch thread")
    for dist in a.dist.split(","):
        ids = tokenize_all(graph, make_texts(dist, a.texts))
        lengths = [len(x) for x in ids]
        batches = plan_batches(lengths, "budget")
        real, padded = padded_tokens(lengths, batches)
        # Same vectors either way (the first batches of each length class).
        for b in (batches[0], batches[len(batches) // 2], batches[-1]):
            rows = [ids[i] for i in b]
            results = [r for r in graph.embed(rows) if isinstance(r, EmbeddingResult)]
            want = torch.stack([torch.from_numpy(r.vector) for r in results])
            assert torch.allclose(packed.embed(rows), want, atol=1e-4), "packed embeddings differ"
        runs: dict[str, list[float]] = {"padded": [], "padded eager": [], "packed": []}
        for _ in range(a.repeats):
            runs["padded"].append(items_per_second(graph.embed, ids, batches))
            runs["padded eager"].append(items_per_second(eager.embed, ids, batches))
            runs["packed"].append(items_per_second(packed.embed, ids, batches))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(
            f"{dist}: {len(ids)} texts in {len(batches)} batches, padding {padding_share(real, padded):.0%} "
            f"of {padded} padded tokens"
        )
        for k, v in runs.items():
            print(f"  {k:13s} {med[k]:7.1f} items/s (runs {', '.join(f'{x:.1f}' for x in v)})")
        print(
            f"  packed / padded: {med['packed'] / med['padded']:.2f}x; packed / padded eager: "
            f"{med['packed'] / med['padded eager']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
