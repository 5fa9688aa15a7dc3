"""The embeddings cost model with and without its length-squared term, side by side on the
same batches (issue: Batches of like lengths, "a cost model in tokens").

The embeddings engine in-process (one torch thread, as the engine core runs, packed rows as
by default) runs batches of like lengths as the batcher forms them: a random leader from
loadtests/length_mix.py's two pools (long-tailed and bimodal), the inputs of the nearest
lengths after it, a random row count within 2,048 padded tokens. Two cost models, both
seeded by the engine's own warm-up profile as `ferry serve` seeds them, then observe every
batch in turn, each predicting it before it sees it (what admission and deadlines use):
`line` (time = a + c x padded tokens) and `quadratic` (+ d x tokens^2 / items, attention's
growth with length squared; what the embeddings batcher runs). Prints the relative error of
those predictions (median, p90) over all batches and over those with rows above 128 tokens,
and the signed median (below 0: predicted too fast, a long batch would overrun a deadline).

    python -m loadtests.cost_fit [--batches 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from batcher.cost import CostModel
from engine.embeddings import HFEmbeddingEngine

from .length_mix import make_texts, tokenize_all

TOKEN_BUDGET = 2048
LONG = 128


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--texts", type=int, default=1024, help="texts of each pool")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    engine = HFEmbeddingEngine(torch_threads=1)
    ids = sorted(
        tokenize_all(engine, make_texts("longtail", a.texts)) + tokenize_all(engine, make_texts("bimodal", a.texts)),
        key=len,
    )
    models = {"line": CostModel(), "quadratic": CostModel(quadratic=True)}
    profile = engine.warmup()
    for m in models.values():
        m.seed(profile)
    rng = random.Random(a.seed)
    errors: dict[str, list[tuple[float, int]]] = {k: [] for k in models}
    for _ in range(a.batches):
        lead = rng.randrange(len(ids))
        longest_first = len(ids[lead])
        rows = rng.randint(1, max(1, TOKEN_BUDGET // longest_first))
        batch = ids[lead : lead + rows] or [ids[lead]]
        longest = max(len(x) for x in batch)
        tokens = len(batch) * longest
        t0 = time.perf_counter()
        engine.embed(batch)
        seconds = time.perf_counter() - t0
        for name, m in models.items():
            predicted = m.predict(len(batch), tokens)
            errors[name].append(((predicted - seconds) / seconds, longest))
            m.observe(len(batch), tokens, seconds)
    print(f"{a.batches} batches of like lengths, <= {TOKEN_BUDGET} padded tokens, one torch thread")
    for name, m in models.items():
        e = np.array([x for x, _ in errors[name]])
        long = np.array([x for x, n in errors[name] if n > LONG])
        fit = m.params
        print(
            f"  {name:9s} |error| median {np.median(np.abs(e)):.1%}  p90 {np.percentile(np.abs(e), 90):.1%}"
            f"  | rows > {LONG} tokens ({len(long)}): |error| median {np.median(np.abs(long)):.1%}"
            f"  p90 {np.percentile(np.abs(long), 90):.1%}  signed median {np.median(long):+.1%}"
            f"  | fit: {fit.fixed * 1e3:.2f} ms + {fit.per_token * 1e6:.2f} us/token"
            f" + {fit.per_token_row * 1e9:.2f} ns/token x longest row"
        )


if __name__ == "__main__":
    main()
