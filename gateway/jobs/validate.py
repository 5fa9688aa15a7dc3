"""Checking a batch input file, and turning one of its lines into work items.

`validate_file` runs when a batch is created, on a worker thread (it is pure Python:
JSON, pydantic, the translation layer's tokenizer-free checks; no tokenizer, no engine).
Every line is checked and every fault reported with its 1-based line number (`InvalidFile`,
a 422 naming them), so a file is accepted whole or not at all, before any of it runs:

- not a JSON object, missing/invalid `custom_id`, `method` other than POST;
- `url` not a batch route (the OpenAI routes, or a custom model's `/v2/models/NAME/infer`),
  or not the batch's `endpoint`;
- a `custom_id` used twice;
- a `body` the route's own pydantic schema rejects, `stream: true`, or one the route's
  limits reject (too many prompts or inputs, per-prompt list lengths, stop strings,
  max tokens, dimensions);
- a `model` that is not served (or not of the route's kind).

Checks that need the tokenizer (prompt length against the context) run when the line
runs; a line failing them fails alone, in the error file, like a direct request would.

`prepare` does at run time what the routes do per request: translate the body into work
(gateway/translate/), which also says how to turn results into the same response body a
direct request would get.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import APIError, error_body
from ..limits import request_models
from ..models.kinds import CHAT, CUSTOM, EMBEDDING, ModelKind
from ..models.start import ServedModel
from ..request_body import validation_error
from ..responses import json_response
from ..schemas import ChatCompletionRequest, CompletionRequest, EmbeddingsRequest
from ..translate.chat import GenerationBody, check_generation, generation_work
from ..translate.embeddings import check_embeddings, embedding_work
from ..translate.oip import INFER_ENDPOINT, INFER_URL, custom_work
from ..translate.work import Work

if TYPE_CHECKING:
    from .host import JobsHost

CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
ROUTES: dict[str, ModelKind] = {CHAT_URL: CHAT, COMPLETIONS_URL: CHAT, EMBEDDINGS_URL: EMBEDDING}  # url -> model kind
ANY_ENDPOINT = "*"  # Ferry extension: lines may use any of ROUTES

MAX_FILE_BYTES = 100 * 1024 * 1024
MAX_LINES = 50_000
MAX_CUSTOM_ID = 512
MAX_REPORTED = 100  # line errors listed in a 422 (all are counted)
MAX_WINDOW_S = 7 * 24 * 3600
# 1..168 hours, 1..10080 minutes or 1..604800 seconds (at most 7 days), spelled out so that
# the pattern in /openapi.json accepts exactly the windows the server accepts.
WINDOW_PATTERN = (
    r"^(?:(?:[1-9]|[1-9][0-9]|1[0-5][0-9]|16[0-8])h"
    r"|(?:[1-9][0-9]{0,3}|100[0-7][0-9]|10080)m"
    r"|(?:[1-9][0-9]{0,4}|[1-5][0-9]{5}|60[0-3][0-9]{3}|604[0-7][0-9]{2}|604800)s)$"
)
WINDOW_RE = re.compile(r"^([1-9][0-9]{0,6})([hms])$")

MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=256)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v2/models/{model}/infer", "*"] = (
        Field(
            description="The route of every line, or '*' (a Ferry extension: lines may use any of them); "
            "/v2/models/{model}/infer: a custom model's Open Inference Protocol requests, the model in each "
            "line's url (a Ferry extension)."
        )
    )
    completion_window: str = Field(
        "24h", pattern=WINDOW_PATTERN, description="Nh, Nm or Ns, at most 7 days; lines not run by then are not run."
    )
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    output_expires_after: dict[str, Any] | None = None  # accepted for compatibility, ignored


def parse_window(value: str) -> float:
    m = WINDOW_RE.match(value or "")
    if m is None:
        raise APIError(
            422,
            f"completion_window must look like '24h', '30m' or '90s', got {value!r}",
            code="invalid_value",
            param="completion_window",
        )
    seconds = int(m.group(1)) * {"h": 3600, "m": 60, "s": 1}[m.group(2)]
    if seconds > MAX_WINDOW_S:
        raise APIError(422, "completion_window must be at most 168h", code="invalid_value", param="completion_window")
    return float(seconds)


def check_create(body: BatchCreate) -> float:
    """Seconds of the batch's window (its form and bounds were checked by BatchCreate)."""
    return parse_window(body.completion_window)


@dataclass
class LineError:
    line: int
    message: str
    param: str | None = None
    code: str = "invalid_line"

    def to_dict(self) -> dict:
        return {"line": self.line, "message": self.message, "param": self.param, "code": self.code}


class InvalidFile(APIError):
    """422 listing every faulty line of an input file."""

    def __init__(self, file_id: str, errors: list[LineError]):
        shown = "; ".join(f"line {e.line}: {e.message}" for e in errors[:10])
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        super().__init__(
            422,
            f"input file {file_id} has {len(errors)} invalid line(s): {shown}{more}",
            code="invalid_batch_file",
            param="input_file_id",
        )
        self.errors = errors

    def response(self, headers: dict[str, str] | None = None):
        body = error_body(self.status, self.message, self.code, self.param)
        body["error"]["lines"] = [e.line for e in self.errors]
        body["error"]["errors"] = {"object": "list", "data": [e.to_dict() for e in self.errors[:MAX_REPORTED]]}
        return json_response(body, self.status, headers)


