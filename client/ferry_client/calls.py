"""Request construction shared by both clients: prompts, conversations and parameters
into one request body, and the retry policy."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ._json import loads
from .errors import FerryError
from .events import EventAssembler
from .responses import ChatResponse, CompletionResponse, group_choices, vectors

DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = frozenset({429, 503})


def _conversations(conversations: Any) -> tuple[list[list[dict]], bool]:
    """(list of conversations, single?) from one conversation, a list of them, or strings."""
    if isinstance(conversations, str):
        return [[{"role": "user", "content": conversations}]], True
    if isinstance(conversations, dict):
        return [[conversations]], True
    convs = list(conversations)
    if not convs:
        raise ValueError("conversations must not be empty")
    if all(isinstance(m, dict) for m in convs):
        return [convs], True  # one conversation: a list of messages
    out = []
    for i, c in enumerate(convs):
        if isinstance(c, str):
            out.append([{"role": "user", "content": c}])
        elif isinstance(c, dict):
            raise ValueError(
                f"conversations[{i}] is a message, but other items are conversations; give either one "
                "conversation (a list of messages) or a list of conversations"
            )
        else:
            out.append(list(c))
    return out, False


def _prompts(prompts: Any) -> tuple[list[str], bool]:
    if isinstance(prompts, str):
        return [prompts], True
    out = list(prompts)
    if not out:
        raise ValueError("prompts must not be empty")
    return out, False


def _texts(texts: Any) -> tuple[list[str], bool]:
    if isinstance(texts, str):
        return [texts], True
    out = list(texts)
    if not out:
        raise ValueError("texts must not be empty")
    return out, False


def _clean(params: dict[str, Any]) -> dict[str, Any]:
    """Drop None values (server defaults apply); tuples and numpy arrays become lists."""
    out = {}
    for k, v in params.items():
        if v is None:
            continue
        if isinstance(v, tuple):
            v = list(v)
        elif hasattr(v, "tolist") and hasattr(v, "ndim") and v.ndim > 0:  # a numpy array, without importing numpy
            v = v.tolist()
        out[k] = v
    return out


@dataclass
class Call:
    """One prepared request and how to read its answer."""

    path: str
    body: dict
    n_prompts: int
    single: bool
    chat: bool = True
    stream: bool = False
    want_usage: bool = False
    n: int | list[int] = 1  # candidates per prompt: one number, or a per-prompt list
    numpy: bool = False


class ClientBase:
    """What both clients share: settings, request construction, reading answers, the retry policy."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = 120.0,
        retries: int = 0,
        max_retry_wait: float = 30.0,
        headers: dict[str, str] | None = None,
        on_retry: Callable[[int, FerryError, float], None] | None = None,
    ):
        base_url = base_url.rstrip("/")
        if base_url.endswith("/v1"):  # accept the OpenAI-style base URL too
            base_url = base_url[:-3]
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.base_url = base_url
        self.retries, self.max_retry_wait, self.on_retry = int(retries), float(max_retry_wait), on_retry
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": "ferry-client/0.1",
            **(headers or {}),
        }
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = timeout
        self._metadata: dict[str, dict] = {}  # a custom model's Open Inference Protocol metadata, by name

    # Request construction, shared by both clients.
    def _chat_call(
        self, model: str, conversations: Any, stream: bool, include_usage: bool | None, params: dict
    ) -> Call:
        convs, single = _conversations(conversations)
        body = {"model": model, "messages": convs[0] if single else convs, **_clean(params)}
        return self._gen_call("/v1/chat/completions", body, len(convs), single, True, stream, include_usage)

    def _completions_call(
        self, model: str, prompts: Any, stream: bool, include_usage: bool | None, params: dict
    ) -> Call:
        ps, single = _prompts(prompts)
        params = _clean(params)
        if "max_completion_tokens" in params:  # /v1/completions knows only max_tokens
            if "max_tokens" in params:
                raise ValueError("give max_completion_tokens or max_tokens, not both")
            params["max_tokens"] = params.pop("max_completion_tokens")
        body = {"model": model, "prompt": ps[0] if single else ps, **params}
        return self._gen_call("/v1/completions", body, len(ps), single, False, stream, include_usage)

    @staticmethod
    def _gen_call(
        path: str, body: dict, n_prompts: int, single: bool, chat: bool, stream: bool, include_usage: bool | None
    ) -> Call:
        want_usage = False
        if stream:
            body["stream"] = True
            if "stream_options" not in body:
                want_usage = include_usage is not False
                if want_usage:
                    body["stream_options"] = {"include_usage": True}
            else:
                want_usage = bool((body["stream_options"] or {}).get("include_usage"))
        elif include_usage is not None:
            raise ValueError("include_usage applies to streams only (stream=True)")
        n = body.get("n", 1)
        return Call(path, body, n_prompts, single, chat, stream, want_usage, n if isinstance(n, (int, list)) else 1)

    def _embed_call(self, model: str, texts: Any, numpy: bool, params: dict) -> Call:
        ts, single = _texts(texts)
        body = {"model": model, "input": ts[0] if single else ts, **_clean(params)}
        if numpy:
            body.setdefault("encoding_format", "base64")  # exact float32, a third of the bytes
        return Call("/v1/embeddings", body, len(ts), single, numpy=numpy)

    def _result(self, call: Call, r: httpx.Response) -> Any:
        try:
            body = loads(r.content)
        except ValueError:
            raise FerryError(
                f"response is not JSON: {r.text[:200]!r}",
                status=r.status_code,
                request_id=r.headers.get("x-request-id"),
            ) from None
        if call.path == "/v1/embeddings":
            return vectors(body, call.single, call.numpy, call.n_prompts)
        cls = ChatResponse if call.chat else CompletionResponse
        out = group_choices(cls, body, r.headers, call.n_prompts, call.chat)
        return out[0] if call.single else out

    def _assembler(self, call: Call, r: httpx.Response) -> EventAssembler:
        return EventAssembler(call.n_prompts, call.n, call.want_usage, call.chat, r.headers.get("x-request-id"))

    def _retry_delay(self, attempt: int, err: FerryError) -> float | None:
        """Seconds to wait before retry number `attempt` (1-based), or None: give up."""
        if attempt > self.retries:
            return None
        retryable = err.status in RETRY_STATUSES or getattr(err, "_connect", False)
        if not retryable:
            return None
        if err.retry_after is not None:
            if err.retry_after > self.max_retry_wait:
                return None  # the server asks for longer than we may wait: never retry early
            return err.retry_after
        return min(self.max_retry_wait, 0.25 * 2 ** (attempt - 1) * (1 + random.random() * 0.25))
