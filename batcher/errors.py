"""Errors the batcher hands back through an item's future (or raises at submit).

Each carries the HTTP-agnostic facts the gateway needs to answer: a stable `code`
and, where it helps the client, how long to wait before retrying.
"""

from __future__ import annotations


class BatchingError(Exception):
    code = "internal_error"

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class QueueFull(BatchingError):
    code = "queue_full"


class DeadlineInfeasible(BatchingError):
    code = "deadline_infeasible"


class TenantQuota(BatchingError):
    """The request's tenant is over one of its quotas (batcher/fairness.py)."""

    code = "tenant_quota"


class RequestTooLarge(BatchingError):
    """More items in one request than the queue can ever hold: retrying cannot help."""

    code = "request_too_large"


class DeadlineExceeded(BatchingError):
    code = "deadline_exceeded"


class Cancelled(BatchingError):
    code = "cancelled"


class EngineError(BatchingError):
    code = "engine_error"


class ShuttingDown(BatchingError):
    code = "shutting_down"


class ModelUnavailable(BatchingError):
    """The model cannot serve at all now: its engine core exited or stopped reading."""

    code = "model_unavailable"
