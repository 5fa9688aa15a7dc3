"""Three `ferry serve` replicas on loopback (fake engines) behind a real nginx running the
shipped `deploy/nginx/ferry.conf`, and a real Prometheus scraping the three.

- SIGTERM one replica while closed-loop clients keep sending through nginx: every request
  is answered 200 (nginx re-sends the draining replica's refusals, 503 before any work, to
  the others), none is lost, and the drained replica exits 0.
- During a load step that makes queues build, the KEDA ScaledObject's query, evaluated
  through Prometheus's HTTP API, asks for more than the three replicas; after the step,
  for fewer.
- A stream passes through nginx event by event.

It lives in tests/deploy/ because what it tests is what deploy/ ships (the nginx file, the
ScaledObject's query); Ferry's own drain is tested in tests/reliability/test_drain.py. The
replicas and nginx are shared by the module's tests, and the SIGTERM test comes last.

nginx and Prometheus are Debian packages (`make nginx`, `make prometheus` as root); this
module skips without them. Nothing here depends on how long anything took: every wait is
bounded and only says what it waited for when it gives up.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import signal
import subprocess
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtests.openloop import free_port

from ..observability.artifacts import PROMETHEUS_CONFIG
from ..reliability.procs import FakeGatewayProcess
from ..waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "ferry.conf"
# The ScaledObject of deploy/kubernetes/ (the first that exists): its Prometheus triggers.
SCALED_OBJECTS = [
    ROOT / "deploy" / "kubernetes" / "components" / "keda" / "scaledobject.yaml",
    ROOT / "deploy" / "kubernetes" / "autoscaling" / "keda" / "scaledobject.yaml",
]


def _which(name: str) -> str | None:
    """PATH first, then /usr/sbin (where Debian puts nginx; not on every user's PATH)."""
    found = shutil.which(name)
    if found is None and os.access(f"/usr/sbin/{name}", os.X_OK):
        found = f"/usr/sbin/{name}"
    return found


NGINX = _which("nginx")
PROMETHEUS = _which("prometheus")

needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="nginx not found: install the Debian package 'nginx' (as root: `make nginx`)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus not found: install the Debian package 'prometheus' (as root: `make prometheus`)",
)

REPLICAS = 3
# Each fake engine call takes this long and an embeddings batch holds at most BATCH items,
# so a replica serves a bounded rate and closed-loop clients beyond BATCH per replica queue.
DELAY_S = 0.05
BATCH = 2
# BATCH is also the chat running set's cap, so chat prompts queue beyond it too. No
# deadline: a queue built on purpose must not expire.
REPLICA_ARGS = (
    "--drain-timeout",
    "20",
    "--max-batch-size",
    str(BATCH),
    "--max-running",
    str(BATCH),
    "--default-budget-ms",
    "none",
)

EMBED = {"model": "fake-embed", "input": "over the river"}
CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}

# Without a shipped ScaledObject: the same shape of trigger, the sum over replicas of the
# items queued for one model and the items one replica should carry. KEDA's Prometheus
# scaler with metricType AverageValue has the HPA ask for ceil(value / threshold) replicas.
FALLBACK_QUERY = 'sum(ferry_queue_depth{model="fake-embed"})'
FALLBACK_THRESHOLD = 4.0
# Labels of ferry_queue_depth that Ferry itself sets; any other matcher in a query selects a
# label the scrape adds (the PodMonitor's namespace, pod labels), which the test's targets get.
FERRY_LABELS = {"model", "class"}


@dataclass
class Trigger:
    name: str
    query: str  # with its model matcher pointed at the fake model
    threshold: float
    metric_type: str
    model: str  # the fake model standing for the trigger's model
    target_labels: dict[str, str]


