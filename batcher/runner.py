"""Run blocking engine calls off the event loop, on one dedicated worker thread.

One thread per engine: torch work is serialised (the engine needs no locks) and the loop
pays one thread hop per batch, never per request.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


class ThreadRunner:
    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ferry-{name}")

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
