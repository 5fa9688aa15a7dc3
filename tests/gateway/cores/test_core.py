"""`ferry serve --engine-cores` over real processes (the fake engines, FERRY_FAKE_ENGINES=1):
each model (embeddings and chat) in its own engine-core process (gateway/cores/core.py), the
server talking to it through gateway/cores/client.py. Every server and every process it
started are killed when a test ends, whatever happened in it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest

from engine.fake import fake_tokens, fake_vector
from loadtests.openloop import GatewayProcess, free_port
from tests.reliability.procs import whole_tree_killed
from tests.waiting import wait_until

EMBED = "/v1/embeddings"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ADMIN = "/admin/models/fake-embed/batching"
TOKEN = {"Authorization": "Bearer t"}

# What the admin GET reports of each phase's cost model.
COST_REPORT_FIELDS = {"fixed_ms", "per_item_ms", "per_token_ms", "per_token_row_ms", "observations", "slowdown", "tail"}


@contextlib.contextmanager
def serve(*args: str, delay: float = 0.0, log: Path | None = None) -> Iterator[GatewayProcess]:
    env = {"FERRY_FAKE_ENGINES": "1", "FERRY_FAKE_DELAY": str(delay), "FERRY_FAKE_LOG": str(log or "")}
    with whole_tree_killed(GatewayProcess("--admin-token", "t", *args, env=env, ready_timeout=120)) as gw:
        yield gw


def cores_of(pid: int) -> list[psutil.Process]:
    """The engine cores of a server, in the order of its models (they start one by one)."""
    cores = [p for p in psutil.Process(pid).children() if "gateway.cores.launch" in p.cmdline()]
    return sorted(cores, key=lambda p: p.create_time())


# The engine cores this test process already runs for the session's real models (the
# `real_server` fixture), left out where a test counts the cores it starts itself.
_SESSION_CORES: set[int] = set()


def my_cores() -> list[psutil.Process]:
    """The engine cores this test started in this process."""
    return [c for c in cores_of(psutil.Process().pid) if c.pid not in _SESSION_CORES]


@pytest.fixture(autouse=True)
def _note_session_cores():
    _SESSION_CORES.update(c.pid for c in cores_of(psutil.Process().pid))


def core_of(gw: GatewayProcess, kind: str = "embedding") -> psutil.Process:
    cores = cores_of(gw.proc.pid)
    assert len(cores) == 2, cores  # fake-embed's core, then fake-chat's
    return cores[0 if kind == "embedding" else 1]


def computed(log: Path) -> list[str]:
    """What the core's fake engine computed: the ids of each input (it never sees texts)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.split("\t", 1)[1] for line in lines if line.startswith("embed\t")]


def spelled(text: str) -> str:
    return " ".join(map(str, fake_tokens(text)))


def stops_cleanly(gw: GatewayProcess) -> None:
    """SIGTERM: the server drains, its core exits with it, and no process is left."""
    family = [psutil.Process(gw.proc.pid), *psutil.Process(gw.proc.pid).children(recursive=True)]
    assert len(family) >= 2
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(60) == 0
    wait_until(
        lambda: not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
        message=lambda: f"every process of the server to exit: {family}",
    )


def test_embeddings_through_a_core_are_those_of_the_in_process_path():
    body = {
        "model": "fake-embed",
        "input": ["hello", "two words", "three little words", " spaced  out ", "punctuation, too: fine!"],
    }
    answers = {}
    for flag in ("--no-engine-cores", "--engine-cores"):
        with serve(flag) as gw:
            floats = httpx.post(gw.url + EMBED, json=body, timeout=30)
            b64 = httpx.post(gw.url + EMBED, json={**body, "encoding_format": "base64"}, timeout=30)
            failed = httpx.post(gw.url + EMBED, json={"model": "fake-embed", "input": ["ok", "FAIL_ITEM"]}, timeout=30)
            assert floats.status_code == b64.status_code == 200, floats.text
            assert floats.headers["X-Ferry-Batch-Size"] == "5" and float(floats.headers["X-Ferry-Queue-Ms"]) >= 0
            answers[flag] = (floats.json(), b64.json(), failed.status_code, failed.json()["error"]["code"])
            if flag == "--engine-cores":
                core_of(gw)
                stops_cleanly(gw)
    local, remote = answers.values()
    assert remote == local
    assert local[2:] == (500, "engine_error")  # an input's failure crosses as itself
    assert [len(base64.b64decode(d["embedding"])) for d in remote[1]["data"]] == [32] * 5


