"""POST /v1/embeddings: each input string is its own work item, so inputs from many
requests batch together."""
from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request

from ..endpoint import Ctx
from ..errors import APIError
from ..http import parse, scheduling, submit, timing_headers, wait_items
from ..models import EMBEDDING
from ..responses import json_response
from ..schemas import EmbeddingsRequest, request_models


async def create_embeddings(request: Request, ctx: Ctx):
    ferry = request.app.state.ferry
    cfg = ferry.config
    body = await parse(request, request_models(cfg).embeddings, cfg.max_body_bytes)
    served = ferry.model(body.model, EMBEDDING)
    ctx.model = served.name
    texts = [body.input] if isinstance(body.input, str) else body.input
    if cfg.log_prompts:
        ctx.extra["prompts"] = texts
    token_ids = tokenize_inputs(texts, served, body, cfg)
    budget, priority = scheduling(request, body)
    items = submit(served.batcher, token_ids, costs=[len(t) for t in token_ids], budget=budget, priority=priority,
                   request_id=ctx.request_id)
    results = await wait_items(request, served.batcher, items)
    ctx.extra.update(inputs=len(texts), **_log_fields(items))
    return json_response(embeddings_body(results, served, body), headers=timing_headers(items))


def check_inputs(texts: list[str], served, body: EmbeddingsRequest, cfg) -> None:
    """The checks that need the served model but no tokenizer (batch jobs run them when a
    file is validated); the request model checked the input count."""
    dim = served.engine.dim
    if body.dimensions is not None and body.dimensions != dim:
        raise APIError(422, f"dimensions: {served.name} produces {dim}-dimensional embeddings; other sizes are not supported",
                       code="invalid_value", param="dimensions")


def tokenize_inputs(texts: list[str], served, body: EmbeddingsRequest, cfg) -> list[list[int]]:
    check_inputs(texts, served, body, cfg)
    token_ids = served.engine.tokenize(texts)
    if cfg.max_prompt_tokens is not None:
        for i, ids in enumerate(token_ids):
            if len(ids) > cfg.max_prompt_tokens:
                raise APIError(422, f"input[{i}] has {len(ids)} tokens; the limit is {cfg.max_prompt_tokens}",
                               code="too_many_tokens", param="input")
    return token_ids


def embeddings_body(results: list, served, body: EmbeddingsRequest) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": _encode(r.vector, body.encoding_format)}
            for i, r in enumerate(results)]
    tokens = sum(r.tokens for r in results)
    return {"object": "list", "data": data, "model": served.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(vector: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _log_fields(items) -> dict:
    waits = [(i.dispatched_at - i.arrival) * 1000.0 for i in items if i.dispatched_at is not None]
    return {"queue_ms": round(max(waits, default=0.0), 3), "batch_size": max((i.batch_size for i in items), default=0)}
