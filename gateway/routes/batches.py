"""The OpenAI-compatible batch API: /v1/files and /v1/batches (see docs/batch-jobs.md).

Handlers parse HTTP and render OpenAI objects; `gateway.jobs.service.BatchJobs` does the work.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import orjson
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..endpoint import Ctx, endpoint, key_owner, route
from ..errors import APIError
from ..jobs.service import BatchJobs
from ..jobs.validate import MAX_FILE_BYTES, BatchCreate
from ..request_body import parse, read_body
from ..responses import json_response
from ..state import gateway_state

PURPOSES = ("batch",)


def file_object(row: dict) -> dict:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(row: dict) -> dict:
    out: dict[str, Any] = {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": None if row["errors"] is None else orjson.loads(row["errors"]),
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
    }
    for k in (
        "in_progress_at",
        "expires_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    ):
        out[k] = int(row["expires_ts"]) if k == "expires_at" else row[k]
    out["request_counts"] = {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
    out["metadata"] = None if row["metadata"] is None else orjson.loads(row["metadata"])
    return out


def _owner(request: Request) -> str | None:
    """Who the caller is to the batch API: its key's digest (None: the server has no keys)."""
    return key_owner(request, gateway_state(request).api_keys)


def _jobs(request: Request) -> BatchJobs:
    jobs = gateway_state(request).jobs
    assert jobs is not None, "create_app gives every gateway its batch-job service"
    return jobs


# -- files ---------------------------------------------------------------------------------
async def create_file(request: Request, ctx: Ctx) -> Response:
    """multipart/form-data with `purpose` and `file` (what the openai client sends), or,
    for curl convenience, the raw JSONL as the body with `?purpose=batch&filename=...`.
    An empty file is stored like any other; a batch made from it is refused (no requests)."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        content, filename, purpose = await _multipart(request)
    elif ctype.startswith("application/x-www-form-urlencoded"):
        raise APIError(
            422,
            "upload the file as multipart/form-data with fields 'purpose' and 'file'",
            code="invalid_value",
            param="file",
        )
    else:
        content = await read_body(request, MAX_FILE_BYTES)
        if not content:  # no multipart and no body: nothing was sent (an empty multipart file is fine)
            raise APIError(
                422,
                "upload the file as multipart/form-data with fields 'purpose' and 'file'",
                code="invalid_value",
                param="file",
            )
        filename = request.query_params.get("filename") or "upload.jsonl"
        purpose = request.query_params.get("purpose", "batch")
    if purpose not in PURPOSES:
        raise APIError(
            422, f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", code="invalid_value", param="purpose"
        )
    if len(content) > MAX_FILE_BYTES:
        raise APIError(413, f"the file exceeds the limit of {MAX_FILE_BYTES} bytes", code="body_too_large")
    row = await _jobs(request).upload(content, filename[:256], purpose, _owner(request))
    return json_response(file_object(row))


async def _limited(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"upload exceeds the limit of {limit} bytes", code="body_too_large")
        yield chunk


async def _multipart(request: Request) -> tuple[bytes, str, str]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_FILE_BYTES + 65536:
        raise APIError(
            413, f"upload of {declared} bytes exceeds the limit of {MAX_FILE_BYTES} bytes", code="body_too_large"
        )
    parser = MultiPartParser(request.headers, _limited(request, MAX_FILE_BYTES + 65536), max_files=1, max_fields=8)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise APIError(400, f"invalid multipart upload: {exc.message}", code="invalid_request") from None
    try:
        unknown = sorted(set(form.keys()) - {"file", "purpose"})
        if unknown:
            raise APIError(422, f"{unknown[0]}: unknown form field", code="invalid_value", param=unknown[0])
        upload = form.get("file")
        purpose = form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(422, "missing form field 'file'", code="invalid_value", param="file")
        if not isinstance(purpose, str):
            raise APIError(422, "missing form field 'purpose'", code="invalid_value", param="purpose")
        content = await upload.read()
        return content, upload.filename or "upload.jsonl", purpose
    finally:
        await form.close()


async def get_file(request: Request, ctx: Ctx) -> Response:
    return json_response(file_object(await _jobs(request).get_file(request.path_params["file_id"], _owner(request))))


async def delete_file(request: Request, ctx: Ctx) -> Response:
    return json_response(await _jobs(request).delete_file(request.path_params["file_id"], _owner(request)))


async def file_content(request: Request, ctx: Ctx) -> Response:
    content = await _jobs(request).file_content(request.path_params["file_id"], _owner(request))
    return Response(content, media_type="application/jsonl")


# -- batches -------------------------------------------------------------------------------
async def create_batch(request: Request, ctx: Ctx) -> Response:
    body = await parse(request, BatchCreate, gateway_state(request).config.max_body_bytes)
    return json_response(batch_object(await _jobs(request).create(body, _owner(request))))


async def get_batch(request: Request, ctx: Ctx) -> Response:
    return json_response(batch_object(await _jobs(request).get(request.path_params["batch_id"], _owner(request))))


async def cancel_batch(request: Request, ctx: Ctx) -> Response:
    return json_response(batch_object(await _jobs(request).cancel(request.path_params["batch_id"], _owner(request))))


async def list_batches(request: Request, ctx: Ctx) -> Response:
    q = request.query_params
    raw = q.get("limit", "20")
    if not raw.isdigit() or not (1 <= int(raw) <= 100):
        raise APIError(
            422, f"limit must be an integer between 1 and 100, got {raw!r}", code="invalid_value", param="limit"
        )
    rows, has_more = await _jobs(request).list(q.get("after") or None, int(raw), _owner(request))
    data = [batch_object(r) for r in rows]
    return json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


def batch_routes() -> list[Route]:
    return [
        Route("/v1/files", endpoint("/v1/files", create_file), methods=["POST"]),
        route(
            "/v1/files/{file_id}",
            get=endpoint("/v1/files/{id}", get_file),
            delete=endpoint("/v1/files/{id}", delete_file),
        ),
        Route("/v1/files/{file_id}/content", endpoint("/v1/files/{id}/content", file_content), methods=["GET"]),
        route("/v1/batches", post=endpoint("/v1/batches", create_batch), get=endpoint("/v1/batches", list_batches)),
        Route("/v1/batches/{batch_id}", endpoint("/v1/batches/{id}", get_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", endpoint("/v1/batches/{id}/cancel", cancel_batch), methods=["POST"]),
    ]