def keda_triggers() -> list[Trigger]:
    """The Prometheus triggers of the shipped ScaledObject, or the fallback without one."""
    path = next((p for p in SCALED_OBJECTS if p.exists()), None)
    if path is None:
        return [Trigger("fallback", FALLBACK_QUERY, FALLBACK_THRESHOLD, "AverageValue", "fake-embed", {})]
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "ScaledObject"]
    triggers = []
    for t in (t for d in docs for t in d["spec"]["triggers"] if t["type"] == "prometheus"):
        query = t["metadata"]["query"]
        matchers = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', query))
        model = "fake-chat" if "chat" in (t.get("name", "") + matchers.get("model", "")).lower() else "fake-embed"
        triggers.append(
            Trigger(
                name=t.get("name", model),
                query=re.sub(r'\bmodel\s*=\s*"[^"]*"', f'model="{model}"', query),
                threshold=float(t["metadata"]["threshold"]),
                metric_type=t.get("metricType", "AverageValue"),
                model=model,
                target_labels={k: v for k, v in matchers.items() if k not in FERRY_LABELS},
            )
        )
    assert triggers, f"{path} has no prometheus trigger"
    return triggers


def step_load(trigger: Trigger) -> tuple[int, dict]:
    """Closed-loop clients and the request each sends so that, per replica, about twice the
    threshold's items queue beyond the BATCH it runs. A request carries several items (inputs,
    or conversations for chat), each queued on its own, so a few clients are enough."""
    per_request = min(64, math.ceil(trigger.threshold))
    workers = math.ceil(REPLICAS * (BATCH + 2 * trigger.threshold) / per_request)
    if trigger.model == "fake-chat":
        body = {"model": "fake-chat", "messages": [[{"role": "user", "content": "hi"}]] * per_request, "max_tokens": 4}
    else:
        body = {"model": "fake-embed", "input": ["over the river"] * per_request}
    return workers, body


def desired_replicas(value: float, threshold: float, metric_type: str, current: int) -> int:
    """What the HPA that KEDA drives computes from the trigger's value."""
    if metric_type == "Value":
        return math.ceil(current * value / threshold)
    return math.ceil(value / threshold)  # AverageValue: the value is a total over replicas


def render_upstream(ports: list[int], listen_port: int) -> str:
    """The shipped file with only the replica addresses and the listen address changed."""
    text = NGINX_CONF.read_text()
    servers = re.findall(r"^(\s*server )127\.0\.0\.1:\d+(\s[^;\n]*)?;$", text, flags=re.M)
    assert len(servers) == len(ports), f"{NGINX_CONF} should list {len(ports)} example replicas"
    it = iter(ports)
    text = re.sub(
        r"^(\s*server )127\.0\.0\.1:\d+((?:\s[^;\n]*)?;)$",
        lambda m: f"{m.group(1)}127.0.0.1:{next(it)}{m.group(2)}",
        text,
        flags=re.M,
    )
    text, n = re.subn(r"^(\s*listen )\d+;$", rf"\g<1>127.0.0.1:{listen_port};", text, flags=re.M)
    assert n == 1, f"{NGINX_CONF} should have one `listen PORT;` line"
    return text


