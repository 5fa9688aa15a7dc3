"""Embeddings benchmark, one run, side by side on this machine:

1. the raw engine ceiling: no HTTP, tokenization included, best batch size, with as many
   torch threads as the process may use cores (`os.sched_getaffinity`), the machine's own
   limit for this model;
2. Ferry with default flags (plus `--ferry-args`) under open-loop Poisson arrivals of
   single-input requests at rising rates;
3. Ferry with --max-batch-size 1 (unbatched) at the same rates.

    python -m loadtests.bench_embeddings [--rates 40,80,...] [--duration 10] [--slo-ms 200]

Prints throughput, goodput (answers within the SLO, per second), p50/p99 latency and the
ratios (Ferry / ceiling, Ferry / unbatched). That is the default cell (`--cells default`).

`--cells length-mix` (issue #32) runs loadtests/length_mix.py instead: inputs of long-tailed
and bimodal lengths, the raw engine's ceilings in arrival order, sorted, and sorted under a
token budget (with their padding), Ferry under closed-loop clients and, with
`--vllm-python`, vLLM's pooling runner on the same inputs:

    python -m loadtests.bench_embeddings --cells length-mix [--duration 10] [--clients 64] [--slo-ms 200]
    python -m loadtests.bench_embeddings --cells length-mix --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from tuner.traffic import sentence

from . import length_mix
from .openloop import GatewayProcess, open_loop, post_json, summarise

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def engine_ceiling(threads: int, sizes=(8, 16, 32, 64), seconds: float = 4.0) -> tuple[int, float]:
    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=threads)
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


def measure_rates(label: str, args: list[str], rates: list[float], duration: float, slo_ms: float) -> list[dict]:
    rows = []
    with GatewayProcess("--chat-model", "none", *args) as gw:
        asyncio.run(open_loop(20, 2.0, send, gw.url, seed=99))  # warm connections and caches
        for rate in rates:
            samples = asyncio.run(open_loop(rate, duration, send, gw.url, seed=int(rate)))
            s = summarise(samples, duration, slo_ms=slo_ms)
            s["rate"] = rate
            rows.append(s)
            print(
                f"  {label:10s} offered {rate:6.0f}/s -> {s['throughput']:6.1f}/s ok"
                f"  {s['goodput']:6.1f}/s within {slo_ms:.0f} ms  p50 {s['p50_ms']:7.1f} ms"
                f"  p99 {s['p99_ms']:7.1f} ms  rejected {s['rejected']}  errors {s['errors']}",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="80,160,240,320,400")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--slo-ms", type=float, default=200.0, help="latency SLO for goodput")
    p.add_argument("--ceiling-threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--ferry-args", default="", help="extra flags for the batched gateway")
    p.add_argument("--skip-unbatched", action="store_true")
    p.add_argument("--cells", default="default", help="comma-separated subset of default,length-mix")
    length_mix.add_arguments(p)
    a = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cells = [c.strip() for c in a.cells.split(",") if c.strip()]
    unknown = set(cells) - {"default", "length-mix"}
    if unknown:
        p.error(f"--cells: unknown {', '.join(sorted(unknown))}; expected default,length-mix")
    if "default" in cells:
        default_cell(a)
    if "length-mix" in cells:
        print("\nlength-mix cell:" if "default" in cells else "length-mix cell:")
        length_mix.run(a)


def default_cell(a: argparse.Namespace) -> None:
    rates = [float(r) for r in a.rates.split(",")]
    print(f"raw engine ceiling ({a.ceiling_threads} torch threads, tokenization included):")
    best_n, ceiling = engine_ceiling(a.ceiling_threads)
    print(f"  ceiling: {ceiling:.1f} sentences/s at batch {best_n}")
    print(f"Ferry, batched (default flags {a.ferry_args!r}):")
    batched = measure_rates("batched", a.ferry_args.split(), rates, a.duration, a.slo_ms)
    peak_b = max(r["throughput"] for r in batched)
    good_b = max(r["goodput"] for r in batched)
    print("\nsummary")
    print(f"  raw engine ceiling       {ceiling:7.1f} /s (batch {best_n}, {a.ceiling_threads} threads)")
    print(f"  Ferry batched, peak      {peak_b:7.1f} /s  = {peak_b / ceiling:.2f}x ceiling")
    print(f"  Ferry batched, goodput   {good_b:7.1f} /s within {a.slo_ms:.0f} ms = {good_b / ceiling:.2f}x ceiling")
    if not a.skip_unbatched:
        print("Ferry, --max-batch-size 1:")
        unbatched = ["--max-batch-size", "1", "--max-wait-ms", "0"]
        single = measure_rates("unbatched", unbatched, rates, a.duration, a.slo_ms)
        peak_s = max(r["throughput"] for r in single)
        print(f"  Ferry unbatched, peak    {peak_s:7.1f} /s")
        print(f"  batched / unbatched      {peak_b / peak_s:.2f}x")


if __name__ == "__main__":
    main()
