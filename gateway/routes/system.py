"""Health, readiness, metrics and the model list."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from starlette.requests import Request
from starlette.responses import Response

from ..endpoint import Ctx
from ..errors import not_found_model, not_ready
from ..metrics.merge import merged_exposition, merged_families
from ..responses import json_response
from ..state import gateway_state


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    ferry = gateway_state(request)
    if ferry.draining:
        return json_response({"status": "draining"}, 503, {"Retry-After": "1", "Connection": "close"})
    if not ferry.ready:
        status = "failed" if ferry.load_error else "loading"
        return json_response({"status": status, "error": ferry.load_error}, 503)
    failed = {name: m.batcher.failed for name, m in ferry.models.items() if m.batcher.failed}
    if failed:
        return json_response({"status": "failed", "error": "; ".join(f"{k}: {v}" for k, v in failed.items())}, 503)
    return json_response({"status": "ready", "models": list(ferry.models)})


async def metrics(request: Request) -> Response:
    ferry = gateway_state(request)
    registry = _registry(ferry)
    scraped = await _scrapes(ferry)
    compat = ferry.config.metrics_compat
    if scraped is None and compat == "none":  # one process: the server's registry holds everything
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    return Response(merged_exposition(registry, scraped or [], compat), media_type=CONTENT_TYPE_LATEST)


def _registry(ferry) -> CollectorRegistry:
    """This process's registry or, with several front ends (`--api-workers N`), the one that
    reads every front end's and the supervisor's series (gateway/metrics/shared.py; this
    process's are among them, so its own registry is not read as well)."""
    return ferry.shared_metrics if ferry.shared_metrics is not None else ferry.metrics.registry


async def _scrapes(ferry) -> list[Any] | None:
    """Each engine core's metrics (None: no cores, this process holds everything)."""
    answers = await asyncio.gather(*(m.batcher.scrape() for m in ferry.models.values()), return_exceptions=True)
    if all(a is None for a in answers) and ferry.shared_metrics is None:
        return None
    # A batcher in this process has nothing to add; a lost or stuck core is left out.
    return [a for a in answers if a is not None and not isinstance(a, BaseException)]


async def all_families(ferry) -> list[Metric]:
    """The metric families one /metrics scrape shows (the live page reads these)."""
    scraped = await _scrapes(ferry)
    if scraped is None:
        return list(ferry.metrics.registry.collect())
    return merged_families(_registry(ferry), scraped)


def _model_card(m) -> dict:
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "ferry", "type": m.kind}


async def list_models(request: Request, ctx: Ctx) -> Response:
    ferry = gateway_state(request)
    if not ferry.ready:  # an empty list would read as "serves nothing"; the POST routes say 503 too
        raise not_ready(ferry.load_error)
    return json_response({"object": "list", "data": [_model_card(m) for m in ferry.models.values()]})


async def get_model(request: Request, ctx: Ctx) -> Response:
    ferry = gateway_state(request)
    if not ferry.ready:
        raise not_ready(ferry.load_error)
    name = request.path_params["model"]
    m = ferry.models.get(name)
    if m is None:
        raise not_found_model(name, list(ferry.models))
    return json_response(_model_card(m))
