"""Embeddings benchmark, one run, side by side on this machine:

1. the raw engine ceiling (no HTTP, best batch size),
2. Ferry under open-loop Poisson arrivals of single-input requests at rising rates,
3. Ferry with --max-batch-size 1 (unbatched) at the same rates.

    python -m loadtests.bench_embeddings [--rates 40,80,...] [--duration 10]

Prints throughput, p50/p99 latency and the ratios (Ferry / ceiling, Ferry / unbatched).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from tuner.traffic import sentence

from .openloop import GatewayProcess, open_loop, post_json, summarise

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def engine_ceiling(sizes=(8, 16, 32, 64), seconds: float = 4.0) -> tuple[int, float]:
    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=1)
    best = (0, 0.0)
    for n in sizes:
        texts = [sentence(i) for i in range(n)]
        engine.embed(engine.tokenize(texts))  # warm
        done, start = 0, time.perf_counter()
        i = 0
        while time.perf_counter() - start < seconds:
            texts = [sentence(i + k) for k in range(n)]
            engine.embed(engine.tokenize(texts))  # tokenization included, as the server does it
            done += n
            i += n
        rate = done / (time.perf_counter() - start)
        print(f"  engine batch {n:3d}: {rate:7.1f} sentences/s")
        best = max(best, (n, rate), key=lambda x: x[1])
    return best


async def send(session, i):
    return await post_json(session, "/v1/embeddings", {"model": MODEL, "input": sentence(i)})


def measure_rates(label: str, args: list[str], rates: list[float], duration: float) -> list[dict]:
    rows = []
    with GatewayProcess("--chat-model", "none", *args) as gw:
        asyncio.run(open_loop(20, 2.0, send, gw.url, seed=99))  # warm connections and caches
        for rate in rates:
            s = summarise(asyncio.run(open_loop(rate, duration, send, gw.url, seed=int(rate))), duration)
            s["rate"] = rate
            rows.append(s)
            print(
                f"  {label:10s} offered {rate:6.0f}/s -> {s['throughput']:6.1f}/s ok  p50 {s['p50_ms']:7.1f} ms"
                f"  p99 {s['p99_ms']:7.1f} ms  rejected {s['rejected']}  errors {s['errors']}",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="40,80,120,160,200,260")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--ferry-args", default="", help="extra flags for the batched gateway")
    a = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rates = [float(r) for r in a.rates.split(",")]
    print("raw engine ceiling (1 torch thread, tokenization included):")
    best_n, ceiling = engine_ceiling()
    print(f"  ceiling: {ceiling:.1f} sentences/s at batch {best_n}")
    print("Ferry, batched (defaults):")
    batched = measure_rates("batched", a.ferry_args.split(), rates, a.duration)
    print("Ferry, --max-batch-size 1:")
    single = measure_rates("unbatched", ["--max-batch-size", "1", "--max-wait-ms", "0"], rates, a.duration)
    peak_b = max(r["throughput"] for r in batched)
    peak_s = max(r["throughput"] for r in single)
    print("\nsummary")
    print(f"  raw engine ceiling       {ceiling:7.1f} /s (batch {best_n})")
    print(f"  Ferry batched, peak      {peak_b:7.1f} /s  = {peak_b / ceiling:.2f}x ceiling")
    print(f"  Ferry unbatched, peak    {peak_s:7.1f} /s")
    print(f"  batched / unbatched      {peak_b / peak_s:.2f}x")


if __name__ == "__main__":
    main()
