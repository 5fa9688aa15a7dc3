"""Embedded mode: `with Ferry(...) as ferry` starts a gateway in this process and leaves
nothing behind (no thread, no child process, no listening port)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading

import pytest

from engine.fake import FakeGenerationEngine
from ferry_client import AuthenticationError, FerryClient
from gateway import Ferry
from gateway.embedded import resolve_models

from ..conftest import fake_specs

CONV = [{"role": "user", "content": "hello"}]


def child_pids() -> set[int]:
    """Processes whose parent is this one (Linux /proc)."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(entry))
    return out


def assert_port_free(port: int) -> None:
    with socket.socket() as probe:  # nobody accepts connections there ...
        probe.settimeout(2)
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    with socket.socket() as sock:  # ... and a new server can listen on it at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def new_threads(before: list[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before]


def test_embedded_starts_serves_and_leaves_nothing_behind():
    threads, children = threading.enumerate(), child_pids()
    with Ferry(specs=fake_specs(), warmup=False, max_batch_size=16, max_wait_ms=20) as ferry:
        assert ferry.running and set(ferry.models) == {"fake-chat", "fake-embed"}
        assert ferry.url == f"http://127.0.0.1:{ferry.port}" and ferry.port > 0
        assert ferry.state.models["fake-embed"].batcher.settings.max_batch_size == 16  # settings reach the batcher
        client = ferry.client()
        a, b = client.chat("fake-chat", [CONV, CONV], max_completion_tokens=[1, 3])
        assert (a.text, b.text) == ("w0 ", "w0 w1 w2 ")
        assert client.embed("fake-embed", ["x", "y"]) == [
            client.embed("fake-embed", "x"),
            client.embed("fake-embed", "y"),
        ]
        port = ferry.port
    assert not ferry.running and client.closed
    assert new_threads(threads) == []
    assert child_pids() == children
    assert_port_free(port)


def test_given_port_and_taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    threads = threading.enumerate()
    with Ferry(specs=fake_specs(), warmup=False, port=port) as ferry:
        assert ferry.port == port and ferry.client().ready()
        with pytest.raises(OSError, match=str(port)):  # a second gateway on the same port fails at once
            Ferry(specs=fake_specs(), warmup=False, port=port).start()
    assert new_threads(threads) == []
    assert_port_free(port)


def test_an_exception_in_the_block_still_stops_cleanly():
    threads = threading.enumerate()
    with pytest.raises(KeyError), Ferry(specs=fake_specs(), warmup=False) as ferry:
        port = ferry.port
        raise KeyError("boom")
    assert new_threads(threads) == []
    assert_port_free(port)


def test_stop_waits_for_a_stream_in_flight_to_end():
    engine = FakeGenerationEngine(step_delay=0.005)
    threads = threading.enumerate()
    with Ferry(specs=fake_specs(chat=engine), warmup=False) as ferry:
        stream = ferry.client().chat("fake-chat", CONV, max_tokens=50, stream=True)
        next(iter(stream))
    # Leaving the block closed the client, so the server cancelled the sequence and stopped.
    assert engine.running == 0
    assert new_threads(threads) == []


def test_api_key_setting_is_used_by_its_clients():
    with Ferry(specs=fake_specs(), warmup=False, api_key="sesame") as ferry:
        assert ferry.client().chat("fake-chat", CONV, max_tokens=1).text == "w0 "
        with FerryClient(ferry.url) as anonymous, pytest.raises(AuthenticationError):
            anonymous.chat("fake-chat", CONV)


def test_async_context_and_async_client():
    threads = threading.enumerate()

    async def main():
        async with Ferry(specs=fake_specs(), warmup=False) as ferry, ferry.async_client() as client:
            responses = await client.chat("fake-chat", [CONV, CONV, CONV], max_tokens=[3, 1, 2])
            return [r.text for r in responses], ferry.port

    texts, port = asyncio.run(main())
    assert texts == ["w0 w1 w2 ", "w0 ", "w0 w1 "]
    assert new_threads(threads) == []
    assert_port_free(port)


def test_bad_settings_fail_before_starting():
    with pytest.raises(TypeError, match="max_batch"):
        Ferry(specs=fake_specs(), max_batch=4)
    with pytest.raises(ValueError, match="max-batch-size"):
        Ferry(specs=fake_specs(), max_batch_size=0)
    with pytest.raises(RuntimeError, match="not running"):
        Ferry(specs=fake_specs()).client()


