"""`ferry serve --api-workers 2` over real processes (the fake engines, FERRY_FAKE_ENGINES=1):
a supervisor, two front ends on one port, one engine core per model (gateway/cores/supervisor.py).
Every process of a server is killed when a test ends, whatever happened in it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from loadtests.openloop import GatewayProcess
from tests.gateway.cores.test_core import CHAT, chat_body, chat_steps, computed, spelled
from tests.reliability.procs import whole_tree_killed
from tests.waiting import wait_until

EMBED = "/v1/embeddings"
ADMIN = "/admin/models/fake-embed/batching"
TOKEN = {"Authorization": "Bearer t"}


@contextlib.contextmanager
def serve(*args: str, delay: float = 0.0, log: Path | None = None, workers: int = 2) -> Iterator[GatewayProcess]:
    env = {"FERRY_FAKE_ENGINES": "1", "FERRY_FAKE_DELAY": str(delay), "FERRY_FAKE_LOG": str(log or "")}
    gw = GatewayProcess("--admin-token", "t", "--api-workers", str(workers), *args, env=env, ready_timeout=120)
    with whole_tree_killed(gw):
        wait_until(lambda: len(front_ends(gw)) == workers and all_ready(gw), timeout=120, message="every front end")
        yield gw


def children(gw: GatewayProcess) -> list[psutil.Process]:
    alive = [p for p in psutil.Process(gw.proc.pid).children() if "gateway.cores.launch" in p.cmdline()]
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def listens(p: psutil.Process, port: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp"))
    return False


def front_ends(gw: GatewayProcess) -> list[psutil.Process]:
    """The processes serving the port (the cores hold no TCP socket)."""
    return [p for p in children(gw) if listens(p, gw.port)]


def cores(gw: GatewayProcess) -> list[psutil.Process]:
    """The engine cores, in the order of their models (they start one by one)."""
    return sorted((p for p in children(gw) if not listens(p, gw.port)), key=lambda p: p.create_time())


def all_ready(gw: GatewayProcess) -> bool:
    """/readyz is 200 on a run of fresh connections (each may reach either front end)."""
    return all(httpx.get(gw.url + "/readyz", timeout=10).status_code == 200 for _ in range(8))


def connections_of(p: psutil.Process, port: int) -> int:
    with contextlib.suppress(psutil.Error):
        return sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port for c in p.net_connections("tcp"))
    return 0


def stops_cleanly(gw: GatewayProcess) -> None:
    family = [psutil.Process(gw.proc.pid), *psutil.Process(gw.proc.pid).children(recursive=True)]
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(60) == 0
    wait_until(
        lambda: not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
        message=lambda: f"every process of the server to exit: {family}",
    )


def embed(text: str) -> dict:
    return {"model": "fake-embed", "input": text}


def samples(gw: GatewayProcess, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """`name`'s samples in one /metrics scrape (of whichever front end takes it), by labels."""
    text = httpx.get(gw.url + "/metrics", timeout=30).text
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                key = tuple(sorted(s.labels.items()))
                assert key not in found, f"{name}{key} twice in one scrape"
                found[key] = s.value
    return found


async def clients_on_every_front_end(gw: GatewayProcess, fronts: list[psutil.Process]) -> list[httpx.AsyncClient]:
    """Open clients (one connection each) until every front end holds one of them."""
    clients: list[httpx.AsyncClient] = []
    while not all(connections_of(p, gw.port) for p in fronts):
        assert len(clients) < 40, "the kernel never gave a connection to one of the front ends"
        c = httpx.AsyncClient(base_url=gw.url, timeout=30)
        assert (await c.get("/healthz")).status_code == 200  # connected, and kept alive
        clients.append(c)
    return clients


