"""Latency-aware scheduling benchmark, one run, settings switched live. Three kinds of cell:

- latency: open-loop Poisson arrivals of single-input embeddings at 25/50/80/100/150% of
  measured capacity; 30% interactive requests with a 100 ms budget, 70% batch-class with
  1,000 ms. Compares a grid of `fixed` settings with `deadline` and `adaptive` (untuned
  defaults): goodput (requests finished within their budget, per second), p99 per class,
  rejections.
- burst: after 30 s idle, 4 x max_batch_size requests at once with a 1 s budget, for the
  embeddings model and for chat (max_tokens 8; the budget covers the first token).
  Target: no refusal, no expiry.
- priority: interactive embeddings at 10% of capacity (100 ms budget) plus batch-class at
  50/100/150/200% (1 s budget), side by side in each cell, the modes of `--priority-modes`:
  `lane` (the defaults: interactive first, interactive batches beside the batch in flight),
  `reserve` (interactive first without the lane: batch-class batches cut for interactive
  budgets), `throughput` (neither). Target: >= 99% of interactive requests on time in every
  cell with the defaults.
- chat-priority: the same for chat (`ferry-tiny-chat`, streamed, `max_tokens` 16): the
  budgets cover the first token (`budget_scope: ttft`, the default), timed at the client to
  the first content delta; capacity is chat requests per second at saturation. The lane
  there: interactive prompts prefilled alone, ahead of the batch-class decode step.

`--lengths longtail|bimodal`: the embeddings cells send loadtests/length_mix.py's seeded
pools of mixed lengths instead of short sentences of nearly one length.

    python -m loadtests.bench_latency [--cells latency,burst,priority,chat-priority] [--duration 6] [--out f.json]
        [--priority-modes lane,reserve,throughput] [--lengths longtail] [--chat-budgets-ms 500,5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from tuner.percentile import percentile
from tuner.traffic import sentence

from .bench_embeddings import MODEL
from .openloop import GatewayProcess, Sample, burst, open_loop

TOKEN = "bench-admin"
INTERACTIVE_MS, BATCH_MS = 100.0, 1000.0
CHAT_MODEL = "ferry-tiny-chat"
BURST_IDLE_S, BURST_BUDGET_MS, CHAT_BURST_TOKENS = 30.0, 1000.0, 8
PRIORITY_INTERACTIVE, PRIORITY_BATCH_LOADS = 0.10, (0.5, 1.0, 1.5, 2.0)
FIXED_GRID = [(8, 0.0), (8, 10.0), (32, 0.0), (32, 10.0)]
DEFAULTS: dict[str, Any] = {"max_batch_size": 32, "max_wait_ms": 5.0}


# The embeddings cells' inputs: short sentences of nearly one length, or with `--lengths` a
# seeded long-tailed or bimodal pool (loadtests/length_mix.py), input i the pool's i-th.
_text: Callable[[int], str] = sentence


def use_lengths(dist: str) -> None:
    from .length_mix import make_texts

    pool = make_texts(dist, 4096, seed=0)
    global _text
    _text = lambda i: pool[i % len(pool)]  # noqa: E731


def make_embed_send(seed: int, interactive_share: float = 0.3):
    rng = random.Random(seed)
    classes = ["interactive" if rng.random() < interactive_share else "batch" for _ in range(200_000)]

    async def send(session, i: int) -> Sample:
        cls = classes[i]
        budget = INTERACTIVE_MS if cls == "interactive" else BATCH_MS
        body = {"model": MODEL, "input": _text(i), "latency_budget_ms": budget, "priority": cls}
        import orjson

        async with session.post(
            "/v1/embeddings", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            await r.read()
            return Sample(0.0, 0.0, r.status, tag=cls)

    return send


CHAT_PRIORITY_TOKENS = 16


def make_chat_priority_send(seed: int, interactive_share: float, budgets: bool = True):
    """Streamed chat requests; a Sample's `ttft` is the first content delta (absolute, made
    relative to the scheduled send by open_loop)."""
    import orjson

    rng = random.Random(seed)
    classes = ["interactive" if rng.random() < interactive_share else "batch" for _ in range(200_000)]

    async def send(session, i: int) -> Sample:
        cls = classes[i]
        body: dict[str, Any] = {
            "model": CHAT_MODEL,
            "messages": [{"role": "user", "content": sentence(i)}],
            "max_tokens": CHAT_PRIORITY_TOKENS,
            "stream": True,
            "priority": cls,
            "latency_budget_ms": (INTERACTIVE_MS if cls == "interactive" else BATCH_MS) if budgets else 60_000,
        }
        ttft = None
        async with session.post(
            "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            if r.status != 200:
                await r.read()
                return Sample(0.0, 0.0, r.status, tag=cls)
            status = 200
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in orjson.loads(line[6:]).get("choices") or []:
                    if choice.get("error"):  # ended in the stream (expired, failed): on its own chunk
                        status = choice["error"].get("status") or 500
                    if ttft is None and (choice.get("delta") or {}).get("content"):
                        ttft = time.perf_counter()
        return Sample(0.0, 0.0, status, ttft=ttft, tag=cls)

    return send


def summarise_classes(samples: list[Sample], duration: float, by_ttft: bool = False) -> dict:
    """Per class (interactive, batch): budgets met, goodput, refusals, p99. `by_ttft`: a
    budget is met by the first token (chat), else by the whole answer."""
    out: dict = {"sent": len(samples)}
    span = max(duration, max(s.sent + s.latency for s in samples) - min(s.sent for s in samples))
    good = 0
    for cls, budget in (("interactive", INTERACTIVE_MS), ("batch", BATCH_MS)):
        mine = [s for s in samples if s.tag == cls]
        ok = [s for s in mine if s.status == 200]
        timed = [(s, s.ttft if by_ttft else s.latency) for s in ok]
        within = [s for s, t in timed if t is not None and t * 1000 <= budget]
        good += len(within)
        out[cls] = {
            "sent": len(mine),
            "ok": len(ok),
            "within": len(within),
            "attainment": len(within) / len(mine) if mine else float("nan"),
            "goodput": len(within) / span,
            "rejected": sum(1 for s in mine if s.status == 429),
            "expired": sum(1 for s in mine if s.status == 504),
            "p99_ms": percentile([t * 1000 for _, t in timed if t is not None], 99),
        }
    rejected = [s for s in samples if s.status == 429]
    out["goodput"] = good / span
    out["rejected"] = len(rejected)
    out["expired"] = sum(1 for s in samples if s.status == 504)
    out["errors"] = sum(1 for s in samples if s.status not in (200, 429, 504))
    out["p99_429_ms"] = percentile([s.latency * 1000 for s in rejected], 99)
    return out


def configure(url: str, model: str = MODEL, /, **settings: Any) -> None:
    r = httpx.patch(f"{url}/admin/models/{model}/batching", json=settings, headers={"Authorization": f"Bearer {TOKEN}"})
    r.raise_for_status()


def capacity(url: str, duration: float) -> float:
    """Saturate with batch-class work (generous budgets) and count what completes. One
    request in 400 (one a second) is interactive: as in the cells, the lane stays kept for
    interactive work, and batch-class work runs on one engine thread (with none, after 10 s
    the lane's thread runs batch-class work too, batcher/microbatcher.py's LANE_QUIET)."""
    configure(url, policy="adaptive", **DEFAULTS)
    samples = asyncio.run(open_loop(400, duration, _saturating_send, url, seed=7))
    ok = [s for s in samples if s.status == 200]
    span = max(s.sent + s.latency for s in samples) - min(s.sent for s in samples)
    return len(ok) / span


async def _saturating_send(session, i):
    import orjson

    cls = "interactive" if i % 400 == 0 else "batch"
    body = {"model": MODEL, "input": _text(i), "latency_budget_ms": 60_000, "priority": cls}
    async with session.post(
        "/v1/embeddings", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        await r.read()
        return Sample(0.0, 0.0, r.status)


def burst_cell(url: str, model: str, size: int) -> dict:
    """Idle, then 4 x max_batch_size requests at once with a 1 s budget."""
    time.sleep(BURST_IDLE_S)
    samples = asyncio.run(burst(4 * size, _burst_send(model), url))
    ok = [s for s in samples if s.status == 200]
    return {
        "model": model,
        "sent": len(samples),
        "ok": len(ok),
        "within": sum(1 for s in ok if s.latency * 1000 <= BURST_BUDGET_MS),
        "rejected": sum(1 for s in samples if s.status == 429),
        "expired": sum(1 for s in samples if s.status == 504),
        "errors": sum(1 for s in samples if s.status not in (200, 429, 504)),
        "p50_ms": percentile([s.latency * 1000 for s in ok], 50),
        "p99_ms": percentile([s.latency * 1000 for s in ok], 99),
    }


def _burst_send(model: str):
    import orjson

    async def send(session, i):
        if model == CHAT_MODEL:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": sentence(i)}],
                "max_tokens": CHAT_BURST_TOKENS,
                "latency_budget_ms": BURST_BUDGET_MS,
            }
            path = "/v1/chat/completions"
        else:
            body = {"model": model, "input": sentence(i), "latency_budget_ms": BURST_BUDGET_MS}
            path = "/v1/embeddings"
        async with session.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return Sample(0.0, 0.0, r.status)

    return send


def run_bursts(duration: float) -> list[dict]:
    rows = []
    with GatewayProcess("--admin-token", TOKEN) as gw:  # both default models
        for model in (MODEL, CHAT_MODEL):
            row = burst_cell(gw.url, model, DEFAULTS["max_batch_size"])
            rows.append(row)
            print(
                f"  burst after {BURST_IDLE_S:.0f} s idle, {row['sent']} x {model}: ok {row['ok']}"
                f" (within 1 s {row['within']})  429 {row['rejected']}  504 {row['expired']}  errors {row['errors']}"
                f"  p50 {row['p50_ms']:.0f} ms  p99 {row['p99_ms']:.0f} ms",
                flush=True,
            )
    return rows


def chat_capacity(url: str, duration: float) -> float:
    """Chat requests per second at saturation (streamed, no binding budget)."""
    samples = asyncio.run(open_loop(200, duration, make_chat_priority_send(7, 0.0, budgets=False), url, seed=7))
    ok = [s for s in samples if s.status == 200]
    span = max(s.sent + s.latency for s in samples) - min(s.sent for s in samples)
    return len(ok) / span


# The priority cells' modes: the settings each is served with (embeddings).
PRIORITY_MODES: dict[str, dict[str, bool]] = {
    "lane": {"interactive_first": True, "interactive_lane": True},
    "reserve": {"interactive_first": True, "interactive_lane": False},
    "throughput": {"interactive_first": False, "interactive_lane": False},
}


def first_token_slowdown(url: str) -> dict[str, float]:
    """`ferry_first_token_slowdown` by class: how much admission stretches its first-token
    predictions (the 90th percentile of observed over predicted lately)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        s.labels["class"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "ferry_first_token_slowdown"
    }


