"""The `--config FILE` of `ferry serve`: the models to serve, in YAML (docs/config.md).

    models:
      - name: minilm              # the name clients ask for ("model" in a request)
        kind: embeddings          # embeddings | chat | custom
        source: default           # default | a Hugging Face id | a local path
                                  # (custom: "package.module:ClassName", docs/custom-models.md)
        device: cpu               # optional: cpu, cuda, cuda:N, auto (default: --device)
        dtype: float32            # optional: float32, float16, bfloat16, auto (default: --dtype)
        batching:                 # optional: this model's batching knobs (batcher/settings.py)
          max_batch_size: 64
        prefix_caching: true      # optional, chat only (default: --prefix-caching)
        prefix_cache_mb: 256      # optional, chat only (default: --prefix-cache-mb)
        kv_cache_mb: 4096         # optional, chat only (default: --kv-cache-mb)
        kv_events_config:         # optional, chat only (default: --kv-events-config): vLLM's JSON
          {enable_kv_cache_events: true, endpoint: "tcp://*:5557", topic: "kv@10.0.0.7@minichat"}
        speculation: ngram        # optional, chat only (default: --speculation): off | ngram
        speculative_tokens: 4     # optional, chat only (default: --speculative-tokens)
        prompt_lookup_max: 4      # optional, chat only (default: --prompt-lookup-max)
        prompt_lookup_min: 2      # optional, chat only (default: --prompt-lookup-min)
        options: {labels: [a, b]} # optional, custom only: keyword arguments of the class
    tenants:                      # optional: fair shares between tenants (docs/scheduling.md)
      - name: team-a              # the tenant's name (metric label, admin API)
        key: sk-team-a            # optional: its API key (accepted beside --api-key)
        weight: 2                 # optional: its share against the others' (default 1)
        tokens_per_minute: 200000 # optional quota: input and output tokens a minute, per model
        max_concurrent: 32        # optional quota: requests' items queued or running at once, per model

The schema is a pydantic model that forbids unknown fields; a bad file fails `ferry serve` at
start with one line naming the file, the model and the field (`ConfigError`). Each model's
`batching` values override the batching flags for that model only.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from batcher.knobs import SettingsError
from batcher.settings import BatchingSettings
from engine.kv_events import parse_kv_events_config

ConfigKind = Literal["embeddings", "chat", "custom"]
DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
# What a model's name may be: it is a URL path segment (/v1/models/{name}) and a metric label.
NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"


class ConfigError(ValueError):
    """A bad config file; the message is the one line to show (file, model, field)."""


class ModelEntry(BaseModel):
    """One model to serve."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(min_length=1, max_length=200, pattern=NAME, description="the name clients ask for")
    kind: ConfigKind = Field(description="`embeddings` or `chat`")
    source: str = Field(
        "default",
        min_length=1,
        description="`default` (the built-in model of its kind), a Hugging Face id or a local path; "
        "custom: `package.module:ClassName`",
    )
    device: str | None = Field(
        None, pattern=DEVICE.pattern, description="`cpu`, `cuda`, `cuda:N` or `auto`; null: `--device`"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = Field(None, description="null: `--dtype`")
    batching: dict[str, Any] = Field(
        default_factory=dict, description="this model's batching knobs, by name (docs/settings.md)"
    )
    prefix_caching: bool | None = Field(None, description="a chat model's prefix cache on or off; null: the flag's")
    prefix_cache_mb: int | None = Field(
        None, ge=0, description="a chat model's prefix cache memory in MiB (0: off); null: the flag's"
    )
    kv_cache_mb: int | None = Field(
        None, ge=0, description="a chat model's running sequences' KV memory in MiB (0: no bound); null: the flag's"
    )
    kv_events_config: dict[str, Any] | str | None = Field(
        None,
        description="a chat model's KV cache events: vLLM's `--kv-events-config` (a mapping or its JSON); "
        "null: the flag's",
    )
    speculation: Literal["off", "ngram"] | None = Field(
        None, description="a chat model's speculative decoding (`--speculation`); null: the flag's"
    )
    speculative_tokens: int | None = Field(
        None, ge=1, le=16, description="a chat model's most draft tokens a step; null: the flag's"
    )
    prompt_lookup_max: int | None = Field(
        None, ge=1, le=32, description="a chat model's longest suffix looked up for a draft; null: the flag's"
    )
    prompt_lookup_min: int | None = Field(
        None, ge=1, le=32, description="a chat model's shortest suffix looked up for a draft; null: the flag's"
    )
    options: dict[str, Any] | None = Field(
        None, description="a custom model's keyword arguments (its class is made with them)"
    )

    @field_validator("speculation", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false: it means `off` here."""
        return "off" if value is False else value

    def speculation_overrides(self) -> dict[str, Any]:
        """Its speculation fields that are set, by knob name."""
        return {f: getattr(self, f) for f in SPECULATION_FIELDS if getattr(self, f) is not None}


SPECULATION_FIELDS = ("speculation", "speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}$"


class TenantEntry(BaseModel):
    """One tenant: its name, optionally its API key, its weight and quotas."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(pattern=TENANT_NAME, description="the tenant's name (at most 64 characters)")
    key: str | None = Field(None, min_length=8, description="its API key, accepted beside --api-key")
    weight: float = Field(1.0, gt=0, le=1000, description="its share against the others'")
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12, description="quota: tokens a minute, per model")
    max_concurrent: int | None = Field(
        None, ge=1, le=10**9, description="quota: items queued or running at once, per model"
    )


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    models: list[ModelEntry] = Field(min_length=1)
    tenants: list[TenantEntry] = Field(default_factory=list)


def load_config(path: str) -> list[ModelEntry]:
    """The models of the config file at `path`, checked; ConfigError (one line) when not."""
    return load_file(path).models


def load_file(path: str) -> ConfigFile:
    """The config file at `path`, checked; ConfigError (one line) when not."""
    where = f"config {path}"
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"invalid {where}: not YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"invalid {where}: expected a mapping with `models:` (a list of models)")
    try:
        parsed = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid {where}: {_describe(exc, data)}") from None
    seen: set[str] = set()
    for entry in parsed.models:
        if entry.name in seen:
            raise ConfigError(f"invalid {where}: model {entry.name!r}: field 'name': another model has this name")
        seen.add(entry.name)
        if entry.kind != "chat":
            for field in ("prefix_caching", "prefix_cache_mb", "kv_cache_mb", "kv_events_config"):
                if getattr(entry, field) is not None:
                    raise ConfigError(
                        f"invalid {where}: model {entry.name!r}: field {field!r}: only chat models keep a KV cache"
                    )
            for field in SPECULATION_FIELDS:
                if getattr(entry, field) is not None:
                    raise ConfigError(
                        f"invalid {where}: model {entry.name!r}: field {field!r}: only chat models speculate"
                    )
        low, high = entry.prompt_lookup_min, entry.prompt_lookup_max
        if low is not None and high is not None and low > high:
            raise ConfigError(
                f"invalid {where}: model {entry.name!r}: field 'prompt_lookup_min': more than prompt_lookup_max"
            )
        try:
            parse_kv_events_config(entry.kv_events_config)
        except ValueError as exc:
            raise ConfigError(f"invalid {where}: model {entry.name!r}: field {exc}") from None
        problem = _kind_problem(entry)
        if problem is not None:
            raise ConfigError(f"invalid {where}: model {entry.name!r}: {problem}")
        try:
            BatchingSettings(**entry.batching)
        except SettingsError as exc:
            raise ConfigError(
                f"invalid {where}: model {entry.name!r}: field 'batching.{exc.field}': {exc.message}"
            ) from None
    names: set[str] = set()
    keys: set[str] = set()
    for tenant in parsed.tenants:
        if tenant.name in names:
            raise ConfigError(f"invalid {where}: tenant {tenant.name!r}: another tenant has this name")
        if tenant.key is not None and tenant.key in keys:
            raise ConfigError(f"invalid {where}: tenant {tenant.name!r}: field 'key': another tenant has this key")
        names.add(tenant.name)
        if tenant.key is not None:
            keys.add(tenant.key)
    return parsed


def _kind_problem(entry: ModelEntry) -> str | None:
    """What a custom entry's source or a built-in entry's options get wrong, if anything."""
    from engine.custom import SOURCE

    if entry.kind == "custom":
        if not SOURCE.match(entry.source):
            return f"field 'source': a custom model's source is package.module:ClassName, got {entry.source!r}"
    elif entry.options is not None:
        return "field 'options': only custom models take options"
    return None


def _describe(exc: ValidationError, data: dict[str, Any]) -> str:
    """The first error, as `model 'NAME': field 'FIELD': what is wrong`."""
    # A misspelt field is also a missing one: name the misspelling.
    first = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    loc = list(first["loc"])
    what = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
    if first["type"] == "missing":
        what = "missing"
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        raw = data.get("models")
        entry = raw[loc[1]] if isinstance(raw, list) and loc[1] < len(raw) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        model = f"model {name!r}" if isinstance(name, str) and name else f"model #{loc[1] + 1} (unnamed)"
        field = ".".join(str(p) for p in loc[2:])
        return f"{model}: field {field!r}: {what}" if field else f"{model}: {what}"
    return f"field {'.'.join(str(p) for p in loc) or 'models'!r}: {what}"
