"""A real uvicorn on 127.0.0.1 in a background thread, for tests that cross a socket."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from .waiting import wait_until


class LiveServer:
    def __init__(self, app, ready_timeout: float = 120.0):
        self.app = app
        self.ready_timeout = ready_timeout
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="live-uvicorn", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ferry(self):
        return self.app.state.ferry

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout

        def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            return self.server.started

        def ready() -> bool:
            r = httpx.get(self.url + "/readyz")
            if r.status_code == 200:
                return True
            if r.json().get("status") == "failed":
                raise RuntimeError(f"models failed to load: {r.json()}")
            return False

        wait_until(started, timeout=self.ready_timeout, message="uvicorn to start")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        wait_until(
            ready, timeout=max(deadline - time.monotonic(), 0.0), interval=0.05, message="the gateway to be ready"
        )
        return self

    def call(self, coro_fn, *args):
        """Run a coroutine function on the server's loop (to poke at batchers safely)."""
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self.loop).result(30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def live(app, ready_timeout: float = 120.0) -> Iterator[LiveServer]:
    server = LiveServer(app, ready_timeout).start()
    try:
        yield server
    finally:
        server.stop()
