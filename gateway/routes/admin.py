"""Live tuning: GET and PATCH /admin/models/{model}/batching, and GET and PATCH
/admin/tenants (every tenant's weight and quotas, for every model).

Off (404) unless --admin-token is set; a wrong or missing token gets 401. A change applies
from the next batch; queued work keeps its place. Both bodies come from the declaration of
the batching knobs (batcher/settings.py): GET answers every knob, PATCH takes the `live` ones.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any

from pydantic import BaseModel, Field, create_model
from starlette.requests import Request
from starlette.responses import Response

from batcher.errors import BatchingError
from batcher.fairness import TenantPolicy
from batcher.knobs import Knob, knobs
from batcher.settings import BatchingSettings, SettingsError

from ..endpoint import Ctx, check_key
from ..errors import APIError
from ..models.config_file import TENANT_NAME
from ..request_body import parse
from ..responses import json_response
from ..schemas import Integral, Strict
from ..state import gateway_state

log = logging.getLogger("ferry.admin")
KNOBS = knobs(BatchingSettings)


def _describe(k: Knob, with_live: bool) -> str:
    text = k.help + (f", in {k.unit}" if k.unit else "")
    if k.nullable and k.null:
        text += f"; null: {k.null}"
    if with_live and not k.live:
        text += f". Set at start only ({k.flag}); PATCH refuses it"
    return text + "."


def _absent(schema: dict) -> None:
    schema.pop("default", None)


def _patch_field(k: Knob) -> tuple[Any, Any]:
    """Absent means unchanged. A knob that may be null takes null; the others refuse it, and
    their schema has no `default: null` that would suggest otherwise."""
    annotation, bounds = k.annotation, k.bounds
    if k.kind is int:  # 2.0 is the integer 2 (Integral goes after the bounds: gateway/schemas.py)
        annotation, bounds = Annotated[int, Field(**k.bounds), Integral], {}
        annotation = annotation | None if k.nullable else annotation
    if k.nullable:
        return annotation, Field(None, description=_describe(k, False), **bounds)
    return annotation, Field(None, description=_describe(k, False), json_schema_extra=_absent, **bounds)


_NULLABLE = [k for k in KNOBS if k.live and k.nullable]
# Typed as Any: mypy checks a ** argument against create_model's own keyword parameters too.
_PATCH_FIELDS: dict[str, Any] = {k.name: _patch_field(k) for k in KNOBS if k.live}
_OUT_FIELDS: dict[str, Any] = {k.name: (k.annotation, Field(..., description=_describe(k, True))) for k in KNOBS}
BatchingPatch = create_model(
    "BatchingPatch",
    __base__=Strict,
    __module__=__name__,
    __doc__="Only the fields sent change. "
    + " and ".join(f"`{k.name}`" for k in _NULLABLE)
    + f" may be null ({', '.join(k.null or 'none' for k in _NULLABLE)}); the others may not.",
    **_PATCH_FIELDS,
)
BatchingSettingsOut = create_model(
    "BatchingSettingsOut",
    __base__=BaseModel,
    __module__=__name__,
    __doc__="Every batching setting of the model; the GET also gives the fitted cost models.",
    **_OUT_FIELDS,
    cost_model=(dict[str, Any] | None, Field(None, description="The fitted cost model of each phase (GET only).")),
)


def _admin(request: Request):
    ferry = gateway_state(request)
    token = ferry.config.admin_token
    if not token:
        raise APIError(404, "Not Found", code="not_found")
    if not check_key(request, [token]):
        raise APIError(401, "missing or invalid admin token", code="invalid_admin_token")
    return ferry


def _authorize(request: Request):
    ferry = _admin(request)
    name = request.path_params["model"]
    served = ferry.models.get(name)
    if served is None:
        raise APIError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
    return served


async def get_batching(request: Request, ctx: Ctx) -> Response:
    served = _authorize(request)
    ctx.model = served.name
    # Every setting and the fitted cost models, so an operator can see what admission and
    # policies assume (a batcher in an engine core answers from there).
    return json_response(await _answered(served.batcher.describe()))


async def _answered(answer):
    """An engine core that cannot answer (lost, or too slow) is a BatchingError."""
    try:
        return await answer
    except BatchingError as exc:
        raise APIError.from_batching(exc) from None


async def patch_batching(request: Request, ctx: Ctx) -> Response:
    served = _authorize(request)
    ctx.model = served.name
    patch = await parse(request, BatchingPatch, 64 * 1024)
    changes = patch.model_dump(exclude_unset=True)
    try:
        new = await _answered(served.batcher.update(**changes))
    except SettingsError as exc:
        raise APIError(422, f"{exc.field}: {exc.message}", code="invalid_value", param=exc.field) from None
    log.info("admin changed batching of %s: %s", served.name, changes)
    return json_response(new.to_dict())


class TenantIn(Strict):
    """One tenant's weight and quotas (as in the config file's `tenants:`)."""

    name: str = Field(pattern=TENANT_NAME, description="the tenant's name")
    weight: float = Field(1.0, gt=0, le=1000, description="its share against the others'")
    # JSON's 2.0 is the integer 2 (Integral, as the batching knobs take it).
    tokens_per_minute: Annotated[int, Field(ge=1, le=10**12), Integral] | None = Field(
        None, description="quota: tokens a minute, per model"
    )
    max_concurrent: Annotated[int, Field(ge=1, le=10**9), Integral] | None = Field(
        None, description="quota: items queued or running at once, per model"
    )


class TenantsPatch(Strict):
    """Every tenant's weight and quotas, replacing the ones in force (a tenant left out gets
    weight 1 and no quota; a name given twice, its last entry). Keys stay as the config file
    gives them."""

    tenants: list[TenantIn] = Field(max_length=10_000)


class TenantsOut(BaseModel):
    """The tenants' weights and quotas in force, and per model served in this process each
    tenant's counter, items and service."""

    tenants: dict[str, dict[str, Any]] = Field(description="by name: weight, tokens_per_minute, max_concurrent")
    models: dict[str, dict[str, dict[str, Any]]] = Field(
        description="by model, by tenant: weight, counter, active, queued, tokens, service_last_minute"
    )


def _tenants_view(ferry: Any) -> dict[str, Any]:
    """The policies in force, and per model served in this process each tenant's counter
    and service (a model in an engine core reports its own on its /metrics)."""
    policies = {name: dataclasses.asdict(p) for name, p in ferry.tenancy.policies.items()}
    models = {
        name: served.batcher.inner.tenant_report()
        for name, served in ferry.models.items()
        if hasattr(served.batcher, "inner")
    }
    return {"tenants": policies, "models": models}


async def get_tenants(request: Request, ctx: Ctx) -> Response:
    return json_response(_tenants_view(_admin(request)))


async def patch_tenants(request: Request, ctx: Ctx) -> Response:
    ferry = _admin(request)
    patch = await parse(request, TenantsPatch, 1024 * 1024)
    # A name given twice: the last entry wins (the schema cannot say names are unique).
    policies = {t.name: TenantPolicy(t.weight, t.tokens_per_minute, t.max_concurrent) for t in patch.tenants}
    for served in ferry.models.values():
        await _answered(served.batcher.update(tenants={n: dataclasses.asdict(p) for n, p in policies.items()}))
    ferry.tenancy = dataclasses.replace(ferry.tenancy, policies=policies)
    ferry.metrics.tenant_labels.named.update(policies)
    log.info("admin changed tenants: %s", {n: dataclasses.asdict(p) for n, p in policies.items()})
    return json_response(_tenants_view(ferry))