def run_priority(
    url: str, cap: float, duration: float, chat: bool = False, modes: tuple[str, ...] = ("lane", "reserve")
) -> list[dict]:
    """For chat the lane is interactive prompts prefilled alone ahead of the decode step."""
    rows = []
    for batch_load in PRIORITY_BATCH_LOADS:
        rate = (PRIORITY_INTERACTIVE + batch_load) * cap
        share = PRIORITY_INTERACTIVE / (PRIORITY_INTERACTIVE + batch_load)
        for mode in modes:
            first = mode != "throughput"
            if chat:
                configure(url, CHAT_MODEL, **PRIORITY_MODES[mode])
            else:
                configure(url, policy="adaptive", **PRIORITY_MODES[mode], **DEFAULTS)
            time.sleep(0.3)
            seed = int(batch_load * 100)
            send = make_chat_priority_send(seed, share) if chat else make_embed_send(seed, share)
            samples = asyncio.run(open_loop(rate, duration, send, url, seed=seed))
            row = {
                "batch_load": batch_load,
                "interactive_first": first,
                "mode": mode,
                "rate": rate,
                **summarise_classes(samples, duration, by_ttft=chat),
            }
            rows.append(row)
            i, b = row["interactive"], row["batch"]
            print(
                f"  batch {batch_load:4.0%} + interactive {PRIORITY_INTERACTIVE:.0%}  {mode:10s}"
                f"  interactive on time {i['attainment']:6.1%}"
                f" (429 {i['rejected']}, 504 {i['expired']}, p99 {i['p99_ms']:5.0f} ms)"
                f"  batch goodput {b['goodput']:6.1f}/s on time {b['attainment']:6.1%}"
                f" (429 {b['rejected']}, 504 {b['expired']})",
                flush=True,
            )
            if chat:  # what admission's first-token promises allowed for, per class, at the cell's end
                slow = first_token_slowdown(url)
                row["first_token_slowdown"] = slow
                shown = ", ".join(f"{k} {v:.2f}" for k, v in slow.items())
                print(f"  {'':42s}first-token slowdown {shown}", flush=True)
    if chat:
        configure(url, CHAT_MODEL, **PRIORITY_MODES["lane"])  # the defaults again
    else:
        configure(url, MODEL, **PRIORITY_MODES["lane"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--loads", default="0.25,0.5,0.8,1.0,1.5")
    p.add_argument("--cells", default="latency,burst,priority")
    p.add_argument("--out", default="")
    p.add_argument("--ferry-args", default="", help="extra `ferry serve` flags, e.g. --no-engine-cores")
    p.add_argument("--priority-modes", default="lane,reserve", help="of " + ",".join(PRIORITY_MODES))
    p.add_argument(
        "--lengths", choices=("longtail", "bimodal"), help="embeddings cells: inputs of mixed lengths, not sentences"
    )
    p.add_argument(
        "--chat-budgets-ms",
        default="",
        help="chat-priority cell: interactive,batch first-token budgets (default the embeddings cells' "
        "100,1000); e.g. 500,5000 for a real model (FERRY_CHAT_MODEL=default)",
    )
    a = p.parse_args()
    if a.lengths:
        use_lengths(a.lengths)
    cells = set(a.cells.split(","))
    out: dict = {}
    if "burst" in cells:
        out["burst"] = run_bursts(a.duration)
    if cells & {"latency", "priority"}:
        with GatewayProcess("--chat-model", "none", "--admin-token", TOKEN, *a.ferry_args.split()) as gw:
            cap = capacity(gw.url, a.duration)
            out["capacity"] = cap
            print(f"measured capacity: {cap:.1f} req/s (adaptive, saturated)")
            if "priority" in cells:
                modes = tuple(a.priority_modes.split(","))
                out["priority"] = run_priority(gw.url, cap, a.duration, modes=modes)
            if "latency" in cells:
                out["results"] = run_latency(gw.url, cap, a)
    if "chat-priority" in cells:
        if a.chat_budgets_ms:
            global INTERACTIVE_MS, BATCH_MS  # (the cells read them as module settings)
            INTERACTIVE_MS, BATCH_MS = (float(x) for x in a.chat_budgets_ms.split(","))
            print(f"chat budgets: interactive {INTERACTIVE_MS:g} ms, batch {BATCH_MS:g} ms (first token)")
        args = ("--embedding-model", "none", "--admin-token", TOKEN, *a.ferry_args.split())
        with GatewayProcess(*args) as gw:
            cap = chat_capacity(gw.url, a.duration)
        out["chat_capacity"] = cap
        print(f"measured chat capacity: {cap:.1f} req/s (streamed, max_tokens {CHAT_PRIORITY_TOKENS}, saturated)")
        # The cells on a server of their own: the saturated run's first tokens, seconds later
        # than predicted, filled the batch class's first-token calibration, and its stretch
        # (about 2.5 on the real model) refused batch-class prompts at 50-100% load until
        # the window forgot it.
        with GatewayProcess(*args) as gw:
            modes = tuple(a.priority_modes.split(","))
            out["chat_priority"] = run_priority(gw.url, cap, a.duration, chat=True, modes=modes)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


def run_latency(url: str, cap: float, a) -> list[dict]:
    loads = [float(x) for x in a.loads.split(",")]
    configs = [
        (f"fixed b={b} w={w:g}", {"policy": "fixed", "max_batch_size": b, "max_wait_ms": w}) for b, w in FIXED_GRID
    ]
    configs += [
        ("deadline (defaults)", {"policy": "deadline", **DEFAULTS}),
        ("adaptive (defaults)", {"policy": "adaptive", **DEFAULTS}),
        ("adaptive throughput-first", {"policy": "adaptive", **DEFAULTS, "interactive_first": False}),
    ]
    for _, settings in configs:
        settings.setdefault("interactive_first", True)
    results = []
    for load in loads:
        rate = load * cap
        for name, settings in configs:
            configure(url, **settings)
            time.sleep(0.3)
            samples = asyncio.run(
                open_loop(rate, a.duration, make_embed_send(int(load * 100)), url, seed=int(load * 100))
            )
            row = {"load": load, "rate": rate, "config": name, **summarise_classes(samples, a.duration)}
            results.append(row)
            print(
                f"  {load:4.0%} {rate:6.1f}/s {name:20s} goodput {row['goodput']:6.1f}/s"
                f"  interactive {row['interactive']['attainment']:6.1%} p99 {row['interactive']['p99_ms']:7.1f} ms"
                f"  batch {row['batch']['attainment']:6.1%} p99 {row['batch']['p99_ms']:7.1f} ms"
                f"  429 {row['rejected']:4d} (p99 {row['p99_429_ms']:5.1f} ms)  504 {row['expired']:4d}",
                flush=True,
            )
    print("\nsummary: adaptive vs best fixed goodput, per load")
    for load in loads:
        rows = [r for r in results if r["load"] == load]
        best = max((r for r in rows if r["config"].startswith("fixed")), key=lambda r: r["goodput"])
        for ada in (r for r in rows if r["config"].startswith("adaptive")):
            print(
                f"  {load:4.0%}: {ada['config']} {ada['goodput']:6.1f}/s"
                f" vs best fixed {best['goodput']:6.1f}/s ({best['config']})"
                f" = {ada['goodput'] / best['goodput']:.2f}x;"
                f" interactive attainment {ada['interactive']['attainment']:.1%}"
                f", 429 {ada['rejected']}, 504 {ada['expired']}"
            )
    return results


if __name__ == "__main__":
    main()
