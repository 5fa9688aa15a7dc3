"""End to end with a real Prometheus: it scrapes a fake-engine gateway every second while
this test drives traffic (served, failed, rejected, expired and cancelled requests on both
the embeddings and the chat model, and live setting changes); then every dashboard query
and every alert expression is evaluated through Prometheus's HTTP API and must return data.

"Returns data" means a non-empty result with at least one number that is not NaN (a
panel of NaN draws nothing). Series are born in a warm-up round that Prometheus scrapes
before the scenario, because rate() needs two samples of a series: a histogram created and
filled within one scrape interval would show NaN quantiles. An alert condition is a comparison
(`A > 0.05`, `A > on (model) B`) that is empty whenever the system is healthy, so for
comparisons each side that is not a plain number is evaluated on its own instead: the
question is whether the names, labels and joins select real series, not whether this
test happened to trip the threshold. Grafana's template variables are substituted as
Grafana would: `$model` with both fake models as a regex, `$__rate_interval` with 1m
(wide enough to hold the whole traffic phase), `$__range` with 5m.

Prometheus is the Debian package `prometheus` (`make prometheus` installs it as root);
without it this module is skipped. No assertion depends on how long anything took: every
wait is bounded and only says what it waited for when it gives up.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from engine.fake import FakeEmbeddingEngine, FakeGenerationEngine

from ..waiting import wait_until
from .artifacts import (
    ALERTS,
    PROMETHEUS_CONFIG,
    alert_queries,
    annotation_queries,
    every_query,
    load_alerts,
    load_dashboard,
    sides_to_evaluate,
    substitute,
    variable_queries,
)

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MODELS = ("fake-embed", "fake-chat")
MODEL_REGEX = "|".join(MODELS)
FAIL_TOKEN = ord("~")  # a completions prompt starting with "~" fails its prefill

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool not found: install the Debian package 'prometheus' (as root: `make prometheus`)",
)


class GatedEmbeddings(FakeEmbeddingEngine):
    """Blocks inside an engine call while `gate` is closed, so work queues behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.blocked = threading.Event(), threading.Event()
        self.gate.set()

    def embed(self, batch):
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait(60)
        return super().embed(batch)


