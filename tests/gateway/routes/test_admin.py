"""Live tuning over HTTP: GET and PATCH /admin/models/{model}/batching (fake engines)."""

from __future__ import annotations

import httpx
import pytest

from batcher.settings import BatchingSettings

DEFAULT_SIZE = BatchingSettings().max_batch_size


def test_admin_routes_are_off_without_a_token(fake_server_factory):
    s = fake_server_factory()
    assert httpx.get(s.url + "/admin/models/fake-embed/batching").status_code == 404


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic admin-secret"])
def test_admin_rejects_a_wrong_token(fake_server_factory, auth):
    s = fake_server_factory(admin_token="admin-secret")
    headers = {"Authorization": auth} if auth else {}
    r = httpx.patch(s.url + "/admin/models/fake-embed/batching", json={"max_batch_size": 2}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    assert s.ferry.models["fake-embed"].batcher.settings.max_batch_size == DEFAULT_SIZE


def test_admin_get_and_patch_apply_live_and_show_in_metrics(fake_server_factory):
    s = fake_server_factory(admin_token="admin-secret")
    h = {"Authorization": "Bearer admin-secret"}
    url = s.url + "/admin/models/fake-embed/batching"
    assert httpx.get(url, headers=h).json()["max_batch_size"] == DEFAULT_SIZE
    r = httpx.patch(url, json={"max_batch_size": 4, "max_wait_ms": 1.5, "policy": "deadline"}, headers=h)
    assert r.status_code == 200 and r.json()["max_batch_size"] == 4 and r.json()["policy"] == "deadline"
    assert s.ferry.models["fake-embed"].batcher.settings.max_wait_ms == 1.5
    bad = httpx.patch(url, json={"max_batch_size": 0}, headers=h)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "max_batch_size"
    bad = httpx.patch(url, json={"policy": "random"}, headers=h)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "policy"
    assert httpx.patch(s.url + "/admin/models/nope/batching", json={}, headers=h).status_code == 404
    metrics = httpx.get(s.url + "/metrics").text
    assert 'ferry_setting_max_batch_size{model="fake-embed"} 4.0' in metrics
    assert 'ferry_config_changes_total{model="fake-embed"} 1.0' in metrics
    r = httpx.post(s.url + "/v1/embeddings", json={"model": "fake-embed", "input": ["a"] * 10})
    assert r.status_code == 200 and int(r.headers["X-Ferry-Batch-Size"]) <= 4
