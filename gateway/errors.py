"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import math
from collections.abc import Iterable

from batcher.errors import (
    BatchingError,
    Cancelled,
    DeadlineExceeded,
    DeadlineInfeasible,
    EngineError,
    ModelUnavailable,
    QueueFull,
    RequestTooLarge,
    ShuttingDown,
    TenantQuota,
)

from .responses import json_response

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

STATUS_OF = {
    QueueFull: 429,
    RequestTooLarge: 422,
    DeadlineInfeasible: 429,
    TenantQuota: 429,
    DeadlineExceeded: 504,
    ShuttingDown: 503,
    ModelUnavailable: 503,
    EngineError: 500,
    Cancelled: 499,
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after

    @classmethod
    def from_batching(cls, exc: BatchingError) -> APIError:
        status = next((s for t, s in STATUS_OF.items() if isinstance(exc, t)), 500)
        return cls(status, exc.message, code=exc.code, retry_after=exc.retry_after)

    def response(self, headers: dict[str, str] | None = None):
        hdrs = dict(headers or {})
        if self.retry_after is not None:
            hdrs["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return json_response(error_body(self.status, self.message, self.code, self.param), self.status, hdrs)

    def oip_response(self, headers: dict[str, str] | None = None):
        """The Open Inference Protocol's shape, `{"error": message}`, for its routes (/v2/...)."""
        hdrs = dict(headers or {})
        if self.retry_after is not None:
            hdrs["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return json_response({"error": self.message}, self.status, hdrs)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def not_found_model(name: str, available: list[str]) -> APIError:
    return APIError(
        404,
        f"The model '{name}' does not exist. Available models: {', '.join(available) or 'none'}",
        code="model_not_found",
        param="model",
    )


def check_vocabulary(ids: Iterable[int], vocab: int | None, where: str, model: str, param: str) -> None:
    """422 invalid_token_id naming the first of `ids` outside a vocabulary of `vocab` ids
    (None: not known, nothing checked); `where` opens the message ("prompt 0")."""
    outside = None if vocab is None else next((t for t in ids if t >= vocab), None)
    if outside is not None:
        raise APIError(
            422,
            f"{where}: token id {outside} is not in the vocabulary of {model} ({vocab} tokens)",
            code="invalid_token_id",
            param=param,
        )


def shutting_down() -> APIError:
    """503 once the server drains: new work is refused, the client may retry elsewhere."""
    return APIError(503, "server is shutting down", code="shutting_down", retry_after=1)


def not_ready(load_error: str | None) -> APIError:
    """503 while the models load (`load_error` None), or once their loading failed."""
    message = "models are still loading" if load_error is None else f"model loading failed: {load_error}"
    return APIError(503, message, code="not_ready", retry_after=2)
