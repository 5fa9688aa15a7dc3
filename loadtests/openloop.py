"""Open-loop load: Poisson arrivals that do not wait for responses (no coordinated
omission), plus helpers to start a gateway subprocess and summarise latencies.
Every loop is bounded in count and time; targets are 127.0.0.1 only."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import numpy as np


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


class Gateway:
    """`ferry serve` in a subprocess on a free loopback port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.proc.stderr.read().decode()[-2000:]}")
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

    def __enter__(self) -> "Gateway":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


async def open_loop(rate: float, duration: float, send: Callable[[httpx.AsyncClient, int], Any], url: str,
                    seed: int = 0, max_requests: int = 100_000) -> list[Sample]:
    """Fire requests at Poisson times for `duration` seconds; wait for all to finish."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
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
            tasks.append(asyncio.create_task(_timed(send, client, i, samples)))
            i += 1
        await asyncio.gather(*tasks)
    return samples


async def _timed(send, client, i, samples):
    t0 = time.perf_counter()
    try:
        result = await send(client, i)
    except httpx.HTTPError:
        samples.append(Sample(t0, time.perf_counter() - t0, 0))
        return
    if isinstance(result, Sample):
        result.sent = t0
        samples.append(result)
    else:
        samples.append(Sample(t0, time.perf_counter() - t0, result.status_code, headers=dict(result.headers)))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarise(samples: list[Sample], duration: float) -> dict[str, float]:
    ok = [s for s in samples if s.status == 200]
    lat = [s.latency * 1000 for s in ok]
    span = max((s.sent + s.latency for s in samples), default=0) - min((s.sent for s in samples), default=0)
    return {
        "sent": len(samples),
        "ok": len(ok),
        "throughput": len(ok) / max(span, duration),
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "rejected": sum(1 for s in samples if s.status in (429, 503)),
        "expired": sum(1 for s in samples if s.status == 504),
        "errors": sum(1 for s in samples if s.status not in (200, 429, 503, 504)),
    }
