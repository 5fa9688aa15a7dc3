"""Open-loop load for the benchmarks: Poisson arrivals that do not wait for responses (no
coordinated omission), plus helpers to start a gateway subprocess and summarise latencies.
Every loop is bounded in count and time; targets are 127.0.0.1 only. (`ferry tune` drives
locust instead: tuner/locustfile.py.)"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from tuner.percentile import percentile


@dataclass
class Sample:
    sent: float
    latency: float
    status: int
    ttft: float | None = None
    tokens: int = 0
    tag: str = ""
    headers: dict = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """`ferry serve` in a subprocess on a free loopback port. Its chat model is the one its
    arguments or FERRY_CHAT_MODEL name, else ferry-tiny-chat (`--chat-model tiny`): the
    cells that measure the machinery send "ferry-tiny-chat"; a cell on another model says so
    (bench_chat's `--chat-model`)."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 300.0, cwd: str | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        if not {"--chat-model", "--config"} & set(args) and not {"FERRY_CHAT_MODEL", "FERRY_CONFIG"} & set(full_env):
            args = ("--chat-model", "tiny", *args)
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        # Logs go to a file: an unread pipe fills up and blocks the server. It stays open as
        # long as the server runs, so no `with`.
        self.log = tempfile.NamedTemporaryFile(prefix="ferry-bench-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("gateway not ready in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


async def open_loop(
    rate: float,
    duration: float,
    send: Callable[[Any, int], Any],
    url: str,
    seed: int = 0,
    max_requests: int = 100_000,
    connections: int = 256,
) -> list[Sample]:
    """Fire requests at Poisson times for `duration` seconds; wait for all to finish.

    The client is aiohttp: httpx costs several times more CPU per request, and on two
    shared cores a load generator that saturates its own core measures itself, not the
    server. The pool is bounded; a wait for a connection still counts in latency (timed
    from the scheduled send), so it hides no queueing.
    """
    rng = random.Random(seed)
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as session:
        tasks = []
        start = time.perf_counter()
        t = 0.0
        i = 0
        while i < max_requests:
            t += rng.expovariate(rate)
            if t > duration:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_timed(send, session, i, start + t, samples)))
            i += 1
        await asyncio.gather(*tasks)
    return samples


async def burst(n: int, send: Callable[[Any, int], Any], url: str) -> list[Sample]:
    """Send `n` requests at once (one connection each) and wait for every answer."""
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=n)
    async with aiohttp.ClientSession(
        base_url=url, connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        start = time.perf_counter()
        await asyncio.gather(*(_timed(send, session, i, start, samples) for i in range(n)))
    return samples


async def _timed(send, session, i, scheduled, samples):
    try:
        result = await send(session, i)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        samples.append(Sample(scheduled, time.perf_counter() - scheduled, 0))
        return
    if isinstance(result, Sample):
        result.latency = time.perf_counter() - scheduled
        if result.ttft is not None:
            result.ttft = result.ttft - scheduled
        result.sent = scheduled
        samples.append(result)
    else:
        status, headers = result
        samples.append(Sample(scheduled, time.perf_counter() - scheduled, status, headers=headers))


async def post_json(session, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with session.post(
        path, data=orjson.dumps(body), headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        await r.read()
        return r.status, dict(r.headers)


def summarise(samples: list[Sample], duration: float, slo_ms: float | None = None) -> dict[str, float]:
    """Counts, throughput (200s per second), p50/p99 of the 200s, and with `slo_ms` the
    goodput: 200s answered within the SLO, per second."""
    ok = [s for s in samples if s.status == 200]
    lat = [s.latency * 1000 for s in ok]
    span = max((s.sent + s.latency for s in samples), default=0) - min((s.sent for s in samples), default=0)
    within = sum(1 for ms in lat if slo_ms is not None and ms <= slo_ms)
    return {
        "sent": len(samples),
        "ok": len(ok),
        "throughput": len(ok) / max(span, duration),
        "goodput": within / max(span, duration),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "rejected": sum(1 for s in samples if s.status in (429, 503)),
        "expired": sum(1 for s in samples if s.status == 504),
        "errors": sum(1 for s in samples if s.status not in (200, 429, 503, 504)),
    }
