"""Are admission's answers right? Open-loop chat load, judged request by request:

- `--modes probe` (the default), one system: the server refuses as users see it
  (`--on-infeasible reject`), and a share of the requests, chosen in advance whatever the
  load (`--probe-share`), ask to be served rather than refused (`"on_infeasible":
  "serve"`, the request's own choice). A probe admission would have refused is served
  best-effort and says so (`X-Ferry-Best-Effort: true`); one that then gets its first token
  within its budget was a **false refusal**: admission said no to work it could serve on
  time. The probes sample admission's refusals at random, so the share of them that met
  their budget estimates the false refusals of the system every other request saw, which a
  probe perturbs by little (a probe share of the refusals is served). Among the admitted
  (probes admitted on their own merit too), the **false admits**: promised a first token
  in time and served late, or expired in the queue (504).
- `--modes serve,reject`, two systems side by side: the same load against `--on-infeasible
  serve` (every would-be refusal served best-effort: false refusals) and against `reject`
  (false admits). After its first best-effort request the serve run is no longer the
  system the reject run measures: its false refusals are an upper bound.

Each request: a short chat prompt (loadtests/saturation_cell.py's), `--max-tokens` new
tokens (greedy, `ignore_eos`), streamed, with `--budget-ms` as its `latency_budget_ms` (the
budget covers the first token). Goodput counts first tokens within the budget, per second.

    python -m loadtests.admission_cell [--chat-model default] [--rates 2,4,8,16] [--duration 20]
        [--budget-ms 500] [--max-tokens 32] [--modes probe] [--probe-share 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

import orjson

from .openloop import GatewayProcess, Sample, open_loop
from .saturation_cell import PROMPTS

SERVED = {"default": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "ferry-tiny-chat"}


def is_probe(i: int, share: float) -> bool:
    """Whether request `i` is a probe: a low-discrepancy choice of `share` of the requests
    (the golden ratio's multiples mod 1), fixed in advance and blind to the load."""
    return share > 0 and (i * 0.6180339887498949) % 1.0 < share


def make_send(model: str, budget_ms: float, max_tokens: int, probe_share: float = 0.0):
    async def send(session, i: int) -> Sample:
        probe = is_probe(i, probe_share)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "latency_budget_ms": budget_ms,
        }
        if probe:
            body["on_infeasible"] = "serve"
        t0 = time.perf_counter()
        ttft = None
        tag = "probe" if probe else ""
        async with session.post(
            "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            flagged = {"best_effort": r.headers.get("X-Ferry-Best-Effort") == "true"}
            if r.status != 200:
                await r.read()
                return Sample(t0, time.perf_counter() - t0, r.status, tag=tag, headers=flagged)
            status = 200
            async for raw in r.content:
                line = raw.decode().strip()
                if ttft is None and line.startswith("data: {") and '"content":"' in line:
                    ttft = time.perf_counter()  # absolute; made relative to the scheduled send
                if line.startswith("data: {") and '"error"' in line:
                    status = 504 if "deadline_exceeded" in line else 500
        return Sample(t0, time.perf_counter() - t0, status, ttft=ttft, tag=tag, headers=flagged)

    return send


def judge(samples: list[Sample], budget_ms: float, duration: float) -> dict:
    """Counts of one rate's requests. `flagged`: served best-effort (admission would have
    refused them); `false_refusals`: of those, met the budget. `probes`: requests that asked
    to be served rather than refused (the probe mode's sample of admission's refusals)."""
    budget = budget_ms / 1000.0
    met = [s.status == 200 and s.ttft is not None and s.ttft <= budget for s in samples]
    flagged = [s.headers.get("best_effort", False) for s in samples]
    promised = [s.status != 429 and not f for s, f in zip(samples, flagged, strict=True)]
    return {
        "sent": len(samples),
        "probes": sum(s.tag == "probe" for s in samples),
        "refused": sum(s.status == 429 for s in samples),
        "flagged": sum(flagged),
        "false_refusals": sum(f and m for f, m in zip(flagged, met, strict=True)),
        "promised": sum(promised),
        "false_admits": sum(p and not m for p, m in zip(promised, met, strict=True)),
        "goodput": sum(met) / duration,
    }


def verdict_line(mode: str, rate: float, row: dict) -> str:
    admits = (
        f"admitted {row['promised']:4d}, of which late {row['false_admits']:4d}"
        f" ({100.0 * row['false_admits'] / max(row['promised'], 1):.1f}% false admits)"
    )
    if mode == "probe":
        # The probes are a random sample of the load: their would-be refusals that met the
        # budget, over the probes, estimate the false refusals' share of all requests; over
        # the probes' would-be refusals, the share of refusals that were wrong.
        share = 100.0 * row["false_refusals"] / max(row["probes"], 1)
        wrong = 100.0 * row["false_refusals"] / max(row["flagged"], 1)
        return (
            f"  probe  {rate:5.1f}/s: sent {row['sent']:4d}, 429 {row['refused']:4d}, {admits};"
            f" probes {row['probes']:3d}, would refuse {row['flagged']:3d}, of which met the budget"
            f" {row['false_refusals']:3d} ({share:.1f}% of requests, {wrong:.0f}% of refusals false);"
            f" goodput {row['goodput']:.2f}/s"
        )
    if mode == "serve":
        share = 100.0 * row["false_refusals"] / max(row["sent"], 1)
        return (
            f"  serve  {rate:5.1f}/s: sent {row['sent']:4d}, would refuse {row['flagged']:4d}, of which met"
            f" the budget {row['false_refusals']:4d} ({share:.1f}% false refusals); goodput {row['goodput']:.2f}/s"
        )
    goodput = f"goodput {row['goodput']:.2f}/s"
    return f"  reject {rate:5.1f}/s: sent {row['sent']:4d}, 429 {row['refused']:4d}, {admits}; {goodput}"


def run_admission(
    chat_model: str,
    rates: list[float],
    duration: float,
    budget_ms: float,
    max_tokens: int,
    extra: list[str],
    modes: Sequence[str] = ("probe",),
    probe_share: float = 0.25,
):
    model = SERVED.get(chat_model, chat_model)
    rows = []
    for mode in modes:
        send = make_send(model, budget_ms, max_tokens, probe_share if mode == "probe" else 0.0)
        server_mode = "serve" if mode == "serve" else "reject"
        args = ["--embedding-model", "none", "--chat-model", chat_model, "--on-infeasible", server_mode, *extra]
        with GatewayProcess(*args) as gw:
            asyncio.run(open_loop(2, 3.0, send, gw.url, seed=99))  # warm-up: the cost models meet real steps
            for rate in rates:
                samples = asyncio.run(open_loop(rate, duration, send, gw.url, seed=int(rate)))
                row = {"mode": mode, "rate": rate, **judge(samples, budget_ms, duration)}
                rows.append(row)
                print(verdict_line(mode, rate, row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chat-model", default="default", help="what `ferry serve --chat-model` takes")
    p.add_argument("--rates", default="2,4,8,16", help="offered requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per rate")
    p.add_argument("--budget-ms", type=float, default=500.0, help="each request's first-token budget")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ferry-args", default="", help="more `ferry serve` flags, space-separated")
    p.add_argument("--modes", default="probe", help="probe (one system), serve, reject; comma-separated")
    p.add_argument("--probe-share", type=float, default=0.25, help="the probe mode's share of requests that probe")
    a = p.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    print(
        f"Admission on {a.chat_model}: first-token budget {a.budget_ms:.0f} ms, {a.max_tokens} new tokens, "
        f"{a.duration:.0f} s per rate"
    )
    modes = [m for m in a.modes.split(",") if m]
    if unknown := set(modes) - {"probe", "serve", "reject"}:
        p.error(f"--modes: unknown {', '.join(sorted(unknown))}")
    run_admission(
        a.chat_model, rates, a.duration, a.budget_ms, a.max_tokens, a.ferry_args.split(), modes, a.probe_share
    )


if __name__ == "__main__":
    main()
