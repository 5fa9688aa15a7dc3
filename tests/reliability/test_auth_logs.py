"""API keys, request ids and the access log."""

from __future__ import annotations

import logging

import httpx
import pytest


@pytest.fixture
def keyed(fake_server_factory):
    return fake_server_factory(api_keys=["key-one", "key-two"], admin_token="adm")


@pytest.mark.parametrize("auth", [None, "Bearer nope", "Bearer key-one-extra", "key-one", "Basic key-one"])
def test_v1_routes_require_a_valid_key(keyed, auth):
    headers = {"Authorization": auth} if auth else {}
    for method, path, body in [
        ("POST", "/v1/embeddings", {"model": "fake-embed", "input": "x"}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}]}),
    ]:
        r = httpx.request(method, keyed.url + path, json=body, headers=headers)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert keyed.ferry.models["fake-embed"].engine.calls == []


def test_v2_routes_refuse_a_missing_key_in_the_protocols_shape(keyed):
    """Errors raised before a /v2 handler runs (authentication) answer
    `{"error": message}` as the Open Inference Protocol states, not OpenAI's object."""
    r = httpx.post(keyed.url + "/v2/models/fake-embed/infer", json={"inputs": []})
    assert r.status_code == 401
    assert r.json() == {"error": "missing or invalid API key (send Authorization: Bearer <key>)"}
    r = httpx.get(keyed.url + "/v2/models/fake-embed")
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    r = httpx.get(keyed.url + "/v2/models/fake-embed", headers={"Authorization": "Bearer key-one"})
    assert r.status_code == 404 and "fake-embed" in r.json()["error"]  # past the key: not a custom model


def test_every_configured_key_works_and_health_and_metrics_stay_open(keyed):
    for key in ("key-one", "key-two"):
        r = httpx.post(
            keyed.url + "/v1/embeddings",
            json={"model": "fake-embed", "input": "x"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200
    assert httpx.get(keyed.url + "/healthz").status_code == 200
    assert httpx.get(keyed.url + "/readyz").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200
    # The admin API keeps its own token: an API key is not an admin token.
    assert (
        httpx.get(
            keyed.url + "/admin/models/fake-embed/batching", headers={"Authorization": "Bearer key-one"}
        ).status_code
        == 401
    )
    assert (
        httpx.get(keyed.url + "/admin/models/fake-embed/batching", headers={"Authorization": "Bearer adm"}).status_code
        == 200
    )


def test_request_id_is_echoed_or_generated_and_logged_once_without_secrets(keyed, caplog):
    caplog.set_level(logging.INFO, logger="ferry.access")
    h = {"Authorization": "Bearer key-one", "X-Request-Id": "trace-123"}
    r = httpx.post(keyed.url + "/v1/embeddings", json={"model": "fake-embed", "input": "secret prompt text"}, headers=h)
    assert r.headers["X-Request-Id"] == "trace-123"
    ids = [
        httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer key-one"}).headers["X-Request-Id"]
        for _ in range(3)
    ]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and len(set(ids)) == 3  # 32 hex digits, never repeated
    lines = [rec for rec in caplog.records if getattr(rec, "request_id", None) == "trace-123"]
    assert len(lines) == 1
    rec = lines[0]
    assert (rec.route, rec.model, rec.status, rec.batch_size) == ("/v1/embeddings", "fake-embed", 200, 1)
    assert rec.queue_ms >= 0 and rec.latency_ms >= 0
    text = " ".join(str(v) for v in vars(rec).values())
    assert "secret prompt text" not in text and "key-one" not in text


def test_log_prompts_opt_in(fake_server_factory, caplog):
    s = fake_server_factory(log_prompts=True)
    caplog.set_level(logging.INFO, logger="ferry.access")
    httpx.post(
        s.url + "/v1/embeddings",
        json={"model": "fake-embed", "input": "visible prompt"},
        headers={"X-Request-Id": "p1"},
    )
    (rec,) = [r for r in caplog.records if getattr(r, "request_id", None) == "p1"]
    assert rec.prompts == ["visible prompt"]
