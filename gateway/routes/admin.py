"""Live tuning: GET and PATCH /admin/models/{model}/batching.

Off (404) unless --admin-token is set; a wrong or missing token gets 401. A change applies
from the next batch; queued work keeps its place.
"""
from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response

from batcher.settings import SettingsError

from ..endpoint import Ctx, check_key
from ..errors import APIError
from ..http import parse
from ..responses import json_response
from ..schemas import BatchingPatch

log = logging.getLogger("ferry.admin")


def _authorize(request: Request):
    ferry = request.app.state.ferry
    token = ferry.config.admin_token
    if not token:
        raise APIError(404, "Not Found", code="not_found")
    if not check_key(request, [token]):
        raise APIError(401, "missing or invalid admin token", code="invalid_admin_token")
    name = request.path_params["model"]
    served = ferry.models.get(name)
    if served is None:
        raise APIError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
    return served


async def get_batching(request: Request, ctx: Ctx) -> Response:
    served = _authorize(request)
    ctx.model = served.name
    return json_response({**served.batcher.settings.to_dict(), "cost_model": cost_models(served.batcher)})


def cost_models(batcher) -> dict:
    """The fitted cost models, so an operator can see what admission and policies assume."""
    out = {}
    for phase, model in getattr(batcher, "cost_models", {"embed": batcher.cost}).items():
        p = model.params
        out[phase] = {"fixed_ms": p.fixed * 1e3, "per_item_ms": p.per_item * 1e3, "per_token_ms": p.per_token * 1e3,
                      "observations": model.observations}
    return out


async def patch_batching(request: Request, ctx: Ctx) -> Response:
    served = _authorize(request)
    ctx.model = served.name
    patch = await parse(request, BatchingPatch, 64 * 1024)
    changes = patch.model_dump(exclude_unset=True)
    try:
        new = served.batcher.update(**changes)
    except SettingsError as exc:
        raise APIError(422, f"{exc.field}: {exc.message}", code="invalid_value", param=exc.field) from None
    log.info("admin changed batching of %s: %s", served.name, changes)
    return json_response(new.to_dict())