def test_refusals_admin_and_disconnects_cross_the_process_boundary(tmp_path):
    log = tmp_path / "computed.log"
    # No interactive lane: the requests below must queue behind the one the engine computes.
    # No warm-up: with every engine call a second long, profiling the engines would take
    # 15 s of each start (admission's cost models start from their priors instead).
    with serve("--engine-cores", "--no-interactive-lane", "--no-warmup", delay=1.0, log=log) as gw:
        admin = httpx.get(gw.url + ADMIN, headers=TOKEN, timeout=30)
        assert admin.status_code == 200 and admin.json()["max_queue"] == 1024
        assert set(admin.json()["cost_model"]["embed"]) == COST_REPORT_FIELDS
        patched = httpx.patch(gw.url + ADMIN, headers=TOKEN, json={"max_queue": 1, "max_wait_ms": 0}, timeout=30)
        assert patched.status_code == 200 and patched.json()["max_queue"] == 1
        assert httpx.get(gw.url + ADMIN, headers=TOKEN, timeout=30).json()["max_queue"] == 1  # the core's own
        bad = httpx.patch(gw.url + ADMIN, headers=TOKEN, json={"max_queue": 0}, timeout=30)
        assert (bad.status_code, bad.json()["error"]["param"]) == (422, "max_queue")

        def embed(c: httpx.AsyncClient, text: str, **kw):
            return c.post(EMBED, json={"model": "fake-embed", "input": text, **kw.pop("body", {})}, **kw)

        async def running(c: httpx.AsyncClient, text: str) -> asyncio.Task:
            """A request whose input the core's engine is computing now (for a second)."""
            task = asyncio.create_task(embed(c, text))
            await asyncio.to_thread(wait_until, lambda: spelled(text) in computed(log), message=f"{text!r} to run")
            return task

        async def scenario() -> tuple:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
                first = await running(c, "first one")
                late = await embed(c, "late", body={"latency_budget_ms": 1})  # cannot finish in 1 ms
                two = await asyncio.gather(embed(c, "one of two"), embed(c, "two of two"))  # the queue holds one
                second = await running(c, "second one")
                with pytest.raises(httpx.ReadTimeout):  # queued behind it, then its client leaves
                    await embed(c, "left early", timeout=0.2)

                def admitted_last() -> httpx.Response | None:
                    r = httpx.post(gw.url + EMBED, json={"model": "fake-embed", "input": "last"}, timeout=30)
                    full = r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
                    return None if full else r  # full: the server has yet to see that client leave

                last = await asyncio.to_thread(wait_until, admitted_last, message="the slot of the client that left")
                return late, sorted(two, key=lambda r: r.status_code), await first, await second, last

        late, (admitted, full), *served = asyncio.run(scenario())
        for refused, code in ((late, "deadline_infeasible"), (full, "queue_full")):
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == code and int(refused.headers["Retry-After"]) >= 1
        assert [r.status_code for r in [admitted, *served]] == [200] * 4
        one = admitted.request.content.decode().split('"input":"')[1].split('"')[0]
        assert computed(log) == [spelled(t) for t in ("first one", one, "second one", "last")]  # "left early" never ran
        stops_cleanly(gw)


def restarts(gw: GatewayProcess, model: str) -> float:
    """ferry_engine_core_restarts_total of `model`, from the server's /metrics."""
    prefix = f'ferry_engine_core_restarts_total{{model="{model}"}} '
    lines = httpx.get(gw.url + "/metrics", timeout=30).text.splitlines()
    return next((float(line.removeprefix(prefix)) for line in lines if line.startswith(prefix)), 0.0)


def ready_again(gw: GatewayProcess) -> None:
    wait_until(
        lambda: httpx.get(gw.url + "/readyz", timeout=30).status_code == 200,
        timeout=120,
        message="/readyz to be ready again after the restart",
    )


def replaced(gw: GatewayProcess, core: psutil.Process) -> bool:
    """Two cores serve, `core` (killed) gone and reaped: a new one took its place."""
    cores = cores_of(gw.proc.pid)
    return len(cores) == 2 and core.pid not in [p.pid for p in cores] and not core.is_running()


