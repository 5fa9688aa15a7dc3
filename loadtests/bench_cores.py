"""Engine cores benchmark (issue: Front ends and engine cores in separate processes), one run,
side by side on this machine: the embeddings model in the server's process (today's
default) against the same model in an engine-core process (`--engine-cores`), each with one
and with two torch threads, under the same open-loop Poisson load of single-sentence
requests; and the raw engine's ceiling with the same thread counts.

    python -m loadtests.bench_cores [--rates 160,240,320] [--duration 8]

Prints, per setting, the peak throughput (requests answered 200 per second), p50/p99 at the
highest rate every setting sustains, and the ratios to the ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from tuner.traffic import sentence

from .openloop import GatewayProcess, open_loop, post_json, summarise

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def ceiling(threads: int, seconds: float = 4.0) -> float:
    """Raw engine, batches of 32, tokenization included, no HTTP."""
    import time

    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=threads)
    texts = [sentence(i) for i in range(32)]
    engine.embed(engine.tokenize(texts))
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        engine.embed(engine.tokenize(texts))
        done += len(texts)
    return done / (time.perf_counter() - start)


async def _send(session, i: int):
    from .openloop import Sample

    status, _ = await post_json(session, "/v1/embeddings", {"model": MODEL, "input": sentence(i)})
    return Sample(0.0, 0.0, status)


def measure(label: str, args: list[str], rates: list[float], duration: float) -> list[dict]:
    rows = []
    with GatewayProcess("--chat-model", "none", *args) as gw:
        for rate in rates:
            s = summarise(asyncio.run(open_loop(rate, duration, _send, gw.url, seed=int(rate))), duration)
            rows.append({"label": label, "rate": rate, **s})
            print(
                f"  {label:26s} offered {rate:5.0f}/s -> {s['throughput']:6.1f}/s ok"
                f"  p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms  429 {s['rejected']}",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="160,240,320")
    p.add_argument("--duration", type=float, default=8.0)
    a = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rates = [float(r) for r in a.rates.split(",")]
    ceilings = {t: ceiling(t) for t in (1, 2)}
    for t, c in ceilings.items():
        print(f"raw engine ceiling, {t} torch thread(s): {c:.1f} sentences/s")
    settings = {
        "in-process, 1 thread": ["--no-engine-cores", "--torch-threads", "1"],
        "engine core, 1 thread": ["--engine-cores", "--torch-threads", "1"],
        "in-process, 2 threads": ["--no-engine-cores", "--torch-threads", "2"],
        "engine core, 2 threads": ["--engine-cores", "--torch-threads", "2"],
    }
    results = {label: measure(label, args, rates, a.duration) for label, args in settings.items()}
    print("\nsummary: peak throughput, and its ratio to the ceiling with the same threads")
    for label, rows in results.items():
        threads = 2 if "2 threads" in label else 1
        peak = max(r["throughput"] for r in rows)
        print(f"  {label:26s} {peak:6.1f}/s = {peak / ceilings[threads]:.2f}x ceiling ({threads} thread(s))")
    for threads in (1, 2):
        suffix = "1 thread" if threads == 1 else "2 threads"
        here = max(r["throughput"] for r in results[f"in-process, {suffix}"])
        core = max(r["throughput"] for r in results[f"engine core, {suffix}"])
        print(f"  engine core / in-process, {suffix}: {core / here:.2f}x")


if __name__ == "__main__":
    main()
