"""The minimal micro-batching server that loadtests/bench_gateway.py holds Ferry against:
Starlette + uvicorn + orjson + asyncio futures, batches of at most 32 gathered for at most
2 ms, a zero-cost engine answering 8-float vectors. No auth, limits, metrics or logs: the
floor under what any such front end can cost per request.

    python -m loadtests.skeleton --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

MAX_BATCH, MAX_WAIT = 32, 0.002
VECTOR = [0.125] * 8
queue: asyncio.Queue[asyncio.Future[list[float]]] = asyncio.Queue()


async def batcher() -> None:
    while True:
        batch = [await queue.get()]
        deadline = asyncio.get_running_loop().time() + MAX_WAIT
        while len(batch) < MAX_BATCH and (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                batch.append(await asyncio.wait_for(queue.get(), left))
            except TimeoutError:
                break
        for fut in batch:  # the zero-cost engine
            if not fut.done():
                fut.set_result(VECTOR)


async def embeddings(request: Request) -> Response:
    body = orjson.loads(await request.body())
    fut = asyncio.get_running_loop().create_future()
    await queue.put(fut)
    vector = await fut
    data = [{"object": "embedding", "index": 0, "embedding": vector}]
    out = {"object": "list", "data": data, "model": body.get("model", ""), "usage": {}}
    return Response(orjson.dumps(out), media_type="application/json")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    task = asyncio.create_task(batcher())
    yield
    task.cancel()


app = Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])], lifespan=lifespan)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8100)
    a = p.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", access_log=False)