def test_two_front_ends_serve_one_port_and_share_the_cores_settings():
    with serve() as gw:
        assert len(cores(gw)) == 2  # fake-embed's, then fake-chat's
        changed = httpx.patch(gw.url + ADMIN, headers=TOKEN, json={"max_queue": 77}, timeout=30)
        assert changed.status_code == 200, changed.text
        for _ in range(6):  # fresh connections: whichever front end takes one sees the core's settings
            assert httpx.get(gw.url + ADMIN, headers=TOKEN, timeout=30).json()["max_queue"] == 77
        answers = [httpx.post(gw.url + EMBED, json=embed(f"text {i}"), timeout=30) for i in range(10)]
        assert [r.status_code for r in answers] == [200] * 10
        stops_cleanly(gw)


def test_one_scrape_of_any_front_end_shows_every_processs_series_once():
    with serve() as gw:
        fronts = front_ends(gw)

        async def scenario() -> int:
            clients = await clients_on_every_front_end(gw, fronts)
            try:
                for i, c in enumerate(clients):  # 3 requests on each connection, so in each front end
                    for k in range(3):
                        assert (await c.post(EMBED, json=embed(f"c{i} r{k}"))).status_code == 200
            finally:
                for c in clients:
                    await c.aclose()
            return 3 * len(clients)

        sent = asyncio.run(scenario())
        route = (("model", "fake-embed"), ("route", "/v1/embeddings"), ("status", "200"))
        for _ in range(4):  # fresh connections: whichever front end answers, the same sums
            assert samples(gw, "ferry_requests_total")[route] == sent
            assert samples(gw, "ferry_batches_total")  # the cores' series are in
            restarts = samples(gw, "ferry_engine_core_restarts_total")
            assert restarts == {(("model", "fake-embed"),): 0.0, (("model", "fake-chat"),): 0.0}
        # The front ends and the supervisor keep their series in one directory; the cores,
        # whose series are pulled, write nothing there (gateway/metrics/shared.py).
        [shared] = {os.path.dirname(f.path) for p in fronts for f in p.open_files() if f.path.endswith(".db")}
        writers = {int(name.rsplit("_", 1)[1].removesuffix(".db")) for name in os.listdir(shared)}
        assert writers == {gw.proc.pid, *(p.pid for p in fronts)}
        stops_cleanly(gw)


def test_a_killed_front_end_is_replaced_and_the_other_keeps_serving():
    with serve(delay=0.005) as gw:
        victim, survivor = front_ends(gw)
        outcomes: collections.Counter[str] = collections.Counter()
        scraped: list[dict] = []  # the counts before the kill

        async def load(stop: asyncio.Event) -> None:
            async def one(i: int) -> None:
                try:  # a fresh connection each time: the kernel picks the front end
                    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
                        r = await c.post(EMBED, json=embed(f"load {i}"))
                    outcomes[str(r.status_code)] += 1
                except httpx.TransportError:  # accepted by the front end that was killed
                    outcomes["transport"] += 1

            i = 0
            while not stop.is_set():
                await asyncio.gather(*(one(i + k) for k in range(4)))
                i += 4

        async def scenario() -> None:
            stop = asyncio.Event()
            running = asyncio.create_task(load(stop))
            await asyncio.to_thread(wait_until, lambda: outcomes["200"] >= 20, message="load to flow")
            scraped.append(await asyncio.to_thread(counts, gw))
            victim.send_signal(signal.SIGKILL)
            before = outcomes["200"]
            await asyncio.to_thread(wait_until, lambda: outcomes["200"] >= before + 20, message="the survivor to serve")
            await asyncio.to_thread(
                wait_until,
                lambda: len(front_ends(gw)) == 2 and victim.pid not in [p.pid for p in front_ends(gw)],
                timeout=60,
                message="a replacement front end",
            )
            stop.set()
            await running

        asyncio.run(scenario())
        assert survivor.is_running()
        # Only requests the killed front end held can fail, and only as a closed connection.
        assert set(outcomes) <= {"200", "transport"}, outcomes
        assert outcomes["transport"] <= 8, outcomes
        wait_until(lambda: all_ready(gw), timeout=60, message="the replacement to be ready")
        answers = [httpx.post(gw.url + EMBED, json=embed(f"after {i}"), timeout=30) for i in range(10)]
        assert [r.status_code for r in answers] == [200] * 10
        # The killed front end's counts stay in the scrape (gateway/metrics/shared.py): no
        # counter or histogram went down, and every 200 the clients got is counted.
        [before], after = scraped, counts(gw)
        assert {k: v for k, v in before.items() if after.get(k, -1.0) < v} == {}
        assert after[("ferry_requests_total", ROUTE_200)] >= outcomes["200"] + 10
        assert after[("ferry_request_duration_seconds_count", ROUTE_200[:2])] >= outcomes["200"] + 10
        in_flight = list(samples(gw, "ferry_requests_in_flight"))
        assert in_flight and all(dict(k).keys() == {"route"} for k in in_flight), in_flight  # no pid label
        stops_cleanly(gw)


