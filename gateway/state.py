"""Process-wide state of one gateway, kept on `app.state.ferry`."""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from starlette.requests import HTTPConnection

from engine.base import EmbeddingEngine, GenerationEngine

from .config import ServerConfig
from .core_process import CoreFailed, start_in_core
from .errors import APIError, not_found_model
from .metrics import GatewayMetrics
from .model_loading import CHAT, ModelKind, ModelSpec, ServedModel, start_model
from .ui_stats import StatsRing

if TYPE_CHECKING:
    from .jobs.worker import BatchJobWorker
    from .remote_batcher import RemoteBatcher

log = logging.getLogger("ferry.gateway")


@dataclass
class GatewayState:
    config: ServerConfig
    metrics: GatewayMetrics
    specs: list[ModelSpec]
    models: dict[str, ServedModel[Any]] = field(default_factory=dict)
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    streams: int = 0
    last_request_at: float = 0.0  # time.monotonic() of the latest request, for the drain linger
    jobs: BatchJobWorker | None = None  # set by create_app
    freeze_gc: bool = False  # set by `ferry serve`, whose process is the server's alone
    fatal: str | None = None  # why the server cannot run at all (`ferry serve` exits with it)
    on_fatal: Any = None  # called once `fatal` is set (`ferry serve` stops)
    ui_ring: StatsRing = field(default_factory=StatsRing)  # the live page's recent snapshots (gateway/routes/ui.py)

    async def load(self) -> None:
        try:
            for index, spec in enumerate(self.specs):
                if self.config.engine_cores:
                    served = await start_in_core(spec, index, self.config, self.metrics)
                    if served.kind == CHAT:  # the front end detokenizes what the core generates
                        cast("RemoteBatcher", served.batcher).tokenizer = served.engine
                else:
                    served = await start_model(spec, self.config, self.metrics)
                self.models[served.name] = served
                self.metrics.core_restarts.labels(served.name)  # at zero from the start, engine cores or not
            if self.freeze_gc:
                # Libraries, models and warm-up leave ~400,000 long-lived objects; a full
                # collection scanning them stalled every request for ~180 ms (bench_latency:
                # one ~200 ms burst of slow answers per run). Move them out of the collector.
                # Only where the process is the server's own (`ferry serve`): frozen objects
                # that later become garbage cycles are never freed.
                gc.collect()
                gc.freeze()
            self.ready = True
            log.info("ready: %s", ", ".join(self.models))
        except CoreFailed as exc:  # one line, no traceback: the model, its source, the reason
            self.load_error = self.fatal = str(exc)
            if self.on_fatal is not None:
                self.on_fatal()
        except Exception as exc:  # surfaced on /readyz; the process keeps answering health checks
            log.exception("model loading failed")
            self.load_error = f"{type(exc).__name__}: {exc}"

    @overload
    def model(self, name: str, kind: Literal["embedding"]) -> ServedModel[EmbeddingEngine]: ...
    @overload
    def model(self, name: str, kind: Literal["chat"]) -> ServedModel[GenerationEngine]: ...
    @overload
    def model(self, name: str, kind: ModelKind) -> ServedModel[EmbeddingEngine | GenerationEngine]: ...

    def model(self, name: str, kind: ModelKind) -> ServedModel[Any]:
        if self.draining:
            raise APIError(503, "server is shutting down", code="shutting_down", retry_after=1)
        if not self.ready:
            raise APIError(
                503,
                "models are still loading" if self.load_error is None else f"model loading failed: {self.load_error}",
                code="not_ready",
                retry_after=2,
            )
        served = self.models.get(name)
        if served is None or served.kind != kind:
            raise not_found_model(name, [m.name for m in self.models.values() if m.kind == kind])
        if served.batcher.failed:
            raise APIError(
                503,
                f"model {name} is unavailable: {served.batcher.failed}",
                code="model_unavailable",
                retry_after=1 if getattr(served.batcher, "restarting", False) else None,  # an engine core's restart
            )
        return served

    async def drain(self, timeout: float) -> int:
        self.draining = True
        if self.jobs is not None:
            self.jobs.pause()  # batch-job lines still queued go back to pending, not computed now
        failed = await asyncio.gather(*(m.batcher.drain(timeout) for m in self.models.values()))
        return sum(failed)

    async def close(self) -> None:
        for m in self.models.values():
            await m.batcher.stop()
            if m.engine_thread is not None:
                m.engine_thread.close()


def gateway_state(conn: HTTPConnection) -> GatewayState:
    """The state of the gateway serving this request (create_app keeps it on `app.state.ferry`)."""
    return cast(GatewayState, conn.app.state.ferry)
