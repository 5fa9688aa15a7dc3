"""POST /v1/chat/completions and /v1/completions.

Several prompts may share one request (`messages` as a list of conversations, `prompt`
as a list of strings); every sampling field is a scalar or a per-prompt list. Each
(prompt, candidate) pair is its own work item, so prompts of one request batch with
prompts of others; choices come back in prompt order and stream deltas carry
`prompt_index`.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from batcher.errors import FerryError
from batcher.scheduler import Delta, GenRequest
from batcher.types import WorkItem
from engine.base import ChatTemplateError, SamplingParams

from ..endpoint import Ctx, finish
from ..errors import APIError, error_body
from ..http import cancel_all, parse, scheduling, submit, timing_headers, wait_items
from ..models import CHAT
from ..responses import dumps, json_response
from ..schemas import ChatCompletionRequest, CompletionRequest, request_models


@dataclass
class Plan:
    """What one request asks for, after validation: prompts and per-item parameters."""

    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt
    n: int

    def items(self) -> list[tuple[int, int, GenRequest]]:
        """(prompt_index, candidate, payload) in item order: prompt-major."""
        out = []
        for p, (ids, sp) in enumerate(zip(self.prompts, self.params)):
            for j in range(self.n):
                seed = None if sp.seed is None else sp.seed + j
                params = SamplingParams(sp.max_tokens, sp.temperature, sp.top_p, seed, list(sp.stop))
                out.append((p, j, GenRequest(ids, params)))
        return out


def per_prompt(name: str, value: Any, n: int, default: Any) -> list[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise APIError(422, f"{name} is a list of {len(value)} values but the request has {n} prompts; "
                                f"give one value per prompt or a single value for all", code="prompt_count_mismatch",
                       param=name)
        return list(value)
    return [value] * n


def stops_per_prompt(value: Any, n: int) -> list[list[str]]:
    """Counts and empty strings were checked by the request model (gateway/schemas.py)."""
    if value is None:
        return [[] for _ in range(n)]
    if isinstance(value, str):
        return [[value] for _ in range(n)]
    if all(isinstance(v, str) for v in value):
        return [list(value) for _ in range(n)]  # a list of strings applies to every prompt (OpenAI)
    return [[] if v is None else ([v] if isinstance(v, str) else list(v)) for v in per_prompt("stop", value, n, None)]


def plan(body: Any, prompts: list[list[int]], served: Any, cfg: Any, default_max: int | None) -> Plan:
    """Per-prompt parameters. The body was validated by the server's request models
    (counts, limits, stop strings); what is left needs the prompts: list lengths against
    the number of prompts, and prompt lengths against the context."""
    n = len(prompts)
    raw_max = getattr(body, "max_completion_tokens", None)
    max_name = "max_completion_tokens" if raw_max is not None else "max_tokens"
    if raw_max is None:
        raw_max = body.max_tokens
    max_tokens = per_prompt(max_name, raw_max, n, None)
    temps = per_prompt("temperature", body.temperature, n, 1.0)
    top_ps = per_prompt("top_p", body.top_p, n, 1.0)
    seeds = per_prompt("seed", body.seed, n, None)
    stops = stops_per_prompt(body.stop, n)
    context = served.engine.max_context
    limit_prompt = min(context - 1, cfg.max_prompt_tokens or context)
    params = []
    for i, ids in enumerate(prompts):
        if len(ids) > limit_prompt:
            raise APIError(422, f"prompt {i} has {len(ids)} tokens; this model accepts at most {limit_prompt} prompt tokens "
                                f"(context {context})", code="context_length_exceeded",
                           param="messages" if isinstance(body, ChatCompletionRequest) else "prompt")
        room = context - len(ids)
        mt = max_tokens[i]
        mt = min(mt if mt is not None else (default_max or cfg.max_completion_tokens), room)
        params.append(SamplingParams(max_tokens=mt, temperature=temps[i], top_p=top_ps[i], seed=seeds[i], stop=stops[i]))
    return Plan(prompts, params, body.n)


async def chat_completions(request: Request, ctx: Ctx):
    ferry = request.app.state.ferry
    body = await parse(request, request_models(ferry.config).chat, ferry.config.max_body_bytes)
    served = ferry.model(body.model, CHAT)
    ctx.model = served.name
    if ferry.config.log_prompts:
        ctx.extra["prompts"] = [[{"role": m.role, "content": m.text()} for m in conv] for conv in body.conversations]
    return await _generate(request, ctx, served, body, make_plan(body, served, ferry.config), chat=True)


async def completions(request: Request, ctx: Ctx):
    ferry = request.app.state.ferry
    body = await parse(request, request_models(ferry.config).completions, ferry.config.max_body_bytes)
    served = ferry.model(body.model, CHAT)
    ctx.model = served.name
    if ferry.config.log_prompts:
        ctx.extra["prompts"] = body.prompts
    return await _generate(request, ctx, served, body, make_plan(body, served, ferry.config), chat=False)


def make_plan(body: ChatCompletionRequest | CompletionRequest, served: Any, cfg: Any) -> Plan:
    """Count, tokenize and validate the prompts of a chat or completions request."""
    chat = isinstance(body, ChatCompletionRequest)
    texts = body.conversations if chat else body.prompts
    if chat:
        nested = texts is body.messages
        prompts = [encode_chat(served, conv, i, nested) for i, conv in enumerate(texts)]
    else:
        prompts = [served.engine.encode_prompt(t) for t in texts]
    return plan(body, prompts, served, cfg, None if chat else 16)


def encode_chat(served: Any, conversation: list, index: int, nested: bool) -> list[int]:
    """A conversation the model's chat template refuses is the client's error (422 naming the
    prompt and quoting the template), found before anything is queued."""
    try:
        return served.engine.encode_chat([{"role": m.role, "content": m.text()} for m in conversation])
    except ChatTemplateError as exc:
        raise APIError(422, f"prompt {index}: the chat template of {served.name} refuses this conversation: {exc}",
                       code="chat_template_error", param=f"messages.{index}" if nested else "messages") from None


def completion_body(p: Plan, results: list[Any], model: str, chat: bool) -> dict[str, Any]:
    """The non-streaming response: one choice per (prompt, candidate), in prompt order."""
    choices = []
    for k, ((prompt_index, _, _), r) in enumerate(zip(p.items(), results)):
        choice: dict[str, Any] = {"index": k, "prompt_index": prompt_index}
        if chat:
            choice["message"] = {"role": "assistant", "content": r.text}
        else:
            choice["text"] = r.text
        choice.update(finish_reason=r.finish_reason, logprobs=None)
        choices.append(choice)
    return {"id": _id(chat), "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(p, results)}


async def _generate(request: Request, ctx: Ctx, served: Any, body: Any, p: Plan, *, chat: bool):
    ferry = request.app.state.ferry
    budget, priority = scheduling(request, body)
    triples = p.items()
    if body.stream:
        if ferry.streams >= ferry.config.max_streams:
            raise APIError(429, f"too many concurrent streams (limit {ferry.config.max_streams})", code="too_many_streams",
                           retry_after=1)
        deltas: asyncio.Queue[Delta | WorkItem] = asyncio.Queue()  # deltas, then endings
        items = submit(served.batcher, [t[2] for t in triples], costs=[len(t[2].prompt_ids) for t in triples],
                       budget=budget, priority=priority, request_id=ctx.request_id, on_delta=deltas.put_nowait)
        state = StreamState(time.perf_counter())
        ferry.streams += 1

        def close() -> None:
            # The client left, the stream ended or the server stops: cancel whatever is
            # still queued or running, then account for the request exactly once.
            cancel_all(served.batcher, items)
            ferry.streams -= 1
            status = 499 if state.open else state.status
            ctx.extra.update(n_prompts=len(p.prompts), completion_tokens=state.completion_tokens, **_queue_fields(items))
            ferry.metrics.in_flight.labels(ctx.route).dec()
            finish(ferry, ctx, status, state.start)

        stream = _stream(served, body, p, triples, items, deltas, chat, state)
        return EventStream(stream, close)
    items = submit(served.batcher, [t[2] for t in triples], costs=[len(t[2].prompt_ids) for t in triples],
                   budget=budget, priority=priority, request_id=ctx.request_id)
    results = await wait_items(request, served.batcher, items)
    out = completion_body(p, results, served.name, chat)
    ctx.extra.update(n_prompts=len(p.prompts), completion_tokens=out["usage"]["completion_tokens"])
    return json_response(out, headers=timing_headers(items))


def _usage(p: Plan, results: list[Any]) -> dict[str, int]:
    prompt = sum(len(ids) for ids in p.prompts)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def _sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


@dataclass
class StreamState:
    start: float
    status: int = 200
    completion_tokens: int = 0
    open: set[int] = field(default_factory=lambda: {-1})  # ids still owed a final event


class EventStream(StreamingResponse):
    """SSE response whose clean-up runs however it ends, even when the client leaves before
    the first byte: then the generator never starts and its own `finally` never runs."""

    def __init__(self, gen: Any, on_close: Any):
        super().__init__(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._on_close()


async def _stream(served: Any, body: Any, p: Plan, triples: list, items: list[WorkItem], deltas: asyncio.Queue,
                  chat: bool, state: StreamState):
    rid, created, model = _id(chat), int(time.time()), served.name
    obj = "chat.completion.chunk" if chat else "text_completion"
    index_of = {item.id: k for k, item in enumerate(items)}
    started: set[int] = set()
    open_items = state.open = {item.id for item in items}

    def chunk(k: int, text: str | None, finish_reason: str | None, error: dict | None = None) -> bytes:
        choice: dict[str, Any] = {"index": k, "prompt_index": triples[k][0], "finish_reason": finish_reason, "logprobs": None}
        if error is not None:
            choice["error"] = error
        if chat:
            delta: dict[str, Any] = {}
            if k not in started:
                delta["role"] = "assistant"
                started.add(k)
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

    # Deltas and item endings share one queue. An item's future resolves only after its
    # last delta was queued, and done-callbacks run later still, so an ending always comes
    # after the item's deltas; an ending without a final delta is an error or expiry.
    def ended(fut: asyncio.Future, item: WorkItem) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved here: after a disconnect nobody reads the queue
        deltas.put_nowait(item)

    for item in items:
        item.future.add_done_callback(lambda f, item=item: ended(f, item))
    while open_items:
        events = [await deltas.get()]
        while not deltas.empty():  # whatever else is already here goes out in one write
            events.append(deltas.get_nowait())
        out = []
        for ev in events:
            if isinstance(ev, Delta):
                k = index_of[ev.item.id]
                state.completion_tokens += ev.tokens
                out.append(chunk(k, ev.text, ev.finish_reason))
                if ev.finish_reason is not None:
                    open_items.discard(ev.item.id)
                continue
            if ev.id not in open_items:
                continue
            exc = ev.future.exception()
            if exc is None:  # cannot happen: a result always follows a final delta
                continue
            open_items.discard(ev.id)
            err = APIError.from_ferry(exc) if isinstance(exc, FerryError) else APIError(500, str(exc))
            state.status = err.status if state.status == 200 else state.status
            # The error rides on the prompt's own final chunk: a separate top-level error
            # event would make OpenAI clients abort the whole stream, and with it the
            # other prompts' answers. Its finish_reason is the one value OpenAI's chat and
            # completion chunk types both allow that does not claim a whole answer.
            detail = error_body(err.status, err.message, err.code)["error"]
            k = index_of[ev.id]
            detail.update(status=err.status, prompt_index=triples[k][0], index=k)
            out.append(chunk(k, None, "content_filter", detail))
        yield b"".join(out)
    if body.stream_options is not None and body.stream_options.include_usage:
        prompt_tokens = sum(len(ids) for ids in p.prompts)
        done_tokens = state.completion_tokens
        yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": done_tokens,
                              "total_tokens": prompt_tokens + done_tokens}})
    yield b"data: [DONE]\n\n"


def _queue_fields(items: list[WorkItem]) -> dict:
    h = timing_headers(items)
    return {"queue_ms": float(h.get("X-Ferry-Queue-Ms", 0.0)), "batch_size": int(h.get("X-Ferry-Batch-Size", 0))}