def test_models_argument():
    assert resolve_models(None) == ("default", "default")
    assert resolve_models(["embeddings", "chat"]) == ("default", "default")
    assert resolve_models(["embeddings"]) == ("default", "none")
    assert resolve_models("chat") == ("none", "default")
    assert resolve_models(["sentence-transformers/all-MiniLM-L6-v2", "ferry-tiny-chat"]) == ("default", "tiny")
    assert resolve_models(["HuggingFaceTB/SmolLM2-135M-Instruct"]) == ("none", "default")
    assert resolve_models(["chat:tiny"]) == resolve_models(["chat:ferry-tiny-chat"]) == ("none", "tiny")
    # A built-in name stands for the built-in model only under its own kind.
    assert resolve_models(["chat:sentence-transformers/all-MiniLM-L6-v2"]) == (
        "none",
        "sentence-transformers/all-MiniLM-L6-v2",
    )
    assert resolve_models(["chat:/models/llama", "embeddings:BAAI/bge-small"]) == ("BAAI/bge-small", "/models/llama")
    assert resolve_models({"chat": "/models/llama"}) == ("none", "/models/llama")
    with pytest.raises(ValueError, match="two chat models"):
        resolve_models(["chat", "chat:/models/llama"])
    with pytest.raises(ValueError, match="chat:/no/such/model"):
        resolve_models(["/no/such/model"])


def test_models_argument_reads_the_kind_of_a_local_model(tmp_path):
    llama, bert = tmp_path / "llama", tmp_path / "bert"
    for path, arch in ((llama, "LlamaForCausalLM"), (bert, "BertModel")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    assert resolve_models([str(llama), str(bert)]) == (str(bert), str(llama))
    with pytest.raises(ValueError, match="embeddings:"):
        resolve_models([str(tmp_path)])  # a directory without config.json


def test_a_model_that_fails_to_load_raises_and_cleans_up():
    from gateway.models.catalogue import ModelSpec
    from gateway.models.kinds import CHAT

    def broken():
        raise RuntimeError("weights missing")

    threads = threading.enumerate()
    with pytest.raises(RuntimeError, match="weights missing"), Ferry(specs=[ModelSpec(CHAT, broken)], warmup=False):
        pass
    assert new_threads(threads) == []


def test_api_workers_start_and_stop_the_whole_set_of_processes(monkeypatch, tmp_path):
    import psutil

    from tests.waiting import wait_until

    monkeypatch.setenv("FERRY_FAKE_ENGINES", "1")  # read by the cores and front ends (they inherit it)
    threads, children = threading.enumerate(), child_pids()
    with Ferry(api_workers=2, warmup=False, data_dir=tmp_path) as ferry:
        assert ferry.running and ferry.state is None and set(ferry.models) == {"fake-embed", "fake-chat"}
        started = [psutil.Process(p) for p in child_pids() - children]
        ours = [p for p in started if "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's own
        assert len(ours) == 4  # two engine cores, two front ends
        vectors = ferry.client().embed("fake-embed", ["hello", "ferry"], numpy=True)
        assert vectors.shape == (2, 8)
        port = ferry.port
    assert not ferry.running
    wait_until(
        lambda: all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in ours),
        message="every process of the Ferry to exit",
    )
    assert_port_free(port)
    assert new_threads(threads) == []


def test_a_custom_model_from_a_config_file_is_served_and_called_by_both_clients(tmp_path):
    from ferry_client import BadRequest, NotFound

    config = tmp_path / "custom.yaml"
    config.write_text(
        "models:\n  - name: shout\n    kind: custom\n    source: engine.fake:FakeCustomModel\n    device: cpu\n"
    )
    before = child_pids()
    with Ferry(config=str(config)) as ferry:
        client = ferry.client()
        assert ferry.models == ["shout"]
        out = client.infer("shout", {"text": ["ab", "cde"], "vector": [[1, 2], [3, 4]]}, priority="batch")
        assert out == {"length": [2, 3], "sum": [3.0, 7.0], "upper": ["AB", "CDE"]}
        one = client.infer("shout", {"text": "hi", "vector": [0.5, 0.25]}, outputs=["sum"], numpy=True)
        assert one["sum"].dtype == "float32" and float(one["sum"]) == 0.75
        with pytest.raises(BadRequest, match="FP32 data are numbers"):  # the server's 400, typed
            client.infer("shout", {"text": ["x"], "vector": [["not a number"]]})
        with pytest.raises(ValueError, match="takes inputs"):  # caught before sending
            client.infer("shout", {"text": ["x"]})
        with pytest.raises(NotFound):
            client.infer("nobody", {"text": ["x"]})

        async def call() -> dict:
            async with ferry.async_client() as a:
                return await a.infer("shout", {"text": ["async"], "vector": [[1.0]]}, latency_budget_ms=5000)

        assert asyncio.run(call())["upper"] == ["ASYNC"]
    assert child_pids() - before == set()  # its engine core exited with it
