"""/v1/embeddings over a real socket with the fake engine: shapes, errors, headers."""

from __future__ import annotations

import asyncio
import base64
import gc
import threading

import httpx
import numpy as np
import pytest

from engine.fake import FakeEmbeddingEngine, fake_vector

from ...waiting import async_wait_until


def post(server, body, **kw):
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=30, **kw)


def test_list_input_keeps_order_and_usage(fake_server_factory):
    s = fake_server_factory()
    texts = ["one", "two words", "three little words"]
    r = post(s, {"model": "fake-embed", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, t in zip(body["data"], texts, strict=True):
        np.testing.assert_allclose(d["embedding"], fake_vector(t, 8), rtol=1e-6)
    assert body["usage"] == {"prompt_tokens": 3 + 4 + 5, "total_tokens": 12}
    assert body["model"] == "fake-embed" and body["object"] == "list"
    assert r.headers["X-Ferry-Batch-Size"].isdigit() and float(r.headers["X-Ferry-Queue-Ms"]) >= 0
    assert r.headers["X-Ferry-Dispatch-Reason"] in {"full", "max_wait", "adaptive", "deadline"}
    assert r.headers["X-Request-Id"]


def test_base64_is_little_endian_float32(fake_server_factory):
    s = fake_server_factory()
    r = post(s, {"model": "fake-embed", "input": "hello", "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, fake_vector("hello", 8), rtol=1e-6)


@pytest.mark.parametrize(
    "raw, status, code, param",
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (b'{"input": "x"}', 422, "invalid_value", "model"),
        (b'{"model": "fake-embed", "input": 5}', 422, "invalid_value", "input"),
        (b'{"model": "fake-embed", "input": []}', 422, "invalid_value", "input"),
        (b'{"model": "fake-embed", "input": [""]}', 422, "invalid_value", "input.0"),
        (b'{"model": "fake-embed", "input": "x", "encoding_format": "int8"}', 422, "invalid_value", "encoding_format"),
        (b'{"model": "fake-embed", "input": "x", "bogus": 1}', 422, "invalid_value", "bogus"),
        (b'{"model": "fake-embed", "input": "x", "latency_budget_ms": -5}', 422, "invalid_value", "latency_budget_ms"),
        (b'{"model": "nope", "input": "x"}', 404, "model_not_found", "model"),
        (b'{"model": "fake-chat", "input": "x"}', 404, "model_not_found", "model"),
    ],
)
def test_bad_input_gets_openai_error(fake_server_factory, raw, status, code, param):
    s = fake_server_factory()
    r = httpx.post(s.url + "/v1/embeddings", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param and err["message"]
    assert s.ferry.models["fake-embed"].engine.calls == []  # nothing reached the engine
    assert post(s, {"model": "fake-embed", "input": "still serving"}).status_code == 200


def test_body_and_input_limits(fake_server_factory):
    s = fake_server_factory(max_body_bytes=2000, max_inputs=3)
    r = post(s, {"model": "fake-embed", "input": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = post(s, {"model": "fake-embed", "input": ["a", "b", "c", "d"]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "too_many_inputs"


class HeldEngine(FakeEmbeddingEngine):
    """Holds each batch until `release` is set: the queue fills behind the first whatever
    the host's speed (with a fixed 0.3 s batch, a loaded host could finish it before the
    next two were queued, and the queue never reached two)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def embed(self, batch):
        self.entered.set()
        assert self.release.wait(30), "never released"
        return super().embed(batch)


def test_queue_full_gets_429_with_retry_after(fake_server_factory):
    engine = HeldEngine()
    # No interactive lane: requests after the first must queue behind it (they are interactive)
    s = fake_server_factory(
        embed=engine, max_batch_size=1, max_queue=2, max_wait_ms=0, policy="fixed", interactive_lane=False
    )

    async def burst():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            first = asyncio.create_task(c.post("/v1/embeddings", json={"model": "fake-embed", "input": "a"}))
            # The first is on the engine; the next two fill the queue.
            await async_wait_until(engine.entered.is_set, message="the first request to reach the engine")
            queued = [
                asyncio.create_task(c.post("/v1/embeddings", json={"model": "fake-embed", "input": f"q{i}"}))
                for i in range(2)
            ]
            await async_wait_until(
                lambda: len(s.ferry.models["fake-embed"].batcher.inner.queue) >= 2, message="two requests to queue"
            )
            rejected = await c.post("/v1/embeddings", json={"model": "fake-embed", "input": "late"})
            engine.release.set()
            return rejected, await asyncio.gather(first, *queued)

    rejected, served = asyncio.run(burst())
    assert rejected.status_code == 429
    assert rejected.json()["error"]["code"] == "queue_full"
    assert int(rejected.headers["Retry-After"]) >= 1
    assert [r.status_code for r in served] == [200, 200, 200]


def test_engine_failures_are_isolated(fake_server_factory):
    s = fake_server_factory(max_batch_size=8, max_wait_ms=50, policy="fixed")

    async def mixed():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            bodies = [{"model": "fake-embed", "input": t} for t in ("good one", "FAIL_ITEM here", "good two")]
            return await asyncio.gather(*(c.post("/v1/embeddings", json=b) for b in bodies))

    good1, bad, good2 = asyncio.run(mixed())
    assert good1.status_code == 200 and good2.status_code == 200
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
    assert s.ferry.models["fake-embed"].engine.calls == [3]  # one batch held all three


def test_oom_batch_is_split_until_the_culprit_is_isolated(fake_server_factory):
    s = fake_server_factory(max_batch_size=4, max_wait_ms=100, policy="fixed")

    async def mixed():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            texts = ["a", "b", "OOM c", "d"]
            return await asyncio.gather(
                *(c.post("/v1/embeddings", json={"model": "fake-embed", "input": t}) for t in texts)
            )

    rs = asyncio.run(mixed())
    assert [r.status_code for r in rs] == [200, 200, 500, 200]
    assert s.ferry.models["fake-embed"].engine.calls[0] == 4


def test_models_health_and_metrics(fake_server_factory):
    s = fake_server_factory()
    ids = {m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]}
    assert ids == {"fake-embed", "fake-chat"}
    assert httpx.get(s.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(s.url + "/readyz").status_code == 200
    post(s, {"model": "fake-embed", "input": ["a", "b"]})
    text = httpx.get(s.url + "/metrics").text
    assert 'ferry_requests_total{model="fake-embed",route="/v1/embeddings",status="200"} 1.0' in text
    assert "ferry_batch_size_items_count" in text


def test_the_models_routes_name_what_is_served_and_say_503_while_loading(fake_server_factory):
    s = fake_server_factory()
    assert httpx.get(s.url + "/v1/models/fake-chat").json()["id"] == "fake-chat"
    ghost = httpx.get(s.url + "/v1/models/ghost")
    assert ghost.status_code == 404 and ghost.json()["error"]["code"] == "model_not_found"
    assert "Available models: fake-embed, fake-chat" in ghost.json()["error"]["message"]
    s.ferry.ready = False  # as while the models load: no empty list, no "does not exist"
    try:
        for path in ("/v1/models", "/v1/models/fake-chat"):
            r = httpx.get(s.url + path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", path
            assert r.headers["Retry-After"] == "2"
    finally:
        s.ferry.ready = True


def test_a_failed_input_withdraws_its_siblings_without_counting_a_client_cancel(fake_server_factory):
    s = fake_server_factory(max_batch_size=1, max_wait_ms=0, policy="fixed")
    r = post(s, {"model": "fake-embed", "input": ["FAIL_ITEM first", "second", "third"]})
    assert r.status_code == 500
    registry = s.ferry.metrics.registry
    for phase in ("queued", "running"):
        assert not registry.get_sample_value("ferry_cancellations_total", {"model": "fake-embed", "phase": phase})
    assert sum(s.ferry.models["fake-embed"].batcher.inner.outcomes.values()) == 3  # every item still ended once


def test_a_server_process_freezes_what_loading_left_out_of_the_collector():
    """`ferry serve` owns its process: once ready, a full collection no longer scans the
    libraries and models (it took ~180 ms and stalled every request). Embedded and test
    gateways share their process and freeze nothing."""
    from tests.conftest import fake_app
    from tests.live import live

    gc.unfreeze()
    app = fake_app()
    with live(app):
        assert gc.get_freeze_count() == 0
    app = fake_app()
    app.state.ferry.freeze_gc = True
    try:
        with live(app) as server:
            assert httpx.get(server.url + "/readyz").status_code == 200
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
