"""POST /v1/chat/completions and /v1/completions: parse, translate (gateway/translate/chat.py),
submit, then answer with one JSON body or stream the deltas as server-sent events."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from batcher.errors import BatchingError
from batcher.types import Delta, WorkItem
from engine.base import GenerationEngine

from ..endpoint import Ctx, finish
from ..errors import APIError
from ..limits import request_models
from ..models.kinds import CHAT
from ..models.start import ServedModel
from ..request_body import parse
from ..responses import json_bytes, json_response
from ..state import gateway_state
from ..submission import cancel_all, itl_target, on_infeasible, scheduling, submit, timing_headers, wait_items
from ..translate.chat import GenerationBody, GenerationWork, generation_work, template_messages
from ..translate.stream import StreamChunks
from ..translate.structured import compile_structures


async def chat_completions(request: Request, ctx: Ctx):
    ferry = gateway_state(request)
    body = await parse(request, request_models(ferry.config).chat, ferry.config.max_body_bytes)
    served = ferry.model(body.model, CHAT)
    ctx.model = served.name
    if ferry.config.log_prompts:
        ctx.extra["prompts"] = [template_messages(conv) for conv in body.conversations]
    return await _generate(request, ctx, served, body)


async def completions(request: Request, ctx: Ctx):
    ferry = gateway_state(request)
    body = await parse(request, request_models(ferry.config).completions, ferry.config.max_body_bytes)
    served = ferry.model(body.model, CHAT)
    ctx.model = served.name
    if ferry.config.log_prompts:
        ctx.extra["prompts"] = body.prompts
    return await _generate(request, ctx, served, body)


async def _generate(request: Request, ctx: Ctx, served: ServedModel[GenerationEngine], body: GenerationBody):
    ferry = gateway_state(request)
    work = generation_work(body, served.engine, ferry.config)
    await compile_structures(work.structures, served.engine)
    budget, priority = scheduling(request, body)
    queued: dict[str, Any] = {
        "costs": work.costs,
        "budget": budget,
        "priority": priority,
        "request_id": ctx.request_id,
        "itl_target": itl_target(request),
        "tenant": ferry.tenancy.tenant(request, body),
        "on_infeasible": on_infeasible(request, body),
    }
    if body.stream:
        if ferry.streams >= ferry.config.max_streams:
            raise APIError(
                429,
                f"too many concurrent streams (limit {ferry.config.max_streams})",
                code="too_many_streams",
                retry_after=1,
            )
        deltas: asyncio.Queue[Delta | WorkItem] = asyncio.Queue()  # deltas, then endings
        # Counted before the submit awaits (an engine core's admission): streams checked
        # meanwhile see this one, so max_streams holds under concurrency.
        ferry.streams += 1
        try:
            items = await submit(served.batcher, work.payloads, on_delta=deltas.put_nowait, **queued)
        except BaseException:
            ferry.streams -= 1
            raise
        state = StreamState(time.perf_counter())

        def close() -> None:
            # The client left, the stream ended or the server stops: cancel whatever is
            # still queued or running, then account for the request exactly once.
            cancel_all(served.batcher, items)
            ferry.streams -= 1
            status = 499 if state.open else state.status
            ctx.extra.update(
                n_prompts=len(work.prompts), completion_tokens=state.completion_tokens, **_queue_fields(items)
            )
            ferry.metrics.series(ferry.metrics.in_flight, ctx.route).dec()
            finish(ferry, ctx, status, state.start)

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        # Admission has answered (submit awaited it): a stream says it is served best-effort
        # in its headers, as a whole answer does.
        extra = {"X-Ferry-Best-Effort": "true"} if any(i.best_effort for i in items) else {}
        return EventStream(_stream(work, items, deltas, include_usage, state), close, extra)
    items = await submit(served.batcher, work.payloads, **queued)
    results = await wait_items(request, served.batcher, items)
    out = work.response(results)
    ctx.extra.update(n_prompts=len(work.prompts), completion_tokens=out["usage"]["completion_tokens"])
    return json_response(out, headers=timing_headers(items))


# How long the usage chunk waits for results that have not come yet (their counts are then 0).
RESULT_WAIT_S = 5.0


def _sse(obj: Any) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


@dataclass
class StreamState:
    start: float
    status: int = 200
    completion_tokens: int = 0
    open: set[int] = field(default_factory=lambda: {-1})  # ids still owed a final event


class EventStream(StreamingResponse):
    """SSE response whose clean-up runs however it ends, even when the client leaves before
    the first byte: then the generator never starts and its own `finally` never runs."""

    def __init__(
        self, gen: AsyncGenerator[bytes, None], on_close: Callable[[], None], headers: dict[str, str] | None = None
    ):
        super().__init__(
            gen,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._gen = gen
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._gen.aclose()
            self._on_close()


async def _stream(
    work: GenerationWork,
    items: list[WorkItem],
    deltas: asyncio.Queue[Delta | WorkItem],
    include_usage: bool,
    state: StreamState,
) -> AsyncGenerator[bytes, None]:
    chunks = StreamChunks(work, include_usage)
    index_of = {item.id: k for k, item in enumerate(items)}
    open_items = state.open = {item.id for item in items}

    # Deltas and item endings share one queue. An item's future resolves only after its
    # last delta was queued, and done-callbacks run later still, so an ending always comes
    # after the item's deltas; an ending without a final delta is an error or expiry.
    def ended(fut: asyncio.Future, item: WorkItem) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved here: after a disconnect nobody reads the queue
        deltas.put_nowait(item)

    for item in items:
        item.result_future.add_done_callback(functools.partial(ended, item=item))
    while open_items:
        events = [await deltas.get()]
        while not deltas.empty():  # whatever else is already here goes out in one write
            events.append(deltas.get_nowait())
        out: list[bytes] = []
        for ev in events:
            if isinstance(ev, Delta):
                state.completion_tokens += ev.tokens
                out.extend(
                    _sse(c)
                    for c in chunks.deltas(
                        index_of[ev.item.id], ev.text, ev.finish_reason, ev.logprobs, ev.prompt_logprobs
                    )
                )
                if ev.finish_reason is not None:
                    open_items.discard(ev.item.id)
                continue
            if ev.id not in open_items:
                continue
            exc = ev.result_future.exception()
            if exc is None:  # cannot happen: a result always follows a final delta
                continue
            open_items.discard(ev.id)
            err = APIError.from_batching(exc) if isinstance(exc, BatchingError) else APIError(500, str(exc))
            state.status = err.status if state.status == 200 else state.status
            out.append(_sse(chunks.error(index_of[ev.id], err)))
        yield b"".join(out)
    if include_usage:
        yield _sse(chunks.usage(state.completion_tokens, await _cached_tokens(work, items)))
    yield b"data: [DONE]\n\n"


async def _cached_tokens(work: GenerationWork, items: list[WorkItem]) -> int:
    """The usage's cached prompt tokens, from the items' results. From an engine core a
    result follows its item's last tokens in a later message: waited for, briefly."""
    futures = [item.result_future for item in items]
    pending = [f for f in futures if not f.done()]
    if pending:
        await asyncio.wait(pending, timeout=RESULT_WAIT_S)
    results = [f.result() if f.done() and not f.cancelled() and not f.exception() else None for f in futures]
    return work.cached_tokens(results)


def _queue_fields(items: list[WorkItem]) -> dict:
    h = timing_headers(items)
    return {"queue_ms": float(h.get("X-Ferry-Queue-Ms", 0.0)), "batch_size": int(h.get("X-Ferry-Batch-Size", 0))}
