"""GET /openapi.json: an OpenAPI 3.1 description of every public route, generated from the
same pydantic models that validate requests (made for this server's limits), so it cannot
drift from behaviour. Once the models are loaded it also names what only the server knows:
the served models of each route and the embedding sizes they produce."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request

from . import schemas as s
from .config import ServerConfig
from .jobs import objects as jo
from .jobs.validate import MAX_FILE_BYTES, BatchCreate
from .limits import RequestModels, request_models
from .models.kinds import CHAT, CUSTOM, EMBEDDING
from .models.start import ServedModel
from .responses import json_response
from .routes import admin, oip, tokenize
from .state import gateway_state

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
# One server-sent event (Open API 3.1: the schema of a stream describes each event).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "description": "With stream=true: one chunk per event, then `data: [DONE]`",
    "properties": {
        "data": {"type": "string", "description": "A chunk as JSON, or [DONE]"},
        "event": {"type": "string"},
    },
}
BATCH_ERRORS = ("400", "401", "404", "413", "422", "503")


def _operations(req: RequestModels) -> list[tuple]:
    # (path, method, summary, request model, 200 model, stream?, tag)
    return [
        (
            "/v1/embeddings",
            "post",
            "Create embeddings; each input is its own work item",
            req.embeddings,
            s.EmbeddingsResponse,
            False,
            "v1",
        ),
        (
            "/v1/chat/completions",
            "post",
            "Chat completions for one or several conversations",
            req.chat,
            s.ChatCompletionResponse,
            True,
            "v1",
        ),
        (
            "/v1/completions",
            "post",
            "Completions for one or several prompts",
            req.completions,
            s.CompletionResponse,
            True,
            "v1",
        ),
        ("/v1/models", "get", "List served models", None, s.ModelList, False, "v1"),
        (
            "/tokenize",
            "post",
            "A text or a conversation as a chat model's tokens (vLLM's)",
            tokenize.TokenizeRequest,
            tokenize.TokenizeResponse,
            False,
            "v1",
        ),
        (
            "/detokenize",
            "post",
            "Token ids as a chat model's text (vLLM's)",
            tokenize.DetokenizeRequest,
            tokenize.DetokenizeResponse,
            False,
            "v1",
        ),
        (
            "/tokenizer_info",
            "get",
            "A chat model's special tokens, chat template and length (vLLM's)",
            None,
            tokenize.TokenizerInfo,
            False,
            "v1",
        ),
        ("/v1/models/{model}", "get", "One served model", None, s.ModelCard, False, "v1"),
        ("/healthz", "get", "Liveness", None, s.Status, False, "ops"),
        ("/readyz", "get", "Readiness: models loaded and warmed up", None, s.Status, False, "ops"),
        (
            "/admin/models/{model}/batching",
            "get",
            "Current batching settings",
            None,
            admin.BatchingSettingsOut,
            False,
            "admin",
        ),
        (
            "/admin/models/{model}/batching",
            "patch",
            "Change batching settings live",
            admin.BatchingPatch,
            admin.BatchingSettingsOut,
            False,
            "admin",
        ),
        ("/admin/tenants", "get", "Tenants' weights, quotas and service", None, admin.TenantsOut, False, "admin"),
        (
            "/admin/tenants",
            "patch",
            "Replace the tenants' weights and quotas live",
            admin.TenantsPatch,
            admin.TenantsOut,
            False,
            "admin",
        ),
    ]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def build(cfg: ServerConfig | None = None, models: dict[str, ServedModel[Any]] | None = None) -> dict[str, Any]:
    """The description for a server with this config; `models` (name -> ServedModel), once
    loaded, add the served model names and embedding sizes."""
    cfg = cfg or ServerConfig()
    req = request_models(cfg)
    ops = _operations(req)
    batch_models: list[type[BaseModel]] = [jo.FileObject, jo.FileDeleted, jo.BatchObject, jo.BatchList]
    wanted: set[type[BaseModel]] = {m for op in ops for m in (op[3], op[4]) if m is not None} | {
        s.ErrorResponse,
        BatchCreate,
        *batch_models,
        *oip.SCHEMAS,
    }
    ordered = sorted(wanted, key=lambda m: m.__name__)
    _, defs = models_json_schema([(m, "validation") for m in ordered], ref_template=REF)
    components = defs.get("$defs", {})
    if models:
        _served_facts(components, models)
    paths: dict[str, dict[str, Any]] = {}
    for path, method, summary, body, resp, stream, tag in ops:
        op: dict[str, Any] = {
            "summary": summary,
            "tags": [tag],
            "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
        }
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        if body is not None:
            op["requestBody"] = {
                "required": True,
                "description": f"At most {cfg.max_body_bytes} bytes (413 body_too_large beyond)",
                "content": _json(body),
            }
        content: dict[str, Any] = _json(resp)
        if stream:
            content["text/event-stream"] = {"schema": SSE_EVENT}
        responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
        if path == "/readyz":
            responses["503"] = {"description": "Loading or draining", "content": _json(s.Status)}
        elif tag != "ops":
            for code, text in ERRORS.items():
                responses[code] = {"description": text, "content": _json(s.ErrorResponse)}
        op["responses"] = responses
        if tag == "admin":
            op["security"] = [{"adminToken": []}]
        elif tag == "v1":
            op["security"] = [{"apiKey": []}, {}]
        paths.setdefault(path, {})[method] = op
    _batch_jobs(paths)
    custom = sorted(n for n, m in (models or {}).items() if m.kind == CUSTOM)
    paths.update(oip.oip_paths(REF, cfg.max_body_bytes, custom))
    paths["/metrics"] = {
        "get": {
            "summary": "Prometheus metrics",
            "tags": ["ops"],
            "operationId": "get_metrics",
            "responses": {
                "200": {
                    "description": "Prometheus text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Ferry",
            "version": "0.1.0",
            "description": "Latency-aware dynamic micro-batching gateway (OpenAI-compatible).",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer"},
                "adminToken": {"type": "http", "scheme": "bearer"},
            },
        },
    }


def _served_facts(components: dict[str, Any], models: dict[str, ServedModel[Any]]) -> None:
    """What the request models cannot know: which models each route serves (another name is
    a 404) and the size each embedding model produces (`dimensions` is only that size)."""
    names = {kind: sorted(n for n, m in models.items() if m.kind == kind) for kind in (EMBEDDING, CHAT)}
    for schema_name, kind in (
        ("EmbeddingsRequest", EMBEDDING),
        ("ChatCompletionRequest", CHAT),
        ("CompletionRequest", CHAT),
    ):
        if names[kind]:
            components[schema_name]["properties"]["model"]["enum"] = names[kind]
    _queue_caps(components, models)
    dims = sorted({m.engine.dim for m in models.values() if m.kind == EMBEDDING})
    if dims:
        components["EmbeddingsRequest"]["properties"]["dimensions"] = {
            "anyOf": [{"type": "integer", "enum": dims}, {"type": "null"}],
            "default": None,
            "description": "The size the model produces (the only one it supports).",
        }


# Per route: the request schema, the kind of model it serves, the field that lists prompts
# or inputs and which of its anyOf branches is the list.
LISTED = (
    ("EmbeddingsRequest", EMBEDDING, "input", (1, 3)),  # a list of texts, a list of token-id lists
    ("ChatCompletionRequest", CHAT, "messages", (0,)),
    ("CompletionRequest", CHAT, "prompt", (1, 3)),  # a list of texts, a list of token-id lists
)


def _queue_caps(components: dict[str, Any], models: dict[str, ServedModel[Any]]) -> None:
    """A request is refused whole (422 request_too_large) when it holds more work items than
    its model's queue can ever hold (`max_queue`, per model and live): inputs, or prompts x
    `n` candidates. State that per model as `if model == m then ...` clauses, one per `n`
    whose cap is below the listed one, so a request the description allows is never refused
    for its size, and one it refuses is (nothing here is looser or tighter than the server).
    One exception, said in words: a per-prompt list of `n` is refused when its sum exceeds
    the queue, which no JSON Schema keyword can state."""
    for schema_name, kind, field, branches in LISTED:
        schema = components[schema_name]
        props = schema["properties"]
        listed = props[field]["anyOf"][branches[0]]["maxItems"]
        n_max = props["n"]["anyOf"][0]["maximum"] if "n" in props else 1
        clauses, loosest = [], 0
        for name in sorted(n for n, m in models.items() if m.kind == kind):
            queue = models[name].batcher.settings.max_queue
            loosest = max(loosest, min(listed, queue))
            then: list[dict[str, Any]] = []
            if queue < n_max:  # even one prompt with more candidates than the queue holds
                then.append({"properties": {"n": {"maximum": queue, "items": {"maximum": queue}}}})
            for n in range(1, min(n_max, queue) + 1):
                if queue // n >= listed:
                    continue
                capped = copy.deepcopy(props[field])
                for branch in branches:
                    capped["anyOf"][branch]["maxItems"] = queue // n
                # `properties` holds when n is absent, which means n = 1; n > 1 must be there.
                when: dict[str, Any] = {"properties": {"n": {"const": n}}} if n_max > 1 else {}
                if n > 1:
                    when["required"] = ["n"]
                then.append(
                    {"if": when, "then": {"properties": {field: capped}}} if when else {"properties": {field: capped}}
                )
            if then:
                is_model = {"properties": {"model": {"const": name}}, "required": ["model"]}
                clauses.append({"if": is_model, "then": {"allOf": then}})
        if clauses:
            for branch in branches:
                props[field]["anyOf"][branch]["maxItems"] = loosest
            props[field]["description"] += (
                f" At most {loosest} per request, fewer where a model's queue (max_queue) holds fewer"
                + (" items (prompts x n; with a per-prompt list of n, its sum)" if n_max > 1 else "")
                + ": the per-model clauses say how many."
            )
            schema.setdefault("allOf", []).extend(clauses)


def _batch_jobs(paths: dict[str, dict[str, Any]]) -> None:
    """The OpenAI batch API (gateway/routes/batches.py), with links from the operations that
    create files and batches to those that use their ids, so a stateful fuzzer (or a
    reader) follows real ids from one to the next."""
    errors = {code: {"description": ERRORS[code], "content": _json(s.ErrorResponse)} for code in BATCH_ERRORS}

    def op(
        op_id: str,
        summary: str,
        content: dict[str, Any],
        param: str | None = None,
        body: dict | None = None,
        links: dict[str, Any] | None = None,
        query: list[dict] | None = None,
    ) -> dict:
        ok: dict[str, Any] = {"description": "OK", "content": content}
        if links:
            ok["links"] = links
        out: dict[str, Any] = {
            "summary": summary,
            "tags": ["batch"],
            "operationId": op_id,
            "security": [{"apiKey": []}, {}],
            "responses": {"200": ok, **errors},
        }
        params = [{"name": param, "in": "path", "required": True, "schema": {"type": "string"}}] if param else []
        params += query or []
        if params:
            out["parameters"] = params
        if body:
            out["requestBody"] = body
        return out

    def link(op_id: str, expr: str, param: str | None = None, body_field: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"operationId": op_id}
        if param:
            out["parameters"] = {param: expr}
        if body_field:
            out["requestBody"] = {body_field: expr}
        return out

    file_links = {
        "GetFile": link("get_file", "$response.body#/id", "file_id"),
        "GetFileContent": link("get_file_content", "$response.body#/id", "file_id"),
        "CreateBatch": link("post_batches", "$response.body#/id", body_field="input_file_id"),
    }
    batch_links = {
        "GetBatch": link("get_batch", "$response.body#/id", "batch_id"),
        "CancelBatch": link("cancel_batch", "$response.body#/id", "batch_id"),
        "GetInputFile": link("get_file", "$response.body#/input_file_id", "file_id"),
        "GetOutputContent": link("get_file_content", "$response.body#/output_file_id", "file_id"),
        "GetErrorContent": link("get_file_content", "$response.body#/error_file_id", "file_id"),
    }
    # Empty files are accepted (a batch made from one is refused: the file has no requests);
    # multipart fields other than these two are refused, and the schema says so.
    upload = {
        "required": True,
        "description": f"A file of at most {MAX_FILE_BYTES} bytes (413 body_too_large beyond)",
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["purpose", "file"],
                    "additionalProperties": False,
                    "properties": {
                        "purpose": {"type": "string", "enum": ["batch"]},
                        "file": {"type": "string", "format": "binary"},
                    },
                }
            }
        },
    }
    create = {"required": True, "content": _json(BatchCreate)}
    page = [
        {
            "name": "after",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "description": "A batch id: list the batches created before it",
        },
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
        },
    ]
    jsonl = {"application/jsonl": {"schema": {"type": "string"}}}
    paths["/v1/files"] = {
        "post": op("post_files", "Upload a JSONL batch input file", _json(jo.FileObject), body=upload, links=file_links)
    }
    paths["/v1/files/{file_id}"] = {
        "get": op(
            "get_file",
            "A file object",
            _json(jo.FileObject),
            "file_id",
            links={"GetFileContent": file_links["GetFileContent"]},
        ),
        "delete": op(
            "delete_file",
            "Delete an uploaded file (a batch's output and error files stay)",
            _json(jo.FileDeleted),
            "file_id",
        ),
    }
    paths["/v1/files/{file_id}/content"] = {"get": op("get_file_content", "A file's content (JSONL)", jsonl, "file_id")}
    paths["/v1/batches"] = {
        "post": op(
            "post_batches",
            "Create a batch job from an uploaded file",
            _json(jo.BatchObject),
            body=create,
            links=batch_links,
        ),
        "get": op(
            "list_batches",
            "List batch jobs, newest first (paginated with after and limit)",
            _json(jo.BatchList),
            query=page,
            links={"GetFirstBatch": link("get_batch", "$response.body#/first_id", "batch_id")},
        ),
    }
    paths["/v1/batches/{batch_id}"] = {
        "get": op(
            "get_batch", "A batch job: status and request counts", _json(jo.BatchObject), "batch_id", links=batch_links
        )
    }
    paths["/v1/batches/{batch_id}/cancel"] = {
        "post": op(
            "cancel_batch",
            "Cancel a batch job",
            _json(jo.BatchObject),
            "batch_id",
            links={"GetBatch": batch_links["GetBatch"]},
        )
    }


async def openapi(request: Request):
    ferry = gateway_state(request)
    if not ferry.ready:  # it lacks the served models and their limits; build again next time
        return json_response(build(ferry.config))
    # Built once per set of the limits it states: max_queue changes live (admin PATCH).
    key = tuple((name, m.batcher.settings.max_queue) for name, m in ferry.models.items())
    cached = getattr(request.app.state, "openapi", None)
    if cached is None or cached[0] != key:
        cached = request.app.state.openapi = (key, build(ferry.config, ferry.models))
    return json_response(cached[1])
