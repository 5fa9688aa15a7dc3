"""The Starlette application: routes, lifespan (model loading in the background so
/healthz answers at once and /readyz tells when models are warm), and drain."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from . import openapi
from .config import ServerConfig
from .endpoint import endpoint, route
from .errors import APIError
from .jobs.service import BatchJobs
from .metrics.registry import GatewayMetrics
from .models.catalogue import ModelSpec, default_specs
from .routes import admin, batches, chat, embeddings, oip, system, tokenize
from .state import GatewayState
from .tenancy import Tenancy
from .ui import route as ui

log = logging.getLogger("ferry.gateway")


def model_routes() -> dict[str, Callable[[Request], Awaitable[Response]]]:
    """The routes that carry inference: POST only, no path parameters."""
    return {
        "/v1/embeddings": endpoint("/v1/embeddings", embeddings.create_embeddings),
        "/v1/chat/completions": endpoint("/v1/chat/completions", chat.chat_completions),
        "/v1/completions": endpoint("/v1/completions", chat.completions),
    }


def routes(models: dict[str, Callable[[Request], Awaitable[Response]]]) -> list[Route]:
    # Starlette tries routes in order, a regular expression each; no two paths overlap, so
    # the busiest come first rather than after six misses per request. (Gateway answers
    # the model routes before Starlette's router sees them; they stay here for the rest:
    # a GET on them answers 405 from here, and the OpenAPI description lists them.)
    return [
        *(Route(path, handler, methods=["POST"]) for path, handler in models.items()),
        Route("/healthz", system.healthz, methods=["GET"]),
        Route("/readyz", system.readyz, methods=["GET"]),
        Route("/metrics", system.metrics, methods=["GET"]),
        Route("/openapi.json", openapi.openapi, methods=["GET"]),
        Route("/v1/models", endpoint("/v1/models", system.list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint("/v1/models/{model}", system.get_model), methods=["GET"]),
        Route("/tokenize", endpoint("/tokenize", tokenize.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint("/detokenize", tokenize.detokenize), methods=["POST"]),
        Route("/tokenizer_info", endpoint("/tokenizer_info", tokenize.tokenizer_info), methods=["GET"]),
        *batches.batch_routes(),
        *oip.oip_routes(),
        route(
            "/admin/tenants",
            get=endpoint("/admin/tenants", admin.get_tenants, public=True),
            patch=endpoint("/admin/tenants", admin.patch_tenants, public=True),
        ),
        route(
            "/admin/models/{model:path}/batching",
            get=endpoint("/admin/batching", admin.get_batching, public=True),
            patch=endpoint("/admin/batching", admin.patch_batching, public=True),
        ),
        *ui.ui_routes(),
    ]


def _oip_path(path: str) -> bool:
    """Under /v2 the Open Inference Protocol's error shape holds, whatever answers."""
    return path == "/v2" or path.startswith("/v2/")


async def _http_error(request, exc):
    """Unknown routes and methods answer in the same error shape as the routes around them:
    OpenAI's, or the Open Inference Protocol's `{"error": message}` under /v2."""
    code = "not_found" if exc.status_code == 404 else "method_not_allowed"
    if exc.status_code == 404:
        message = f"no route {request.url.path!r}" if _oip_path(request.url.path) else "Not Found"
    else:
        message = f"method {request.method} is not allowed here"
    error = APIError(exc.status_code, message, code=code)
    headers = getattr(exc, "headers", None)
    return error.oip_response(headers) if _oip_path(request.url.path) else error.response(headers=headers)


async def _server_error(request, exc):
    """An exception that escaped a route (the routes' own wrapper answers theirs): a 500 in
    the route family's shape, never Starlette's plain-text page."""
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    error = APIError(500, "internal server error", code="internal_error")
    return error.oip_response() if _oip_path(request.url.path) else error.response()


class Gateway(Starlette):
    """Starlette, with the model routes answered by one dictionary lookup.

    Every other request goes through Starlette's middleware (server errors, exception
    handlers) and its router. A POST to a model route skips them: `endpoint` already turns
    every exception into an OpenAI-style answer, and under the zero-cost engines those
    layers (three wrappers around each `send`, a regular expression per route tried) were
    a fifth of a front end's time per request (docs/benchmarks-history.md, "A leaner request path").
    """

    def __init__(self, *, fast: dict[str, Callable[[Request], Awaitable[Response]]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fast = fast
        self.ferry: GatewayState | None = None  # also app.state.ferry (gateway_state reads this)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            handler = self._fast.get(scope["path"])
            if handler is not None:
                scope["app"] = self
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(
    config: ServerConfig | None = None,
    specs: list[ModelSpec] | None = None,
    metrics: GatewayMetrics | None = None,
    *,
    cores: list[dict] | None = None,
) -> Gateway:
    """`cores`: in a front end of several (`--api-workers N`), the engine cores its
    supervisor runs, one account per model (gateway/cores/supervisor.py)."""
    config = config or ServerConfig()
    if cores is not None and specs is not None:
        raise ValueError("engine cores load their models from the configuration; specs cannot cross processes")
    if config.engine_cores and specs is not None:
        # Models handed over as objects (tests, `Ferry(specs=...)`) cannot cross to another
        # process, and an engine core loads its model from the configuration: they run here.
        config = dataclasses.replace(config, engine_cores=False)
    ferry = GatewayState(config, metrics or GatewayMetrics(), specs if specs is not None else default_specs(config))
    ferry.cores = cores
    ferry.tenancy = Tenancy.of(config)
    ferry.metrics.tenant_labels.named.update(ferry.tenancy.named)
    jobs = ferry.jobs = BatchJobs(ferry)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loader = asyncio.create_task(ferry.load())
        jobs.start(loader)  # resumes unfinished batch jobs once the models are loaded
        if cores is not None:
            # A front end of several shares its listening socket with the others, and the
            # kernel hands a connection to whichever process accepts first; uvicorn accepts
            # once this startup returns. Attaching (a chat model's tokenizer: seconds) first
            # keeps a replacement front end from answering 503 not_ready beside a sibling that
            # serves. A single server accepts at once: /healthz answers while models load.
            await asyncio.wait([loader])
        try:
            yield
        finally:
            if not loader.done():
                loader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loader
            failed = await ferry.drain(config.drain_timeout)
            if failed:
                log.warning("drain timeout: %d accepted items ended with an error", failed)
            await jobs.close()
            await ferry.close()

    fast = model_routes()
    app = Gateway(
        fast=fast,
        routes=routes(fast),
        lifespan=lifespan,
        exception_handlers={404: _http_error, 405: _http_error, 500: _server_error},
    )
    app.state.ferry = app.ferry = ferry
    return app
