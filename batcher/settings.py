"""Batching knobs of one model. Validated at construction; changed live by the admin API."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

POLICIES = ("fixed", "deadline", "adaptive")
INFEASIBLE_ACTIONS = ("reject", "serve")
BUDGET_SCOPES = ("ttft", "total")
BATCHING_MODES = ("continuous", "static")


class SettingsError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class BatchingSettings:
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 1024
    policy: str = "adaptive"
    # Latency budget of a request that names none (milliseconds); None = no deadline.
    default_budget_ms: float | None = 10_000.0
    # Safety margin the deadline-aware policies keep between prediction and deadline: it
    # covers what the server's clock does not see (reading the request, writing the answer,
    # the client's own queueing) and the noise of a shared CPU.
    deadline_margin_ms: float = 10.0
    # Batch-class work waits at most this long behind interactive work before it is
    # ordered as if it were interactive.
    aging_ms: float = 2_000.0
    on_infeasible: str = "reject"
    # Interactive first (the default): while interactive requests arrive, batches are sized
    # for their budgets and batch-class work absorbs the shortfall (waits, is refused, or
    # expires by its own budget). False: every urgent item sizes batches, total throughput
    # first (interactive work is then refused under batch-class overload).
    interactive_first: bool = True
    # Generation only.
    budget_scope: str = "ttft"
    max_itl_ms: float | None = None
    max_running: int = 64
    prefill_token_budget: int = 2048
    mode: str = "continuous"

    def __post_init__(self) -> None:
        _positive_int(self, "max_batch_size")
        _positive_int(self, "max_queue")
        _positive_int(self, "max_running")
        _positive_int(self, "prefill_token_budget")
        for name in ("max_wait_ms", "deadline_margin_ms", "aging_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0 <= value < 3.6e6):
                raise SettingsError(name, "must be a number of milliseconds between 0 and 3600000")
        for name in ("default_budget_ms", "max_itl_ms"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or not (0 < value < 3.6e6)
            ):
                raise SettingsError(name, "must be null or a number of milliseconds above 0")
        if not isinstance(self.interactive_first, bool):
            raise SettingsError("interactive_first", "must be true or false")
        _choice(self, "policy", POLICIES)
        _choice(self, "on_infeasible", INFEASIBLE_ACTIONS)
        _choice(self, "budget_scope", BUDGET_SCOPES)
        _choice(self, "mode", BATCHING_MODES)

    @property
    def max_wait(self) -> float:
        return self.max_wait_ms / 1000.0

    @property
    def margin(self) -> float:
        return self.deadline_margin_ms / 1000.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def updated(self, **changes: Any) -> "BatchingSettings":
        known = {f.name for f in fields(self)}
        for name in changes:
            if name not in known:
                raise SettingsError(name, "unknown setting")
        return replace(self, **changes)


def _positive_int(s: BatchingSettings, name: str) -> None:
    value = getattr(s, name)
    if not isinstance(value, int) or isinstance(value, bool) or not (1 <= value <= 1_000_000):
        raise SettingsError(name, "must be an integer between 1 and 1000000")


def _choice(s: BatchingSettings, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(s, name) not in allowed:
        raise SettingsError(name, f"must be one of {', '.join(allowed)}")
