"""Run the app under uvicorn, with a graceful drain on SIGTERM/SIGINT.

On the first signal: /readyz turns 503 at once, new requests get 503 with Retry-After,
accepted work (streams included) finishes within --drain-timeout, whatever is left ends
with a clear error, then uvicorn stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import uvicorn

from .app import create_app
from .config import ServerConfig
from .model_loading import GIL_SWITCH_INTERVAL_S

log = logging.getLogger("ferry.gateway")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ferry):
        super().__init__(config)
        self.ferry = ferry
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drain_task is None and not self.should_exit:
            log.info("signal %s: draining for up to %.1f s", sig, self.ferry.config.drain_timeout)
            self._drain_task = asyncio.get_event_loop().create_task(self._drain())
        else:
            super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        failed = await self.ferry.drain(self.ferry.config.drain_timeout)
        if failed:
            log.warning("drain timeout: %d accepted items ended with an error", failed)
        # Let the last streams send their final events, then keep answering 503 (with
        # Connection: close) while clients are still sending: closing the socket under a
        # keep-alive connection the client is writing to would reset a request instead of
        # refusing it. Linger until 0.5 s pass with no new request, at most 5 s.
        loop = asyncio.get_running_loop()
        end = loop.time() + 5.0
        # Polled: "0.5 s with no new request" is a condition on time that no event signals.
        while loop.time() < end and (self.ferry.streams > 0 or time.monotonic() - self.ferry.last_request_at < 0.5):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        self.should_exit = True


def serve(cfg: ServerConfig) -> int:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = create_app(cfg)
    app.state.ferry.freeze_gc = True
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=cfg.drain_timeout + 5,
    )
    server = DrainingServer(config, app.state.ferry)
    app.state.ferry.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run()
    if app.state.ferry.fatal:
        print(f"ferry: {app.state.ferry.fatal}", file=sys.stderr)
        return 1
    return 0