def main_config(workdir: Path) -> str:
    """What /etc/nginx/nginx.conf gives the shipped file, with every path in `workdir`. The
    access log records each request's upstream attempts."""
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers must reach workdir (mode 700)
    temp = "\n".join(
        f"    {kind}_temp_path {workdir / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""{user}worker_processes 1;
pid {workdir / "nginx.pid"};
error_log {workdir / "error.log"} warn;
events {{ worker_connections 1024; }}
http {{
    log_format attempts '$status "$upstream_addr" "$upstream_status" $request_uri';
    access_log {workdir / "access.log"} attempts;
{temp}
    include {workdir / "ferry.conf"};
}}
"""


def write_configs(ports: list[int], listen_port: int, workdir: Path) -> list[str]:
    """Write the rendered file and its main config into `workdir`; the nginx command line."""
    (workdir / "ferry.conf").write_text(render_upstream(ports, listen_port))
    (workdir / "nginx.conf").write_text(main_config(workdir))
    return [NGINX or "nginx", "-p", str(workdir), "-e", str(workdir / "error.log"), "-c", str(workdir / "nginx.conf")]


class Nginx:
    """nginx in the foreground as a child process, every file in `workdir`."""

    def __init__(self, ports: list[int], workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.cmd = write_configs(ports, self.port, workdir)
        check = subprocess.run([*self.cmd, "-t"], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen([*self.cmd, "-g", "daemon off;"], stderr=subprocess.DEVNULL)
        wait_until(self.ready, message="nginx to answer /healthz through a replica", timeout=30, interval=0.1)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"nginx exited with {self.proc.returncode}: {self.errors()}")
        try:
            return httpx.get(self.url + "/healthz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def errors(self) -> str:
        path = self.workdir / "error.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def attempts(self) -> list[tuple[int, list[str], list[str], str]]:
        """(status, upstream ports, upstream statuses, uri) of every API request logged."""
        rows = []
        for line in (self.workdir / "access.log").read_text().splitlines():
            match = re.fullmatch(r'(\d+) "([^"]*)" "([^"]*)" (\S+)', line)
            assert match, line
            status, addrs, statuses, uri = match.groups()
            if uri.startswith("/v1/"):
                rows.append((int(status), re.split(r"[,:] ?", addrs)[1::2], statuses.split(", "), uri))
        return rows

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish open requests, then exit
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def start_replicas() -> list[FakeGatewayProcess]:
    """Three replicas, started side by side; any that started is stopped if one fails."""
    with ThreadPoolExecutor(REPLICAS) as pool:
        futures = [pool.submit(FakeGatewayProcess, *REPLICA_ARGS, delay=DELAY_S) for _ in range(REPLICAS)]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for r in started:
            r.kill()
        raise failed[0]  # type: ignore[misc]
    return started


class Pool:
    """The replicas and nginx in front of them, shared by this module's tests (starting
    three servers is most of each test's cost). A test that needs all three and finds one
    gone (the SIGTERM test ran first) gets a fresh pool."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.replicas: list[FakeGatewayProcess] = []
        self.nginx: Nginx | None = None
        self.starts = 0

    def ensure(self) -> tuple[list[FakeGatewayProcess], Nginx]:
        if self.nginx is None or any(r.proc.poll() is not None for r in self.replicas):
            self.stop()
            self.starts += 1
            self.replicas = start_replicas()
            workdir = self.workdir / f"nginx-{self.starts}"
            workdir.mkdir()
            self.nginx = Nginx([r.port for r in self.replicas], workdir)
        return self.replicas, self.nginx

    def stop(self) -> None:
        if self.nginx is not None:
            self.nginx.stop()
            self.nginx = None
        for r in self.replicas:
            r.kill()
        self.replicas = []


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("replicas"))
    try:
        yield p
    finally:
        p.stop()


class ClosedLoop:
    """`workers` asyncio tasks (on a thread of their own), each sending its next request
    through `url` as soon as the last is answered, until `stop()`. Every outcome is
    counted: "ok" is a 200 with a complete body (a stream ends with [DONE]); anything else
    is named by its status or its exception."""

    def __init__(self, url: str, workers: int, bodies: list[dict]):
        self.url, self.workers, self.bodies = url, workers, bodies
        self.sent = 0
        self.outcomes: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    @property
    def ok(self) -> int:
        return self.outcomes["ok"]

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.workers, max_keepalive_connections=self.workers)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as client:
            await asyncio.gather(*(self._worker(client, i) for i in range(self.workers)))

    async def _worker(self, client: httpx.AsyncClient, i: int) -> None:
        n = i
        while not self._stop.is_set():
            body = self.bodies[n % len(self.bodies)]
            n += 1
            self.sent += 1
            self.outcomes[await self._one(client, body)] += 1

    async def _one(self, client: httpx.AsyncClient, body: dict) -> str:
        path = "/v1/chat/completions" if body["model"] == "fake-chat" else "/v1/embeddings"
        try:
            async with client.stream("POST", path, json=body) as r:
                raw = await r.aread()
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if r.status_code != 200:
            return f"{r.status_code} {raw[:200]!r}"
        if body.get("stream") and not raw.rstrip().endswith(b"data: [DONE]"):
            return f"cut stream {raw[-200:]!r}"
        return "ok"

    def stop(self) -> Counter[str]:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the load did not stop"
        return self.outcomes


