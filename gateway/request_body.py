"""Reading a request body within its size limit and parsing it into a pydantic request
model, with OpenAI-style errors (413 too large, 400 not JSON, 422 naming the field)."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import ClientDisconnect, HTTPConnection, Request

from .errors import APIError

M = TypeVar("M", bound=BaseModel)

# Error types raised by the request models' validators (gateway/schemas.py) that keep their
# own error code: limits, and rules across fields that JSON Schema does not state.
LIMIT_CODES = frozenset(
    {
        "too_many_prompts",
        "too_many_inputs",
        "too_many_stop_strings",
        "stream_options_without_stream",
        "unsupported_parameter",
    }
)
# OpenAI request fields Ferry's models cannot honour: refused by name rather than ignored.
UNSUPPORTED_FIELDS = frozenset(
    {
        "echo",
        "reasoning",
        "functions",
        "function_call",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "verbosity",
        "service_tier",
    }
)


def header(request: HTTPConnection, name: str, default: str | None = None) -> str | None:
    """The request's header `name` (the first value when repeated). Starlette's `Headers`
    scans and decodes every header on each lookup and a request makes up to eight; the
    first lookup here builds a dictionary the rest share."""
    scope = request.scope
    table = scope.get("ferry.headers")
    if table is None:
        raw = reversed(scope["headers"])  # the first value of a repeated header wins
        table = scope["ferry.headers"] = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
    return table.get(name.lower(), default)


async def read_body(request: Request, limit: int) -> bytes:
    declared = header(request, "content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", code="body_too_large"
        )
    # The ASGI messages read directly, as Request.stream() would, without an async generator
    # per request; a disconnect raises the same ClientDisconnect.
    chunks, size, more = [], 0, True
    while more:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def parse(request: Request, model: type[M], limit: int) -> M:
    raw = await read_body(request, limit)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, data) from None


def validation_error(exc: ValidationError, data: Any = None) -> APIError:
    # A union field reports one error per branch; the one that got deepest into the value
    # names the real problem ("messages.0.role", not "messages.0: should be a list").
    def where(e: ErrorDetails) -> list[str]:
        return _path([p for p in e["loc"] if not _is_type_tag(p)], data)

    err = max(exc.errors(), key=lambda e: len(where(e)))
    loc = where(err)
    param = ".".join(loc) or None
    msg = err["msg"]
    code = err["type"] if err["type"] in LIMIT_CODES else "invalid_value"
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
        if len(loc) == 1 and loc[0] in UNSUPPORTED_FIELDS:
            msg, code = (
                "this server's models cannot honour this field; it is refused rather than ignored",
                ("unsupported_parameter"),
            )
    return APIError(422, f"{param}: {msg}" if param else msg, code=code, param=param)


def _path(loc: list[Any], data: Any) -> list[str]:
    """The parts of an error's location that lead through the request's JSON (`data`), so
    `param` names a field the client sent: pydantic also puts a union branch's model name
    ("NamedToolChoice") or a discriminator's value ("json_schema") in the location. The last
    part stays when it is a field the client left out ("missing")."""
    if data is None:
        return [str(p) for p in loc]
    out, node = [], data
    for k, p in enumerate(loc):
        if isinstance(node, dict) and isinstance(p, str) and p in node:
            out.append(p)
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            out.append(str(p))
            node = node[p]
        elif k == len(loc) - 1:
            out.append(str(p))
    return out


def _is_type_tag(p: Any) -> bool:
    """Pydantic names union branches in error locations ("str", "list[constrained-str]");
    field names are identifiers, branch tags are not (or are bare type names)."""
    return isinstance(p, str) and (not p.isidentifier() or p in {"str", "int", "float", "bool", "list", "dict", "none"})
