"""The errors this client raises: one class per HTTP status family, built from the
gateway's OpenAI-style error bodies (and from a stream's error events)."""

from __future__ import annotations

import email.utils
import time
from typing import Any

import httpx

from ._json import loads


class FerryError(Exception):
    """Base of every error this client raises.

    status: the HTTP status (None for connection failures); code: the OpenAI-style error
    code (`queue_full`, `invalid_value`, `model_not_found`, ...); param: the request field
    at fault, where the server names one; retry_after: seconds from the Retry-After header
    (429/503), else None; request_id: the X-Request-Id of the failed request; prompt_index:
    the prompt a streaming error belongs to.
    """

    status: int | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
        request_id: str | None = None,
        prompt_index: int | None = None,
        body: Any = None,
    ):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.code, self.param, self.type = code, param, type
        self.retry_after, self.request_id, self.prompt_index, self.body = retry_after, request_id, prompt_index, body

    def __str__(self) -> str:
        bits = [
            f"{self.status}" if self.status is not None else None,
            self.code,
            f"param={self.param}" if self.param else None,
        ]
        head = " ".join(b for b in bits if b)
        return f"[{head}] {self.message}" if head else self.message

    def __reduce__(self):  # keep keyword fields across pickling (multiprocessing, pytest-xdist)
        return (_rebuild_error, (type(self), self.message, dict(self.__dict__)))


def _rebuild_error(cls: type[FerryError], message: str, state: dict) -> FerryError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class APIConnectionError(FerryError):
    """The gateway could not be reached, or the connection broke mid-response."""


class APITimeoutError(APIConnectionError):
    """The HTTP client timed out (see the `timeout` argument)."""


class BadRequest(FerryError):
    status = 400


class AuthenticationError(FerryError):
    status = 401


class PermissionDenied(FerryError):
    status = 403


class NotFound(FerryError):
    status = 404


class PayloadTooLarge(FerryError):
    status = 413


class UnprocessableEntity(FerryError):
    """A request field is invalid; `.param` names it (e.g. a per-prompt list of the wrong length)."""

    status = 422


class RateLimited(FerryError):
    """429: the queue is full, the latency budget cannot be met, or too many streams. See `.retry_after`."""

    status = 429


class ServerError(FerryError):
    """Any 5xx."""

    status = 500


class ServiceUnavailable(ServerError):
    """503: models still loading or the gateway is draining. See `.retry_after`."""

    status = 503


class GatewayTimeout(ServerError):
    """504: the request's latency budget passed before it was served."""

    status = 504


_BY_STATUS: dict[int, type[FerryError]] = {
    400: BadRequest,
    401: AuthenticationError,
    403: PermissionDenied,
    404: NotFound,
    413: PayloadTooLarge,
    422: UnprocessableEntity,
    429: RateLimited,
    503: ServiceUnavailable,
    504: GatewayTimeout,
}
# Stream error events carry no status; these give the one the same failure has as a response.
_STATUS_OF_CODE = {
    "queue_full": 429,
    "deadline_infeasible": 429,
    "too_many_streams": 429,
    "deadline_exceeded": 504,
    "shutting_down": 503,
    "not_ready": 503,
    "engine_error": 500,
    "internal_error": 500,
    "cancelled": 499,
}
_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "rate_limit_error": 429,
    "server_error": 500,
    "service_unavailable_error": 503,
    "timeout_error": 504,
}


def error_class(status: int | None) -> type[FerryError]:
    if status is None:
        return APIConnectionError
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return ServerError if status >= 500 else FerryError


def make_error(
    status: int | None,
    payload: Any,
    *,
    retry_after: float | None = None,
    request_id: str | None = None,
    default_message: str = "",
) -> FerryError:
    """Build the typed error for an OpenAI-style body `{"error": {...}}` (or anything else)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        err = {"message": err if isinstance(err, str) else (default_message or f"HTTP {status}")}
    code, type_ = err.get("code"), err.get("type")
    if status is None:  # an error event inside a stream
        status = _STATUS_OF_CODE.get(code or "") or _STATUS_OF_TYPE.get(type_ or "", 500)
    prompt_index = err.get("prompt_index")
    return error_class(status)(
        str(err.get("message") or f"HTTP {status}"),
        status=status,
        code=code,
        param=err.get("param"),
        type=type_,
        retry_after=retry_after,
        request_id=request_id,
        prompt_index=prompt_index,
        body=payload,
    )


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def from_response(r: httpx.Response) -> FerryError:
    try:
        payload = loads(r.content) if r.content else None
    except ValueError:
        payload = None
    text = r.text[:500] if payload is None else ""
    return make_error(
        r.status_code,
        payload,
        retry_after=parse_retry_after(r.headers.get("retry-after")),
        request_id=r.headers.get("x-request-id"),
        default_message=text or f"HTTP {r.status_code} {r.reason_phrase}".strip(),
    )


def transport_error(exc: httpx.HTTPError) -> FerryError:
    cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    return cls(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def connect_error(exc: httpx.HTTPError) -> FerryError:
    err = transport_error(exc)
    # A failed connect never reached the server, so it is always safe to retry.
    err._connect = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))  # type: ignore[attr-defined]
    return err
