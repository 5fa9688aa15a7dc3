"""What a call returns: one `Response` per prompt, with its candidates, the request's
usage and the batching facts from the `X-Ferry-*` headers; embeddings as vectors."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from .errors import FerryError


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Of the prompt tokens, those the server's prefix cache served (usage.prompt_tokens_details).
    cached_tokens: int = 0

    @classmethod
    def of(cls, raw: Any) -> Usage | None:
        if not isinstance(raw, dict):
            return None
        details = raw.get("prompt_tokens_details")
        return cls(
            int(raw.get("prompt_tokens") or 0),
            int(raw.get("completion_tokens") or 0),
            int(raw.get("total_tokens") or 0),
            int((details.get("cached_tokens") if isinstance(details, dict) else 0) or 0),
        )


@dataclass
class RequestInfo:
    """Facts about the HTTP request a response came from (shared by all its prompts)."""

    id: str | None = None  # the completion id (chatcmpl-...)
    model: str | None = None
    request_id: str | None = None  # X-Request-Id
    queue_ms: float | None = None  # X-Ferry-Queue-Ms: the slowest item's queue wait
    batch_size: int | None = None  # X-Ferry-Batch-Size
    dispatch_reason: str | None = None  # X-Ferry-Dispatch-Reason: full, max_wait, deadline, adaptive, drain
    best_effort: bool = False  # X-Ferry-Best-Effort

    @classmethod
    def of(cls, body: dict | None, headers: httpx.Headers | None) -> RequestInfo:
        h = headers or httpx.Headers()

        def num(name: str, conv: Callable[[str], Any]) -> Any:
            try:
                return conv(h[name]) if h.get(name) else None
            except ValueError:
                return None

        body = body or {}
        return cls(
            body.get("id"),
            body.get("model"),
            h.get("x-request-id"),
            num("x-ferry-queue-ms", float),
            num("x-ferry-batch-size", int),
            h.get("x-ferry-dispatch-reason") or None,
            h.get("x-ferry-best-effort", "").lower() == "true",
        )


@dataclass
class Choice:
    """One candidate of one prompt (several when n > 1)."""

    index: int  # candidate number within its prompt: 0 .. n-1
    text: str
    finish_reason: str | None  # "stop", "length", or "error" (streams only)
    error: FerryError | None = None


@dataclass
class Response:
    """The answer to one prompt.

    `text` and `finish_reason` are those of the first candidate; `choices` holds every
    candidate (n > 1). `usage` counts the tokens of the whole request (the server counts
    per request; with one prompt that is the prompt's own usage). `error` is set only by
    `gather_stream` when this prompt failed mid-stream.
    """

    prompt_index: int
    choices: list[Choice]
    usage: Usage | None = None
    info: RequestInfo | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def error(self) -> FerryError | None:
        return next((c.error for c in self.choices if c.error is not None), None)

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.choices]


class ChatResponse(Response):
    """A `Response` to one conversation of `chat`."""


class CompletionResponse(Response):
    """A `Response` to one prompt of `completions`."""


def _choice_text(c: dict, chat: bool) -> str:
    if chat:
        return (c.get("message") or {}).get("content") or ""
    return c.get("text") or ""


def group_choices(
    cls: type[Response], body: dict, headers: httpx.Headers | None, n_prompts: int, chat: bool
) -> list[Response]:
    info = RequestInfo.of(body, headers)
    usage = Usage.of(body.get("usage"))
    by_prompt: dict[int, list[tuple[int, dict]]] = {}
    for k, c in enumerate(body.get("choices") or []):
        p = c.get("prompt_index", 0 if n_prompts == 1 else k)
        by_prompt.setdefault(int(p), []).append((int(c.get("index", k)), c))
    missing = [p for p in range(n_prompts) if p not in by_prompt]
    if missing:
        raise FerryError(
            f"malformed response: no choice for prompt(s) {missing}", status=200, request_id=info.request_id, body=body
        )
    out = []
    for p in range(n_prompts):
        cs = sorted(by_prompt[p], key=lambda t: t[0])
        choices = [Choice(j, _choice_text(c, chat), c.get("finish_reason")) for j, (_, c) in enumerate(cs)]
        out.append(cls(p, choices, usage, info))
    return out


def vectors(body: dict, single: bool, numpy: bool, n: int) -> Any:
    """The embeddings of a response in input order: lists of floats, or float32 numpy arrays."""
    data = sorted(body.get("data") or [], key=lambda d: d.get("index", 0))
    if len(data) != n:
        raise FerryError(f"malformed response: {len(data)} embeddings for {n} inputs", status=200, body=body)
    if numpy:
        try:
            import numpy as np
        except ImportError:
            raise ImportError("numpy=True needs numpy: pip install 'ferry-client[numpy]'") from None
        rows = [
            np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
            if isinstance(d["embedding"], str)
            else np.asarray(d["embedding"], dtype=np.float32)
            for d in data
        ]
        arr = np.stack(rows).astype(np.float32, copy=False)
        return arr[0] if single else arr
    vecs = [d["embedding"] if isinstance(d["embedding"], list) else _floats32(d["embedding"]) for d in data]
    return vecs[0] if single else vecs


def _floats32(b64: str) -> list[float]:
    """A base64 string of little-endian float32s as Python floats (each exactly its float32)."""
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
