"""Faults with the fake engine: each affects only the items it touched, and the outcomes
add up to the requests sent."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from engine.fake import FakeEmbeddingEngine

MODEL = "fake-embed"


async def _fire(url: str, texts: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await asyncio.gather(*(c.post("/v1/embeddings", json={"model": MODEL, "input": t}) for t in texts))


def test_mixed_faults_fail_only_what_they_touched(fake_server_factory):
    engine = FakeEmbeddingEngine(fixed=0.005)
    s = fake_server_factory(embed=engine, max_batch_size=4, max_wait_ms=20, policy="fixed")
    texts = [f"fine {i}" for i in range(12)] + ["FAIL_ITEM one", "FAIL_ITEM two", "OOM here"]
    rs = asyncio.run(_fire(s.url, texts))
    by_text = dict(zip(texts, rs, strict=True))
    assert all(by_text[f"fine {i}"].status_code == 200 for i in range(12))
    assert [by_text[t].status_code for t in texts[12:]] == [500, 500, 500]
    outcomes = s.ferry.models[MODEL].batcher.inner.outcomes
    assert sum(outcomes.values()) == len(texts)
    assert Counter({o.name: n for o, n in outcomes.items() if n}) == Counter({"RESULT": 12, "ERROR": 3})


def test_a_whole_batch_failure_fails_that_batch_only(fake_server_factory):
    engine = FakeEmbeddingEngine()
    s = fake_server_factory(embed=engine, max_batch_size=3, max_wait_ms=50, policy="fixed")
    first = asyncio.run(_fire(s.url, ["a", "FAIL_BATCH b", "c"]))
    second = asyncio.run(_fire(s.url, ["d", "e", "f"]))
    assert [r.status_code for r in first] == [500, 500, 500]
    assert {r.json()["error"]["code"] for r in first} == {"engine_error"}
    assert [r.status_code for r in second] == [200, 200, 200]


def test_a_hung_engine_call_times_out_and_the_engine_keeps_serving(fake_server_factory):
    engine = FakeEmbeddingEngine(hang_seconds=3.0)
    s = fake_server_factory(embed=engine, engine_timeout=0.3, max_batch_size=1, max_wait_ms=0)
    hung, after = asyncio.run(_hung_then_normal(s.url))
    assert hung.status_code == 500 and "exceeded" in hung.json()["error"]["message"]
    assert after.status_code == 200  # served by a fresh worker thread while the old one is stuck
    assert s.ferry.models[MODEL].engine_thread.abandoned == 1


async def _hung_then_normal(url: str):
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        hung = await c.post("/v1/embeddings", json={"model": MODEL, "input": "HANG now"})
        after = await c.post("/v1/embeddings", json={"model": MODEL, "input": "after"})
        return hung, after


def test_a_slow_engine_turns_into_fast_429s_not_timeouts(fake_server_factory):
    batch_time = 0.2
    engine = FakeEmbeddingEngine(fixed=batch_time)
    s = fake_server_factory(embed=engine, max_batch_size=2, max_wait_ms=0, max_queue=4)
    batcher = s.ferry.models[MODEL].batcher.inner
    from batcher.cost import CostModel, LinearCost

    batcher.cost = CostModel(LinearCost(batch_time, 0.0, 0.0))  # the cost model knows the engine
    texts = [f"t{i}" for i in range(20)]

    async def fire():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            return await asyncio.gather(
                *(c.post("/v1/embeddings", json={"model": MODEL, "input": t, "latency_budget_ms": 700}) for t in texts)
            )

    rs = asyncio.run(fire())
    statuses = Counter(r.status_code for r in rs)
    assert set(statuses) <= {200, 429, 504} and statuses[200] >= 2 and statuses[429] >= 1
    assert all(int(r.headers["Retry-After"]) >= 1 for r in rs if r.status_code == 429)
    assert sum(batcher.outcomes.values()) == statuses[200] + statuses[504]  # 429s were never accepted
