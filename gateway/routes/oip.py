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
from ..submission import on_infeasible, scheduling, submit, timing_headers, wait_items
from ..translate.oip import (
    HEADER_LENGTH,
    InferenceRequest,
    InferenceResponse,
    ModelMetadata,
    OIPErrorBody,
    ServerMetadata,
    encode_response,
    metadata,
    parse_infer,
)

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


VERSION = "1"  # the one version of every custom model (a model's metadata lists it)


def _custom(request: Request, ctx: Ctx):
    name = request.path_params["model"]
    served = gateway_state(request).model(name, CUSTOM)
    ctx.model = served.name
    version = request.path_params.get("version")
    if version is not None and version != VERSION:
        raise APIError(404, f"model {name} has no version {version!r} (it serves version {VERSION})", code="not_found")
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
        tenant=ferry.tenancy.tenant(request),
        on_infeasible=on_infeasible(request, work),
    )
    results = await wait_items(request, served.batcher, items)
    body, headers = encode_response(served.name, work, results)
    ctx.extra.update(inputs=len(work.rows))
    return Response(body, headers={**headers, **timing_headers(items)})


def oip_routes() -> list:
    from starlette.routing import Route

    def op(path: str, handler, method: str = "GET", public: bool = False) -> Route:
        label = path.replace("{model:path}", "{model}")  # the metrics' and access log's route
        return Route(path, endpoint(label, handler, oip=True, public=public), methods=[method])

    # The suffixed model routes first, versioned ones before the rest: a model's name may
    # hold "/" ({model:path}). Clients that name a version (tritonclient's model_version="1")
    # reach the same handlers.
    versioned = "/v2/models/{model:path}/versions/{version}"
    return [
        op("/v2", server_metadata),
        op("/v2/health/live", live, public=True),  # probes carry no API key, as /healthz and /readyz
        op("/v2/health/ready", ready, public=True),
        op(f"{versioned}/ready", model_ready),
        op(f"{versioned}/infer", infer, "POST"),
        op(versioned, model_metadata),
        op("/v2/models/{model:path}/ready", model_ready),
        op("/v2/models/{model:path}/infer", infer, "POST"),
        op("/v2/models/{model:path}", model_metadata),
    ]


SCHEMAS = (InferenceRequest, InferenceResponse, ModelMetadata, ServerMetadata, OIPErrorBody)
OIP_ERRORS = {
    "400": "Bad tensors or parameters (the message says which and why)",
    "401": "Missing or invalid API key",
    "404": "Not a custom model served here",
    "413": "Body too large",
    "422": "More rows than --max-inputs, or a bad scheduling header",
    "429": "Queue full or budget infeasible (see Retry-After)",
    "500": "The model failed on this request's rows",
    "503": "Loading, draining or its engine core lost (see Retry-After)",
    "504": "Latency budget exceeded while queued",
}


def oip_paths(ref: str, max_body_bytes: int, names: list[str] | None = None) -> dict[str, dict]:
    """The /v2 routes for /openapi.json; `ref` formats a schema name into a $ref; `names`: the
    custom models served (another name is a 404), once they are loaded."""

    def json(name: str) -> dict:
        return {"application/json": {"schema": {"$ref": ref.format(model=name)}}}

    schema: dict = {"type": "string", "enum": names} if names else {"type": "string"}
    model = [{"name": "model", "in": "path", "required": True, "schema": schema}]
    errors = {code: {"description": text, "content": json("OIPErrorBody")} for code, text in OIP_ERRORS.items()}

    def op(op_id: str, summary: str, ok: dict, failures: tuple[str, ...], **extra) -> dict:
        responses = {"200": ok, **{c: errors[c] for c in failures}}
        return {"summary": summary, "tags": ["v2"], "operationId": op_id, "responses": responses, **extra}

    empty = {"description": "true"}
    false = {"400": {"description": "false"}}
    on_model = {"parameters": model, "security": [{"apiKey": []}, {}]}
    binary = {"schema": {"type": "string", "format": "binary"}}
    paths = {
        "/v2": {"get": op("get_v2", "Server metadata", {"description": "OK", "content": json("ServerMetadata")}, ())},
        "/v2/health/live": {"get": op("get_v2_live", "Liveness (200: live)", empty, ())},
        "/v2/health/ready": {
            "get": {
                **op("get_v2_ready", "Readiness (200: every model serves)", empty, ()),
                "responses": {"200": empty, **false},
            }
        },
        "/v2/models/{model}": {
            "get": op(
                "get_v2_model",
                "A custom model's metadata",
                {"description": "OK", "content": json("ModelMetadata")},
                ("401", "404", "503"),
                **on_model,
            )
        },
        "/v2/models/{model}/ready": {
            "get": {
                **op("get_v2_model_ready", "A custom model's readiness", empty, ("401", "404"), **on_model),
                "responses": {
                    "200": empty,
                    "400": {"description": "false"},
                    "401": errors["401"],
                    "404": errors["404"],
                },
            }
        },
        "/v2/models/{model}/infer": {
            "post": op(
                "post_v2_model_infer",
                "Inference over a custom model; each row is a work item",
                {
                    "description": "OK (binary outputs: the JSON header, Inference-Header-Content-Length bytes, "
                    "then the tensors)",
                    "content": {**json("InferenceResponse"), "application/octet-stream": binary},
                },
                tuple(OIP_ERRORS),
                requestBody={
                    "required": True,
                    "description": f"At most {max_body_bytes} bytes; binary tensors after the JSON header "
                    "(Inference-Header-Content-Length)",
                    "content": json("InferenceRequest"),
                },
                **on_model,
            )
        },
    }
    version = {"name": "version", "in": "path", "required": True, "schema": {"type": "string", "enum": [VERSION]}}
    for path in ("/v2/models/{model}", "/v2/models/{model}/ready", "/v2/models/{model}/infer"):
        versioned = path.replace("{model}", "{model}/versions/{version}")
        paths[versioned] = {
            method: {**operation, "operationId": operation["operationId"] + "_version", "parameters": [*model, version]}
            for method, operation in paths[path].items()
        }
    return paths
