"""Python client for a Ferry gateway: many prompts in one call, results in prompt order.

    from gateway.client import FerryClient

    with FerryClient("http://127.0.0.1:8000") as client:
        a, b = client.chat("ferry-tiny-chat", [conv_a, conv_b], max_completion_tokens=[4, 16])
        vectors = client.embed("sentence-transformers/all-MiniLM-L6-v2", ["hello", "goodbye"])

`chat` and `completions` send ONE request however many prompts they carry, so the
prompts batch on the server; every generation parameter is a scalar (for every prompt)
or a per-prompt list, validated by the server (a wrong-length list is a 422 naming the
field). `stream=True` returns a stream of `(prompt_index, delta)` events;
`gather_stream` collects them into per-prompt responses. Errors are typed
(`RateLimited`, `UnprocessableEntity`, ...) and carry the HTTP status, the OpenAI error
code, the offending parameter and `Retry-After`; `retries=N` retries 429/503 and
connection failures, waiting what `Retry-After` says.

`AsyncFerryClient` is the same API with `await` (and `async for` over streams).
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import email.utils
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, AsyncIterator, Callable, Iterable, Iterator

import httpx
import numpy as np
import orjson

__all__ = [
    "FerryClient", "AsyncFerryClient", "gather_stream", "agather_stream",
    "ChatResponse", "CompletionResponse", "Response", "Choice", "Usage", "RequestInfo", "StreamEvent",
    "ChatStream", "AsyncChatStream",
    "FerryError", "APIConnectionError", "APITimeoutError", "BadRequest", "AuthenticationError", "PermissionDenied",
    "NotFound", "PayloadTooLarge", "UnprocessableEntity", "RateLimited", "ServerError", "ServiceUnavailable",
    "GatewayTimeout",
]

DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = frozenset({429, 503})


# -- errors ------------------------------------------------------------------------------
class FerryError(Exception):
    """Base of every error this client raises.

    status: the HTTP status (None for connection failures); code: the OpenAI-style error
    code (`queue_full`, `invalid_value`, `model_not_found`, ...); param: the request field
    at fault, where the server names one; retry_after: seconds from the Retry-After header
    (429/503), else None; request_id: the X-Request-Id of the failed request; prompt_index:
    the prompt a streaming error belongs to.
    """

    status: int | None = None

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None, param: str | None = None,
                 type: str | None = None, retry_after: float | None = None, request_id: str | None = None,
                 prompt_index: int | None = None, body: Any = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.code, self.param, self.type = code, param, type
        self.retry_after, self.request_id, self.prompt_index, self.body = retry_after, request_id, prompt_index, body

    def __str__(self) -> str:
        bits = [f"{self.status}" if self.status is not None else None, self.code, f"param={self.param}" if self.param else None]
        head = " ".join(b for b in bits if b)
        return f"[{head}] {self.message}" if head else self.message

    def __reduce__(self):  # keep keyword fields across pickling (multiprocessing, pytest-xdist)
        return (_rebuild_error, (type(self), self.message, dict(self.__dict__)))


def _rebuild_error(cls: type, message: str, state: dict) -> "FerryError":
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class APIConnectionError(FerryError):
    """The gateway could not be reached, or the connection broke mid-response."""


class APITimeoutError(APIConnectionError):
    """The HTTP client timed out (see the `timeout` argument)."""


class BadRequest(FerryError):
    status = 400


class AuthenticationError(FerryError):
    status = 401


class PermissionDenied(FerryError):
    status = 403


class NotFound(FerryError):
    status = 404


class PayloadTooLarge(FerryError):
    status = 413


class UnprocessableEntity(FerryError):
    """A request field is invalid; `.param` names it (e.g. a per-prompt list of the wrong length)."""

    status = 422


class RateLimited(FerryError):
    """429: the queue is full, the latency budget cannot be met, or too many streams. See `.retry_after`."""

    status = 429


class ServerError(FerryError):
    """Any 5xx."""

    status = 500


class ServiceUnavailable(ServerError):
    """503: models still loading or the gateway is draining. See `.retry_after`."""

    status = 503


class GatewayTimeout(ServerError):
    """504: the request's latency budget passed before it was served."""

    status = 504


