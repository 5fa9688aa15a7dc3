"""Latency-aware scheduling benchmark, one run, one gateway, settings switched live:

open-loop Poisson arrivals of single-input embeddings at 25/50/80/100/150% of measured
capacity; 30% interactive requests with a 100 ms budget, 70% batch-class with 1,000 ms.
Compares a grid of `fixed` settings with `deadline` and `adaptive` (untuned defaults):
goodput (requests finished within their budget, per second), p99 per class, rejections.

    python -m loadtests.bench_latency [--duration 6] [--out results/latency.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from .bench_embeddings import MODEL, sentence
from .openloop import Gateway, Sample, open_loop, pct

TOKEN = "bench-admin"
INTERACTIVE_MS, BATCH_MS = 100.0, 1000.0
FIXED_GRID = [(8, 0.0), (8, 10.0), (32, 0.0), (32, 10.0)]
DEFAULTS = {"max_batch_size": 32, "max_wait_ms": 5.0}


def make_send(seed: int):
    rng = random.Random(seed)
    classes = ["interactive" if rng.random() < 0.3 else "batch" for _ in range(200_000)]

    async def send(session, i: int) -> Sample:
        cls = classes[i]
        budget = INTERACTIVE_MS if cls == "interactive" else BATCH_MS
        body = {"model": MODEL, "input": sentence(i), "latency_budget_ms": budget, "priority": cls}
        import orjson

        async with session.post("/v1/embeddings", data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return Sample(0.0, 0.0, r.status, tag=cls)

    return send


def summarise(samples: list[Sample], duration: float) -> dict:
    out: dict = {"sent": len(samples)}
    span = max(duration, max(s.sent + s.latency for s in samples) - min(s.sent for s in samples))
    good = 0
    for cls, budget in (("interactive", INTERACTIVE_MS), ("batch", BATCH_MS)):
        mine = [s for s in samples if s.tag == cls]
        ok = [s for s in mine if s.status == 200]
        within = [s for s in ok if s.latency * 1000 <= budget]
        good += len(within)
        out[cls] = {"sent": len(mine), "ok": len(ok), "within": len(within),
                    "attainment": len(within) / len(mine) if mine else float("nan"),
                    "p99_ms": pct([s.latency * 1000 for s in ok], 99)}
    rejected = [s for s in samples if s.status == 429]
    out["goodput"] = good / span
    out["rejected"] = len(rejected)
    out["expired"] = sum(1 for s in samples if s.status == 504)
    out["errors"] = sum(1 for s in samples if s.status not in (200, 429, 504))
    out["p99_429_ms"] = pct([s.latency * 1000 for s in rejected], 99)
    return out


def configure(url: str, **settings) -> None:
    r = httpx.patch(f"{url}/admin/models/{MODEL}/batching", json=settings, headers={"Authorization": f"Bearer {TOKEN}"})
    r.raise_for_status()


def capacity(url: str, duration: float) -> float:
    """Saturate with batch-class work (generous budgets) and count what completes."""
    configure(url, policy="adaptive", **DEFAULTS)
    samples = asyncio.run(open_loop(400, duration, _saturating_send, url, seed=7))
    ok = [s for s in samples if s.status == 200]
    span = max(s.sent + s.latency for s in samples) - min(s.sent for s in samples)
    return len(ok) / span


async def _saturating_send(session, i):
    import orjson

    body = {"model": MODEL, "input": sentence(i), "latency_budget_ms": 60_000, "priority": "batch"}
    async with session.post("/v1/embeddings", data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
        await r.read()
        return Sample(0.0, 0.0, r.status)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--loads", default="0.25,0.5,0.8,1.0,1.5")
    p.add_argument("--out", default="")
    a = p.parse_args()
    loads = [float(x) for x in a.loads.split(",")]
    configs = [(f"fixed b={b} w={w:g}", {"policy": "fixed", "max_batch_size": b, "max_wait_ms": w}) for b, w in FIXED_GRID]
    configs += [("deadline (defaults)", {"policy": "deadline", **DEFAULTS}), ("adaptive (defaults)", {"policy": "adaptive", **DEFAULTS})]
    results = []
    with Gateway("--chat-model", "none", "--admin-token", TOKEN) as gw:
        cap = capacity(gw.url, a.duration)
        print(f"measured capacity: {cap:.1f} req/s (adaptive, saturated)")
        for load in loads:
            rate = load * cap
            for name, settings in configs:
                configure(gw.url, **settings)
                time.sleep(0.3)
                samples = asyncio.run(open_loop(rate, a.duration, make_send(int(load * 100)), gw.url, seed=int(load * 100)))
                row = {"load": load, "rate": rate, "config": name, **summarise(samples, a.duration)}
                results.append(row)
                print(f"  {load:4.0%} {rate:6.1f}/s {name:20s} goodput {row['goodput']:6.1f}/s"
                      f"  interactive {row['interactive']['attainment']:6.1%} p99 {row['interactive']['p99_ms']:7.1f} ms"
                      f"  batch {row['batch']['attainment']:6.1%} p99 {row['batch']['p99_ms']:7.1f} ms"
                      f"  429 {row['rejected']:4d} (p99 {row['p99_429_ms']:5.1f} ms)  504 {row['expired']:4d}", flush=True)
    print("\nsummary: adaptive vs best fixed goodput, per load")
    for load in loads:
        rows = [r for r in results if r["load"] == load]
        best = max((r for r in rows if r["config"].startswith("fixed")), key=lambda r: r["goodput"])
        ada = next(r for r in rows if r["config"].startswith("adaptive"))
        print(f"  {load:4.0%}: adaptive {ada['goodput']:6.1f}/s vs best fixed {best['goodput']:6.1f}/s ({best['config']})"
              f" = {ada['goodput'] / best['goodput']:.2f}x; interactive attainment {ada['interactive']['attainment']:.1%}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"capacity": cap, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