ROUTE_200 = (("model", "fake-embed"), ("route", "/v1/embeddings"), ("status", "200"))


def counts(gw: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The front ends' counters and histogram counts in one /metrics scrape."""
    found = {}
    for name in ("ferry_requests_total", "ferry_request_duration_seconds_count", "ferry_rejections_total"):
        found.update({(name, k): v for k, v in samples(gw, name).items()})
    return found


async def clients_by_front_end(gw: GatewayProcess, fronts: list[psutil.Process]) -> dict[int, list[httpx.AsyncClient]]:
    """Clients (one connection each), opened one at a time until every front end holds one,
    by the pid of the front end that took each connection."""
    by_pid: dict[int, list[httpx.AsyncClient]] = {p.pid: [] for p in fronts}
    while not all(by_pid.values()):
        assert sum(map(len, by_pid.values())) < 40, "the kernel never gave a connection to one of the front ends"
        before = {p.pid: connections_of(p, gw.port) for p in fronts}
        c = httpx.AsyncClient(base_url=gw.url, timeout=60)
        assert (await c.get("/healthz")).status_code == 200  # connected, and kept alive
        [pid] = [p.pid for p in fronts if connections_of(p, gw.port) > before[p.pid]]
        by_pid[pid].append(c)
    return by_pid


def test_a_killed_front_ends_work_is_cancelled_in_the_core_and_the_other_front_ends_completes(tmp_path):
    log = tmp_path / "computed.log"
    # 400 tokens at 50 ms a decode step: 20 s in the core, unless the front end's death stops them.
    with serve(delay=0.05, log=log) as gw:
        victim, survivor = front_ends(gw)

        async def scenario() -> tuple[list, list[httpx.Response]]:
            by_pid = await clients_by_front_end(gw, [victim, survivor])
            try:
                warm = len(chat_steps(log))  # the core's warm-up steps
                doomed = [
                    asyncio.create_task(c.post(CHAT, json=chat_body(f"long {i}", max_tokens=400)))
                    for i, c in enumerate(by_pid[victim.pid])
                ]
                await asyncio.to_thread(
                    wait_until,
                    lambda: len(doomed) in chat_steps(log)[warm:],
                    message="every long request to run in the core",
                )
                kept = [
                    asyncio.create_task(c.post(CHAT, json=chat_body(f"kept {i}", max_tokens=30)))
                    for i, c in enumerate(by_pid[survivor.pid])
                ]
                victim.send_signal(signal.SIGKILL)
                lost = await asyncio.gather(*doomed, return_exceptions=True)
                return lost, list(await asyncio.gather(*kept))
            finally:
                for c in [c for clients in by_pid.values() for c in clients]:
                    await c.aclose()

        lost, kept = asyncio.run(scenario())
        assert all(isinstance(e, httpx.TransportError) for e in lost), lost  # their connections closed
        for r in kept:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 30

        def alone() -> bool:  # a short request runs by itself in the core's decode steps
            before = len(chat_steps(log))
            short = httpx.post(gw.url + CHAT, json=chat_body("short", max_tokens=3), timeout=30)
            assert short.status_code == 200, short.text
            return chat_steps(log)[before:] == [1, 1]

        wait_until(alone, message="the dead front end's sequences to leave the core's running set")
        assert len(chat_steps(log)) < 400  # they never decoded to their max_tokens
        cancelled = samples(gw, "ferry_cancellations_total")
        assert cancelled[(("model", "fake-chat"), ("phase", "running"))] >= len(lost)
        stops_cleanly(gw)


def test_a_killed_core_ends_in_flight_requests_on_every_front_end_and_service_resumes(tmp_path):
    log = tmp_path / "computed.log"
    with serve(log=log) as gw:
        embed_core = cores(gw)[0]
        fronts = front_ends(gw)

        async def scenario() -> list[httpx.Response]:
            clients = await clients_on_every_front_end(gw, fronts)
            try:
                # HANG holds the fake engine for 30 s: only the core's death can end these
                # requests (one on each connection, so some on each front end) sooner.
                tasks = [asyncio.create_task(c.post(EMBED, json=embed(f"HANG {i}"))) for i, c in enumerate(clients)]
                in_flight = (("route", "/v1/embeddings"),)
                await asyncio.to_thread(
                    wait_until,
                    lambda: computed(log) and samples(gw, "ferry_requests_in_flight").get(in_flight) == len(tasks),
                    message="every request to be in flight, and a hanging input computed",
                )
                embed_core.send_signal(signal.SIGKILL)
                return list(await asyncio.gather(*tasks))
            finally:
                for c in clients:
                    await c.aclose()

        answers = asyncio.run(scenario())
        for r in answers:
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable", r.text
            assert "SIGKILL" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) >= 1
        wait_until(lambda: all_ready(gw), timeout=120, message="/readyz ready on every front end again")
        after = [httpx.post(gw.url + EMBED, json=embed(f"after {i}"), timeout=30) for i in range(6)]
        assert [r.status_code for r in after] == [200] * 6
        assert embed_core.pid not in [p.pid for p in cores(gw)] and len(cores(gw)) == 2
        restarts = samples(gw, "ferry_engine_core_restarts_total")  # the supervisor's, in any scrape
        assert restarts == {(("model", "fake-embed"),): 1.0, (("model", "fake-chat"),): 0.0}
        stops_cleanly(gw)


