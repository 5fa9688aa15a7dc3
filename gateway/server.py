"""Run the app under uvicorn, with a graceful drain on SIGTERM/SIGINT.

On the first signal: /readyz turns 503 at once, new requests get 503 with Retry-After,
accepted work (streams included) finishes within --drain-timeout, whatever is left ends
with a clear error, then uvicorn stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from typing import Any

import uvicorn

from .app import create_app
from .config import ServerConfig
from .models.start import GIL_SWITCH_INTERVAL_S

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


class FrontEndServer(DrainingServer):
    """One front end of several (`--api-workers N`): serves the socket its supervisor bound,
    and takes the supervisor's word on the engine cores from `control` (a pipe); the pipe's
    end means the supervisor is gone, and the front end stops."""

    def __init__(self, config: uvicorn.Config, ferry, control: Any):
        super().__init__(config, ferry)
        self.control = control

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT:
            return  # a terminal's Ctrl-C reaches the whole group: the supervisor decides (SIGTERM)
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        asyncio.get_running_loop().add_reader(self.control.fileno(), self._from_supervisor)

    def _from_supervisor(self) -> None:
        try:
            message = self.control.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.control.fileno())
            log.error("the supervisor is gone; this front end stops")
            self.should_exit = True
            return
        self.ferry.core_event(message)


def serve_front_end(
    cfg: ServerConfig, sock: socket.socket, control: Any, cores: list[dict], shared_metrics: str
) -> int:
    """The life of one front end of several: the app over the supervisor's cores, on its
    socket; /metrics reads the series every front end and the supervisor keep in
    `shared_metrics` (gateway/metrics/shared.py) rather than this process's registry."""
    from .metrics.shared import shared_registry

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = create_app(cfg, cores=cores)
    app.state.ferry.freeze_gc = True
    app.state.ferry.shared_metrics = shared_registry(shared_metrics)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=cfg.drain_timeout + 5)
    server = FrontEndServer(config, app.state.ferry, control)
    server.run(sockets=[sock])
    return 0
