"""Graceful drain: SIGTERM during load loses no accepted request."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import orjson
import pytest

from .procs import FakeGatewayProcess

CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
EMB = {"model": "fake-embed", "input": "hello"}


async def one(session: aiohttp.ClientSession, i: int) -> str:
    """Returns 'ok' (a full answer), 'refused-<status>' or 'connect' (socket closed)."""
    body = CHAT if i % 2 else EMB
    path = "/v1/chat/completions" if i % 2 else "/v1/embeddings"
    try:
        async with session.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
            raw = await r.read()
            if r.status != 200:
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1, (r.status, raw[:300])
                return f"refused-{r.status}"
            if body is CHAT:
                assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]  # a stream is never cut short
                assert b'"finish_reason":"length"' in raw
            return "ok"
    except aiohttp.ClientConnectorError:
        return "connect"  # the listening socket is gone: never accepted


async def load(url: str, gateway: FakeGatewayProcess) -> tuple[Counter, list[int]]:
    outcomes: Counter = Counter()
    ready: list[int] = []
    async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=60)) as s:
        tasks = []
        for i in range(120):
            tasks.append(asyncio.create_task(one(s, i)))
            await asyncio.sleep(0.01)
            if i == 60:
                gateway.terminate()
                await asyncio.sleep(0.05)
                async with s.get("/readyz") as r:
                    ready.append(r.status)
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            outcomes[result if isinstance(result, str) else f"FAILED {result!r}"] += 1
    return outcomes, ready


@pytest.mark.parametrize("cores", ["--no-engine-cores", "--engine-cores"])
def test_sigterm_during_load_loses_no_accepted_request(cores):
    gw = FakeGatewayProcess("--drain-timeout", "20", cores, delay=0.02)
    try:
        outcomes, ready = asyncio.run(load(gw.url, gw))
        assert gw.wait(60) == 0
    finally:
        gw.kill()
    assert ready == [503]  # readiness turns at once
    assert not [k for k in outcomes if k.startswith("FAILED")], outcomes
    assert outcomes["ok"] >= 60  # everything sent before the signal was answered in full
    assert outcomes["refused-503"] + outcomes["connect"] > 0
    assert sum(outcomes.values()) == 120


def test_work_left_at_the_drain_timeout_ends_with_a_clear_error():
    gw = FakeGatewayProcess("--drain-timeout", "1", delay=0.1)

    async def scenario():
        async with aiohttp.ClientSession(base_url=gw.url, timeout=aiohttp.ClientTimeout(total=60)) as s:
            body = {**CHAT, "max_tokens": 400}
            async with s.post(
                "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
            ) as r:
                first = await r.content.readline()
                gw.terminate()
                rest = await r.read()
                return first, rest

    try:
        first, rest = asyncio.run(scenario())
        assert gw.wait(60) == 0
    finally:
        gw.kill()
    assert first.startswith(b"data: ")
    assert b'"finish_reason":"content_filter"' in rest and b'"code":"shutting_down"' in rest
    assert rest.rstrip().endswith(b"data: [DONE]")