def test_sigterm_drains_every_front_end_then_the_cores_and_loses_nothing(tmp_path):
    log = tmp_path / "computed.log"
    with serve("--no-warmup", delay=0.3, log=log) as gw:  # (a warm-up: 4 s a start)
        fronts = front_ends(gw)
        family = [psutil.Process(gw.proc.pid), *psutil.Process(gw.proc.pid).children(recursive=True)]

        async def scenario() -> list[httpx.Response]:
            clients = await clients_on_every_front_end(gw, fronts)
            try:
                tasks = [asyncio.create_task(c.post(EMBED, json=embed(f"accepted {i}"))) for i, c in enumerate(clients)]
                in_flight = (("route", "/v1/embeddings"),)
                await asyncio.to_thread(
                    wait_until,
                    lambda: computed(log) and samples(gw, "ferry_requests_in_flight").get(in_flight) == len(tasks),
                    message="every request to be in flight, and the first computed",
                )
                gw.proc.send_signal(signal.SIGTERM)
                return list(await asyncio.gather(*tasks))
            finally:
                for c in clients:
                    await c.aclose()

        answers = asyncio.run(scenario())
        failed = [r.text for r in answers if r.status_code != 200]
        assert not failed and len(answers) >= 2, failed
        assert gw.proc.wait(60) == 0
        wait_until(
            lambda: not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
            message=lambda: f"every process of the server to exit: {family}",
        )
        assert sorted(computed(log)) == sorted(spelled(f"accepted {i}") for i in range(len(answers)))


def test_a_batch_job_with_two_front_ends_runs_every_line_exactly_once(tmp_path):
    from tests.jobs.conftest import Api, embed_line

    log = tmp_path / "computed.log"
    with serve("--data-dir", str(tmp_path / "data"), log=log) as gw:
        texts = [f"line {i}" for i in range(30)]
        batches = []
        for k in range(3):  # fresh connections: created through either front end
            api = Api(gw.url)
            batches.append(api.create([embed_line(f"b{k}-e{i}", t) for i, t in enumerate(texts)])["id"])
        for batch_id in batches:
            done = Api(gw.url).wait(batch_id, timeout=60)
            assert done["status"] == "completed" and done["request_counts"]["completed"] == 30, done
            out = [r["custom_id"] for r in Api(gw.url).content(done["output_file_id"])]
            assert sorted(out) == sorted({*out}) and len(out) == 30
        ran = collections.Counter(computed(log))
        assert ran == collections.Counter({spelled(t): 3 for t in texts}), ran  # each line of each job, once
        stops_cleanly(gw)