@needs_nginx
def test_nginx_accepts_the_shipped_config(tmp_path):
    r = subprocess.run(
        [*write_configs([8001, 8002, 8003], 8080, tmp_path), "-t"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr


class Prometheus:
    """Prometheus with the shipped scrape config (1 s interval), its job retargeted at the
    replicas with `labels` on them (what a PodMonitor's scrape would add)."""

    def __init__(self, ports: list[int], workdir: Path, labels: dict[str, str]):
        cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
        cfg.pop("rule_files", None)
        job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "ferry")
        job["static_configs"] = [
            {"targets": [f"127.0.0.1:{p}" for p in ports], "labels": {"service": "ferry", **labels}}
        ]
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(cfg))
        port = free_port()
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            self.log.flush()
            raise AssertionError(f"prometheus exited: {Path(self.log.name).read_text(errors='replace')[-3000:]}")
        try:
            return self.http.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def query(self, expr: str) -> list:
        body = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert body.get("status") == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        """The value of a one-series answer; None while the answer is empty."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} should give one series: {result}"
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        self.log.close()


@needs_nginx
@needs_prometheus
def test_the_keda_query_asks_for_more_replicas_during_a_load_step_and_fewer_after(pool, tmp_path):
    replicas, nginx = pool.ensure()
    triggers = keda_triggers()
    labels = {k: v for t in triggers for k, v in t.target_labels.items()}
    prom = Prometheus([r.port for r in replicas], tmp_path, labels)
    seen: dict[str, list[tuple[float | None, int | None]]] = {t.name: [] for t in triggers}

    def desired(t: Trigger) -> int | None:
        value = prom.scalar(t.query)
        d = None if value is None else desired_replicas(value, t.threshold, t.metric_type, REPLICAS)
        seen[t.name].append((value, d))
        return d

    def all_desire(ok) -> bool:
        return all((d := desired(t)) is not None and ok(d) for t in triggers)

    def last_seen() -> str:
        return "; ".join(
            f"{t.name}: {t.query} / {t.threshold:g}, (value, desired) {seen[t.name][-4:]}" for t in triggers
        )

    try:
        wait_until(prom.ready, message="prometheus to be ready", timeout=60, interval=0.2)
        wait_until(
            lambda: len(prom.query('up{job="ferry"} == 1')) == REPLICAS,
            message="a scrape of all three replicas",
            timeout=60,
            interval=0.2,
        )
        # Idle: every query has a value (the series exist at 0), and none asks to grow.
        wait_until(lambda: all_desire(lambda d: d <= REPLICAS), message=lambda: f"idle values; {last_seen()}")
        loads = [ClosedLoop(nginx.url, workers, [body]) for workers, body in map(step_load, triggers)]
        try:
            wait_until(
                lambda: all_desire(lambda d: d > REPLICAS),
                message=lambda: f"every query to ask for more than {REPLICAS} replicas; {last_seen()}",
                timeout=60,
                interval=0.2,
            )
        finally:
            outcomes = [(load.stop(), load.sent) for load in loads]
        for counts, sent in outcomes:
            assert counts == Counter(ok=sent), counts  # the step's requests were all served
        wait_until(
            lambda: all_desire(lambda d: d < REPLICAS),
            message=lambda: f"every query to ask for fewer than {REPLICAS} replicas; {last_seen()}",
            timeout=60,
            interval=0.2,
        )
    finally:
        prom.stop()


def running_sequences(replicas: list[FakeGatewayProcess], model: str) -> float:
    """ferry_running_sequences of `model`, summed over the replicas' own /metrics."""
    total = 0.0
    for r in replicas:
        for family in text_string_to_metric_families(httpx.get(r.url + "/metrics", timeout=10).text):
            total += sum(
                x.value for x in family.samples if x.name == "ferry_running_sequences" and x.labels["model"] == model
            )
    return total


