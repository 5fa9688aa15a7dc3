"""POST /v1/embeddings: parse, translate (gateway/translate/embeddings.py), submit, answer."""

from __future__ import annotations

from starlette.requests import Request

from ..endpoint import Ctx
from ..limits import request_models
from ..models.kinds import EMBEDDING
from ..request_body import parse
from ..responses import json_response
from ..state import gateway_state
from ..submission import itl_target, on_infeasible, scheduling, submit, timing_headers, wait_items
from ..translate.embeddings import embedding_work


async def create_embeddings(request: Request, ctx: Ctx):
    ferry = gateway_state(request)
    cfg = ferry.config
    body = await parse(request, request_models(cfg).embeddings, cfg.max_body_bytes)
    served = ferry.model(body.model, EMBEDDING)
    ctx.model = served.name
    if cfg.log_prompts:
        ctx.extra["prompts"] = body.inputs
    work = embedding_work(body, served.engine, cfg)
    budget, priority = scheduling(request, body)
    itl_target(request)  # checked, then unused: an embedding has no tokens after its first
    items = await submit(
        served.batcher,
        work.payloads,
        one_shot=True,
        costs=work.costs,
        budget=budget,
        priority=priority,
        request_id=ctx.request_id,
        tenant=ferry.tenancy.tenant(request, body),
        on_infeasible=on_infeasible(request, body),
    )
    results = await wait_items(request, served.batcher, items)
    ctx.extra.update(inputs=len(work.payloads), **_log_fields(items))
    return json_response(work.response(results), headers=timing_headers(items))


def _log_fields(items) -> dict:
    if len(items) == 1:  # most requests: no lists, no max()
        item = items[0]
        wait = 0.0 if item.dispatched_at is None else (item.dispatched_at - item.arrival) * 1000.0
        return {"queue_ms": round(wait, 3), "batch_size": item.batch_size}
    waits = [(i.dispatched_at - i.arrival) * 1000.0 for i in items if i.dispatched_at is not None]
    return {"queue_ms": round(max(waits, default=0.0), 3), "batch_size": max((i.batch_size for i in items), default=0)}
