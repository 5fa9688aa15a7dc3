"""GET /openapi.json: an OpenAPI 3 description of every public route, generated from the
same pydantic models that validate requests, so it cannot drift from behaviour."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request

from . import schemas as s
from .responses import json_response

REF = "#/components/schemas/{model}"
ERRORS = {
    "400": "Malformed JSON",
    "401": "Missing or invalid API key",
    "404": "Unknown model",
    "413": "Body too large",
    "422": "Invalid field (param names it) or a limit",
    "429": "Queue full, budget infeasible or too many streams (see Retry-After)",
    "500": "Engine failure on this input",
    "503": "Loading or draining (see Retry-After)",
    "504": "Latency budget exceeded while queued",
}

# (path, method, summary, request model, 200 model, stream?, tags, extra parameters)
OPERATIONS: list[tuple[str, str, str, type[BaseModel] | None, type[BaseModel] | None, bool, str]] = [
    ("/v1/embeddings", "post", "Create embeddings; each input is its own work item", s.EmbeddingsRequest, s.EmbeddingsResponse, False, "v1"),
    ("/v1/chat/completions", "post", "Chat completions for one or several conversations", s.ChatCompletionRequest, s.ChatCompletionResponse, True, "v1"),
    ("/v1/completions", "post", "Completions for one or several prompts", s.CompletionRequest, s.CompletionResponse, True, "v1"),
    ("/v1/models", "get", "List served models", None, s.ModelList, False, "v1"),
    ("/v1/models/{model}", "get", "One served model", None, s.ModelCard, False, "v1"),
    ("/healthz", "get", "Liveness", None, s.Status, False, "ops"),
    ("/readyz", "get", "Readiness: models loaded and warmed up", None, s.Status, False, "ops"),
    ("/admin/models/{model}/batching", "get", "Current batching settings", None, s.BatchingSettingsOut, False, "admin"),
    ("/admin/models/{model}/batching", "patch", "Change batching settings live", s.BatchingPatch, s.BatchingSettingsOut, False, "admin"),
]

_extra_paths: dict[str, dict[str, Any]] = {}
_extra_models: list[type[BaseModel]] = []


def register(path: str, method: str, operation: dict[str, Any], models: list[type[BaseModel]] = ()) -> None:
    """Other route modules (batch jobs) add their operations here."""
    _extra_paths.setdefault(path, {})[method] = operation
    _extra_models.extend(models)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def build() -> dict[str, Any]:
    models = {m for op in OPERATIONS for m in (op[3], op[4]) if m is not None} | {s.ErrorResponse, *_extra_models}
    ordered = sorted(models, key=lambda m: m.__name__)
    _, defs = models_json_schema([(m, "validation") for m in ordered], ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for path, method, summary, req, resp, stream, tag in OPERATIONS:
        op: dict[str, Any] = {"summary": summary, "tags": [tag], "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}"}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(req)}}}
        content: dict[str, Any] = {"application/json": {"schema": _ref(resp)}} if resp is not None else {}
        if stream:
            content["text/event-stream"] = {"schema": {"type": "string", "description": "SSE chunks when stream=true"}}
        responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
        if path == "/readyz":
            responses["503"] = {"description": "Loading or draining", "content": {"application/json": {"schema": _ref(s.Status)}}}
        elif tag != "ops":
            for code, text in ERRORS.items():
                responses[code] = {"description": text, "content": {"application/json": {"schema": _ref(s.ErrorResponse)}}}
        op["responses"] = responses
        if tag == "admin":
            op["security"] = [{"adminToken": []}]
        elif tag == "v1":
            op["security"] = [{"apiKey": []}, {}]
        paths.setdefault(path, {})[method] = op
    for path, ops in _extra_paths.items():
        paths.setdefault(path, {}).update(ops)
    _batch_jobs(paths)
    paths["/metrics"] = {"get": {"summary": "Prometheus metrics", "tags": ["ops"], "operationId": "get_metrics",
                                 "responses": {"200": {"description": "Prometheus text format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Ferry", "version": "0.1.0",
                 "description": "Latency-aware dynamic micro-batching gateway (OpenAI-compatible)."},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"},
                                "adminToken": {"type": "http", "scheme": "bearer"}},
        },
    }


def _batch_jobs(paths: dict[str, dict[str, Any]]) -> None:
    """The OpenAI batch API (gateway/routes/batches.py): request schema from BatchCreate;
    file and batch objects follow OpenAI's shapes and are documented as objects."""
    from .jobs.validate import BatchCreate

    obj = {"type": "object"}
    errors = {code: {"description": text, "content": {"application/json": {"schema": _ref(s.ErrorResponse)}}}
              for code, text in ERRORS.items() if code in ("400", "401", "404", "413", "422", "503")}

    def op(op_id: str, summary: str, content: dict[str, Any], param: str | None = None, body: dict | None = None) -> dict:
        out: dict[str, Any] = {"summary": summary, "tags": ["batch"], "operationId": op_id, "security": [{"apiKey": []}, {}],
                               "responses": {"200": {"description": "OK", "content": content}, **errors}}
        if param:
            out["parameters"] = [{"name": param, "in": "path", "required": True, "schema": {"type": "string"}}]
        if body:
            out["requestBody"] = body
        return out

    upload = {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["purpose", "file"],
        "properties": {"purpose": {"type": "string", "enum": ["batch"]}, "file": {"type": "string", "format": "binary"}}}}}}
    create = {"required": True, "content": {"application/json": {"schema": BatchCreate.model_json_schema(ref_template=REF)}}}
    j = {"application/json": {"schema": obj}}
    paths["/v1/files"] = {"post": op("post_files", "Upload a JSONL batch input file", j, body=upload)}
    paths["/v1/files/{file_id}"] = {"get": op("get_file", "A file object", j, "file_id")}
    paths["/v1/files/{file_id}/content"] = {"get": op("get_file_content", "A file's content (JSONL)",
                                                      {"application/jsonl": {"schema": {"type": "string"}}}, "file_id")}
    paths["/v1/batches"] = {"post": op("post_batches", "Create a batch job from an uploaded file", j, body=create),
                            "get": op("list_batches", "List batch jobs (paginated with after and limit)", j)}
    paths["/v1/batches/{batch_id}"] = {"get": op("get_batch", "A batch job: status and request counts", j, "batch_id")}
    paths["/v1/batches/{batch_id}/cancel"] = {"post": op("cancel_batch", "Cancel a batch job", j, "batch_id")}


async def openapi(request: Request):
    app = request.app
    if getattr(app.state, "openapi", None) is None:
        app.state.openapi = build()
    return json_response(app.state.openapi)
