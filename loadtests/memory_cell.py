"""bench_chat's memory cell: the same load against Ferry with its KV memory unbounded and
with a quarter of what the load needs (`--kv-cache-mb`), side by side in one run.

The load: `clients` closed-loop batch-class clients (`X-Ferry-Priority: batch`), each
sending a ~300-token chat prompt of its own for 128 new tokens (greedy, `ignore_eos`, not
streamed), beside interactive requests arriving at Poisson times (`rate` per second; a
short prompt, 16 new tokens, streamed, timed to the first content token). What it shows:
what bounding the memory costs the batch-class throughput (fewer rows decode at once, and
preempted rows are recomputed), that interactive first tokens do not pay for it (batch-class
rows yield to them), how many preemptions it took, and the most KV the running rows held
(`ferry_kv_cache_tokens`: the running rows and the prompts prefilling, sampled every half
second, so a lower bound; 8 KiB a token for the built-in model). Batch-class answers that
are not 200s are counted and reported, not spun on. The quarter is of an estimate of the
need (clients x (300 + 128) tokens), about a fifth of what the unbounded server holds at
its peak.

    python -m loadtests.bench_chat --servers memory --duration 20
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from tuner.percentile import percentile

from .openloop import GatewayProcess, Sample, open_loop
from .saturation_cell import PROMPTS

MODEL = "ferry-tiny-chat"
BATCH_TOKENS = 128
TOKEN_BYTES = 8192  # the built-in model's keys and values of one token, all layers (fp32)


def batch_prompt(k: int) -> str:
    return f"Passenger {k} asks: " + " ".join(f"ferry {k} crosses river {i}" for i in range(40))


async def _batch_client(session: aiohttp.ClientSession, k: int, until: float, out: list) -> None:
    while time.perf_counter() < until:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": batch_prompt(k)}],
            "max_tokens": BATCH_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        try:
            async with session.post(
                "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Ferry-Priority": "batch"}
            ) as r:
                status, data = r.status, (orjson.loads(await r.read()) if r.status == 200 else {})
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status, data = 0, {}
        out.append((time.perf_counter(), (data.get("usage") or {}).get("completion_tokens", 0), status))
        if status != 200:
            await asyncio.sleep(0.1)  # a refusal is counted, not spun on


async def _interactive(session, i: int) -> Sample:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    async with session.post("/v1/chat/completions", data=orjson.dumps(body)) as r:
        async for raw in r.content:
            if ttft is None and raw.startswith(b'data: {"') and b'"content":"' in raw:
                ttft = time.perf_counter()
    return Sample(t0, time.perf_counter() - t0, r.status, ttft=ttft)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def run_memory_cell(duration: float, clients: int = 48, rate: float = 2.0) -> list[dict]:
    need_mb = clients * (300 + BATCH_TOKENS) * TOKEN_BYTES / 2**20
    rows = []
    quarter_mb = max(1, round(need_mb / 4))
    print(f"KV memory ({clients} batch-class clients, {BATCH_TOKENS} tokens each, closed loop; interactive {rate}/s):")
    for label, mb in (("unbounded (--kv-cache-mb 0)", 0), (f"a quarter (--kv-cache-mb {quarter_mb})", quarter_mb)):
        with GatewayProcess("--embedding-model", "none", "--kv-cache-mb", str(mb)) as gw:
            before = _metric(gw.url, "ferry_preemptions_total")

            async def main(url: str = gw.url) -> tuple[list, list, float, str]:
                done: list = []
                peak = 0.0
                connector = aiohttp.TCPConnector(limit=clients + 8)
                timeout = aiohttp.ClientTimeout(total=600)
                async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as session:
                    start = time.perf_counter()
                    until = start + duration * 4 / 3
                    loops = [asyncio.create_task(_batch_client(session, k, until, done)) for k in range(clients)]
                    await asyncio.sleep(duration / 3)  # warm-up: the rows fill
                    inter = asyncio.create_task(open_loop(rate, duration, _interactive, url, seed=3))
                    while time.perf_counter() < until:
                        await asyncio.sleep(0.5)
                        kv = await asyncio.to_thread(_metric, url, "ferry_kv_cache_tokens")
                        peak = max(peak, kv)
                    samples = await inter
                    await asyncio.gather(*loops)
                    window = [tokens for t, tokens, _ in done if start + duration / 3 <= t <= until]
                    failed = sum(1 for _, _, status in done if status != 200)
                return window, samples, peak, f"{len(done) - failed}/{len(done)}"

            window, samples, peak, answered = asyncio.run(main())
            preempted = _metric(gw.url, "ferry_preemptions_total") - before
        ttft = [s.ttft * 1000 for s in samples if s.status == 200 and s.ttft is not None]  # from the scheduled send
        row = {
            "label": label,
            "tok_s": sum(window) / duration,
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "interactive": f"{len(ttft)}/{len(samples)}",
            "batch_answered": answered,
            "preemptions_s": preempted / (duration * 4 / 3),
            "peak_kv_mb": peak * TOKEN_BYTES / 2**20,
        }
        rows.append(row)
        print(
            f"  {label:32s} batch {row['tok_s']:7.0f} tok/s ({answered} answered)  "
            f"interactive TTFT p50 {row['ttft_p50']:5.0f} / "
            f"p99 {row['ttft_p99']:5.0f} ms ({row['interactive']})  preemptions {row['preemptions_s']:5.1f}/s  "
            f"KV peak {row['peak_kv_mb']:5.0f} MiB"
        )
    full, quarter = rows
    print(
        f"  a quarter / unbounded: batch tok/s {quarter['tok_s'] / full['tok_s']:.2f}x, interactive TTFT p99 "
        f"{quarter['ttft_p99'] / full['ttft_p99']:.2f}x, "
        f"KV peak {quarter['peak_kv_mb'] / full['peak_kv_mb']:.2f}x"
    )
    return rows
