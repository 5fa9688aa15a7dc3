from __future__ import annotations

import os
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

# Before the imports below: huggingface_hub, tokenizers and OpenMP read these when they load.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.fake import FakeEmbeddingEngine, FakeGenerationEngine
from gateway.app import create_app
from gateway.config import ServerConfig
from gateway.metrics.registry import GatewayMetrics
from gateway.models.catalogue import ModelSpec
from gateway.models.kinds import CHAT, CUSTOM, EMBEDDING

from .live import live


def fake_specs(
    embed: FakeEmbeddingEngine | None = None, chat: FakeGenerationEngine | None = None, custom: Any = None
) -> list[ModelSpec]:
    """The fake embeddings and chat engines, and a custom model (a class instance, served as
    "fake-custom") when given one."""
    embed = embed or FakeEmbeddingEngine()
    chat = chat or FakeGenerationEngine()
    specs = [ModelSpec(EMBEDDING, lambda: embed), ModelSpec(CHAT, lambda: chat)]
    if custom is not None:
        specs.append(custom_model_spec(custom))
    return specs


def custom_model_spec(model: Any, name: str = "fake-custom", **settings: Any) -> ModelSpec:
    """A spec serving the instance `model` (engine/custom.py's contract) as `name`."""
    from engine.custom import CustomEngine, Tensor

    def load() -> CustomEngine:
        model.load(device="cpu", dtype="auto")
        return CustomEngine(model, name, [Tensor.of(t) for t in model.inputs], [Tensor.of(t) for t in model.outputs])

    return ModelSpec(CUSTOM, load, settings, source=name, name=name)


def fake_app(embed=None, chat=None, custom=None, **config):
    config.setdefault("warmup", False)
    cfg = ServerConfig(**config)
    return create_app(cfg, fake_specs(embed, chat, custom), GatewayMetrics(CollectorRegistry()))


@pytest.fixture
def fake_server_factory():
    """Start a gateway over fake engines on a real socket; stopped at test end."""
    stack = []

    def start(embed=None, chat=None, custom=None, **config):
        cm = live(fake_app(embed, chat, custom, **config))
        server = cm.__enter__()
        stack.append(cm)
        return server

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def real_server():
    """The default embeddings model and ferry-tiny-chat, loaded once per test session."""
    # A KV budget of two full contexts of the tiny model (4,096 tokens): tests that fill it see preemption.
    cfg = ServerConfig(admin_token="admin-secret", max_wait_ms=5.0, kv_cache_mb=32, chat_model="tiny")
    app = create_app(cfg, metrics=GatewayMetrics(CollectorRegistry()))
    with live(app, ready_timeout=300) as server:
        yield server
