"""bench_chat's goodput cell: requests per second whose first token comes within a
time-to-first-token SLO, under open-loop Poisson arrivals of streaming chat requests that
each carry the SLO as their latency budget (`latency_budget_ms`), at each offered rate.

Each request: a short chat prompt (loadtests/saturation_cell.py's), 32 new tokens, greedy,
`ignore_eos` (every answer is 32 tokens on any server), streamed. Ferry reads the budget
and refuses at once (429) what it cannot start in time; vLLM has no budgets and queues
everything (the field is sent to it too and ignored). Goodput counts only answers whose
first content token arrived within the SLO, timed from the scheduled send.

    python -m loadtests.bench_chat --servers goodput --rates 48,64,96,128 --duration 15 \\
        --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import asyncio
import time

import orjson

from tuner.percentile import percentile

from .openloop import Sample, open_loop
from .saturation_cell import PROMPTS

MAX_TOKENS = 32


def make_budget_send(model: str, slo_ms: float, tenant: str = ""):
    """A streaming request with the SLO as its budget; `tenant`: sent as `X-Ferry-Tenant`
    and kept as the sample's tag (loadtests/fairness_cell.py)."""
    headers = {"Content-Type": "application/json", **({"X-Ferry-Tenant": tenant} if tenant else {})}

    async def send(session, i: int) -> Sample:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "latency_budget_ms": slo_ms,
        }
        t0 = time.perf_counter()
        ttft = None
        async with session.post("/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
            if r.status != 200:
                await r.read()
                return Sample(t0, time.perf_counter() - t0, r.status, tag=tenant)
            async for raw in r.content:
                line = raw.decode().strip()
                if ttft is None and line.startswith("data: {") and '"content":"' in line:
                    ttft = time.perf_counter()  # absolute; made relative to the scheduled send
        return Sample(t0, time.perf_counter() - t0, 200, ttft=ttft, tag=tenant)

    return send


def run_goodput(label: str, url: str, model: str, rates: list[float], duration: float, slo_ms: float) -> list[dict]:
    rows = []
    asyncio.run(open_loop(4, 2.0, make_budget_send(model, slo_ms), url, seed=1))  # warm-up
    for rate in rates:
        samples = asyncio.run(open_loop(rate, duration, make_budget_send(model, slo_ms), url, seed=int(rate)))
        ok = [s for s in samples if s.status == 200 and s.ttft is not None]
        ttfts = [s.ttft * 1000 for s in ok if s.ttft is not None]
        good = sum(1 for t in ttfts if t <= slo_ms)
        row = {
            "label": label,
            "rate": rate,
            "sent": len(samples),
            "ok": len(ok),
            "refused": sum(1 for s in samples if s.status == 429),
            "good": good,
            "goodput": good / duration,
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99),
        }
        rows.append(row)
        print(
            f"  {label:26s} {rate:6.1f} req/s offered: goodput {row['goodput']:6.1f}/s"
            f"  (TTFT <= {slo_ms:.0f} ms: {good}/{len(samples)}, 429: {row['refused']})"
            f"  TTFT p50 {row['ttft_p50']:7.1f} p99 {row['ttft_p99']:7.1f} ms",
            flush=True,
        )
    return rows


def run_goodput_cells(
    common: list[str], rates: list[float], duration: float, slo_ms: float, vllm_python: str
) -> list[dict]:
    """Ferry with the bench's common flags, then vLLM when `vllm_python` is given; the best
    goodput of each over the offered rates, and their ratio."""
    from engine.tiny_chat import ensure_tiny_chat

    from .bench_chat import GatewayProcess
    from .prefix_cell import vllm_server

    print(f"Goodput within a {slo_ms:.0f} ms TTFT SLO (streaming, {MAX_TOKENS} new tokens, budgets sent):")
    rows = []
    with GatewayProcess(*common) as gw:
        rows += run_goodput("ferry", gw.url, "ferry-tiny-chat", rates, duration, slo_ms)
    if vllm_python:
        proc, url = vllm_server(vllm_python, ensure_tiny_chat())
        try:
            rows += run_goodput("vllm", url, "ferry-tiny-chat", rates, duration, slo_ms)
        finally:
            proc.terminate()
            proc.wait(60)
    best: dict[str, float] = {}
    for r in rows:
        best[r["label"]] = max(best.get(r["label"], 0.0), r["goodput"])
    for label, value in best.items():
        print(f"  best goodput, {label}: {value:.1f}/s")
    if best.get("vllm"):
        print(f"  ferry / vllm, best goodput: {best['ferry'] / best['vllm']:.2f}x")
    return rows