def test_a_killed_core_fails_its_requests_at_once_and_is_restarted_with_its_settings(tmp_path):
    log = tmp_path / "computed.log"
    with serve("--engine-cores", "--no-interactive-lane", log=log) as gw:  # requests queue behind HANG
        core = core_of(gw)
        changes = {"max_queue": 77, "max_wait_ms": 7}
        assert httpx.patch(gw.url + ADMIN, headers=TOKEN, json=changes, timeout=30).status_code == 200
        # A tenant given a quota of one token a minute: its second request is refused.
        capped = {"tenants": [{"name": "capped", "tokens_per_minute": 1}]}
        assert httpx.patch(gw.url + "/admin/tenants", headers=TOKEN, json=capped, timeout=30).status_code == 200
        assert restarts(gw, "fake-embed") == 0

        async def scenario() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=gw.url, timeout=20) as c:
                # HANG holds the fake engine for 30 s: only the core's death can end it, or
                # the requests queued behind it, sooner.
                hung = asyncio.create_task(c.post(EMBED, json={"model": "fake-embed", "input": "HANG here"}))
                await asyncio.to_thread(wait_until, lambda: computed(log), message="the hanging input to be computed")
                queued = [
                    asyncio.create_task(c.post(EMBED, json={"model": "fake-embed", "input": f"queued {i}"}))
                    for i in range(5)
                ]
                await asyncio.sleep(0.2)  # not needed for the assertions: gives the queued ones time to arrive
                core.send_signal(signal.SIGKILL)
                answers = await asyncio.gather(hung, *queued)
                return (
                    list(answers),
                    await c.post(EMBED, json={"model": "fake-embed", "input": "x"}),
                    await c.get("/readyz"),
                )

        in_flight, during, ready = asyncio.run(scenario())
        for r in in_flight:
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable", r.text
            assert "SIGKILL" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) >= 1
        # Right after the kill the new core is most likely still starting; whenever it is,
        # the model answers 503 with a Retry-After and /readyz names it.
        if during.status_code != 200:
            assert during.status_code == 503 and during.json()["error"]["code"] == "model_unavailable", during.text
            assert int(during.headers["Retry-After"]) >= 1
        if ready.status_code != 200:
            assert ready.status_code == 503 and "fake-embed" in ready.json()["error"]
        ready_again(gw)
        after = httpx.post(gw.url + EMBED, json={"model": "fake-embed", "input": "after"}, timeout=30)
        assert after.status_code == 200, after.text
        np.testing.assert_allclose(after.json()["data"][0]["embedding"], fake_vector("after", 8), rtol=1e-6)
        settings = httpx.get(gw.url + ADMIN, headers=TOKEN, timeout=30).json()  # the new core's own
        assert {k: settings[k] for k in changes} == changes
        # The new core kept the PATCHed quota too (its counts start afresh): one request, then 429.
        as_capped = {"X-Ferry-Tenant": "capped"}
        quota = [
            httpx.post(gw.url + EMBED, json={"model": "fake-embed", "input": f"q {i}"}, headers=as_capped, timeout=30)
            for i in range(2)
        ]
        assert quota[0].status_code == 200, quota[0].text
        assert quota[1].status_code == 429 and quota[1].json()["error"]["code"] == "tenant_quota", quota[1].text
        assert restarts(gw, "fake-embed") == 1 and restarts(gw, "fake-chat") == 0
        assert replaced(gw, core)
        chat = {"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(gw.url + CHAT, json=chat, timeout=30).status_code == 200  # its own core lived on
        stops_cleanly(gw)


def test_sigterm_lets_the_core_finish_accepted_work(tmp_path):
    with serve("--engine-cores", "--no-warmup", delay=0.5, log=tmp_path / "computed.log") as gw:

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
                running = asyncio.create_task(c.post(EMBED, json={"model": "fake-embed", "input": "accepted"}))
                await asyncio.to_thread(
                    wait_until, lambda: computed(tmp_path / "computed.log"), message="the input to be computed"
                )
                gw.proc.send_signal(signal.SIGTERM)
                return await running

        assert asyncio.run(scenario()).status_code == 200
        assert gw.proc.wait(60) == 0


def test_a_core_that_cannot_load_its_model_fails_start_up_with_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--engine-cores",
            "--port",
            str(free_port()),
            "--embedding-model",
            str(missing),
            "--chat-model",
            "none",
        ],
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"ferry: cannot load the embedding model {missing}: no such file or directory", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# -- failure_line: the one line of a core that cannot load its model ------------------------------
def spec_of(kind: str, source: str):
    from gateway.models.catalogue import ModelSpec

    return ModelSpec(kind, load=lambda: None, source=source)  # type: ignore[arg-type]


def raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    """`outer` as transformers raises it: `raise outer from inner`."""
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:
        return e


