"""Metrics across the processes of one server with several front ends (`--api-workers N`).

Each front end, and the supervisor (its `ferry_engine_core_restarts_total`), answers
`wire.MetricsRequest` with `wire.MetricsAnswer` (its own registry's families, as an
engine core sends them) on a ZMQ ROUTER bound to an ipc socket of its own (`MetricsServer`). A /metrics
scrape of any front end asks its peers (`scrape_peers`) and the engine cores
(`RemoteBatcher.scrape`) and merges everything with its own registry
(gateway/metrics_merge.py sums equal series), so every process's series shows once and a
counter incremented in two front ends scrapes as the sum. A peer that does not answer
within `SCRAPE_TIMEOUT_S` (dead, being replaced) is left out of that scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from batcher import wire

from .metrics_merge import metric_families
from .remote_batcher import SCRAPE_TIMEOUT_S

log = logging.getLogger("ferry.gateway")

_seqs = itertools.count(1)


def metrics_address(run_dir: str, name: str) -> str:
    """The metrics socket of one process of a server: `supervisor`, or `front-<i>`."""
    return f"ipc://{run_dir}/metrics-{name}"


class MetricsServer:
    """Answers MetricsRequest with `registry`'s text, on a ROUTER bound to `address`."""

    def __init__(self, registry: CollectorRegistry, address: str, ctx: zmq.asyncio.Context | None = None):
        self.registry = registry
        self.sock = (ctx or zmq.asyncio.Context.instance()).socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)  # a replaced front end binds its predecessor's path again
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve(), name="ferry-metrics-peer")

    async def _serve(self) -> None:
        while True:
            peer, raw = await self.sock.recv_multipart()
            try:
                message = wire.decode_to_core(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(message, wire.MetricsRequest):
                answer = wire.MetricsAnswer(message.seq, metric_families(self.registry))
                await self.sock.send_multipart([peer, wire.encode(answer)])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sock.close(linger=0)


async def scrape_peers(addresses: list[str], timeout: float = SCRAPE_TIMEOUT_S) -> list[list[wire.MetricFamily]]:
    """The metric families of every peer that answers within `timeout`."""
    answers = await asyncio.gather(*(_scrape(a, timeout) for a in addresses))
    return [a for a in answers if a is not None]


async def _scrape(address: str, timeout: float) -> list[wire.MetricFamily] | None:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        seq = next(_seqs)
        await sock.send(wire.encode(wire.MetricsRequest(seq)), flags=zmq.NOBLOCK)
        end = asyncio.get_running_loop().time() + timeout
        while True:
            left = end - asyncio.get_running_loop().time()
            raw = await asyncio.wait_for(sock.recv(), max(0.0, left))
            answer = wire.decode_to_front_end(raw)
            if isinstance(answer, wire.MetricsAnswer) and answer.seq == seq:
                return answer.families
    except (asyncio.TimeoutError, zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    finally:
        sock.close(linger=0)
