"""Budgets, priorities and admission as an HTTP client sees them (fake engines). Live
tuning: routes/test_admin.py."""

from __future__ import annotations

import asyncio

import httpx

from batcher.cost import CostModel, LinearCost
from engine.fake import FakeEmbeddingEngine, FakeGenerationEngine

from ..waiting import async_wait_until

EMB = {"model": "fake-embed", "input": "hello"}


def test_budget_and_priority_from_header_or_body(fake_server_factory):
    s = fake_server_factory()
    r = httpx.post(s.url + "/v1/embeddings", json=EMB, headers={"X-Ferry-Latency-Budget-Ms": "abc"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "X-Ferry-Latency-Budget-Ms"
    r = httpx.post(s.url + "/v1/embeddings", json=EMB, headers={"X-Ferry-Priority": "urgent"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "priority"
    r = httpx.post(
        s.url + "/v1/embeddings",
        json={**EMB, "priority": "batch", "latency_budget_ms": 5000},
        headers={"X-Ferry-Latency-Budget-Ms": "100"},
    )
    assert r.status_code == 200
    assert (
        s.ferry.metrics.registry.get_sample_value(
            "ferry_queue_wait_seconds_count", {"model": "fake-embed", "class": "batch"}
        )
        == 1
    )


def test_infeasible_budget_is_refused_at_once_with_retry_after(fake_server_factory):
    batch_time = 0.2  # the engine's, which the cost model knows: a 50 ms budget cannot wait for it
    engine = FakeEmbeddingEngine(fixed=batch_time)
    s = fake_server_factory(embed=engine, max_batch_size=1, max_wait_ms=0, interactive_lane=False)  # queue behind it
    s.ferry.models["fake-embed"].batcher.inner.cost = CostModel(LinearCost(batch_time, 0.0, 0.0))

    async def scenario():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            busy = asyncio.create_task(c.post("/v1/embeddings", json=EMB))
            await async_wait_until(lambda: engine.calls, message="the first request to reach the engine")
            tight = await c.post("/v1/embeddings", json={**EMB, "latency_budget_ms": 50})
            return tight, await busy

    tight, busy = asyncio.run(scenario())
    assert busy.status_code == 200
    assert tight.status_code == 429
    assert tight.json()["error"]["code"] == "deadline_infeasible"
    assert int(tight.headers["Retry-After"]) >= 1
    assert engine.calls == [1]


def test_on_infeasible_serve_marks_best_effort(fake_server_factory):
    s = fake_server_factory(on_infeasible="serve", interactive_lane=False)
    batcher = s.ferry.models["fake-embed"].batcher.inner
    batcher.cost = CostModel(LinearCost(1.0, 0.0, 0.0))  # predicts 1 s per batch
    r = httpx.post(s.url + "/v1/embeddings", json={**EMB, "latency_budget_ms": 100})
    assert r.status_code == 200 and r.headers["X-Ferry-Best-Effort"] == "true"


def test_a_stream_served_best_effort_says_so_in_its_headers(fake_server_factory):
    s = fake_server_factory(on_infeasible="serve", interactive_lane=False)
    scheduler = s.ferry.models["fake-chat"].batcher.inner
    scheduler.prefill_cost = scheduler.cost = CostModel(LinearCost(1.0, 0.0, 0.0), refit_every=10**9)  # 1 s a prefill
    body = {"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "latency_budget_ms": 100}) as r:
        assert r.status_code == 200 and r.headers["X-Ferry-Best-Effort"] == "true"
        assert r.read().endswith(b"data: [DONE]\n\n")
    with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "latency_budget_ms": 60_000}) as r:
        assert r.status_code == 200 and "X-Ferry-Best-Effort" not in r.headers


def test_a_request_chooses_to_be_served_late_rather_than_refused(fake_server_factory):
    s = fake_server_factory(interactive_lane=False)  # the model refuses (on_infeasible=reject)
    batcher = s.ferry.models["fake-embed"].batcher.inner
    batcher.cost = CostModel(LinearCost(1.0, 0.0, 0.0))  # predicts 1 s per batch
    tight = {**EMB, "latency_budget_ms": 100}
    r = httpx.post(s.url + "/v1/embeddings", json=tight)
    assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_infeasible"
    r = httpx.post(s.url + "/v1/embeddings", json={**tight, "on_infeasible": "serve"})
    assert r.status_code == 200 and r.headers["X-Ferry-Best-Effort"] == "true"
    assert len(r.json()["data"][0]["embedding"]) > 0
    r = httpx.post(s.url + "/v1/embeddings", json=tight, headers={"X-Ferry-On-Infeasible": "serve"})
    assert r.status_code == 200 and r.headers["X-Ferry-Best-Effort"] == "true"
    # The body wins over the header.
    r = httpx.post(
        s.url + "/v1/embeddings", json={**tight, "on_infeasible": "reject"}, headers={"X-Ferry-On-Infeasible": "serve"}
    )
    assert r.status_code == 429
    r = httpx.post(s.url + "/v1/embeddings", json=tight, headers={"X-Ferry-On-Infeasible": "maybe"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "X-Ferry-On-Infeasible"
    r = httpx.post(s.url + "/v1/embeddings", json={**tight, "on_infeasible": "maybe"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "on_infeasible"


def test_a_chat_request_may_refuse_where_the_model_would_serve_best_effort(fake_server_factory):
    s = fake_server_factory(on_infeasible="serve", interactive_lane=False)
    scheduler = s.ferry.models["fake-chat"].batcher.inner
    scheduler.prefill_cost = scheduler.cost = CostModel(LinearCost(1.0, 0.0, 0.0), refit_every=10**9)  # 1 s a prefill
    body = {"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(s.url + "/v1/chat/completions", json={**body, "latency_budget_ms": 100, "on_infeasible": "reject"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_infeasible"
    r = httpx.post(s.url + "/v1/chat/completions", json={**body, "latency_budget_ms": 100})
    assert r.status_code == 200 and r.headers["X-Ferry-Best-Effort"] == "true"


def test_deadline_passing_in_the_queue_gives_504(fake_server_factory):
    engine = FakeEmbeddingEngine(fixed=0.3)
    s = fake_server_factory(
        embed=engine, max_batch_size=1, max_wait_ms=0, on_infeasible="serve", interactive_lane=False
    )

    async def scenario():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            busy = asyncio.create_task(c.post("/v1/embeddings", json=EMB))
            await async_wait_until(lambda: engine.calls, message="the first request to reach the engine")
            late = await c.post("/v1/embeddings", json={**EMB, "latency_budget_ms": 40})
            return late, await busy

    late, _busy = asyncio.run(scenario())
    assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
    assert engine.calls == [1]  # the expired item never reached the engine
    assert (
        s.ferry.metrics.registry.get_sample_value(
            "ferry_expired_total", {"model": "fake-embed", "class": "interactive"}
        )
        == 1
    )


async def _one_by_one_then_burst(url: str, path: str, body: dict, singles: int, burst: int) -> list[int]:
    limits = httpx.Limits(max_connections=burst + 10)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        for _ in range(singles):
            assert (await c.post(path, json=body)).status_code == 200
        await asyncio.sleep(1.0)  # a quiet spell
        replies = await asyncio.gather(*(c.post(path, json=body) for _ in range(burst)))
        return [r.status_code for r in replies]


def test_an_embeddings_burst_after_a_quiet_spell_is_served_in_full(fake_server_factory):
    """A few single requests, a quiet second, then 40 at once (max_batch_size 16,
    max_wait_ms 20, the 10 s default budget): none is refused (was: 23 of 40, with
    predictions of ~32 s from the few completions of the quiet spell)."""
    engine = FakeEmbeddingEngine(fixed=0.05, per_item=0.001)  # slow enough for a queue to form
    s = fake_server_factory(embed=engine, max_batch_size=16, max_wait_ms=20)
    statuses = asyncio.run(_one_by_one_then_burst(s.url, "/v1/embeddings", EMB, 3, 40))
    assert statuses == [200] * 40


def test_a_chat_burst_after_a_quiet_spell_is_served_in_full(fake_server_factory):
    """Three chat requests one after another, a quiet second, then 100 at once
    (max_tokens 32, no budget: the 10 s default): none is refused (was: 67 of 100).
    With the warm-up `ferry serve` runs by default: without it the decode cost model knows
    one occupancy only and extrapolates the prior's slope to 64 sequences, and on a busy
    machine the 65th request's predicted first token passed 10 s (a flaky 429)."""
    from engine.fake import FakeGenerationEngine

    s = fake_server_factory(chat=FakeGenerationEngine(step_delay=0.02), warmup=True)
    body = {"model": "fake-chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 32}
    statuses = asyncio.run(_one_by_one_then_burst(s.url, "/v1/chat/completions", body, 3, 100))
    assert statuses == [200] * 100


CHAT_BODY = {"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SLO_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms", "x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")


def test_slo_headers_that_are_not_positive_numbers_are_a_400_naming_the_header(fake_server_factory):
    s = fake_server_factory()
    for header in SLO_HEADERS:
        for value in ("abc", "0", "-5", "nan", "", "1e9"):
            for path, body in (("/v1/chat/completions", CHAT_BODY), ("/v1/embeddings", EMB)):
                r = httpx.post(s.url + path, json=body, headers={header: value})
                assert r.status_code == 400, (header, value, path, r.text)
                error = r.json()["error"]
                assert error["param"] == header and header in error["message"], error
                assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"


def test_the_ttft_headers_set_the_budget_as_the_ferry_header_does(fake_server_factory):
    s = fake_server_factory()
    chat = s.ferry.models["fake-chat"].batcher.inner
    chat.prefill_cost = chat.cost = CostModel(LinearCost(1.0, 0.0, 0.0))  # a first token takes 1 s

    def answer(headers: dict[str, str]) -> tuple[int, str | None]:
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT_BODY, headers=headers, timeout=30)
        return r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None

    for ms, expected in (("100", (429, "deadline_infeasible")), ("5000", (200, None))):
        for header in ("X-Ferry-Latency-Budget-Ms", "x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"):
            assert answer({header: ms}) == expected, (header, ms)
    # The body field, then Ferry's own header, then the inference gateway's: the newest name first.
    assert answer({"X-Ferry-Latency-Budget-Ms": "5000", "x-llm-d-slo-ttft-ms": "100"}) == (200, None)
    assert answer({"x-llm-d-slo-ttft-ms": "5000", "x-slo-ttft-ms": "100"}) == (200, None)
    assert answer({"x-llm-d-slo-ttft-ms": "100", "x-slo-ttft-ms": "5000"}) == (429, "deadline_infeasible")


def test_a_tpot_header_the_decode_step_cannot_meet_is_refused_at_once(fake_server_factory):
    engine = FakeGenerationEngine()
    s = fake_server_factory(chat=engine)
    step = 0.05  # what the decode cost model predicts of one step
    s.ferry.models["fake-chat"].batcher.inner.decode_cost = CostModel(LinearCost(step, 0.0, 0.0))
    for header in ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"):
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT_BODY, headers={header: str(step * 1000 / 2)})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "deadline_infeasible" and "inter-token" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1
    assert engine.calls == []  # refused before any work
    r = httpx.post(s.url + "/v1/chat/completions", json=CHAT_BODY, headers={"x-llm-d-slo-tpot-ms": str(step * 2000)})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    refused = s.ferry.metrics.registry.get_sample_value(
        "ferry_rejections_total", {"model": "fake-chat", "reason": "deadline_infeasible"}
    )
    assert refused == 2


def test_an_interactive_request_is_answered_beside_a_long_batch_class_batch(fake_server_factory):
    """The interactive lane over HTTP: the engine holds a batch-class batch of 8 for two
    seconds; an interactive request sent while it runs is answered before it ends, in a
    batch of its own (dispatch reason `lane`, a quarter of a second), and the batch-class
    one is still served in full."""
    engine = FakeEmbeddingEngine(fixed=0.0, per_item=0.25)
    s = fake_server_factory(embed=engine, max_wait_ms=0)
    batcher = s.ferry.models["fake-embed"].batcher.inner
    # What warm-up would fit (it is off in tests): the lane is taken when its batch ends
    # before the batch in flight is predicted to.
    batcher.cost = CostModel(LinearCost(0.0, 0.25, 0.0))
    batcher.lane_cost = CostModel(LinearCost(0.0, 0.25, 0.0))

    async def scenario():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            bulk = asyncio.create_task(
                c.post(
                    "/v1/embeddings",
                    json={"model": "fake-embed", "input": [f"bulk {i}" for i in range(8)], "priority": "batch"},
                )
            )
            await async_wait_until(lambda: engine.calls, message="the batch-class batch to reach the engine")
            urgent = await c.post("/v1/embeddings", json={**EMB, "priority": "interactive"})
            still_running = not bulk.done()
            return urgent, still_running, await bulk

    urgent, still_running, bulk = asyncio.run(scenario())
    assert urgent.status_code == 200 and len(urgent.json()["data"]) == 1
    assert still_running, "the interactive request waited for the batch-class batch"
    assert bulk.status_code == 200 and len(bulk.json()["data"]) == 8
    assert sorted(engine.calls) == [1, 8]
    registry = s.ferry.metrics.registry
    assert registry.get_sample_value("ferry_batches_total", {"model": "fake-embed", "reason": "lane"}) == 1