_BY_STATUS: dict[int, type[FerryError]] = {400: BadRequest, 401: AuthenticationError, 403: PermissionDenied, 404: NotFound,
                                          413: PayloadTooLarge, 422: UnprocessableEntity, 429: RateLimited,
                                          503: ServiceUnavailable, 504: GatewayTimeout}
# Stream error events carry no status; these give the one the same failure has as a response.
_STATUS_OF_CODE = {"queue_full": 429, "deadline_infeasible": 429, "too_many_streams": 429, "deadline_exceeded": 504,
                   "shutting_down": 503, "not_ready": 503, "engine_error": 500, "internal_error": 500, "cancelled": 499}
_STATUS_OF_TYPE = {"invalid_request_error": 400, "authentication_error": 401, "rate_limit_error": 429,
                   "server_error": 500, "service_unavailable_error": 503, "timeout_error": 504}


def error_class(status: int | None) -> type[FerryError]:
    if status is None:
        return APIConnectionError
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return ServerError if status >= 500 else FerryError


def make_error(status: int | None, payload: Any, *, retry_after: float | None = None, request_id: str | None = None,
               default_message: str = "") -> FerryError:
    """Build the typed error for an OpenAI-style body `{"error": {...}}` (or anything else)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        err = {"message": err if isinstance(err, str) else (default_message or f"HTTP {status}")}
    code, type_ = err.get("code"), err.get("type")
    if status is None:  # an error event inside a stream
        status = _STATUS_OF_CODE.get(code) or _STATUS_OF_TYPE.get(type_, 500)
    prompt_index = err.get("prompt_index")
    return error_class(status)(str(err.get("message") or f"HTTP {status}"), status=status, code=code,
                               param=err.get("param"), type=type_, retry_after=retry_after, request_id=request_id,
                               prompt_index=prompt_index, body=payload)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_from_response(r: httpx.Response) -> FerryError:
    try:
        payload = orjson.loads(r.content) if r.content else None
    except orjson.JSONDecodeError:
        payload = None
    text = r.text[:500] if payload is None else ""
    return make_error(r.status_code, payload, retry_after=parse_retry_after(r.headers.get("retry-after")),
                      request_id=r.headers.get("x-request-id"),
                      default_message=text or f"HTTP {r.status_code} {r.reason_phrase}".strip())


def _transport_error(exc: httpx.HTTPError) -> FerryError:
    cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    return cls(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


# -- response types ----------------------------------------------------------------------
@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, raw: Any) -> "Usage | None":
        if not isinstance(raw, dict):
            return None
        return cls(int(raw.get("prompt_tokens") or 0), int(raw.get("completion_tokens") or 0),
                   int(raw.get("total_tokens") or 0))


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
    def of(cls, body: dict | None, headers: httpx.Headers | None) -> "RequestInfo":
        h = headers or httpx.Headers()

        def num(name: str, conv: Callable[[str], Any]) -> Any:
            try:
                return conv(h[name]) if h.get(name) else None
            except ValueError:
                return None

        body = body or {}
        return cls(body.get("id"), body.get("model"), h.get("x-request-id"), num("x-ferry-queue-ms", float),
                   num("x-ferry-batch-size", int), h.get("x-ferry-dispatch-reason") or None,
                   h.get("x-ferry-best-effort", "").lower() == "true")


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


def _group_choices(cls: type[Response], body: dict, headers: httpx.Headers | None, n_prompts: int, chat: bool) -> list[Response]:
    info = RequestInfo.of(body, headers)
    usage = Usage.of(body.get("usage"))
    by_prompt: dict[int, list[tuple[int, dict]]] = {}
    for k, c in enumerate(body.get("choices") or []):
        p = c.get("prompt_index", 0 if n_prompts == 1 else k)
        by_prompt.setdefault(int(p), []).append((int(c.get("index", k)), c))
    missing = [p for p in range(n_prompts) if p not in by_prompt]
    if missing:
        raise FerryError(f"malformed response: no choice for prompt(s) {missing}", status=200, request_id=info.request_id,
                         body=body)
    out = []
    for p in range(n_prompts):
        cs = sorted(by_prompt[p], key=lambda t: t[0])
        choices = [Choice(j, _choice_text(c, chat), c.get("finish_reason")) for j, (_, c) in enumerate(cs)]
        out.append(cls(p, choices, usage, info))
    return out


# -- streaming -----------------------------------------------------------------------------
class StreamEvent(tuple):
    """One streamed delta: unpacks as `(prompt_index, delta)`.

    Attributes: `prompt_index`, `delta` (new text, may be ""), `finish_reason` (set on the
    prompt's final event: "stop", "length" or "error"), `candidate` (0 .. n-1), `error`
    (a typed FerryError when this prompt failed), `usage` (on the stream's very last event
    when usage was requested: the whole request's token counts).
    """

    finish_reason: str | None
    candidate: int
    error: FerryError | None
    usage: Usage | None

    def __new__(cls, prompt_index: int | None, delta: str, finish_reason: str | None = None, candidate: int = 0,
                error: FerryError | None = None, usage: Usage | None = None):
        self = super().__new__(cls, (prompt_index, delta))
        self.finish_reason, self.candidate, self.error, self.usage = finish_reason, candidate, error, usage
        return self

    @property
    def prompt_index(self) -> int | None:
        return self[0]

    @property
    def delta(self) -> str:
        return self[1]

    def __repr__(self) -> str:
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("finish_reason", "candidate", "error", "usage")
                        if getattr(self, k))
        return f"StreamEvent(prompt_index={self[0]!r}, delta={self[1]!r}{extra})"

    def __reduce__(self):
        return (StreamEvent, (self[0], self[1], self.finish_reason, self.candidate, self.error, self.usage))


class _SSEDecoder:
    """Server-sent events: `data:` lines (joined by newlines) up to a blank line make one event."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def line(self, line: str) -> str | None:
        line = line.rstrip("\r")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        return self.line("")


class _EventAssembler:
    """Turns decoded SSE payloads into StreamEvents: merges a prompt's "error" finish with
    the error event that follows it, and the last finish with the usage chunk."""

    def __init__(self, n_prompts: int, n: int, want_usage: bool, chat: bool, request_id: str | None):
        self.total = n_prompts * n
        self.n, self.want_usage, self.chat, self.request_id = max(n, 1), want_usage, chat, request_id
        self.finished = 0
        self.held: StreamEvent | None = None
        self.done = False
        self.usage: Usage | None = None
        self.id: str | None = None
        self.model: str | None = None

    def feed(self, data: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if data == "[DONE]":
            self.done = True
            return self._release(out)
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise APIConnectionError(f"malformed stream event: {data[:200]!r}", request_id=self.request_id) from None
        if not isinstance(msg, dict):
            return out
        if "error" in msg:
            err = make_error(None, msg, request_id=self.request_id)
            held = self.held
            if held is not None and held.finish_reason == "error" and held.error is None \
                    and held.prompt_index == err.prompt_index:
                self.held = None  # the prompt's "error" finish, now with its error
                self._emit(out, StreamEvent(held.prompt_index, held.delta, "error", held.candidate, err))
            else:
                self._release(out)
                self.finished += 1
                self._emit(out, StreamEvent(err.prompt_index, "", "error", 0, err))
            return out
        if self.id is None and msg.get("id"):
            self.id, self.model = msg.get("id"), msg.get("model")
        choices = msg.get("choices") or []
        if not choices:
            usage = Usage.of(msg.get("usage"))
            if usage is not None:
                self.usage = usage
                h, self.held = self.held, None
                if h is not None:
                    out.append(StreamEvent(h.prompt_index, h.delta, h.finish_reason, h.candidate, h.error, usage))
                else:
                    out.append(StreamEvent(None, "", None, 0, None, usage))
            return out
        self._release(out)
        for c in choices:
            k = int(c.get("index", 0))
            p = int(c.get("prompt_index", k // self.n))
            text = ((c.get("delta") or {}).get("content") if self.chat else c.get("text")) or ""
            ev = StreamEvent(p, text, c.get("finish_reason"), max(0, k - p * self.n))
            if ev.finish_reason is not None:
                self.finished += 1
                if isinstance(c.get("error"), dict):  # a failed prompt's final chunk
                    err = make_error(c["error"].get("status"), {"error": c["error"]}, request_id=self.request_id)
                    self._emit(out, StreamEvent(p, text, "error", ev.candidate, err))
                    continue
                if ev.finish_reason == "error":
                    self._release(out)
                    self.held = ev  # its error event comes next
                    continue
            if ev.delta or ev.finish_reason is not None:
                self._emit(out, ev)
        return out

    def _emit(self, out: list[StreamEvent], ev: StreamEvent) -> None:
        """Hold the stream's last finish back for the usage chunk that follows it."""
        if ev.finish_reason is not None and self.want_usage and self.finished >= self.total:
            self._release(out)
            self.held = ev
        else:
            out.append(ev)

    def _release(self, out: list[StreamEvent]) -> list[StreamEvent]:
        if self.held is not None:
            out.append(self.held)
            self.held = None
        return out

    def end(self) -> list[StreamEvent]:
        out = self._release([])
        if not self.done:
            raise APIConnectionError("the stream ended before [DONE]", request_id=self.request_id)
        return out


class _StreamBase:
    def __init__(self, response: httpx.Response, assembler: _EventAssembler, cls: type[Response]):
        self.response = response
        self._asm = assembler
        self._cls = cls
        self._info = RequestInfo.of(None, response.headers)

    @property
    def info(self) -> RequestInfo:
        """Request facts: X-Request-Id from the headers; id and model once the first chunk is read."""
        return dataclasses.replace(self._info, id=self._asm.id, model=self._asm.model)

    @property
    def request_id(self) -> str | None:
        return self.info.request_id

    @property
    def usage(self) -> Usage | None:
        """The whole request's usage, once the stream has been read to the end."""
        return self._asm.usage


class ChatStream(_StreamBase):
    """Iterate for `StreamEvent`s, i.e. `(prompt_index, delta)` pairs, as the server sends them.

    Close it (or use `with`) to hang up early: the server then cancels the prompts'
    remaining work. `gather()` reads the rest and returns one response per prompt.
    """

    def __init__(self, response: httpx.Response, assembler: _EventAssembler, cls: type[Response]):
        super().__init__(response, assembler, cls)
        self._it = self._events()

    def _events(self) -> Iterator[StreamEvent]:
        sse = _SSEDecoder()
        try:
            try:
                for line in self.response.iter_lines():
                    data = sse.line(line)
                    if data is not None:
                        yield from self._asm.feed(data)
                        if self._asm.done:
                            break
                data = sse.flush()
                if data is not None:
                    yield from self._asm.feed(data)
            except httpx.HTTPError as exc:
                raise _transport_error(exc) from exc
            yield from self._asm.end()
        finally:
            self.response.close()

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._it)

    def close(self) -> None:
        self._it.close()
        self.response.close()

    def __enter__(self) -> "ChatStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def gather(self) -> list[Response]:
        return gather_stream(self)


class AsyncChatStream(_StreamBase):
    """The async twin of ChatStream: `async for prompt_index, delta in stream`."""

    def __init__(self, response: httpx.Response, assembler: _EventAssembler, cls: type[Response]):
        super().__init__(response, assembler, cls)
        self._it = self._events()

    async def _events(self) -> AsyncIterator[StreamEvent]:
        sse = _SSEDecoder()
        try:
            try:
                async for line in self.response.aiter_lines():
                    data = sse.line(line)
                    if data is not None:
                        for ev in self._asm.feed(data):
                            yield ev
                        if self._asm.done:
                            break
                data = sse.flush()
                if data is not None:
                    for ev in self._asm.feed(data):
                        yield ev
            except httpx.HTTPError as exc:
                raise _transport_error(exc) from exc
            for ev in self._asm.end():
                yield ev
        finally:
            await self.response.aclose()

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        return await self._it.__anext__()

    async def aclose(self) -> None:
        await self._it.aclose()
        await self.response.aclose()

    async def __aenter__(self) -> "AsyncChatStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def gather(self) -> list[Response]:
        return await agather_stream(self)


class _Gatherer:
    def __init__(self, cls: type[Response]):
        self.cls = cls
        self.parts: dict[int, dict[int, list[str]]] = {}
        self.finish: dict[tuple[int, int], str | None] = {}
        self.errors: dict[tuple[int, int], FerryError] = {}
        self.usage: Usage | None = None

    def add(self, ev: Any) -> None:
        p, delta = ev[0], ev[1]
        usage = getattr(ev, "usage", None)
        if usage is not None:
            self.usage = usage
        if p is None:
            return
        j = getattr(ev, "candidate", 0)
        self.parts.setdefault(p, {}).setdefault(j, []).append(delta or "")
        fr = getattr(ev, "finish_reason", None)
        if fr is not None:
            self.finish[(p, j)] = fr
        err = getattr(ev, "error", None)
        if err is not None:
            self.errors[(p, j)] = err

    def result(self, info: RequestInfo | None) -> list[Response]:
        out = []
        for p in sorted(self.parts):
            choices = [Choice(j, "".join(bits), self.finish.get((p, j)), self.errors.get((p, j)))
                       for j, bits in sorted(self.parts[p].items())]
            out.append(self.cls(p, choices, self.usage, info))
        return out


def gather_stream(events: Iterable[Any]) -> list[Response]:
    """Read a stream to its end and return one response per prompt, in prompt order.

    `events` is what `chat(..., stream=True)` / `completions(..., stream=True)` return (or
    any iterable of `(prompt_index, delta)` pairs). Each response's text is the
    concatenation of its deltas, its finish_reason that of its final event, `.usage` the
    request's usage when it was streamed, and `.error` the typed error of a prompt that
    failed mid-stream. Always a list, also for a single prompt.
    """
    if hasattr(events, "__aiter__") and not hasattr(events, "__iter__"):
        raise TypeError("gather_stream() got an async stream; use `await agather_stream(events)`")
    g = _Gatherer(getattr(events, "_cls", ChatResponse))
    for ev in events:
        g.add(ev)
    return g.result(getattr(events, "info", None))


async def agather_stream(events: AsyncIterable[Any]) -> list[Response]:
    """`gather_stream` for async streams (`AsyncFerryClient.chat(..., stream=True)`)."""
    g = _Gatherer(getattr(events, "_cls", ChatResponse))
    async for ev in events:
        g.add(ev)
    return g.result(getattr(events, "info", None))


# -- request building -------------------------------------------------------------------------
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
            raise ValueError(f"conversations[{i}] is a message, but other items are conversations; give either one "
                             "conversation (a list of messages) or a list of conversations")
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
    """Drop None values (server defaults apply); tuples/arrays become lists."""
    out = {}
    for k, v in params.items():
        if v is None:
            continue
        if isinstance(v, (tuple, np.ndarray)):
            v = np.asarray(v).tolist() if isinstance(v, np.ndarray) else list(v)
        out[k] = v
    return out


def _dumps(body: dict) -> bytes:
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass
class _Call:
    """One prepared request and how to read its answer."""

    path: str
    body: dict
    n_prompts: int
    single: bool
    chat: bool = True
    stream: bool = False
    want_usage: bool = False
    n: int = 1
    numpy: bool = False
    extra: dict = field(default_factory=dict)


def _vectors(body: dict, single: bool, numpy: bool, n: int) -> Any:
    data = sorted(body.get("data") or [], key=lambda d: d.get("index", 0))
    if len(data) != n:
        raise FerryError(f"malformed response: {len(data)} embeddings for {n} inputs", status=200, body=body)
    if numpy:
        rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") if isinstance(d["embedding"], str)
                else np.asarray(d["embedding"], dtype=np.float32) for d in data]
        arr = np.stack(rows).astype(np.float32, copy=False)
        return arr[0] if single else arr
    vecs = [d["embedding"] if isinstance(d["embedding"], list)
            else np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() for d in data]
    return vecs[0] if single else vecs


class _Base:
    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float | httpx.Timeout | None = 120.0,
                 retries: int = 0, max_retry_wait: float = 30.0, headers: dict[str, str] | None = None,
                 on_retry: Callable[[int, FerryError, float], None] | None = None):
        base_url = base_url.rstrip("/")
        if base_url.endswith("/v1"):  # accept the OpenAI-style base URL too
            base_url = base_url[:-3]
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.base_url = base_url
        self.retries, self.max_retry_wait, self.on_retry = int(retries), float(max_retry_wait), on_retry
        self._headers = {"Content-Type": "application/json", "Accept": "application/json",
                         "User-Agent": "ferry-client/0.1", **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = timeout

    # Request construction, shared by both clients.
    def _chat_call(self, model: str, conversations: Any, stream: bool, include_usage: bool | None, params: dict) -> _Call:
        convs, single = _conversations(conversations)
        body = {"model": model, "messages": convs[0] if single else convs, **_clean(params)}
        return self._gen_call("/v1/chat/completions", body, len(convs), single, True, stream, include_usage)

    def _completions_call(self, model: str, prompts: Any, stream: bool, include_usage: bool | None, params: dict) -> _Call:
        ps, single = _prompts(prompts)
        params = _clean(params)
        if "max_completion_tokens" in params:  # /v1/completions knows only max_tokens
            if "max_tokens" in params:
                raise ValueError("give max_completion_tokens or max_tokens, not both")
            params["max_tokens"] = params.pop("max_completion_tokens")
        body = {"model": model, "prompt": ps[0] if single else ps, **params}
        return self._gen_call("/v1/completions", body, len(ps), single, False, stream, include_usage)

    @staticmethod
    def _gen_call(path: str, body: dict, n_prompts: int, single: bool, chat: bool, stream: bool,
                  include_usage: bool | None) -> _Call:
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
        return _Call(path, body, n_prompts, single, chat, stream, want_usage, n if isinstance(n, int) else 1)

    def _embed_call(self, model: str, texts: Any, numpy: bool, params: dict) -> _Call:
        ts, single = _texts(texts)
        body = {"model": model, "input": ts[0] if single else ts, **_clean(params)}
        if numpy:
            body.setdefault("encoding_format", "base64")  # exact float32, a third of the bytes
        return _Call("/v1/embeddings", body, len(ts), single, numpy=numpy)

    def _result(self, call: _Call, r: httpx.Response) -> Any:
        try:
            body = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            raise FerryError(f"response is not JSON: {r.text[:200]!r}", status=r.status_code,
                             request_id=r.headers.get("x-request-id")) from None
        if call.path == "/v1/embeddings":
            return _vectors(body, call.single, call.numpy, call.n_prompts)
        cls = ChatResponse if call.chat else CompletionResponse
        out = _group_choices(cls, body, r.headers, call.n_prompts, call.chat)
        return out[0] if call.single else out

    def _assembler(self, call: _Call, r: httpx.Response) -> _EventAssembler:
        return _EventAssembler(call.n_prompts, call.n, call.want_usage, call.chat, r.headers.get("x-request-id"))

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

    def _url(self, path: str) -> str:
        return self.base_url + path


def _connect_error(exc: httpx.HTTPError) -> FerryError:
    err = _transport_error(exc)
    # A failed connect never reached the server, so it is always safe to retry.
    err._connect = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))  # type: ignore[attr-defined]
    return err


# -- the sync client ----------------------------------------------------------------------------
class FerryClient(_Base):
    """Synchronous client. Thread-safe; use one per process and `close()` it (or `with`).

    base_url: the gateway (`http://host:port`, a trailing `/v1` is accepted); api_key: sent
    as `Authorization: Bearer`; timeout: seconds (or an httpx.Timeout) per request, between
    chunks for streams; retries: how often a 429/503 or a failed connect is retried,
    waiting Retry-After (or a short backoff without one); max_retry_wait: longest single
    wait; a Retry-After beyond it raises at once; on_retry(attempt, error, delay): called
    before each retry's wait.
    """

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float | httpx.Timeout | None = 120.0,
                 retries: int = 0, *, max_retry_wait: float = 30.0, headers: dict[str, str] | None = None,
                 on_retry: Callable[[int, FerryError, float], None] | None = None,
                 transport: httpx.BaseTransport | None = None):
        super().__init__(base_url, api_key, timeout, retries, max_retry_wait, headers, on_retry)
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport)

    # lifecycle
    def close(self) -> None:
        self._http.close()

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    def __enter__(self) -> "FerryClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    # transport with retries
    def _send(self, method: str, path: str, body: dict | None = None, *, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            attempt += 1
            try:
                req = self._http.build_request(method, path, content=None if body is None else _dumps(body))
                r = self._http.send(req, stream=stream)
            except httpx.HTTPError as exc:
                err = _connect_error(exc)
            else:
                if r.status_code < 400:
                    return r
                if stream:
                    r.read()
                    r.close()
                err = _error_from_response(r)
            delay = self._retry_delay(attempt, err)
            if delay is None:
                raise err
            if self.on_retry is not None:
                self.on_retry(attempt, err, delay)
            self._sleep(delay)

    def _run(self, call: _Call) -> Any:
        r = self._send("POST", call.path, call.body, stream=call.stream)
        if call.stream:
            return ChatStream(r, self._assembler(call, r), ChatResponse if call.chat else CompletionResponse)
        return self._result(call, r)

    # the API
    def chat(self, model: str, conversations: Any, *, stream: bool = False, include_usage: bool | None = None,
             **params: Any) -> Any:
        """Chat completions for one conversation or a list of them, in ONE request.

        conversations: a conversation (list of {"role", "content"} dicts), a list of
        conversations, or strings (each a one-message user conversation). params: any
        field of /v1/chat/completions (temperature, top_p, max_completion_tokens or
        max_tokens, stop, seed, n, latency_budget_ms, priority, user, ...), each a scalar
        for every prompt or a list with one value per prompt (`stop` per prompt is a list
        of lists: a list of strings applies to every prompt).

        Returns a ChatResponse for one conversation, else a list in prompt order. With
        stream=True, a ChatStream of `(prompt_index, delta)` StreamEvents (usage included
        unless include_usage=False).
        """
        return self._run(self._chat_call(model, conversations, stream, include_usage, params))

    def completions(self, model: str, prompts: Any, *, stream: bool = False, include_usage: bool | None = None,
                    **params: Any) -> Any:
        """Text completions for one prompt (str) or a list of them, in ONE request; as `chat`."""
        return self._run(self._completions_call(model, prompts, stream, include_usage, params))

    def embed(self, model: str, texts: Any, *, numpy: bool = False, **params: Any) -> Any:
        """Embeddings in input order: one vector for a str, else a list of vectors.

        Vectors are lists of floats; numpy=True gives float32 arrays instead (shape (dim,)
        for a str, (len(texts), dim) for a list), transferred as exact float32.
        params: dimensions, latency_budget_ms, priority, user.
        """
        return self._run(self._embed_call(model, texts, numpy, params))

    def models(self) -> list[str]:
        """The served model ids."""
        return [m["id"] for m in self._send("GET", "/v1/models").json()["data"]]

    def ready(self) -> bool:
        """Whether /readyz answers 200 (models loaded, not draining)."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.1) -> None:
        """Block until the gateway is ready; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} not ready after {timeout} s")
            time.sleep(interval)


