"""The live page: GET /ui, its assets under /ui/static/, and GET /ui/stats.

The page (gateway/ui/static/: HTML, plain JavaScript, CSS and a vendored uPlot, shipped as
package data, no build step) polls /ui/stats every second and changes knobs through the
admin API with a token typed into it. Like /metrics, these routes are open whatever
`--api-key` says: they carry the figures /metrics carries, plus each model's settings and
fitted cost model, and no prompt, key or token. Every answer carries a strict
Content-Security-Policy: scripts and styles from the server only, no inline script.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from batcher.knobs import knobs
from batcher.settings import BatchingSettings

from ..errors import APIError
from ..responses import json_response
from ..routes.system import all_families
from ..state import gateway_state
from .stats import ModelInfo

log = logging.getLogger("ferry.gateway")

STATIC = Path(__file__).resolve().parent / "static"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; object-src 'none'; base-uri 'none'; form-action 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
# The knobs the page may change (all live in the admin PATCH), in the order it shows them.
PAGE_KNOBS = ("max_batch_size", "max_wait_ms", "policy", "default_budget_ms", "max_queue", "max_running", "max_itl_ms")
DESCRIBE_TIMEOUT_S = 2.0


def _assets() -> dict[str, tuple[bytes, str]]:
    """Every file the page may load, read once: nothing outside this list is ever served."""
    out = {}
    for path in STATIC.rglob("*"):
        if path.is_file():  # LICENSE and README as plain text
            media = TYPES.get(path.suffix, "text/plain; charset=utf-8")
            out[path.relative_to(STATIC).as_posix()] = (path.read_bytes(), media)
    return out


ASSETS = _assets()


def _knob_specs() -> list[dict[str, Any]]:
    by_name = {k.name: k for k in knobs(BatchingSettings)}
    specs = []
    for name in PAGE_KNOBS:
        k = by_name[name]
        assert k.live, name  # the page changes only what PATCH takes
        specs.append(
            {
                "name": k.name,
                "kind": k.kind.__name__,
                "unit": k.unit,
                "nullable": k.nullable,
                "null": k.null,
                "choices": list(k.choices) if k.choices else None,
                "help": k.help,
            }
        )
    return specs


KNOB_SPECS = _knob_specs()


async def page(request: Request) -> Response:
    body, media = ASSETS["index.html"]
    return Response(body, media_type=media, headers={**HEADERS, "Cache-Control": "no-cache"})


async def asset(request: Request) -> Response:
    found = ASSETS.get(request.path_params["path"])
    if found is None:
        return APIError(404, "Not Found", code="not_found").response({**HEADERS, "Cache-Control": "no-cache"})
    body, media = found
    return Response(body, media_type=media, headers={**HEADERS, "Cache-Control": "no-cache"})


async def _info(served) -> ModelInfo:
    batcher = served.batcher
    settings, cost = batcher.settings.to_dict(), None
    try:  # the fitted cost model lives where the batcher runs (an engine core, or here)
        described = await asyncio.wait_for(batcher.describe(), DESCRIBE_TIMEOUT_S)
        cost = described.pop("cost_model", None)
        settings = described
    except Exception as exc:  # a lost or stuck core: its settings as last known, no cost model
        log.debug("ui: no answer from the batcher of %s: %s", served.name, exc)
    return ModelInfo(served.name, served.kind, settings, cost)


async def stats(request: Request) -> Response:
    ferry = gateway_state(request)
    families = await all_families(ferry)
    infos = await asyncio.gather(*(_info(m) for m in ferry.models.values()))
    body = ferry.ui_ring.stats(families, infos)
    admin = bool(ferry.config.admin_token)  # off: the page's knobs are read-only
    body.update({"ready": ferry.ready, "draining": ferry.draining, "admin": admin, "knob_specs": KNOB_SPECS})
    return json_response(body, headers={**HEADERS, "Cache-Control": "no-store"})


def ui_routes() -> list[Route]:
    return [
        Route("/ui", page, methods=["GET"]),
        Route("/ui/stats", stats, methods=["GET"]),
        Route("/ui/static/{path:path}", asset, methods=["GET"]),
    ]