def test_nothing_outlives_a_killed_supervisor():
    with serve() as gw:
        family = children(gw)
        assert len(family) == 4  # two cores, two front ends
        gw.proc.send_signal(signal.SIGKILL)  # no drain: only the closed pipes tell the children
        gw.proc.wait(30)
        wait_until(
            lambda: all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in family),
            message=lambda: f"every front end and core to exit after their supervisor: {family}",
        )


def lease_holder(gw: GatewayProcess) -> int | None:
    """The pid of the front end that last took the batch-job lease, from the server's log."""
    pid = None
    for line in Path(gw.log.name).read_text().splitlines():
        if "runs batch jobs now" in line:
            pid = int(line.split("this front end (", 1)[1].split(":")[1])
    return pid


def test_when_the_job_worker_dies_another_front_end_finishes_its_job_recording_each_line_once(tmp_path):
    from tests.jobs.conftest import Api, embed_line

    log = tmp_path / "computed.log"
    with serve("--data-dir", str(tmp_path / "data"), "--max-batch-size", "4", "--no-warmup", delay=0.2, log=log) as gw:
        texts = [f"line {i}" for i in range(40)]
        api = Api(gw.url)
        batch_id = api.create([embed_line(f"e{i}", t) for i, t in enumerate(texts)])["id"]
        holder = wait_until(lambda: lease_holder(gw), message="a front end to take the lease")
        wait_until(lambda: len(computed(log)) >= 4, message="the job to be under way")
        psutil.Process(holder).send_signal(signal.SIGKILL)
        wait_until(lambda: lease_holder(gw) not in (None, holder), timeout=60, message="another front end to take over")
        done = Api(gw.url).wait(batch_id, timeout=90)
        counts = done["request_counts"]
        assert done["status"] == "completed" and (counts["completed"], counts["failed"]) == (40, 0), done
        out = [r["custom_id"] for r in Api(gw.url).content(done["output_file_id"])]
        assert sorted(out) == sorted(f"e{i}" for i in range(40))  # every line recorded once
        ran = collections.Counter(computed(log))
        assert set(ran) == {spelled(t) for t in texts}  # a line running at the kill may have run twice
        stops_cleanly(gw)


def test_a_front_end_of_several_accepts_only_once_attached_and_a_single_server_at_once(monkeypatch, tmp_path):
    """Front ends share one listening socket and the kernel hands a connection to whichever
    accepts first (uvicorn accepts once the lifespan's startup returns): a replacement front
    end still attaching (a chat tokenizer: seconds) must not take connections it would answer
    503 not_ready while its sibling serves. A single server accepts at once (/healthz, /readyz
    say it loads)."""
    from gateway.app import create_app
    from gateway.config import ServerConfig
    from gateway.state import GatewayState

    async def started(cores: list[dict] | None) -> list[str]:
        attached = asyncio.Event()
        said: list[str] = []

        async def load(self: GatewayState) -> None:
            await attached.wait()
            said.append("attached")
            self.ready = True

        monkeypatch.setattr(GatewayState, "load", load)
        app = create_app(ServerConfig(warmup=False, engine_cores=False, data_dir=str(tmp_path)), cores=cores)

        async def startup() -> None:
            async with app.router.lifespan_context(app):
                said.append("accepting")
                assert app.ferry.ready == (cores is not None)
                attached.set()
                await asyncio.sleep(0)

        entering = asyncio.create_task(startup())
        for _ in range(20):  # the event loop turns: a startup that does not wait is through by now
            await asyncio.sleep(0)
        attached.set()
        await entering
        return said

    assert asyncio.run(started(cores=[])) == ["attached", "accepting"]
    assert asyncio.run(started(cores=None))[0] == "accepting"
