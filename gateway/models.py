"""The models a gateway serves: each an engine, its worker thread and its batcher."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from batcher.core import QueueingBatcher
from batcher.cost import CostModel
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher, split_on_oom
from batcher.runner import ThreadRunner

from .config import ServerConfig

log = logging.getLogger("ferry.gateway")

EMBEDDING, CHAT = "embedding", "chat"


@dataclass
class ModelSpec:
    """How to load one model. `load` runs on a worker thread and returns an engine."""

    kind: str
    load: Callable[[], Any]
    settings: dict[str, Any] = field(default_factory=dict)  # per-model overrides


@dataclass
class ServedModel:
    name: str
    kind: str
    engine: Any
    batcher: QueueingBatcher
    runner: ThreadRunner
    created: int = field(default_factory=lambda: int(time.time()))


def default_specs(cfg: ServerConfig) -> list[ModelSpec]:
    specs = []
    if cfg.embedding_model != "none":
        def load_embeddings():
            from engine.embeddings import HFEmbeddingEngine

            path = None if cfg.embedding_model == "default" else cfg.embedding_model
            return HFEmbeddingEngine(path, device=cfg.device, dtype=cfg.dtype, torch_threads=cfg.torch_threads)

        specs.append(ModelSpec(EMBEDDING, load_embeddings))
    if cfg.chat_model != "none":
        def load_chat():
            from engine.generation import HFGenerationEngine

            if cfg.chat_model == "default":
                return HFGenerationEngine.tiny_default(device=cfg.device, dtype=cfg.dtype, torch_threads=cfg.torch_threads,
                                                       max_running=cfg.max_running)
            return HFGenerationEngine(cfg.chat_model, device=cfg.device, dtype=cfg.dtype, torch_threads=cfg.torch_threads,
                                      max_running=cfg.max_running)

        specs.append(ModelSpec(CHAT, load_chat))
    return specs


async def start_model(spec: ModelSpec, cfg: ServerConfig, metrics: Metrics) -> ServedModel:
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(None, spec.load)
    runner = ThreadRunner(engine.name)
    settings = cfg.batching_settings(**spec.settings)
    if spec.kind == EMBEDDING:
        cost = CostModel()
        if cfg.warmup and hasattr(engine, "warmup"):
            for items, tokens, seconds in await runner(engine.warmup):
                cost.observe(items, tokens, seconds)
            cost.refit()
        from engine.device import is_oom

        async def execute(payloads: list[Any]) -> list[Any]:
            return await runner(engine.embed, payloads)

        batcher: QueueingBatcher = MicroBatcher(engine.name, split_on_oom(execute, is_oom), settings, cost=cost,
                                                metrics=metrics, phase="embed")
    else:
        from batcher.scheduler import GenerationScheduler

        batcher = GenerationScheduler(engine.name, engine, runner, settings, metrics=metrics)
        if cfg.warmup:
            await batcher.warmup()
    await batcher.start()
    log.info("serving %s model %s", spec.kind, engine.name)
    return ServedModel(engine.name, spec.kind, engine, batcher, runner)