@dataclass
class ValidLine:
    line: int
    custom_id: str
    url: str
    body: str  # compact JSON of the request body


def validate_file(host: JobsHost, content: bytes, endpoint: str) -> tuple[list[ValidLine], list[LineError]]:
    """Every line checked; returns the lines, or the errors (never both non-empty)."""
    good: list[ValidLine] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = content[: exc.start].count(b"\n") + 1
        return [], [LineError(line, "the file is not valid UTF-8", code="invalid_encoding")]
    count = 0
    for n, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        count += 1
        if count > MAX_LINES:
            errors.append(LineError(n, f"the file has more than {MAX_LINES} requests", code="too_many_lines"))
            break
        try:
            good.append(_check_line(host, n, raw, endpoint, seen))
        except _Bad as bad:
            errors.append(LineError(n, bad.message, bad.param, bad.code))
    if not good and not errors:
        errors.append(LineError(1, "the file has no requests", code="empty_file"))
    return ([] if errors else good), errors


class _Bad(Exception):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_line"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _check_line(host: JobsHost, n: int, raw: str, endpoint: str, seen: dict[str, int]) -> ValidLine:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _Bad(f"not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise _Bad("a line must be a JSON object", code="invalid_json")
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise _Bad(f"unknown field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        raise _Bad(f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters", param="custom_id")
    if cid in seen:
        raise _Bad(
            f"duplicate custom_id {cid!r} (first used on line {seen[cid]})",
            param="custom_id",
            code="duplicate_custom_id",
        )
    seen[cid] = n
    if obj.get("method") != "POST":
        raise _Bad(f"method must be 'POST', got {obj.get('method')!r}", param="method")
    url = obj.get("url")
    route = INFER_ENDPOINT if isinstance(url, str) and INFER_URL.match(url) else url
    if not isinstance(url, str) or (route not in ROUTES and route != INFER_ENDPOINT):
        routes = ", ".join([*ROUTES, INFER_ENDPOINT])
        raise _Bad(f"url {url!r} is not a batch route ({routes})", param="url", code="invalid_url")
    if endpoint != ANY_ENDPOINT and route != endpoint:
        raise _Bad(f"url {url!r} does not match the batch endpoint {endpoint!r}", param="url", code="invalid_url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Bad("body must be a JSON object", param="body")
    try:
        if route == INFER_ENDPOINT:
            _custom_line(host, url, body)
        else:
            check_body(host, parse_body(host, url, body))
    except APIError as exc:
        if exc.status >= 500:  # not ready / draining: the whole request fails, not this line
            raise
        param = f"body.{exc.param}" if exc.param else "body"
        raise _Bad(exc.message, param=param, code=exc.code or "invalid_value") from None
    return ValidLine(n, cid, url, orjson.dumps(body).decode())


def parse_body(host: JobsHost, url: str, body: dict) -> EmbeddingsRequest | GenerationBody:
    """The route's own request model, with this server's limits."""
    models = request_models(host.config)
    schemas: dict[str, type[EmbeddingsRequest] | type[ChatCompletionRequest] | type[CompletionRequest]] = {
        CHAT_URL: models.chat,
        COMPLETIONS_URL: models.completions,
        EMBEDDINGS_URL: models.embeddings,
    }
    schema = schemas[url]
    try:
        parsed = schema.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc, body) from None
    if getattr(parsed, "stream", False):
        raise APIError(422, "stream is not supported in batch requests", code="invalid_value", param="stream")
    return parsed


# Each check looks up the model first: 404 model_not_found (or 503 while not ready / draining).


def check_body(host: JobsHost, body: EmbeddingsRequest | GenerationBody) -> None:
    """The translation layer's tokenizer-free checks (limits, per-prompt lists, known model)."""
    if isinstance(body, EmbeddingsRequest):
        check_embeddings(body, host.model(body.model, EMBEDDING).engine)
    else:
        host.model(body.model, CHAT)
        check_generation(body)


def _custom_line(host: JobsHost, url: str, body: dict) -> tuple[ServedModel[Any], Work]:
    """A custom model's infer line: its model (404 if not a custom model served here) and work."""
    match = INFER_URL.match(url)
    assert match is not None
    served = host.model(match["model"], CUSTOM)
    return served, custom_work(served.name, served.engine, body, host.config.max_inputs)


def prepare(host: JobsHost, url: str, body_json: str) -> tuple[ServedModel[Any], Work]:
    """The line's served model and its work, translated as the route would translate it.
    Runs on the event loop, like the routes (tokenizers are not shared across threads).
    Raises APIError for a line that fails as a direct request would."""
    if INFER_URL.match(url):
        return _custom_line(host, url, orjson.loads(body_json))
    body = parse_body(host, url, orjson.loads(body_json))
    if isinstance(body, EmbeddingsRequest):
        embedder = host.model(body.model, EMBEDDING)
        return embedder, embedding_work(body, embedder.engine, host.config)
    generator = host.model(body.model, CHAT)
    return generator, generation_work(body, generator.engine, host.config)
