"""Are admission's answers right? The same open-loop load twice, side by side:

- `--on-infeasible serve`: nothing is refused; a request admission would have refused is
  served best-effort and says so (`X-Ferry-Best-Effort: true`). One that then gets its
  first token within its budget was a **false refusal**: admission said no to work it could
  serve on time.
- `--on-infeasible reject` (the default): what a user sees: 429s at once, and among the
  admitted requests the **false admits**, promised a first token in time and served late
  (or expired in the queue, 504).

Each request: a short chat prompt (loadtests/saturation_cell.py's), `--max-tokens` new
tokens (greedy, `ignore_eos`), streamed, with `--budget-ms` as its `latency_budget_ms` (the
budget covers the first token). Goodput counts first tokens within the budget, per second.

    python -m loadtests.admission_cell [--chat-model default] [--rates 2,4,8,16] [--duration 20]
        [--budget-ms 500] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson

from .openloop import GatewayProcess, Sample, open_loop
from .saturation_cell import PROMPTS

SERVED = {"default": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "ferry-tiny-chat"}


def make_send(model: str, budget_ms: float, max_tokens: int):
    async def send(session, i: int) -> Sample:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "latency_budget_ms": budget_ms,
        }
        t0 = time.perf_counter()
        ttft = None
        async with session.post(
            "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            flagged = {"best_effort": r.headers.get("X-Ferry-Best-Effort") == "true"}
            if r.status != 200:
                await r.read()
                return Sample(t0, time.perf_counter() - t0, r.status, headers=flagged)
            status = 200
            async for raw in r.content:
                line = raw.decode().strip()
                if ttft is None and line.startswith("data: {") and '"content":"' in line:
                    ttft = time.perf_counter()  # absolute; made relative to the scheduled send
                if line.startswith("data: {") and '"error"' in line:
                    status = 504 if "deadline_exceeded" in line else 500
        return Sample(t0, time.perf_counter() - t0, status, ttft=ttft, headers=flagged)

    return send


def judge(samples: list[Sample], budget_ms: float, duration: float) -> dict:
    budget = budget_ms / 1000.0
    met = [s.status == 200 and s.ttft is not None and s.ttft <= budget for s in samples]
    flagged = [s.headers.get("best_effort", False) for s in samples]
    promised = [s.status != 429 and not f for s, f in zip(samples, flagged, strict=True)]
    return {
        "sent": len(samples),
        "refused": sum(s.status == 429 for s in samples),
        "flagged": sum(flagged),
        "false_refusals": sum(f and m for f, m in zip(flagged, met, strict=True)),
        "promised": sum(promised),
        "false_admits": sum(p and not m for p, m in zip(promised, met, strict=True)),
        "goodput": sum(met) / duration,
    }


def run_admission(
    chat_model: str, rates: list[float], duration: float, budget_ms: float, max_tokens: int, extra: list[str]
):
    model = SERVED.get(chat_model, chat_model)
    send = make_send(model, budget_ms, max_tokens)
    rows = []
    for mode in ("serve", "reject"):
        args = ["--embedding-model", "none", "--chat-model", chat_model, "--on-infeasible", mode, *extra]
        with GatewayProcess(*args) as gw:
            asyncio.run(open_loop(2, 3.0, send, gw.url, seed=99))  # warm-up: the cost models meet real steps
            for rate in rates:
                row = {
                    "mode": mode,
                    "rate": rate,
                    **judge(asyncio.run(open_loop(rate, duration, send, gw.url, seed=int(rate))), budget_ms, duration),
                }
                rows.append(row)
                if mode == "serve":
                    share = 100.0 * row["false_refusals"] / max(row["sent"], 1)
                    print(
                        f"  serve  {rate:5.1f}/s: sent {row['sent']:4d}, would refuse {row['flagged']:4d}, of which met"
                        f" the budget {row['false_refusals']:4d} ({share:.1f}% false refusals);"
                        f" goodput {row['goodput']:.2f}/s",
                        flush=True,
                    )
                else:
                    print(
                        f"  reject {rate:5.1f}/s: sent {row['sent']:4d}, 429 {row['refused']:4d}, admitted"
                        f" {row['promised']:4d}, of which late {row['false_admits']:4d}"
                        f" ({100.0 * row['false_admits'] / max(row['promised'], 1):.1f}% false admits);"
                        f" goodput {row['goodput']:.2f}/s",
                        flush=True,
                    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chat-model", default="default", help="what `ferry serve --chat-model` takes")
    p.add_argument("--rates", default="2,4,8,16", help="offered requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per rate")
    p.add_argument("--budget-ms", type=float, default=500.0, help="each request's first-token budget")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ferry-args", default="", help="more `ferry serve` flags, space-separated")
    a = p.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    print(
        f"Admission on {a.chat_model}: first-token budget {a.budget_ms:.0f} ms, {a.max_tokens} new tokens, "
        f"{a.duration:.0f} s per rate"
    )
    run_admission(a.chat_model, rates, a.duration, a.budget_ms, a.max_tokens, a.ferry_args.split())


if __name__ == "__main__":
    main()
