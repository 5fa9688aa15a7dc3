"""One wrapper for every route: request id, API-key check, OpenAI error mapping,
request metrics and one structured log line per request."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .errors import APIError
from .logs import log_line
from .request_body import header
from .state import gateway_state
from .submission import ClientGone

log = logging.getLogger("ferry.access")

INVALID_INPUT = frozenset({400, 413, 422})  # counted as ferry_rejections_total{reason="invalid"}


@dataclass
class Ctx:
    route: str
    request_id: str
    model: str = ""
    extra: dict = field(default_factory=dict)  # fields for the access log line


Handler = Callable[[Request, Ctx], Awaitable[Response]]


def check_key(request: Request, keys: list[str], name: str = "authorization") -> bool:
    auth = header(request, name) or ""
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    # Compare against every key so timing reveals neither which key nor how much matched.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token.encode(), key.encode())
    return ok


def key_owner(request: Request, keys: list[str]) -> str | None:
    """The caller's API key as the batch API records who owns a file or batch: a digest,
    never the key (None where the server has no keys; the endpoint has checked the key)."""
    if not keys:
        return None
    token = (header(request, "authorization") or "").partition(" ")[2]
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def endpoint(
    route: str, handler: Handler, *, public: bool = False, oip: bool = False
) -> Callable[[Request], Awaitable[Response]]:
    """`route`'s handler wrapped; `oip`: errors in the Open Inference Protocol's shape."""

    async def wrapped(request: Request) -> Response:
        ferry = gateway_state(request)
        rid = header(request, "x-request-id") or new_request_id()
        if len(rid) > 128 or not rid.isprintable():
            rid = new_request_id()
        ctx = Ctx(route, rid)
        ferry.last_request_at = time.monotonic()
        m = ferry.metrics
        start = time.perf_counter()
        m.series(m.in_flight, route).inc()
        try:
            if not public and (keys := ferry.api_keys) and not check_key(request, keys):
                raise APIError(
                    401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key"
                )
            response = await handler(request, ctx)
        except APIError as exc:
            if exc.status in INVALID_INPUT and not public:
                m.series(m.rejections, ctx.model, "invalid").inc()  # refused before queuing
            response = exc.oip_response() if oip else exc.response()
        except ClientGone:
            response = Response(status_code=499)
        except Exception:
            log.exception("unhandled error on %s", route)
            error = APIError(500, "internal server error", code="internal_error")
            response = error.oip_response() if oip else error.response()
        # Appended to the raw list: no handler sets it, so MutableHeaders' scan to replace
        # an earlier value would find none.
        response.raw_headers.append((b"x-request-id", rid.encode("latin-1")))
        if ferry.draining:
            response.headers["Connection"] = "close"  # no more requests on this connection
        if isinstance(response, StreamingResponse):
            return response  # streams account for themselves (in flight, status, latency) when they end
        m.series(m.in_flight, route).dec()
        finish(ferry, ctx, response.status_code, start)
        return response

    return wrapped


# A request id is unique, not secret: 20 random hex digits drawn once per process (a front
# end of several draws its own) and a 12-digit counter. os.urandom per request, a system
# call, was 3% of a front end's time under the zero-cost engines (docs/benchmarks.md).
_ID_PREFIX = os.urandom(10).hex()
_id_counter = itertools.count()


def new_request_id() -> str:
    """32 hex digits, as uuid4().hex gave: the process's random prefix and a counter."""
    return f"{_ID_PREFIX}{next(_id_counter) & 0xFFFFFFFFFFFF:012x}"


def finish(ferry, ctx: Ctx, status: int, start: float) -> None:
    elapsed = time.perf_counter() - start
    m = ferry.metrics
    m.series(m.requests, ctx.route, ctx.model, str(status)).inc()
    if ctx.model:
        m.series(m.request_latency, ctx.route, ctx.model).observe(elapsed)
    if log.isEnabledFor(logging.INFO):
        fields = {
            "request_id": ctx.request_id,
            "route": ctx.route,
            "model": ctx.model,
            "status": status,
            "latency_ms": round(elapsed * 1000.0, 3),
            **ctx.extra,
        }
        log_line(log, "request", fields)


def route(path: str, **handlers: Callable[[Request], Awaitable[Response]]) -> Route:
    """One Route per path, whatever its methods (`route(p, get=..., patch=...)`). Starlette
    answers 405 from the first route whose path matches, with that route's methods in
    `Allow`; one route per method would leave the others out."""
    by_method = {m.upper(): h for m, h in handlers.items()}
    if len(by_method) == 1:
        return Route(path, *by_method.values(), methods=list(by_method))

    async def dispatch(request: Request) -> Response:
        return await by_method["GET" if request.method == "HEAD" else request.method](request)

    return Route(path, dispatch, methods=list(by_method))
