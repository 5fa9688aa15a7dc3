"""Every surface of the knobs lists exactly the declared ones (batcher/settings.py,
gateway/config.py): the `ferry serve` flags, the FERRY_* environment, ServerConfig, the admin
PATCH body and GET answer, /openapi.json and the docs' tables."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from batcher.knobs import Knob
from gateway import settings_docs
from gateway.config import BATCHING_KNOBS, OPTIONS, SERVER_KNOBS, ServerConfig, from_args, parser
from gateway.openapi import build
from gateway.routes.admin import BatchingPatch, BatchingSettingsOut

KNOBS = list(OPTIONS.values())
LIVE = {k.name for k in BATCHING_KNOBS if k.live}
# Names that scripts, tests and docs already use: the declaration must keep them.
EXISTING_FLAGS = {
    "--host",
    "--port",
    "--embedding-model",
    "--chat-model",
    "--device",
    "--dtype",
    "--torch-threads",
    "--torchscript",
    "--packed-embeddings",
    "--prepacked-linears",
    "--native-attention",
    "--max-batch-size",
    "--max-wait-ms",
    "--max-queue",
    "--policy",
    "--default-budget-ms",
    "--on-infeasible",
    "--interactive-first",
    "--batching",
    "--max-running",
    "--max-itl-ms",
    "--prefill-token-budget",
    "--admin-token",
    "--api-key",
    "--max-body-bytes",
    "--max-inputs",
    "--max-prompts",
    "--max-prompt-tokens",
    "--max-completion-tokens",
    "--max-stop-strings",
    "--max-streams",
    "--drain-timeout",
    "--engine-timeout",
    "--log-prompts",
    "--warmup",
    "--data-dir",
    "--fairness",
    "--tenant-source",
}
EXISTING_PATCH_FIELDS = {
    "max_batch_size",
    "max_wait_ms",
    "policy",
    "max_queue",
    "default_budget_ms",
    "max_itl_ms",
    "max_running",
    "max_batch_tokens",
    "fairness",
    "fair_input_weight",
    "fair_output_weight",
    "fair_hold_margin",
    "group_by_length",
    "on_infeasible",
    "aging_ms",
    "interactive_first",
    "interactive_lane",
}


def serve_actions() -> list[argparse.Action]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["serve"]._actions if a.dest != "help"]


def sample(k: Knob) -> tuple[str, Any]:
    """A valid value other than the default: as a flag or variable would spell it, and parsed."""
    if k.kind is bool:
        return ("0", False) if k.default else ("yes", True)
    if k.kind is list:
        return "key-a, key-b", ["key-a", "key-b"]
    if k.nullable and k.default is not None:
        return "none", None
    if k.choices:
        other = next(c for c in k.choices if c != k.default)
        return other, other
    if k.kind in (int, float):
        value = k.kind((k.default or k.bounds.get("ge", k.bounds.get("gt", 0))) + 1)
        return str(value), value
    if k.option == "config":  # read at start: a file that is there and valid
        path = str(settings_docs.ROOT / "docs/examples/ferry.yaml")
        return path, path
    if k.option == "kv_events_config":  # read at start: vLLM's JSON
        text = '{"enable_kv_cache_events": false}'
        return text, text
    return "somewhere-else", "somewhere-else"


@pytest.fixture
def clean_env(monkeypatch):
    for k in KNOBS:
        monkeypatch.delenv(k.env, raising=False)
    return monkeypatch


def test_the_flags_are_the_declared_knobs(clean_env):
    actions = serve_actions()
    assert [a.dest for a in actions] == list(OPTIONS)
    flags = {s for a in actions for s in a.option_strings}
    declared = {k.flag for k in KNOBS} | {"--no-" + k.flag[2:] for k in KNOBS if k.kind is bool}
    assert flags == declared
    assert flags >= EXISTING_FLAGS
    assert OPTIONS["batching"].name == "mode"  # --batching sets the setting `mode`
    for a in actions:
        assert a.help and a.help.endswith(f"(env {OPTIONS[a.dest].env})"), a.dest


def test_serverconfig_has_one_field_per_knob_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    assert list(fields) == list(OPTIONS)
    cfg = ServerConfig()
    for name, k in OPTIONS.items():
        assert getattr(cfg, name) == k.default, name
    assert cfg.batching_settings().to_dict() == {k.name: k.default for k in BATCHING_KNOBS}
    assert ServerConfig(batching="static").batching_settings().mode == "static"
    assert ServerConfig(max_batch_size=4).batching_settings(max_batch_size=8).max_batch_size == 8  # per-model override


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.env)
def test_every_knob_is_read_from_its_environment_variable(clean_env, knob):
    text, value = sample(knob)
    clean_env.setenv(knob.env, text)
    if knob.option == "served_model_name":  # it names one model: serve one
        clean_env.setenv("FERRY_EMBEDDING_MODEL", "none")
    _, cfg = from_args(["serve"])
    assert getattr(cfg, knob.option) == value
    assert knob.env == "FERRY_" + knob.option.upper()


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.kind is not bool], ids=lambda k: k.flag)
def test_every_knob_is_read_from_its_flag(clean_env, knob):
    text, value = sample(knob)
    one_model = ["--embedding-model", "none"] if knob.option == "served_model_name" else []
    _, cfg = from_args(["serve", knob.flag, text, *one_model])
    assert getattr(cfg, knob.option) == value


def test_a_flag_wins_over_the_environment(clean_env):
    clean_env.setenv("FERRY_MAX_WAIT_MS", "2")
    clean_env.setenv("FERRY_BATCHING", "static")
    clean_env.setenv("FERRY_API_KEYS", "a,b")
    _, cfg = from_args(["serve", "--max-wait-ms", "3", "--api-key", "c"])
    assert (cfg.max_wait_ms, cfg.batching, cfg.api_keys) == (3.0, "static", ["a", "b", "c"])
    assert cfg.batching_settings().mode == "static"


def bad(k: Knob) -> str | None:
    if k.choices:
        return "nope"
    if "ge" in k.bounds:
        return str(k.bounds["ge"] - 1)
    if "gt" in k.bounds:
        return str(k.bounds["gt"])
    return None


@pytest.mark.parametrize("knob", [k for k in KNOBS if bad(k) is not None], ids=lambda k: k.flag)
def test_a_bad_setting_fails_at_start_naming_the_flag(clean_env, knob):
    with pytest.raises(SystemExit) as info:
        from_args(["serve", knob.flag, bad(knob)])
    assert str(info.value) == f"ferry: invalid {knob.flag}: {knob.requirement}"


def test_bad_settings_name_their_flag_in_the_messages_operators_know(clean_env, capsys):
    def fail(*argv: str) -> str:
        with pytest.raises(SystemExit) as info:
            from_args(["serve", *argv])
        return str(info.value)

    assert fail("--batching", "dynamic") == "ferry: invalid --batching: must be one of continuous, static"
    assert fail("--max-batch-size", "0") == "ferry: invalid --max-batch-size: must be an integer between 1 and 1000000"
    assert fail("--max-body-bytes", "0") == "ferry: invalid --max-body-bytes: must be at least 1"
    assert fail("--drain-timeout", "0") == "ferry: invalid --drain-timeout: must be a number of seconds above 0"
    assert fail("--port", "70000").startswith("ferry: invalid --port")
    assert fail("--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}').startswith(
        "ferry: invalid --kv-events-config: kv_events_config: publisher"
    )
    assert fail("--kv-events-config", "{not json").startswith("ferry: invalid --kv-events-config")
    assert (
        fail("--embedding-model", "none", "--chat-model", "none")
        == "ferry: nothing to serve: both --embedding-model and --chat-model are 'none'"
    )
    with pytest.raises(SystemExit):  # not a number at all: argparse says which flag and what it takes
        from_args(["serve", "--max-wait-ms", "soon"])
    assert "argument --max-wait-ms: must be a number of milliseconds" in capsys.readouterr().err
    clean_env.setenv("FERRY_MAX_QUEUE", "many")
    assert fail() == "ferry: invalid FERRY_MAX_QUEUE='many': must be an integer between 1 and 1000000"


def test_the_patch_body_takes_the_live_knobs_and_null_only_where_declared():
    assert set(BatchingPatch.model_fields) == LIVE == EXISTING_PATCH_FIELDS
    assert BatchingPatch.model_validate({}).model_dump(exclude_unset=True) == {}  # absent: unchanged
    by_name = {k.name: k for k in BATCHING_KNOBS}
    for name in LIVE:
        k = by_name[name]
        if k.nullable:
            assert BatchingPatch.model_validate({name: None}).model_dump(exclude_unset=True) == {name: None}
        else:
            with pytest.raises(ValidationError):
                BatchingPatch.model_validate({name: None})
        if bad(k) is not None:
            with pytest.raises(ValidationError):
                BatchingPatch.model_validate({name: k.kind(bad(k)) if not k.choices else bad(k)})
    assert BatchingPatch.model_validate({"max_batch_size": 2.0}).max_batch_size == 2  # JSON's 2.0 is an integer
    for value in (True, "8"):
        with pytest.raises(ValidationError):
            BatchingPatch.model_validate({"max_batch_size": value})
    for name in {k.name for k in BATCHING_KNOBS} - LIVE:
        with pytest.raises(ValidationError):
            BatchingPatch.model_validate({name: by_name[name].default})


def test_the_openapi_admin_bodies_are_the_declared_knobs():
    schemas = build()["components"]["schemas"]
    patch, out = schemas["BatchingPatch"], schemas["BatchingSettingsOut"]
    assert set(patch["properties"]) == LIVE and patch["additionalProperties"] is False
    assert list(out["properties"]) == [k.name for k in BATCHING_KNOBS] + ["cost_model"]
    assert set(out["required"]) == {k.name for k in BATCHING_KNOBS}
    for k in BATCHING_KNOBS:
        assert out["properties"][k.name]["description"].startswith(k.help)
        if k.live:
            prop = patch["properties"][k.name]
            assert prop["description"].startswith(k.help)
            assert ("default" in prop) == k.nullable  # `default: null` only where null is accepted
    assert set(BatchingSettingsOut.model_fields) == {k.name for k in BATCHING_KNOBS} | {"cost_model"}


def test_the_admin_get_answers_every_declared_knob_and_patch_the_live_ones(fake_server_factory):
    s = fake_server_factory(admin_token="admin-secret", aging_ms=500, batching="static")
    h = {"Authorization": "Bearer admin-secret"}
    url = s.url + "/admin/models/fake-chat/batching"
    got = httpx.get(url, headers=h).json()
    assert list(got) == [k.name for k in BATCHING_KNOBS] + ["cost_model"]
    assert (got["aging_ms"], got["mode"]) == (500, "static")  # from the flags of the same names
    r = httpx.patch(url, json={"max_itl_ms": 40, "default_budget_ms": None}, headers=h)
    assert r.status_code == 200 and list(r.json()) == [k.name for k in BATCHING_KNOBS]
    assert (r.json()["max_itl_ms"], r.json()["default_budget_ms"]) == (40, None)
    for name in {k.name for k in BATCHING_KNOBS} - LIVE:
        r = httpx.patch(url, json={name: got[name]}, headers=h)
        assert r.status_code == 422 and r.json()["error"]["param"] == name
    r = httpx.patch(url, json={"max_queue": None}, headers=h)
    assert r.status_code == 422 and r.json()["error"]["param"] == "max_queue"


def table_rows(path: str, marker: str) -> list[list[str]]:
    text = (settings_docs.ROOT / path).read_text()
    block = text.split(f"<!-- knobs {marker}")[1].split("<!-- end knobs -->")[0]
    rows = [line.strip("|").split(" | ") for line in block.splitlines()[1:] if line.startswith("|")]
    return [[cell.strip().strip("`") for cell in row] for row in rows[2:]]


def test_the_docs_tables_are_the_declarations():
    assert settings_docs.outdated() == [], "run: python -m gateway.settings_docs"
    batching = table_rows("docs/settings.md", "batching")
    assert [(r[0], r[1], r[2], r[5]) for r in batching] == [
        (k.name, k.flag, k.env, "yes" if k.live else "no") for k in BATCHING_KNOBS
    ]
    server = table_rows("docs/settings.md", "server")
    assert [(r[0], r[1]) for r in server] == [(k.flag, k.env) for k in SERVER_KNOBS]
    readme = table_rows("README.md", "main")
    assert {r[0] for r in readme} <= {k.flag for k in KNOBS}


def test_a_changed_declaration_makes_the_docs_check_fail(tmp_path):
    for name in settings_docs.FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        text = (settings_docs.ROOT / name).read_text()
        (tmp_path / name).write_text(re.sub(r"\| 1024 \|", "| 512 |", text, count=1))
    assert "docs/settings.md" in settings_docs.outdated(tmp_path)


def test_serve_help_prints_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--max-batch-tokens" in out and "99%" in out
