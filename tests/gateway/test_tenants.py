"""Tenants over real HTTP (gateway/tenancy.py): a key's tenant from the config file, a forged
tenant header ignored when keys are on, the header or `user` field without keys, quotas
answered `429 tenant_quota` with Retry-After, weights changed live through the admin API,
the per-tenant metrics never showing a key, and batch jobs counted toward their key's tenant."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from batcher.fairness import DEFAULT
from gateway.tenancy import Tenancy, key_tenant

CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
KEY_A, KEY_B, KEY_LOOSE = "sk-team-a-0123", "sk-team-b-4567", "sk-unnamed-89ab"


def config_file(tmp_path: Path, tenants: str) -> str:
    path = tmp_path / "ferry.yaml"
    path.write_text("models:\n  - {name: fake-chat, kind: chat}\n" + tenants)
    return str(path)


def tokens(server, tenant: str, kind: str = "output") -> float:
    text = httpx.get(server.url + "/metrics").text
    line = f'ferry_tenant_tokens_total{{kind="{kind}",model="fake-chat",tenant="{tenant}"}}'
    return sum(float(row.split()[-1]) for row in text.splitlines() if row.startswith(line))


@pytest.fixture
def keyed(fake_server_factory, tmp_path):
    cfg = config_file(
        tmp_path,
        f"tenants:\n  - {{name: team-a, key: {KEY_A}, weight: 3}}\n"
        f"  - {{name: team-b, key: {KEY_B}, tokens_per_minute: 10}}\n",
    )
    return fake_server_factory(config=cfg, api_keys=[KEY_LOOSE], admin_token="admin-tok")


def test_each_key_is_its_tenant_and_a_forged_tenant_header_is_ignored(keyed):
    with httpx.Client(base_url=keyed.url) as http:
        r = http.post(
            "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {KEY_A}", "X-Ferry-Tenant": "team-b"},
        )
        assert r.status_code == 200
        assert http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert (
            http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY_LOOSE}"}).status_code
            == 200
        )
    assert tokens(keyed, "team-a") == 4 and tokens(keyed, "team-b") == 0
    # A key the config file does not name is labelled by a digest, never by the key.
    assert tokens(keyed, key_tenant(KEY_LOOSE)) == 4
    assert KEY_LOOSE not in httpx.get(keyed.url + "/metrics").text


def test_a_tenant_over_its_tokens_a_minute_gets_429_tenant_quota_with_retry_after(keyed):
    auth = {"Authorization": f"Bearer {KEY_B}"}
    with httpx.Client(base_url=keyed.url) as http:
        assert http.post("/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
        http.post("/v1/chat/completions", json=CHAT, headers=auth)  # past 10 tokens now, or with this one
        r = http.post("/v1/chat/completions", json=CHAT, headers=auth)
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "tenant_quota" and int(r.headers["Retry-After"]) >= 1
        # Another tenant is not held back by team-b's quota.
        assert http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY_A}"}).is_success
    text = httpx.get(keyed.url + "/metrics").text
    assert 'ferry_tenant_refusals_total{model="fake-chat",reason="tenant_quota",tenant="team-b"}' in text


def test_weights_change_live_through_the_admin_api(keyed):
    admin = {"Authorization": "Bearer admin-tok"}
    with httpx.Client(base_url=keyed.url) as http:
        assert http.get("/admin/tenants").status_code == 401
        got = http.get("/admin/tenants", headers=admin).json()
        assert got["tenants"]["team-a"]["weight"] == 3 and got["tenants"]["team-b"]["tokens_per_minute"] == 10
        r = http.patch("/admin/tenants", json={"tenants": [{"name": "team-a", "weight": 0.5}]}, headers=admin)
        assert r.status_code == 200
        assert r.json()["tenants"] == {"team-a": {"weight": 0.5, "tokens_per_minute": None, "max_concurrent": None}}
        http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY_A}"})
        report = http.get("/admin/tenants", headers=admin).json()["models"]["fake-chat"]
        assert report["team-a"]["weight"] == 0.5 and report["team-a"]["tokens"]["output"] == 4
        bad = http.patch("/admin/tenants", json={"tenants": [{"name": "x", "weight": 0}]}, headers=admin)
        assert bad.status_code == 422


def test_without_keys_the_tenant_comes_from_the_header_and_a_bad_one_is_a_400(fake_server_factory):
    s = fake_server_factory()
    with httpx.Client(base_url=s.url) as http:
        assert http.post("/v1/chat/completions", json=CHAT, headers={"X-Ferry-Tenant": "app-7"}).is_success
        assert http.post("/v1/chat/completions", json=CHAT).is_success
        r = http.post("/v1/chat/completions", json=CHAT, headers={"X-Ferry-Tenant": "no spaces"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Ferry-Tenant"
    assert tokens(s, "app-7") == 4 and tokens(s, DEFAULT) == 4


def test_the_user_field_names_the_tenant_where_the_operator_says_so(fake_server_factory):
    s = fake_server_factory(tenant_source="user")
    with httpx.Client(base_url=s.url) as http:
        assert http.post("/v1/chat/completions", json={**CHAT, "user": "alice"}).is_success
        assert http.post("/v1/chat/completions", json=CHAT, headers={"X-Ferry-Tenant": "bob"}).is_success
    assert tokens(s, "alice") == 4 and tokens(s, "bob") == 0 and tokens(s, DEFAULT) == 4


def test_a_batch_jobs_lines_belong_to_its_creators_tenant():
    from types import SimpleNamespace

    t = Tenancy.of(SimpleNamespace(api_keys=[KEY_LOOSE], config=None, tenant_source="header"))
    import hashlib

    owner = hashlib.sha256(KEY_LOOSE.encode()).hexdigest()[:32]  # as endpoint.key_owner records it
    assert t.owner_tenant(owner) == key_tenant(KEY_LOOSE)
    assert t.owner_tenant(None) == DEFAULT and t.owner_tenant("0" * 32) == DEFAULT


def test_the_live_page_shows_service_per_tenant_and_the_fairness_index(fake_server_factory):
    s = fake_server_factory()
    with httpx.Client(base_url=s.url) as http:
        http.get("/ui/stats")  # the first snapshot: rates are over the window from here
        for tenant in ("app-1", "app-2"):
            assert http.post("/v1/chat/completions", json=CHAT, headers={"X-Ferry-Tenant": tenant}).is_success
        chat = next(m for m in http.get("/ui/stats").json()["models"] if m["name"] == "fake-chat")
    tenants = chat["tenants"]
    assert set(tenants["by_tenant"]) == {"app-1", "app-2"}
    assert all(t["output_per_s"] > 0 and t["queued"] == 0 for t in tenants["by_tenant"].values())
    assert 0.8 < tenants["fairness"] <= 1.0  # about equal service (the second prompt found a cached prefix)
