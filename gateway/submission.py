"""A request's work items: its scheduling fields (latency budget, priority) from body or
headers, submitting them, waiting for them while watching for the client to leave,
cancelling them, and the timing headers they report."""

from __future__ import annotations

import asyncio
import math
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from batcher.errors import BatchingError
from batcher.types import Priority, WorkItem

from .errors import APIError
from .request_body import header
from .schemas import ON_INFEASIBLE

if TYPE_CHECKING:
    from .models.served import ServedBatcher

BUDGET_HEADER = "x-ferry-latency-budget-ms"
PRIORITY_HEADER = "x-ferry-priority"
ON_INFEASIBLE_HEADER = "x-ferry-on-infeasible"
# Per-request SLO headers of the Gateway API Inference Extension (llm-d), newest name first.
TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
TPOT_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
MAX_SLO_MS = 3_600_000.0


# Seconds a request's results may take before a task watches its connection for a
# disconnect (wait_items).
WATCH_AFTER = 0.02


class ClientGone(Exception):
    """The client disconnected; nobody is listening for an answer."""


def slo_header(request: Request, names: tuple[str, ...]) -> float | None:
    """The first of the SLO headers `names` the request carries, in milliseconds; a value
    that is not a positive number of milliseconds (at most an hour) is a 400 naming it."""
    for name in names:
        raw = header(request, name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (0 < value <= MAX_SLO_MS):  # NaN fails too
            raise APIError(
                400,
                f"header {name} must be a positive number of milliseconds (at most {MAX_SLO_MS:.0f}), got {raw!r}",
                code="invalid_value",
                param=name,
            )
        return value
    return None


def itl_target(request: Request) -> float | None:
    """The request's inter-token target in seconds, from `x-llm-d-slo-tpot-ms` (or the older
    `x-slo-tpot-ms`); None without one."""
    ms = slo_header(request, TPOT_HEADERS)
    return None if ms is None else ms / 1000.0


def scheduling(request: Request, body: Any) -> tuple[float | None, Priority]:
    """Latency budget (seconds) and priority class: body field, else header
    (X-Ferry-Latency-Budget-Ms, else the inference gateway's `x-llm-d-slo-ttft-ms` or
    `x-slo-ttft-ms`), else default."""
    budget_ms = getattr(body, "latency_budget_ms", None)
    if budget_ms is None and (raw := header(request, BUDGET_HEADER)) is not None:
        try:
            budget_ms = float(raw)
        except ValueError:
            budget_ms = -1.0
        if not (0 < budget_ms <= 3_600_000):
            raise APIError(
                422,
                f"header X-Ferry-Latency-Budget-Ms must be a number of milliseconds in (0, 3600000], got {raw!r}",
                code="invalid_value",
                param="X-Ferry-Latency-Budget-Ms",
            )
    slo_ms = slo_header(request, TTFT_HEADERS)  # validated even when a Ferry budget wins
    if budget_ms is None:
        budget_ms = slo_ms
    name = getattr(body, "priority", None) or header(request, PRIORITY_HEADER)
    try:
        priority = Priority.parse(name)
    except ValueError as exc:
        raise APIError(422, str(exc), code="invalid_value", param="priority") from None
    return (None if budget_ms is None else budget_ms / 1000.0), priority


def on_infeasible(request: Request, body: Any = None) -> str | None:
    """The request's own choice for a budget admission judges it cannot meet ("reject" or
    "serve"): the body's `on_infeasible`, else `X-Ferry-On-Infeasible`; None: the model's
    `on_infeasible` setting."""
    choice = getattr(body, "on_infeasible", None)
    if choice is None and (raw := header(request, ON_INFEASIBLE_HEADER)) is not None:
        choice = raw.strip().lower()
        if choice not in ON_INFEASIBLE:
            raise APIError(
                422,
                f"header X-Ferry-On-Infeasible must be reject or serve, got {raw!r}",
                code="invalid_value",
                param="X-Ferry-On-Infeasible",
            )
    return choice


async def submit(batcher: ServedBatcher, payloads: list[Any], *, one_shot: bool = False, **kw: Any) -> list[WorkItem]:
    """Queue a request's items, refusals as APIErrors. `one_shot`: the caller only waits for
    the results (embeddings): an engine core's batcher returns the items without waiting for
    admission, and a refusal fails them with the error raised here otherwise (wait_items
    answers it the same way)."""
    try:
        return await batcher.submit_many(payloads, one_shot=one_shot, **kw)
    except BatchingError as exc:
        raise APIError.from_batching(exc) from None


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_items(request: Request, batcher: ServedBatcher, items: list[WorkItem]) -> list[Any]:
    """Results in item order. If the client leaves first, its items are cancelled (and
    never computed if still queued). If one item fails, its siblings are cancelled."""
    # One item (most requests) is awaited as it is; gather() would wrap it in another future.
    gathered = items[0].result_future if len(items) == 1 else asyncio.gather(*(i.result_future for i in items))
    # Whichever ends first wakes one future: asyncio.wait's sets, waiter and callback
    # removal cost more than the request's own work under zero-cost engines. The watcher
    # of the client's connection (a task) starts only if the results take WATCH_AFTER:
    # most answers under light engines come sooner, and a client that left meanwhile is
    # seen as soon as it starts.
    loop = gathered.get_loop()
    either = loop.create_future()
    wake = partial(_wake, either)
    gathered.add_done_callback(wake)
    watching: list[asyncio.Future[None]] = []
    timer = loop.call_later(WATCH_AFTER, _watch, request, either, wake, watching)
    try:
        await either
    except asyncio.CancelledError:
        cancel_all(batcher, items)
        gathered.add_done_callback(_consume)
        raise
    finally:
        timer.cancel()
        for watcher in watching:
            watcher.cancel()
    if not gathered.done():
        cancel_all(batcher, items)  # resolves every item future, so `gathered` completes too
        gathered.add_done_callback(_consume)
        raise ClientGone()
    try:
        return [gathered.result()] if len(items) == 1 else gathered.result()
    except BatchingError as exc:
        cancel_all(batcher, items, by_client=False)  # one failed: its siblings' work is moot
        raise APIError.from_batching(exc) from None


def _watch(request: Request, either: asyncio.Future, wake: Any, watching: list[asyncio.Future[None]]) -> None:
    if not either.done():
        watcher = asyncio.ensure_future(wait_disconnect(request))
        watcher.add_done_callback(wake)
        watching.append(watcher)


def _wake(either: asyncio.Future, _: asyncio.Future) -> None:
    if not either.done():
        either.set_result(None)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: the client is gone, nobody else will


def cancel_all(batcher: ServedBatcher, items: list[WorkItem], by_client: bool = True) -> None:
    for item in items:
        batcher.cancel(item, by_client=by_client)


def timing_headers(items: list[WorkItem]) -> dict[str, str]:
    """The slowest item speaks for the request: its queue wait, batch size and reason."""
    waits = [(i.dispatched_at - i.arrival, i) for i in items if i.dispatched_at is not None]
    if not waits:
        return {}
    wait, worst = max(waits, key=lambda w: w[0])
    headers = {
        "X-Ferry-Queue-Ms": f"{wait * 1000.0:.3f}",
        "X-Ferry-Batch-Size": str(worst.batch_size),
        "X-Ferry-Dispatch-Reason": worst.reason.value if worst.reason else "",
    }
    if any(i.best_effort for i in items):
        headers["X-Ferry-Best-Effort"] = "true"
    return headers