@needs_nginx
def test_a_stream_passes_through_nginx_event_by_event(pool):
    """The client has the first event while the replica is still generating the rest: SSE
    is not held back by the proxy. (Ferry's streams also carry `X-Accel-Buffering: no`;
    with it nginx 1.22 passed the events on even with `proxy_buffering on`, so this checks
    the behaviour, not which of the two settings gives it.) The client then leaves, and
    nginx passes that on too: the replica stops generating."""
    replicas, nginx = pool.ensure()
    wait_until(lambda: running_sequences(replicas, "fake-chat") == 0, message="no chat sequence running")
    body = {**CHAT, "max_tokens": 400}  # 400 steps of DELAY_S: still running when the test looks
    with httpx.stream("POST", nginx.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped line iterator would close the response
        first = next(line for line in lines if line.startswith("data: "))
        assert first.startswith('data: {"id"'), first
        running = running_sequences(replicas, "fake-chat")
    assert running == 1, "the first event arrived only after the generation ended"
    wait_until(
        lambda: running_sequences(replicas, "fake-chat") == 0, message="the replica to stop the stream the client left"
    )


@needs_nginx
def test_sigterm_of_one_replica_under_load_costs_no_client_a_request(pool):
    replicas, nginx = pool.ensure()
    earlier = len(nginx.attempts())  # requests of the tests before this one
    leaving = replicas[0]
    load = ClosedLoop(nginx.url, workers=8, bodies=[EMBED, EMBED, CHAT])
    try:
        wait_until(lambda: load.ok >= 60, message=lambda: f"60 answers before the signal; so far {load.outcomes}")
        before = len(nginx.attempts()) - earlier
        leaving.terminate()
        wait_until(lambda: leaving.proc.poll() is not None, timeout=60, message="the drained replica to exit")
        after_exit = load.ok
        # Keep sending after it is gone (nginx meets a refused connect when it tries it
        # again) until some request has met the leaving replica and been sent on.
        wait_until(
            lambda: load.ok >= after_exit + 60 and any(len(a[2]) > 1 for a in nginx.attempts()[earlier:]),
            message=lambda: f"60 answers after the exit and a re-sent request; so far {load.outcomes}",
        )
    finally:
        outcomes = load.stop()
    assert leaving.wait(10) == 0
    assert outcomes == Counter(ok=load.sent), outcomes  # every request answered, every answer a 200
    # nginx logs a request once its response has gone out: the last lines may come a moment
    # after the client has read its answers (a make test worker beside it slows nginx).
    wait_until(
        lambda: len(nginx.attempts()) - earlier >= load.sent,
        message=lambda: f"{load.sent} requests logged; so far {len(nginx.attempts()) - earlier}",
    )
    attempts = nginx.attempts()[earlier:]
    assert len(attempts) == load.sent
    assert {status for status, *_ in attempts} == {200}
    # Least connections spread the load over all three before the signal...
    first = Counter(addrs[-1] for _, addrs, _, _ in attempts[:before])
    assert set(first) == {str(r.port) for r in replicas}, first
    # ...and the draining replica's refusals (503) or its closed port (502, a refused
    # connect) were retried on another replica, which answered.
    retried = [(addrs, statuses) for _, addrs, statuses, _ in attempts if len(statuses) > 1]
    for addrs, statuses in retried:
        assert addrs[0] == str(leaving.port) and statuses[0] in ("503", "502"), (addrs, statuses)
        assert statuses[-1] == "200"
