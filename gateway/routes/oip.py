"""The Open Inference Protocol (KServe v2) over HTTP, for custom models (docs/custom-models.md):
server and model metadata, liveness and readiness, and `infer`, whose rows are work items
like a list of prompts. Errors are the protocol's `{"error": message}`, with Ferry's statuses
(400 bad input, 404 unknown model, 422 too many rows, 429/503/504 admission, 500 the model)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..endpoint import Ctx, endpoint
from ..errors import APIError
from ..models.kinds import CUSTOM
from ..request_body import header, read_body
from ..responses import json_response
from ..state import gateway_state
from ..submission import scheduling, submit, timing_headers, wait_items
from ..translate.oip import HEADER_LENGTH, encode_response, metadata, parse_infer

SERVER_NAME = "ferry"
EXTENSIONS = ["binary_tensor_data"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ferry-gateway")
    except PackageNotFoundError:
        return "0"


async def server_metadata(request: Request, ctx: Ctx) -> Response:
    return json_response({"name": SERVER_NAME, "version": _version(), "extensions": EXTENSIONS})


async def live(request: Request, ctx: Ctx) -> Response:
    return Response(status_code=200)


async def ready(request: Request, ctx: Ctx) -> Response:
    """200 once every model serves; 400 before (the protocol's "4xx: false"), as Triton answers."""
    ferry = gateway_state(request)
    ok = ferry.ready and not ferry.draining and not any(m.batcher.failed for m in ferry.models.values())
    return Response(status_code=200 if ok else 400)


def _custom(request: Request, ctx: Ctx):
    name = request.path_params["model"]
    served = gateway_state(request).model(name, CUSTOM)
    ctx.model = served.name
    return served


async def model_metadata(request: Request, ctx: Ctx) -> Response:
    served = _custom(request, ctx)
    return json_response(metadata(served.name, served.engine.inputs, served.engine.outputs))


async def model_ready(request: Request, ctx: Ctx) -> Response:
    try:
        _custom(request, ctx)
    except APIError as exc:
        if exc.status == 404:
            raise
        return Response(status_code=400)  # loading, draining or its core lost: not ready
    return Response(status_code=200)


async def infer(request: Request, ctx: Ctx) -> Response:
    ferry = gateway_state(request)
    cfg = ferry.config
    served = _custom(request, ctx)
    raw = await read_body(request, cfg.max_body_bytes)
    work = parse_infer(raw, header(request, HEADER_LENGTH), served.engine, cfg.max_inputs)
    budget, priority = scheduling(request, work)
    items = await submit(
        served.batcher,
        work.rows,
        one_shot=True,
        costs=served.engine.costs(work.rows),
        budget=budget,
        priority=priority,
        request_id=ctx.request_id,
    )
    results = await wait_items(request, served.batcher, items)
    body, headers = encode_response(served.name, work, results)
    ctx.extra.update(inputs=len(work.rows))
    return Response(body, headers={**headers, **timing_headers(items)})


def oip_routes() -> list:
    from starlette.routing import Route

    def op(path: str, handler, method: str = "GET", public: bool = False) -> Route:
        return Route(path, endpoint(path, handler, oip=True, public=public), methods=[method])

    # The suffixed model routes first: a model's name may hold "/" ({model:path}).
    return [
        op("/v2", server_metadata),
        op("/v2/health/live", live, public=True),  # probes carry no API key, as /healthz and /readyz
        op("/v2/health/ready", ready, public=True),
        op("/v2/models/{model:path}/ready", model_ready),
        op("/v2/models/{model:path}/infer", infer, "POST"),
        op("/v2/models/{model:path}", model_metadata),
    ]