class GatedChat(FakeGenerationEngine):
    def __init__(self) -> None:
        super().__init__(fail_prompts={FAIL_TOKEN})
        self.gate, self.blocked = threading.Event(), threading.Event()
        self.gate.set()
        # (draft tokens, taken, steps) as an engine with --speculation reports them: two
        # drafted and one taken a row a step, so the speculation panels have data.
        self.speculated = (0, 0, 0)

    def step(self):
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait(60)
        outputs = super().step()
        drafted, taken, steps = self.speculated
        self.speculated = (drafted + 2 * len(outputs), taken + len(outputs), steps + bool(outputs))
        return outputs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def abandoned_request(port: int, path: str, body: dict) -> socket.socket:
    """Send a complete request on a raw socket; the caller hangs up later (a client that leaves)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def hang_up(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class Prometheus:
    def __init__(self, target_port: int, workdir: Path):
        cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())  # the shipped config, retargeted
        job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "ferry")
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{target_port}"]
        cfg["rule_files"] = [str(ALERTS)]
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}: {self.logs()}")
        try:
            return self.http.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def query(self, expr: str) -> list:
        r = self.http.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert body.get("status") == "success", f"{expr}: {body}"
        data = body["data"]
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def models_with(self, expr: str) -> set[str]:
        return {s["metric"].get("model", "") for s in self.query(expr)}

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        self.log.close()


def drive_embeddings(s, c: httpx.Client, engine: GatedEmbeddings) -> None:
    url = s.url + "/v1/embeddings"
    for _ in range(3):
        assert c.post(url, json={"model": "fake-embed", "input": ["a b", "c d e"]}).status_code == 200
    assert c.post(url, json={"model": "fake-embed", "input": ["ok", "FAIL_ITEM"]}).status_code == 500
    assert c.post(url, json={"model": "fake-embed", "input": "x", "dimensions": 3}).status_code == 422
    r = c.post(url, json={"model": "fake-embed", "input": list("abcde")})  # 5 items can never fit max_queue 4
    assert r.status_code == 422 and r.json()["error"]["code"] == "request_too_large"
    queue = s.ferry.models["fake-embed"].batcher.inner.queue
    engine.gate.clear()
    with ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(c.post, url, json={"model": "fake-embed", "input": "blocker"})
        wait_until(engine.blocked.is_set, message="the embeddings engine to hold a batch")
        # The engine is busy: a 1 ms budget is admitted best-effort (on_infeasible=serve)
        # and expires in the queue.
        r = c.post(url, json={"model": "fake-embed", "input": "hurry", "latency_budget_ms": 1})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
        sock = abandoned_request(s.port, "/v1/embeddings", {"model": "fake-embed", "input": "leaving"})
        wait_until(lambda: len(queue) == 1, message="the abandoned embeddings request to queue")
        r = c.post(url, json={"model": "fake-embed", "input": list("abcd")})  # 1 queued + 4 > max_queue 4
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        hang_up(sock)
        wait_until(lambda: cancelled(s, "fake-embed") == 1, message="the queued embeddings item to be cancelled")
        engine.gate.set()
        assert blocker.result(30).status_code == 200


def drive_chat(s, c: httpx.Client, engine: GatedChat) -> None:
    url = s.url + "/v1/chat/completions"
    conv = [{"role": "user", "content": "hello ferry"}]
    assert c.post(url, json={"model": "fake-chat", "messages": [conv, conv], "max_tokens": [2, 4]}).status_code == 200
    r = c.post(s.url + "/v1/completions", json={"model": "fake-chat", "prompt": ["one", "two"], "max_tokens": 3})
    assert r.status_code == 200
    r = c.post(s.url + "/v1/completions", json={"model": "fake-chat", "prompt": "~boom", "max_tokens": 3})
    assert r.status_code == 500  # prefill fails for this prompt alone
    r = c.post(url, json={"model": "fake-chat", "messages": [conv] * 5})
    assert r.status_code == 422 and r.json()["error"]["code"] == "request_too_large"
    queue = s.ferry.models["fake-chat"].batcher.inner.queue
    engine.gate.clear()
    with ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(c.post, url, json={"model": "fake-chat", "messages": conv, "max_tokens": 3})
        wait_until(engine.blocked.is_set, message="the chat engine to hold a decode step")
        hurry = pool.submit(c.post, url, json={"model": "fake-chat", "messages": conv, "latency_budget_ms": 1})
        wait_until(lambda: len(queue) == 1, message="the 1 ms chat request to queue")
        sock = abandoned_request(s.port, "/v1/chat/completions", {"model": "fake-chat", "messages": conv})
        wait_until(lambda: len(queue) == 2, message="the abandoned chat request to queue")
        r = c.post(url, json={"model": "fake-chat", "messages": [conv] * 3})  # 2 queued + 3 > max_queue 4
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        hang_up(sock)
        wait_until(lambda: cancelled(s, "fake-chat") == 1, message="the queued chat item to be cancelled")
        engine.gate.set()  # the step ends; the 1 ms item is found expired before admission
        r = hurry.result(30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
        assert blocker.result(30).status_code == 200


def warm_up(s, c: httpx.Client) -> None:
    """One ordinary request per route and model."""
    conv = [{"role": "user", "content": "good morning"}]
    assert c.post(s.url + "/v1/embeddings", json={"model": "fake-embed", "input": ["warm", "up"]}).status_code == 200
    r = c.post(
        s.url + "/v1/chat/completions", json={"model": "fake-chat", "messages": [conv, conv], "max_tokens": [2, 3]}
    )
    assert r.status_code == 200
    assert (
        c.post(s.url + "/v1/completions", json={"model": "fake-chat", "prompt": "warm", "max_tokens": 2}).status_code
        == 200
    )
    # A second tenant on each model: the fairness index needs two.
    other = {"X-Ferry-Tenant": "second-app"}
    assert c.post(s.url + "/v1/embeddings", json={"model": "fake-embed", "input": "hi"}, headers=other).is_success
    r = c.post(s.url + "/v1/chat/completions", json={"model": "fake-chat", "messages": conv}, headers=other)
    assert r.status_code == 200


def wait_scraped(s, prom: Prometheus) -> None:
    """Until Prometheus holds a scrape taken after every request so far had finished."""
    registry = s.ferry.metrics.registry
    local = sum(
        x.value
        for m in registry.collect()
        if m.name == "ferry_requests"
        for x in m.samples
        if x.name == "ferry_requests_total"
    )

    def seen() -> bool:
        result = prom.query("sum(ferry_requests_total)")
        return bool(result) and float(result[0]["value"][1]) == local

    wait_until(seen, message=f"a scrape showing {local:.0f} requests", timeout=60, interval=0.2)


def wait_scrapes(prom: Prometheus, n: int) -> None:
    """Until Prometheus has scraped the gateway `n` more times, so that a series born in the
    last scrape has the two samples rate() needs."""

    def last() -> float:
        result = prom.query('timestamp(up{job="ferry"})')
        return float(result[0]["value"][1]) if result else 0.0

    first = last()
    wait_until(lambda: last() >= first + n - 0.5, message=f"{n} more scrapes", timeout=60, interval=0.2)


def has_number(result: list) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


def cancelled(s, model: str) -> float:
    return (
        s.ferry.metrics.registry.get_sample_value("ferry_cancellations_total", {"model": model, "phase": "queued"}) or 0
    )


def change_settings(s, c: httpx.Client) -> None:
    auth = {"Authorization": "Bearer admin"}
    r = c.patch(
        s.url + "/admin/models/fake-embed/batching", json={"max_wait_ms": 3, "on_infeasible": "reject"}, headers=auth
    )
    assert r.status_code == 200, r.text
    r = c.patch(s.url + "/admin/models/fake-chat/batching", json={"max_batch_size": 8}, headers=auth)
    assert r.status_code == 200, r.text
    r = c.post(s.url + "/v1/embeddings", json={"model": "fake-embed", "input": "x", "latency_budget_ms": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_infeasible", r.text


@needs_prometheus
def test_promtool_accepts_the_shipped_config_and_rules():
    for args in (["check", "config", str(PROMETHEUS_CONFIG)], ["check", "rules", str(ALERTS)]):
        r = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


@needs_prometheus
def test_every_dashboard_query_and_alert_returns_data_from_a_real_prometheus(fake_server_factory, tmp_path):
    embed, chat = GatedEmbeddings(), GatedChat()
    # No interactive lane: the gated engine holds one batch and everything after it queues
    # (with the lane the interactive requests below would run beside it, and block there).
    s = fake_server_factory(
        embed=embed,
        chat=chat,
        max_queue=4,
        on_infeasible="serve",
        admin_token="admin",
        default_budget_ms=3_000_000,
        interactive_lane=False,
    )
    prom = Prometheus(s.port, tmp_path)
    try:
        wait_until(prom.ready, message="prometheus to be ready", timeout=60, interval=0.2)
        wait_until(
            lambda: prom.query('up{job="ferry"} == 1'),
            timeout=60,
            interval=0.2,
            message="the first scrape of the gateway",
        )

        with httpx.Client(timeout=30) as c:
            warm_up(s, c)
            wait_scraped(s, prom)
            drive_embeddings(s, c, embed)
            drive_chat(s, c, chat)
            change_settings(s, c)
        wait_scraped(s, prom)
        wait_scrapes(prom, 2)

        # Prometheus has seen every kind of event, for both models.
        sel = f'model=~"{MODEL_REGEX}"'
        for what, expr in [
            ("rejections (queue_full)", f'ferry_rejections_total{{{sel}, reason="queue_full"}} > 0'),
            ("expiries", f"sum by (model) (ferry_expired_total{{{sel}}}) > 0"),
            ("cancellations while queued", f'ferry_cancellations_total{{{sel}, phase="queued"}} > 0'),
            ("engine errors", f"sum by (model) (ferry_engine_errors_total{{{sel}}}) > 0"),
            ("setting changes", f"ferry_config_changes_total{{{sel}}} > 0"),
            ("504 answers", f'sum by (model) (ferry_requests_total{{{sel}, status="504"}}) > 0'),
        ]:
            wait_until(
                lambda expr=expr: prom.models_with(expr) == set(MODELS),
                timeout=60,
                interval=0.25,
                message=f"{what} in prometheus for both models",
            )
        assert prom.models_with('ferry_rejections_total{reason="deadline_infeasible"} > 0') == {"fake-embed"}

        # Every query of the dashboard and every alert expression returns data.
        pending = {
            (q.where, side) for q in every_query() for side in sides_to_evaluate(substitute(q.expr, MODEL_REGEX))
        }

        def all_answered() -> bool:
            nonlocal pending
            pending = {(where, expr) for where, expr in pending if not has_number(prom.query(expr))}
            return not pending

        wait_until(
            all_answered,
            timeout=60,
            interval=0.5,
            message=lambda: (
                "every query to return data; without:\n" + "\n".join(f"  {w}: {e}" for w, e in sorted(pending))
            ),
        )

        # The traffic panel shows the refused, expired, cancelled and failed requests.
        by_status = next(q for q in every_query() if q.where.startswith("panel 'Requests by status'"))
        statuses = {r["metric"]["status"] for r in prom.query(substitute(by_status.expr, MODEL_REGEX))}
        assert {"200", "422", "429", "499", "500", "504"} <= statuses, statuses

        # The model variable lists both models.
        for name, selector, label in variable_queries(load_dashboard()):
            values = {s_["metric"].get(label) for s_ in prom.query(selector)}
            assert set(MODELS) <= values, (name, values)

        # The setting-change annotation fires as a whole (the first change of a counter
        # created at zero is visible to changes()), and so does the engine-error alert.
        for q in annotation_queries(load_dashboard()):
            assert prom.models_with(substitute(q.expr, MODEL_REGEX)) == set(MODELS), q
        engine_alert = next(q for q in alert_queries(load_alerts()) if q.where == "alert FerryEngineErrors")
        assert prom.models_with(engine_alert.expr) == set(MODELS)

        # Prometheus itself evaluates every rule without error.
        def rules_evaluated():
            groups = prom.http.get("/api/v1/rules").json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if rules and all(r["health"] != "unknown" for r in rules) else None

        rules = wait_until(rules_evaluated, message="prometheus to evaluate the alert rules", timeout=60, interval=0.25)
        assert {r["name"]: (r["health"], r.get("lastError", "")) for r in rules} == {
            q.where.split(" ", 1)[1]: ("ok", "") for q in alert_queries(load_alerts())
        }

        def firing() -> set[str]:
            alerts = prom.http.get("/api/v1/alerts").json()["data"]["alerts"]
            return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}

        wait_until(
            lambda: "FerryEngineErrors" in firing(), message="FerryEngineErrors to fire", timeout=60, interval=0.25
        )
    finally:
        prom.stop()
