"""The shipped EndpointPickerConfig's `engineConfigs` entry `ferry`, applied to a live replica's
/metrics as the endpoint picker applies it: each spec (queued requests, running requests, KV-cache
usage) finds its series, a gauge, and reads what the replica is doing. The replica is a real
uvicorn on 127.0.0.1 over fake engines that carry the model names of the shipped config file."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.fake import FakeEmbeddingEngine, FakeGenerationEngine
from gateway.app import create_app
from gateway.config import ServerConfig
from gateway.metrics.registry import GatewayMetrics
from gateway.models.catalogue import ModelSpec
from gateway.models.kinds import CHAT, EMBEDDING

from ..live import live
from ..waiting import wait_until
from .manifests import config_file, epp_config, parse_spec, render

SPECS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")


def _ferry_engine_config(docs) -> dict[str, str]:
    extractor = next(p for p in epp_config(docs)["plugins"] if p["type"] == "core-metrics-extractor")
    return next(e for e in extractor["parameters"]["engineConfigs"] if e["name"] == "ferry")


def _families(docs) -> set[str]:
    """The families the picker's metrics-data-source keeps of a scrape (it drops the rest)."""
    source = next(p for p in epp_config(docs)["plugins"] if p["type"] == "metrics-data-source")
    return set(source["parameters"]["families"])


def _pick(metrics_text: str, spec: str, families: set[str]) -> tuple[str, float]:
    """What the picker reads for `spec`: the type and value of the first series whose name is the
    spec's and whose labels include the spec's (the picker takes one matching series), among the
    families its data source keeps."""
    name, labels = parse_spec(spec)
    kept = (f for f in text_string_to_metric_families(metrics_text) if f.name in families)
    for family in kept:
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return family.type, sample.value
    raise AssertionError(f"no series for {spec}")


def _models(docs) -> dict[str, str]:
    return {m["kind"]: m["name"] for m in yaml.safe_load(config_file(docs)[1])["models"]}


def test_every_engine_config_spec_finds_its_series_on_a_live_replica():
    docs = render("base")
    specs = _ferry_engine_config(docs)
    families = _families(docs)
    names = _models(docs)
    # One running sequence at most and slow steps: later requests wait in the queue.
    chat = FakeGenerationEngine(name=names["chat"], step_delay=0.02)
    embed = FakeEmbeddingEngine(name=names["embeddings"])
    cfg = ServerConfig(warmup=False, max_running=1, default_budget_ms=None)
    specs_ = [ModelSpec(EMBEDDING, lambda: embed), ModelSpec(CHAT, lambda: chat)]
    app = create_app(cfg, specs_, GatewayMetrics(CollectorRegistry()))
    with live(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        idle = client.get("/metrics").text
        for key in SPECS:
            kind, value = _pick(idle, specs[key], families)
            assert kind == "gauge", f"{specs[key]} is a {kind}: the picker reads gauges"
            assert value == 0, f"{specs[key]} reads {value} on an idle replica"

        body: dict[str, Any] = {
            "model": names["chat"],
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 40,
        }
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(client.post, "/v1/chat/completions", json=body) for _ in range(3)]
            seen: dict[str, float] = {}

            def busy() -> bool:
                text = client.get("/metrics").text
                seen.update({key: _pick(text, specs[key], families)[1] for key in SPECS})
                # The KV share follows the running count once the engine has prefilled the sequence.
                return seen["queuedRequestsSpec"] >= 1 and seen["runningRequestsSpec"] == 1 and seen["kvUsageSpec"] > 0

            wait_until(
                busy, timeout=30, interval=0.01, message=lambda: f"one running, one queued, KV in use (read: {seen})"
            )
            assert seen["kvUsageSpec"] <= 1, seen
            assert all(a.result(timeout=60).status_code == 200 for a in answers)
