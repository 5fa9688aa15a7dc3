"""The request models a server validates with, bounded by its limits.

`--max-prompts` and its peers are server settings, not constants, so the request models a
server validates with are subclasses of gateway/schemas.py's, made for its limits: each
limit is checked by a validator that keeps its historical error code (too_many_prompts,
...) and written into the JSON schema of the same class, so /openapi.json promises exactly
what is accepted."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    as_conversations,
    completion_prompts,
    stop_lists,
)

if TYPE_CHECKING:
    from .config import ServerConfig


@dataclass(frozen=True)
class Limits:
    max_prompts: int
    max_inputs: int
    max_completion_tokens: int
    max_stop_strings: int

    @classmethod
    def of(cls, cfg: ServerConfig) -> Limits:
        return cls(cfg.max_prompts, cfg.max_inputs, cfg.max_completion_tokens, cfg.max_stop_strings)


@dataclass(frozen=True)
class RequestModels:
    embeddings: type[EmbeddingsRequest]
    chat: type[ChatCompletionRequest]
    completions: type[CompletionRequest]


def request_models(cfg: ServerConfig) -> RequestModels:
    return _bounded(Limits.of(cfg))


def _walk(node: Any, visit: Callable[[dict], None]) -> None:
    if isinstance(node, dict):
        visit(node)
        for v in node.values():
            _walk(v, visit)
    elif isinstance(node, list):
        for v in node:
            _walk(v, visit)


def _cap_tokens(prop: dict, limit: int) -> None:
    _walk(prop, lambda n: n.update(maximum=limit) if n.get("type") == "integer" else None)


def _cap_stops(prop: dict, limit: int) -> None:
    """A string, or a list of at most `limit` strings, for every prompt; or a per-prompt list
    (told apart from the shared list by holding at least one non-string: a list of strings
    always means "for every prompt"). Stop strings are never empty."""

    def visit(n: dict) -> None:
        if n.get("type") == "string":
            n["minLength"] = 1
        elif n.get("type") == "array" and n.get("items", {}).get("type") == "string":
            n["maxItems"] = limit

    _walk(prop, visit)
    for branch in prop["anyOf"]:
        if branch.get("type") == "array" and "anyOf" in branch.get("items", {}):
            branch["contains"] = {"not": {"type": "string"}}


@functools.cache
def _bounded(lim: Limits) -> RequestModels:

    def check_prompts(n: int, v: Any) -> Any:
        if n > lim.max_prompts:
            raise PydanticCustomError(
                "too_many_prompts",
                "request has {n} prompts; at most {limit} are allowed",
                {"n": n, "limit": lim.max_prompts},
            )
        return v

    # Shared by the chat and completions models (pydantic reuses a validator function).
    def limit_tokens(cls: type, v: Any) -> Any:
        return check_tokens(v)

    def limit_stops(cls: type, v: Any) -> Any:
        return check_stops(v)

    def check_tokens(v: Any) -> Any:
        for x in v if isinstance(v, list) else [v]:
            if x is not None and x > lim.max_completion_tokens:
                raise PydanticCustomError(
                    "invalid_value", "{x} exceeds the limit of {limit}", {"x": x, "limit": lim.max_completion_tokens}
                )
        return v

    def check_stops(v: Any) -> Any:
        _, groups = stop_lists(v)
        for i, stops in enumerate(groups):
            if len(stops) > lim.max_stop_strings:
                raise PydanticCustomError(
                    "too_many_stop_strings",
                    "prompt {i} has {n} stop strings; at most {limit} are allowed",
                    {"i": i, "n": len(stops), "limit": lim.max_stop_strings},
                )
            if any(not s for s in stops):
                raise PydanticCustomError("invalid_value", "stop strings must not be empty")
        return v

    def patch_generation(schema: dict) -> None:
        props = schema["properties"]
        for name in ("max_tokens", "max_completion_tokens"):
            if name in props:
                _cap_tokens(props[name], lim.max_completion_tokens)
        _cap_stops(props["stop"], lim.max_stop_strings)

    def chat_schema(schema: dict) -> None:
        patch_generation(schema)
        schema["properties"]["messages"]["anyOf"][0]["maxItems"] = lim.max_prompts

    def completions_schema(schema: dict) -> None:
        patch_generation(schema)
        branches = schema["properties"]["prompt"]["anyOf"]
        branches[1]["maxItems"] = branches[3]["maxItems"] = lim.max_prompts  # strings, token-id lists

    def embeddings_schema(schema: dict) -> None:
        branches = schema["properties"]["input"]["anyOf"]
        branches[1]["maxItems"] = branches[3]["maxItems"] = lim.max_inputs  # strings, token-id lists

    class Chat(ChatCompletionRequest):
        __qualname__ = "ChatCompletionRequest"  # its name in /openapi.json
        model_config = ConfigDict(json_schema_extra=chat_schema)

        @field_validator("messages")
        @classmethod
        def _prompts(cls, v: Any) -> Any:
            return check_prompts(len(as_conversations(v)), v)

        _tokens = field_validator("max_tokens", "max_completion_tokens")(limit_tokens)
        _stops = field_validator("stop")(limit_stops)

    class Completions(CompletionRequest):
        __qualname__ = "CompletionRequest"  # its name in /openapi.json
        model_config = ConfigDict(json_schema_extra=completions_schema)

        @field_validator("prompt")
        @classmethod
        def _prompts(cls, v: Any) -> Any:
            return check_prompts(len(completion_prompts(v)), v)

        _tokens = field_validator("max_tokens")(limit_tokens)
        _stops = field_validator("stop")(limit_stops)

    class Embeddings(EmbeddingsRequest):
        __qualname__ = "EmbeddingsRequest"  # its name in /openapi.json
        model_config = ConfigDict(json_schema_extra=embeddings_schema)

        @field_validator("input")
        @classmethod
        def _inputs(cls, v: Any) -> Any:
            n = len(completion_prompts(v))
            if n > lim.max_inputs:
                raise PydanticCustomError(
                    "too_many_inputs",
                    "input has {n} items; at most {limit} are allowed per request",
                    {"n": n, "limit": lim.max_inputs},
                )
            return v

    for model in (Chat, Completions, Embeddings):
        model.__name__ = model.__qualname__
    return RequestModels(Embeddings, Chat, Completions)
