"""Starts a model in this process: its engine (loaded on a worker thread), its engine thread
and its batcher, served as a `LocalBatcher`. An engine core starts its model so too."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from batcher.cost import CostModel
from batcher.engine_thread import EngineThread
from batcher.isolation import split_in_halves
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher
from batcher.protocols import Execute
from batcher.queueing import QueueingBatcher
from batcher.settings import BatchingSettings
from engine.base import EmbeddingEngine, GenerationEngine

from ..config import ServerConfig
from ..tenancy import Tenancy
from .catalogue import ModelSpec
from .kinds import CUSTOM, EMBEDDING, ModelKind
from .served import LocalBatcher, ServedBatcher

log = logging.getLogger("ferry.gateway")

# The engine a served model runs: an EmbeddingEngine for EMBEDDING, a GenerationEngine for CHAT.
E = TypeVar("E", bound=EmbeddingEngine | GenerationEngine, covariant=True)


# The engine's worker thread hands every batch (every decode step, for generation) back to
# the event loop and waits for the next one. With CPython's default 5 ms switch interval
# the worker then waits for the GIL while the loop writes stream events: measured 5.2 ms
# per decode iteration at 48 req/s of streaming chat, 1.1 ms at 0.5 ms (docs/benchmarks.md).
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass
class ServedModel(Generic[E]):
    name: str
    kind: ModelKind
    engine: E
    batcher: ServedBatcher
    engine_thread: EngineThread | None  # None: the engine runs in an engine core
    created: int = field(default_factory=lambda: int(time.time()))


def _thread_setup(cfg: ServerConfig):
    """Torch's intra-op thread count is per OS thread under OpenMP: set it on the worker."""

    def setup() -> None:
        import sys

        if "torch" in sys.modules:
            from engine.device import configure_threads

            configure_threads(cfg.torch_threads or 1)

    return setup


# The niceness of an embeddings model's main engine thread: its batches (batch-class work
# most of the time) yield the cores to the interactive lane's thread, the event loops and the
# front ends. On 2 vCPUs at 200% load, interactive requests on time went from 87-97% to
# 96-100% with it (docs/benchmarks-history.md, "The interactive lane").
BATCH_THREAD_NICE = 10


# The interactive lane's thread ahead of the other processes on the machine (the front ends,
# a load generator), where the process may raise a priority (CAP_SYS_NICE, as root in a
# container); elsewhere it stays at the process's own. At 200% load its queue wait p99 fell
# from 38-75 ms to 22-48 ms (docs/benchmarks-history.md, "The interactive lane").
LANE_THREAD_NICE = -5


async def start_model(spec: ModelSpec, cfg: ServerConfig, metrics: Metrics) -> ServedModel[Any]:
    """Serve `spec` from this process."""
    served, _ = await start_local(spec, cfg, metrics)
    return served


async def start_local(spec: ModelSpec, cfg: ServerConfig, metrics: Metrics) -> tuple[ServedModel[Any], QueueingBatcher]:
    """Load and start `spec` here; returns the served model and its batcher itself (which
    an engine core serves to its front ends)."""
    loop = asyncio.get_running_loop()
    began = time.perf_counter()
    engine = await loop.run_in_executor(None, spec.load)
    loaded = time.perf_counter()
    engine_thread = EngineThread(
        engine.name,
        timeout=cfg.engine_timeout,
        initializer=_thread_setup(cfg),
        replace_on_timeout=spec.kind == EMBEDDING,
        # Embeddings (and a custom model with a lane): the thread of the batches the lane runs
        # beside yields the cores to it.
        nice=BATCH_THREAD_NICE if spec.kind == EMBEDDING or getattr(engine, "thread_safe", False) else 0,
    )
    settings = cfg.batching_settings(**spec.settings)
    # The spec's kind says which engine its `load` returns.
    if spec.kind == EMBEDDING:
        batcher = await _embedding_batcher(cast(EmbeddingEngine, engine), engine_thread, settings, cfg, metrics)
    elif spec.kind == CUSTOM:
        batcher = _custom_batcher(engine, engine_thread, settings, metrics)
    else:
        batcher = await _generation_batcher(cast(GenerationEngine, engine), engine_thread, settings, cfg, metrics)
    tenancy = Tenancy.of(cfg)  # fair shares: the config file's weights and quotas (gateway/tenancy.py)
    batcher.set_tenants(tenancy.policies)
    metrics.tenant_labels.named.update(tenancy.named)
    await batcher.start()
    # What start-up costs, step by step: an operator waiting on /readyz sees where it goes.
    log.info(
        "serving %s model %s (libraries, weights and kernels %.1f s, warm-up %.1f s)",
        spec.kind,
        engine.name,
        loaded - began,
        time.perf_counter() - loaded,
    )
    return ServedModel(engine.name, spec.kind, engine, LocalBatcher(batcher), engine_thread), batcher