# -- the async client -----------------------------------------------------------------------------
class AsyncFerryClient(_Base):
    """The asyncio twin of FerryClient: every method is awaited; `await client.chat(...,
    stream=True)` returns an AsyncChatStream (`async for prompt_index, delta in stream`)."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float | httpx.Timeout | None = 120.0,
                 retries: int = 0, *, max_retry_wait: float = 30.0, headers: dict[str, str] | None = None,
                 on_retry: Callable[[int, FerryError, float], None] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(base_url, api_key, timeout, retries, max_retry_wait, headers, on_retry)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    close = aclose

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    async def __aenter__(self) -> "AsyncFerryClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _send(self, method: str, path: str, body: dict | None = None, *, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            attempt += 1
            try:
                req = self._http.build_request(method, path, content=None if body is None else _dumps(body))
                r = await self._http.send(req, stream=stream)
            except httpx.HTTPError as exc:
                err = _connect_error(exc)
            else:
                if r.status_code < 400:
                    return r
                if stream:
                    await r.aread()
                    await r.aclose()
                err = _error_from_response(r)
            delay = self._retry_delay(attempt, err)
            if delay is None:
                raise err
            if self.on_retry is not None:
                self.on_retry(attempt, err, delay)
            await self._sleep(delay)

    async def _run(self, call: _Call) -> Any:
        r = await self._send("POST", call.path, call.body, stream=call.stream)
        if call.stream:
            return AsyncChatStream(r, self._assembler(call, r), ChatResponse if call.chat else CompletionResponse)
        return self._result(call, r)

    async def chat(self, model: str, conversations: Any, *, stream: bool = False, include_usage: bool | None = None,
                   **params: Any) -> Any:
        """See FerryClient.chat."""
        return await self._run(self._chat_call(model, conversations, stream, include_usage, params))

    async def completions(self, model: str, prompts: Any, *, stream: bool = False, include_usage: bool | None = None,
                          **params: Any) -> Any:
        """See FerryClient.completions."""
        return await self._run(self._completions_call(model, prompts, stream, include_usage, params))

    async def embed(self, model: str, texts: Any, *, numpy: bool = False, **params: Any) -> Any:
        """See FerryClient.embed."""
        return await self._run(self._embed_call(model, texts, numpy, params))

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._send("GET", "/v1/models")).json()["data"]]

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_ready(self, timeout: float = 60.0, interval: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while not await self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} not ready after {timeout} s")
            await asyncio.sleep(interval)
