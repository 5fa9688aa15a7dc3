"""The live page's routes over HTTP (fake engines): the page and its assets with a strict
CSP, /ui and /ui/stats open whatever --api-key says (as /metrics), nothing secret in the
stats, and every asset shipped as package data. The page itself, in a real browser, is
tested in tests/observability/test_live_page.py."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import httpx

from gateway.ui.route import ASSETS, CSP, PAGE_KNOBS

ROOT = Path(__file__).resolve().parents[3]


def test_page_and_assets_carry_a_strict_csp_and_no_inline_script(fake_server_factory):
    s = fake_server_factory()
    page = httpx.get(s.url + "/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP
    assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP and "frame-ancestors 'none'" in CSP
    html = page.text
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="/ui/static/' in attrs and not body.strip() for attrs, body in scripts)
    assert " style=" not in html and not re.search(r"\son[a-z]+=", html)  # no inline style or handler
    refs = re.findall(r'(?:src|href)="(/ui/static/[^"]+\.(?:js|css))"', html)
    assert len(refs) == 4  # uPlot's script and style, the page's
    types = {".js": "text/javascript", ".css": "text/css"}
    for ref in refs:
        r = httpx.get(s.url + ref)
        assert r.status_code == 200, ref
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["content-type"].startswith(types[Path(ref).suffix])
    assert "MIT License" in httpx.get(s.url + "/ui/static/vendor/uplot/LICENSE").text
    for missing in ("/ui/static/nope.js", "/ui/static/ui/static/ui.js"):  # a 404 of the page's own keeps its CSP
        r = httpx.get(s.url + missing)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", missing
        assert r.headers["content-security-policy"] == CSP, missing
    for sneaky in ("/ui/static/../../app.py", "/ui/static/%2e%2e/%2e%2e/app.py", "/ui/static/ui/static/ui.js"):
        assert httpx.get(s.url + sneaky).status_code == 404, sneaky


def test_ui_is_open_like_metrics_whatever_the_api_key(fake_server_factory):
    s = fake_server_factory(api_keys=["k-123"])
    assert httpx.get(s.url + "/v1/models").status_code == 401
    for path in ("/metrics", "/ui", "/ui/stats"):
        assert httpx.get(s.url + path).status_code == 200, path
    assert httpx.get(s.url + "/ui/stats").json()["admin"] is False  # no --admin-token: the page's knobs are read-only


def test_stats_show_no_prompt_key_or_token(fake_server_factory):
    s = fake_server_factory(api_keys=["k-123"], admin_token="admin-secret")
    key = {"Authorization": "Bearer k-123"}
    r = httpx.post(s.url + "/v1/embeddings", json={"model": "fake-embed", "input": ["secret-prompt"]}, headers=key)
    assert r.status_code == 200
    httpx.get(s.url + "/ui/stats")
    r = httpx.post(s.url + "/v1/embeddings", json={"model": "fake-embed", "input": ["secret-prompt"]}, headers=key)
    stats = httpx.get(s.url + "/ui/stats")
    assert stats.status_code == 200 and stats.headers["cache-control"] == "no-store"
    for secret in ("secret-prompt", "k-123", "admin-secret"):
        assert secret not in stats.text
    body = stats.json()
    assert body["admin"] is True and [k["name"] for k in body["knob_specs"]] == list(PAGE_KNOBS)
    embed = next(m for m in body["models"] if m["name"] == "fake-embed")
    assert embed["latency"]["request"]["count"] == 1  # the request since the first snapshot
    assert embed["rates"]["completions"] > 0


def test_every_asset_ships_as_package_data():
    # tomllib is Python 3.11+; the one line is read as a Python list.
    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    patterns = ast.literal_eval(re.search(r'^"gateway.ui" = (\[.*\])$', section, re.M).group(1))
    assert ASSETS and "index.html" in ASSETS and "vendor/uplot/uPlot.iife.min.js" in ASSETS
    static = ROOT / "gateway" / "ui" / "static"
    for path in static.rglob("*"):
        if path.is_file():
            rel = "static/" + path.relative_to(static).as_posix()
            assert any(fnmatch.fnmatch(rel, p) and rel.count("/") == p.count("/") for p in patterns), rel