async def _embedding_batcher(
    engine: EmbeddingEngine,
    engine_thread: EngineThread,
    settings: BatchingSettings,
    cfg: ServerConfig,
    metrics: Metrics,
) -> QueueingBatcher:
    cost = CostModel(quadratic=True)  # attention grows with length squared: long inputs are costed so
    if cfg.warmup and hasattr(engine, "warmup"):
        cost.seed(await engine_thread(engine.warmup))
    from engine.device import is_oom

    def embed(payloads: list[Any]) -> list[Any]:
        # A batch that runs out of memory is retried by halves until the input that
        # fails alone is found; only that input fails.
        return split_in_halves(engine.embed, payloads, retry_if=is_oom)

    async def execute(payloads: list[Any]) -> list[Any]:
        return await engine_thread(embed, payloads)

    execute_lane, execute_beside = _threads_beside(engine_thread, embed)
    return MicroBatcher(
        engine.name,
        execute,
        settings,
        cost=cost,
        metrics=metrics,
        phase="embed",
        execute_lane=execute_lane,
        execute_beside=execute_beside,
        pads=lambda: not getattr(engine, "packed", False),  # packing may stop at run time
    )


def _threads_beside(engine_thread: EngineThread, fn: Callable[[list[Any]], list[Any]]) -> tuple[Execute, Execute]:
    """Two more worker threads on the same engine (a forward only reads the weights), each
    running `fn`: the interactive lane's, for interactive batches beside the batch in
    flight, and, while no interactive work comes, one for the policy's batches beside it,
    as nice as the main thread (batcher/microbatcher.py, LANE_QUIET)."""
    lane_thread = engine_thread.companion("lane", nice=LANE_THREAD_NICE)
    beside_thread = engine_thread.companion("beside", nice=BATCH_THREAD_NICE)

    async def execute_lane(payloads: list[Any]) -> list[Any]:
        return await lane_thread(fn, payloads)

    async def execute_beside(payloads: list[Any]) -> list[Any]:
        return await beside_thread(fn, payloads)

    return execute_lane, execute_beside


def _custom_batcher(
    engine: Any, engine_thread: EngineThread, settings: BatchingSettings, metrics: Metrics
) -> QueueingBatcher:
    """A user's model (engine/custom.py): its batches on one engine thread; the interactive
    lane's second thread only for a class that says it may be called from two threads at
    once (`thread_safe = True`): the contract otherwise promises one caller at a time. Its
    cost model is fitted online."""

    def predict(payloads: list[Any]) -> list[Any]:
        from engine.device import is_oom  # torch only if the model uses it

        return split_in_halves(engine.predict, payloads, retry_if=is_oom)

    async def execute(payloads: list[Any]) -> list[Any]:
        return await engine_thread(predict, payloads)

    execute_lane, execute_beside = _threads_beside(engine_thread, predict) if engine.thread_safe else (None, None)
    return MicroBatcher(
        engine.name,
        execute,
        settings,
        cost=CostModel(),
        metrics=metrics,
        phase="predict",
        execute_lane=execute_lane,
        execute_beside=execute_beside,
    )


async def _generation_batcher(
    engine: GenerationEngine,
    engine_thread: EngineThread,
    settings: BatchingSettings,
    cfg: ServerConfig,
    metrics: Metrics,
) -> QueueingBatcher:
    from batcher.scheduler import GenerationScheduler
    from engine.base import sequence_request

    scheduler = GenerationScheduler(
        engine.name, engine, engine_thread, settings, make_request=sequence_request, metrics=metrics
    )
    if cfg.warmup:
        await scheduler.warmup()
    return scheduler
