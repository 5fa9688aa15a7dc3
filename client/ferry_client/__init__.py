"""Python client for a Ferry gateway: many prompts in one call, results in prompt order.

    from ferry_client import FerryClient

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

This package needs only httpx (numpy for `embed(..., numpy=True)`): it installs on its own
(`pip install ./client`) and imports none of the server's packages.
"""

from __future__ import annotations

from .async_client import AsyncFerryClient
from .errors import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    BadRequest,
    FerryError,
    GatewayTimeout,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    ServerError,
    ServiceUnavailable,
    UnprocessableEntity,
)
from .events import StreamEvent
from .responses import ChatResponse, Choice, CompletionResponse, RequestInfo, Response, Usage
from .streaming import AsyncChatStream, ChatStream, agather_stream, gather_stream
from .sync_client import FerryClient

__all__ = [
    "APIConnectionError",
    "APITimeoutError",
    "AsyncChatStream",
    "AsyncFerryClient",
    "AuthenticationError",
    "BadRequest",
    "ChatResponse",
    "ChatStream",
    "Choice",
    "CompletionResponse",
    "FerryClient",
    "FerryError",
    "GatewayTimeout",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "RateLimited",
    "RequestInfo",
    "Response",
    "ServerError",
    "ServiceUnavailable",
    "StreamEvent",
    "UnprocessableEntity",
    "Usage",
    "agather_stream",
    "gather_stream",
]