def test_a_missing_path_is_named_as_such_absolute_relative_or_under_an_existing_directory(tmp_path, monkeypatch):
    from gateway.models.diagnosis import failure_line

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    hub = raised_from(OSError("We couldn't connect to 'https://huggingface.co'"), RuntimeError("offline"))
    for source in (str(tmp_path / "gone"), "./gone", "../gone", "~/no-such-ferry-model", "models/gone", "a/b/c"):
        line = failure_line(spec_of("embedding", source), hub)
        assert line == f"cannot load the embedding model {source}: no such file or directory"
    # Shaped like a Hub id, and no directory of that name here: a Hub id, not a path.
    line = failure_line(spec_of("embedding", "someone/gone"), RuntimeError("boom\nmore"))
    assert line == "cannot load the embedding model someone/gone: RuntimeError: boom"


def test_a_hub_id_missing_from_the_cache_while_offline_is_named_as_such(monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    from gateway.models.diagnosis import failure_line

    # What transformers raises (checked against the real loader below): an OSError from the Hub's error.
    exc = raised_from(OSError("We couldn't connect to 'https://huggingface.co' ..."), LocalEntryNotFoundError("x"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert failure_line(spec_of("chat", "someone/gone"), exc) == (
        "cannot load the chat model someone/gone: not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    )
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert failure_line(spec_of("chat", "someone/gone"), exc).endswith(
        ": not in the local Hugging Face cache, and the Hugging Face Hub cannot be reached"
    )
    missing = RepositoryNotFoundError("404", response=httpx.Response(404, request=httpx.Request("GET", "http://hub")))
    assert failure_line(spec_of("chat", "someone/gone"), raised_from(OSError("not a repo"), missing)).endswith(
        ": no such model on the Hugging Face Hub (or a gated one: set HF_TOKEN)"
    )


def test_the_real_loader_offline_gives_the_hub_reason():
    from gateway.config import ServerConfig
    from gateway.models.catalogue import model_spec
    from gateway.models.diagnosis import failure_line
    from gateway.models.kinds import EMBEDDING

    assert os.environ["HF_HUB_OFFLINE"] == "1"  # tests/conftest.py
    spec = model_spec(EMBEDDING, "ferry-tests/no-such-model", ServerConfig())
    with pytest.raises(Exception) as raised:
        spec.load()
    assert failure_line(spec, raised.value) == (
        "cannot load the embedding model ferry-tests/no-such-model: "
        "not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    )


def test_a_model_of_another_kind_is_named_as_such(tmp_path):
    from gateway.models.diagnosis import failure_line

    refused = ValueError(
        "Unrecognized configuration class <class 'BertConfig'> for this kind of AutoModel: AutoModelForCausalLM."
    )
    assert failure_line(spec_of("chat", "someone/encoder"), refused) == (
        "cannot load the chat model someone/encoder: not a chat model"
    )
    assert failure_line(spec_of("embedding", "someone/x"), refused).endswith(": not an embedding model")
    # An encoder that AutoModelForCausalLM takes (BERT as a decoder) fails later, anyhow:
    # its config tells.
    encoder = tmp_path / "minilm"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    late = AttributeError("'NoneType' object has no attribute 'layers'")
    assert failure_line(spec_of("chat", str(encoder)), late) == (
        f"cannot load the chat model {encoder}: not a chat model (its config names BertModel)"
    )
    (encoder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert failure_line(spec_of("chat", str(encoder)), late).endswith(
        ": AttributeError: 'NoneType' object has no attribute 'layers'"
    )


def test_a_core_does_not_outlive_a_killed_server():
    with serve("--engine-cores") as gw:
        core = core_of(gw)
        gw.proc.send_signal(signal.SIGKILL)  # no drain, no atexit: only the closed pipe tells the core
        gw.proc.wait(30)
        wait_until(
            lambda: not core.is_running() or core.status() == psutil.STATUS_ZOMBIE,
            message="the engine core to exit after its server",
        )


def test_embedded_mode_starts_and_stops_its_cores(monkeypatch):
    from gateway import Ferry

    monkeypatch.setenv("FERRY_FAKE_ENGINES", "1")  # read by the core too (it inherits the environment)
    with Ferry(engine_cores=True, warmup=False) as ferry:
        cores = my_cores()
        assert len(cores) == 2
        vectors = ferry.client().embed("fake-embed", ["hello", "ferry"], numpy=True)
        np.testing.assert_array_equal(vectors, np.stack([fake_vector(t, 8) for t in ("hello", "ferry")]))
    wait_until(
        lambda: all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in cores),
        message="the engine cores to exit with their Ferry",
    )


def test_batch_job_lines_run_in_the_core(tmp_path):
    from tests.jobs.conftest import Api, chat_line, completion_line, embed_line

    with serve("--engine-cores", "--data-dir", str(tmp_path / "data")) as gw:
        api = Api(gw.url)
        texts = [f"line {i}" for i in range(6)]
        lines = [embed_line(f"e{i}", t) for i, t in enumerate(texts)] + [embed_line("bad", "FAIL_ITEM")]
        lines += [chat_line("chat", "hi", n=2), completion_line("completion", ["a", "b"], max_tokens=4, stop="w2")]
        batch = api.create(lines)
        done = api.wait(batch["id"], timeout=60)
        counts = done["request_counts"]
        assert done["status"] == "completed" and (counts["completed"], counts["failed"]) == (8, 1), done
        out = {r["custom_id"]: r["response"] for r in api.content(done["output_file_id"])}
        for i, t in enumerate(texts):
            assert out[f"e{i}"]["status_code"] == 200
            np.testing.assert_allclose(out[f"e{i}"]["body"]["data"][0]["embedding"], fake_vector(t, 8), rtol=1e-6)
        chat, completion = out["chat"]["body"]["choices"], out["completion"]["body"]["choices"]
        assert [c["message"]["content"] for c in chat] == ["w0 w1 w2 "] * 2  # the chat model's core
        assert [(c["text"], c["finish_reason"]) for c in completion] == [("w0 w1 ", "stop")] * 2
        [bad] = api.content(done["error_file_id"])
        assert (bad["custom_id"], bad["response"]["status_code"]) == ("bad", 500)
        assert bad["response"]["body"]["error"]["code"] == "engine_error"
        stops_cleanly(gw)


# -- chat models in engine cores (step 3) ----------------------------------------------------
def chat_body(content: str, **kw) -> dict:
    return {"model": "fake-chat", "messages": [{"role": "user", "content": content}], **kw}


GENERATIONS = [
    (CHAT, chat_body("hi", max_tokens=4, n=2)),
    (CHAT, {**chat_body("x", max_tokens=6, stop=["w3"]), "messages": [[{"role": "user", "content": "a"}]] * 2}),
    (CHAT, chat_body("roles", max_tokens=2, messages=[{"role": "developer", "content": "?"}])),  # the template refuses
    (COMPLETIONS, {"model": "fake-chat", "prompt": ["one", "two", "three"], "max_tokens": [2, 3, 5], "stop": "w1"}),
    (COMPLETIONS, {"model": "fake-chat", "prompt": "p", "max_tokens": 5, "n": 2, "stop": [" w2", "w4"]}),
]


def answer(r: httpx.Response) -> tuple[int, object]:
    """A response without what differs between any two calls (ids, times)."""
    body = r.json()
    for key in ("id", "created"):
        body.pop(key, None)
    return r.status_code, body


def streamed(gw: GatewayProcess, path: str, body: dict) -> tuple[int, dict, list]:
    """A streamed answer as each choice's chunks in order (choices interleave as their
    steps come), then the usage chunk and the end."""
    by_choice: dict[int, list] = {}
    tail = []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gw.url + path, json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                tail.append("[DONE]")
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for key in ("id", "created"):
                chunk.pop(key, None)
            if chunk.get("choices"):
                by_choice.setdefault(chunk["choices"][0]["index"], []).append(chunk)
            else:
                tail.append(chunk)
        return r.status_code, by_choice, tail


def test_chat_and_completions_through_a_core_are_those_of_the_in_process_path():
    answers = {}
    for flag in ("--no-engine-cores", "--engine-cores"):
        with serve(flag) as gw:
            plain = [answer(httpx.post(gw.url + path, json=body, timeout=30)) for path, body in GENERATIONS]
            streams = [streamed(gw, path, body) for path, body in GENERATIONS if "developer" not in str(body)]
            answers[flag] = plain, streams
            if flag == "--engine-cores":
                core_of(gw, "chat")
                stops_cleanly(gw)
    local, remote = answers.values()
    assert remote == local
    plain, streams = remote
    assert [status for status, _ in plain] == [200, 200, 422, 200, 200]
    assert plain[2][1]["error"]["code"] == "chat_template_error"
    [first, second] = plain[1][1]["choices"]  # two conversations, each cut before its stop string
    assert (first["prompt_index"], second["prompt_index"]) == (0, 1)
    assert first["message"]["content"] == "w0 w1 w2 " and first["finish_reason"] == "stop"
    assert [c["text"] for c in plain[3][1]["choices"]] == ["w0 ", "w0 ", "w0 "]
    status, by_choice, tail = streams[0]
    assert status == 200 and sorted(by_choice) == [0, 1] and tail[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in by_choice[1]) == "w0 w1 w2 w3 "
    assert tail[0]["usage"]["completion_tokens"] == 8


def chat_steps(log: Path) -> list[int]:
    """How many sequences ran in each decode step of the core's fake chat engine."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [int(line.split("\t", 1)[1]) for line in lines if line.startswith("chat-step\t")]


def test_a_client_gone_mid_stream_stops_its_sequence_in_the_core(tmp_path):
    log = tmp_path / "computed.log"
    with serve("--engine-cores", delay=0.05, log=log) as gw:
        # 400 tokens at 50 ms a step: 20 s, unless the client's leaving stops it.
        with httpx.stream("POST", gw.url + CHAT, json=chat_body("long", max_tokens=400, stream=True), timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        # Gone: once the core hears of it, a short request runs alone in its steps.

        def alone() -> bool:
            before = len(chat_steps(log))
            short = httpx.post(gw.url + CHAT, json=chat_body("short", max_tokens=3), timeout=30)
            assert short.status_code == 200
            return chat_steps(log)[before:] == [1, 1]

        wait_until(alone, message="the abandoned sequence to leave the core's running set")
        stops_cleanly(gw)


# -- stop strings in the front end (step 3b) ----------------------------------------------------
# The fake words are "w0 w1 w2 ..." (one token each). These stops straddle tokens: one starts
# with the previous word's space, one spans three tokens, one is never completed.
STOPS = [
    (CHAT, chat_body("n", max_tokens=8, n=2, stop=[" w2"])),
    (COMPLETIONS, {"model": "fake-chat", "prompt": ["a", "bb", "ccc"], "max_tokens": [3, 6, 9], "stop": "1 w2 w"}),
    (
        CHAT,
        {
            **chat_body("", max_tokens=[5, 12], stop=[["w9x"], ["w3 w4", "w3 w5"]], n=2),
            "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
        },
    ),
]


def test_stop_strings_through_a_core_are_those_of_the_in_process_path():
    answers = {}
    for flag in ("--no-engine-cores", "--engine-cores"):
        with serve(flag) as gw:
            plain = [answer(httpx.post(gw.url + path, json=body, timeout=30)) for path, body in STOPS]
            streams = [streamed(gw, path, body) for path, body in STOPS]
            answers[flag] = plain, streams
            if flag == "--engine-cores":
                stops_cleanly(gw)
    local, remote = answers.values()
    assert remote == local
    plain, streams = remote
    assert all(status == 200 for status, _ in plain)
    texts = [
        [(c.get("message", {}).get("content", c.get("text")), c["finish_reason"]) for c in body["choices"]]
        for _, body in plain
    ]
    assert texts[0] == [("w0 w1", "stop")] * 2  # the space before " w2" was held back, then dropped
    assert texts[1] == [("w0 w1 w2 ", "length"), ("w0 w", "stop"), ("w0 w", "stop")]
    assert texts[2] == [("w0 w1 w2 w3 w4 ", "length")] * 2 + [("w0 w1 w2 ", "stop")] * 2
    assert [c["prompt_index"] for c in plain[2][1]["choices"]] == [0, 0, 1, 1]
    assert plain[1][1]["usage"]["completion_tokens"] == 3 + 4 + 4  # up to the token that completed the stop
    for (_, body), (status, by_choice, tail) in zip(plain, streams, strict=True):
        assert status == 200 and tail[-1] == "[DONE]"
        for k, choice in enumerate(body["choices"]):
            chunks = by_choice[k]
            content = "".join(
                c["choices"][0].get("delta", {}).get("content", "") or c["choices"][0].get("text", "") for c in chunks
            )
            assert content == choice.get("message", {}).get("content", choice.get("text"))
            assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
        # Held-back tokens are counted in the next delta. (The stream ran second: its prompt
        # was in the prefix cache, so only its cached tokens may differ.)
        streamed_usage, cached = dict(tail[0]["usage"]), body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert streamed_usage.pop("prompt_tokens_details")["cached_tokens"] >= cached
        assert streamed_usage == {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}


def test_a_stop_string_found_in_the_front_end_stops_the_sequence_in_the_core(tmp_path):
    log = tmp_path / "computed.log"
    with serve("--engine-cores", delay=0.02, log=log) as gw:
        for stream in (False, True):
            before = len(chat_steps(log))
            # 400 tokens at 20 ms a step, unless the stop string found in the front end ends it.
            body = chat_body("long", max_tokens=400, stop=["w3"])
            if stream:
                _, by_choice, tail = streamed(gw, CHAT, body)
                chunks = by_choice[0]
                text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
                finish, usage = chunks[-1]["choices"][0]["finish_reason"], tail[0]["usage"]
            else:
                r = httpx.post(gw.url + CHAT, json=body, timeout=30)
                choice = r.json()["choices"][0]
                text, finish, usage = choice["message"]["content"], choice["finish_reason"], r.json()["usage"]
            assert (text, finish, usage["completion_tokens"]) == ("w0 w1 w2 ", "stop", 4)

            # The core ended the sequence: a short request then runs alone in its steps.
            def alone() -> bool:
                start = len(chat_steps(log))
                short = httpx.post(gw.url + CHAT, json=chat_body("short", max_tokens=3), timeout=30)
                assert short.status_code == 200
                return chat_steps(log)[start:] == [1, 1]

            wait_until(alone, message="the stopped sequence to leave the core's running set")
            steps = chat_steps(log)[before:]
            assert len(steps) < 100, steps  # not the 399 decode steps of max_tokens
        stops_cleanly(gw)


def test_a_killed_chat_core_ends_its_streams_with_an_error_at_once_and_is_restarted(tmp_path):
    log = tmp_path / "computed.log"
    with serve("--engine-cores", "--no-warmup", delay=0.5, log=log) as gw:  # (a warm-up: 6 s a start)
        chat_core = core_of(gw, "chat")
        chunks = []
        body = chat_body("doomed", max_tokens=400, n=2, stream=True)  # 200 s unless the core dies
        with httpx.stream("POST", gw.url + CHAT, json=body, timeout=20) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                chunks.append(line)
                if len(chunks) == 1:
                    chat_core.send_signal(signal.SIGKILL)
        assert chunks[-1] == "data: [DONE]"
        errors = [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks[:-1]]
        errors = [c for c in errors if c.get("error")]
        assert sorted(c["index"] for c in errors) == [0, 1]
        assert {(c["error"]["status"], c["error"]["code"]) for c in errors} == {(503, "model_unavailable")}
        assert all("SIGKILL" in c["error"]["message"] for c in errors)
        ready_again(gw)
        later = httpx.post(gw.url + CHAT, json=chat_body("after", max_tokens=2), timeout=30)
        assert later.status_code == 200 and later.json()["choices"][0]["message"]["content"] == "w0 w1 "
        assert restarts(gw, "fake-chat") == 1 and replaced(gw, chat_core)
        assert httpx.post(gw.url + EMBED, json={"model": "fake-embed", "input": "still"}, timeout=30).status_code == 200
        stops_cleanly(gw)


def test_the_openai_client_streams_through_a_core():
    with serve("--engine-cores") as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="fake-chat",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            stop=["w3"],
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert ("".join(pieces), finish) == ("w0 w1 w2 ", "stop")
        assert usage is not None and usage.completion_tokens == 4
        completion = client.completions.create(model="fake-chat", prompt="hi", max_tokens=2)
        assert completion.choices[0].text == "w0 w1 "
        stops_cleanly(gw)


def test_a_core_that_cannot_load_its_model_on_a_restart_is_not_restarted_again(monkeypatch, tmp_path):
    from gateway.config import ServerConfig
    from gateway.cores.process import CoreRestarter, start_in_core
    from gateway.metrics.registry import GatewayMetrics
    from gateway.models.catalogue import default_specs
    from tests.waiting import async_wait_until

    missing = tmp_path / "no-such-model"
    cfg = ServerConfig(embedding_model=str(missing), chat_model="none")
    monkeypatch.setenv("FERRY_FAKE_ENGINES", "1")  # the first core serves the fake model ...
    metrics = GatewayMetrics()

    async def scenario() -> None:
        served = await start_in_core(default_specs(cfg)[0], 0, cfg, metrics)
        batcher = served.batcher
        first = my_cores()
        assert len(first) == 1
        monkeypatch.delenv("FERRY_FAKE_ENGINES")  # ... its restart (a fresh spawn) loads the missing one
        first[0].send_signal(signal.SIGKILL)
        await async_wait_until(
            lambda: batcher.failed and "restarted core failed" in batcher.failed and not batcher.restarting,
            timeout=120,
            message=lambda: f"the restart to fail (failed: {batcher.failed})",
        )
        assert "SIGKILL" in batcher.failed and "no such file or directory" in batcher.failed
        assert metrics.core_restarts.labels("fake-embed")._value.get() == 1
        assert isinstance(batcher.core, CoreRestarter) and len(batcher.core.restarts) == 1  # tried once, not again
        with pytest.raises(Exception, match="unavailable"):
            await batcher.submit_many([[1, 2]])
        await batcher.stop()

    asyncio.run(scenario())
    wait_until(
        lambda: all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in my_cores()),
        message="no engine core left",
    )


def test_restarts_are_bounded(monkeypatch):
    from gateway.config import ServerConfig
    from gateway.cores import process as core_process
    from gateway.cores import restarts as core_restarts
    from gateway.metrics.registry import GatewayMetrics
    from gateway.models.catalogue import default_specs
    from tests.waiting import async_wait_until

    monkeypatch.setenv("FERRY_FAKE_ENGINES", "1")
    monkeypatch.setattr(core_restarts, "MAX_RESTARTS", 1)
    cfg, metrics = ServerConfig(), GatewayMetrics()

    async def scenario() -> None:
        served = await core_process.start_in_core(default_specs(cfg)[0], 0, cfg, metrics)
        batcher = served.batcher
        restarts = metrics.core_restarts.labels("fake-embed")
        [first] = my_cores()
        first.send_signal(signal.SIGKILL)
        await async_wait_until(  # restarted once ...
            lambda: restarts._value.get() == 1 and batcher.failed is None, timeout=120, message="the first restart"
        )
        [vector] = await batcher.submit_many([[1, 2]])
        assert (await vector.result_future).tokens == 2
        [second] = my_cores()
        second.send_signal(signal.SIGKILL)
        # ... not twice: the model stays unavailable, and says why (decided as the death is seen)
        await async_wait_until(lambda: batcher.failed is not None, message="the second death to be seen")
        assert "not restarted: 1 restarts in the last 300 s" in batcher.failed
        assert not batcher.restarting and my_cores() == []
        assert restarts._value.get() == 1
        await batcher.stop()

    asyncio.run(scenario())


# -- structured output with the real tiny chat in a core ------------------------------------------
@pytest.mark.model
def test_schemas_and_forced_tool_calls_cross_to_a_real_engine_core():
    """The schema text crosses in the Submit and is compiled in the core before its prompt
    is queued; the front end compiles it too, so a bad one is a 422 before the core."""
    import jsonschema

    from tests.gateway.routes.test_chat_structured import DOCK, MAX_TOKENS, SHIP, WEATHER, fmt

    args = ("--engine-cores", "--embedding-model", "none", "--chat-model", "tiny", "--max-wait-ms", "5")
    gw = GatewayProcess("--admin-token", "t", *args, env={"FERRY_FAKE_ENGINES": "0"}, ready_timeout=300)
    with whole_tree_killed(gw):
        conv = [{"role": "user", "content": "Describe a ferry as JSON."}]
        body = {"model": "ferry-tiny-chat", "messages": [conv, conv, conv], "max_tokens": MAX_TOKENS, "seed": 3}
        body["response_format"] = [fmt(SHIP), fmt(DOCK, "dock"), None]
        r = httpx.post(gw.url + CHAT, json=body, timeout=300)
        assert r.status_code == 200, r.text
        ship, dock, free = r.json()["choices"]
        jsonschema.validate(json.loads(ship["message"]["content"]), SHIP)
        jsonschema.validate(json.loads(dock["message"]["content"]), DOCK)
        assert free["finish_reason"] in ("stop", "length")

        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        choice = {"model": "ferry-tiny-chat", "messages": conv, "tools": [WEATHER], "tool_choice": "required"}
        choice["seed"] = 1
        whole = c.chat.completions.create(**choice, max_tokens=MAX_TOKENS).choices[0]
        assert whole.finish_reason == "tool_calls"
        (call,) = whole.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        streamed = "".join(
            tc.function.arguments or ""
            for ch in c.chat.completions.create(**choice, max_tokens=MAX_TOKENS, stream=True)
            for tc in ch.choices[0].delta.tool_calls or []
        )
        assert streamed == call.function.arguments

        bad = httpx.post(
            gw.url + CHAT,
            json={"model": "ferry-tiny-chat", "messages": conv, "response_format": fmt({"type": "array", "not": {}})},
            timeout=60,
        )
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_schema"
