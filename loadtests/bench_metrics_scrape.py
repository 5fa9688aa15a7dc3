"""`/metrics` latency while the replica is saturated (issue: Beyond one machine, "What the
endpoint picker and autoscalers read": p99 <= 50 ms). An endpoint picker scrapes each
replica about every 50 ms and treats one whose metrics are older than 2 s as saturated, so
a scrape must stay fast exactly when the replica is busiest.

    python -m loadtests.bench_metrics_scrape [--rate 200] [--duration 10] [--real]

Starts `ferry serve --metrics-compat vllm` (in-process, then `--engine-cores`) over the fake
engines (each decode step and embeddings batch takes FERRY_FAKE_DELAY of wall time; `--real`:
the default models instead), floods it with open-loop chat requests above what it serves
(no default budget, a large queue: the queue only grows), and meanwhile scrapes /metrics
every 50 ms from a thread of its own over one kept-alive connection, as a picker does.
Prints each setting's scrape p50 / p99 / max and the deepest queue a scrape saw.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import threading
import time

from tuner.percentile import percentile

from .openloop import GatewayProcess, open_loop, post_json

INTERVAL_S = 0.05


class Scraper(threading.Thread):
    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.latencies: list[float] = []
        self.deepest = 0.0
        self.failures = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        next_at = time.perf_counter()
        while not self.stopping.is_set():
            start = time.perf_counter()
            try:
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                body = response.read().decode()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                ok, body = False, ""
            if ok:
                self.latencies.append((time.perf_counter() - start) * 1000)
                depth = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in body.splitlines()
                    if line.startswith("vllm:num_requests_waiting{")
                )
                self.deepest = max(self.deepest, depth)
            else:
                self.failures += 1
            next_at += INTERVAL_S
            self.stopping.wait(max(0.0, next_at - time.perf_counter()))
        conn.close()


async def _chat(session, i: int):
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 16}
    return await post_json(session, "/v1/chat/completions", body)


MODEL = "fake-chat"


def scrape_under_load(label: str, args: list[str], env: dict[str, str], rate: float, duration: float) -> dict:
    with GatewayProcess(
        "--metrics-compat",
        "vllm",
        "--max-queue",
        "100000",
        "--default-budget-ms",
        "none",
        "--drain-timeout",
        "1",
        *args,
        env=env,
    ) as gw:
        scraper = Scraper(gw.port)
        scraper.start()
        asyncio.run(open_loop(rate, duration, _chat, gw.url, seed=1, connections=512))
        scraper.stopping.set()
        scraper.join(30)
    lat = scraper.latencies
    row = {
        "label": label,
        "scrapes": len(lat),
        "failures": scraper.failures,
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat, default=0.0),
        "deepest_queue": scraper.deepest,
    }
    print(
        f"  {label:14s} {row['scrapes']:4d} scrapes ({row['failures']} failed)  p50 {row['p50_ms']:6.1f} ms"
        f"  p99 {row['p99_ms']:6.1f} ms  max {row['max_ms']:6.1f} ms  deepest queue {row['deepest_queue']:.0f}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    global MODEL
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=200.0, help="chat requests per second offered")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load per setting")
    p.add_argument("--delay", type=float, default=0.02, help="fake engines: seconds per decode step / batch")
    p.add_argument("--real", action="store_true", help="the default models instead of the fake engines")
    a = p.parse_args(argv)
    if a.real:
        MODEL, env = "ferry-tiny-chat", {}
    else:
        env = {"FERRY_FAKE_ENGINES": "1", "FERRY_FAKE_DELAY": str(a.delay)}
    print(f"/metrics every {INTERVAL_S * 1000:.0f} ms under {a.rate:.0f} chat requests/s for {a.duration:.0f} s")
    for label, args in (("in-process", ["--no-engine-cores"]), ("engine cores", ["--engine-cores"])):
        scrape_under_load(label, args, env, a.rate, a.duration)


if __name__ == "__main__":
    main()
