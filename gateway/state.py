"""Process-wide state of one gateway, kept on `app.state.ferry`."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from prometheus_client import CollectorRegistry
from starlette.requests import HTTPConnection

from engine.base import EmbeddingEngine, GenerationEngine

from .config import ServerConfig
from .cores.client import CoreClient
from .cores.process import CoreFailed, attach_core, start_in_core
from .errors import APIError, not_found_model, not_ready, shutting_down
from .metrics.registry import GatewayMetrics
from .models.catalogue import ModelSpec
from .models.kinds import ModelKind
from .models.start import ServedModel, start_model
from .tenancy import Tenancy
from .ui.stats import StatsRing

if TYPE_CHECKING:
    from .jobs.service import BatchJobs

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
    jobs: BatchJobs | None = None  # set by create_app
    freeze_gc: bool = False  # set by `ferry serve`, whose process is the server's alone
    fatal: str | None = None  # why the server cannot run at all (`ferry serve` exits with it)
    on_fatal: Any = None  # called once `fatal` is set (`ferry serve` stops)
    ui_ring: StatsRing = field(default_factory=StatsRing)  # the live page's recent snapshots (gateway/ui/route.py)
    # A front end of several (`--api-workers N`): the supervisor's account of each core, by
    # model index (gateway/cores/supervisor.py), kept current by `core_event`.
    cores: list[dict[str, Any]] | None = None
    by_index: dict[int, CoreClient] = field(default_factory=dict)
    # ... and what its /metrics reads instead of `metrics.registry`: the series of every
    # front end and of the supervisor (gateway/metrics/shared.py), the cores' merged in
    shared_metrics: CollectorRegistry | None = None
    _events: asyncio.Queue | None = None
    _event_task: asyncio.Task | None = None
    tenancy: Tenancy = field(default_factory=Tenancy)  # whose work each request is (gateway/tenancy.py)

    @property
    def api_keys(self) -> list[str]:
        """Every key the `/v1` routes accept: `--api-key`'s and the config file's tenants'."""
        return list(self.tenancy.keys) if self.tenancy.keys else list(self.config.api_keys)

    async def load(self) -> None:
        began = time.monotonic()
        try:
            if self.cores is None and self.config.engine_cores:
                await self._start_cores()
            for index, spec in enumerate(self.specs):
                if self.cores is not None:
                    served, self.by_index[index] = await attach_core(spec, self.cores[index])
                elif not self.config.engine_cores:
                    served = await start_model(spec, self.config, self.metrics)
                else:
                    continue
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
            log.info("ready in %.1f s: %s", time.monotonic() - began, ", ".join(self.models))
        except CoreFailed as exc:  # one line, no traceback: the model, its source, the reason
            self.load_error = self.fatal = str(exc)
            if self.on_fatal is not None:
                self.on_fatal()
        except Exception as exc:  # surfaced on /readyz; the process keeps answering health checks
            log.exception("model loading failed")
            self.load_error = f"{type(exc).__name__}: {exc}"

    async def _start_cores(self) -> None:
        """One engine core per model, all loading side by side (each its own process: a
        model's libraries and weights load while another's do); the first failure is
        raised once every core has answered, the cores that started kept for close()."""

        async def start(index: int, spec: ModelSpec) -> ServedModel:
            served = await start_in_core(spec, index, self.config, self.metrics)
            # Kept at once: if the load is cancelled (SIGTERM while another core still
            # loads), close() still stops this core.
            self.models[served.name] = served
            self.metrics.core_restarts.labels(served.name)  # at zero from the start
            return served

        results = await asyncio.gather(*(start(i, spec) for i, spec in enumerate(self.specs)), return_exceptions=True)
        # In the order of the specs, whichever core was ready first (/v1/models lists them so).
        ordered = [r for r in results if not isinstance(r, BaseException)]
        self.models.clear()  # the same dictionary: others may hold it
        self.models.update((r.name, r) for r in ordered)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    def core_event(self, message: tuple) -> None:
        """The supervisor's word on a core (a front end of several): ("lost", index, reason,
        clean, restarting) or ("reconnect", index, address), applied in order."""
        kind, index, *rest = message
        assert self.cores is not None
        view = self.cores[index]
        if kind == "lost":
            view.update(failed=rest[0], restarting=rest[2])
        elif kind == "reconnect":
            view.update(address=rest[0], failed=None, restarting=False)
        if self._events is None:
            self._events = asyncio.Queue()
            self._event_task = asyncio.create_task(self._apply_events(), name="ferry-core-events")
        self._events.put_nowait(message)

    async def _apply_events(self) -> None:
        assert self._events is not None
        while True:
            kind, index, *rest = await self._events.get()
            batcher = self.by_index.get(index)
            if batcher is None:  # not attached yet: it starts from the view updated above
                continue
            try:
                if kind == "lost":
                    reason, clean, restarting = rest
                    await batcher.lost(reason, clean=clean, restarting=restarting)
                elif kind == "reconnect":
                    await batcher.reconnect(rest[0])
                    log.info("engine core of %s serves again", batcher.model)
            except Exception:
                log.exception("applying the supervisor's %s of core %d failed", kind, index)

    @overload
    def model(self, name: str, kind: Literal["embedding"]) -> ServedModel[EmbeddingEngine]: ...
    @overload
    def model(self, name: str, kind: Literal["chat"]) -> ServedModel[GenerationEngine]: ...
    @overload
    def model(self, name: str, kind: ModelKind) -> ServedModel[EmbeddingEngine | GenerationEngine]: ...

    def model(self, name: str, kind: ModelKind) -> ServedModel[Any]:
        if self.draining:
            raise shutting_down()
        if not self.ready:
            raise not_ready(self.load_error)
        served = self.models.get(name)
        if served is None or served.kind != kind:
            raise not_found_model(name, [m.name for m in self.models.values() if m.kind == kind])
        if served.batcher.failed:
            raise APIError(
                503,
                f"model {name} is unavailable: {served.batcher.failed}",
                code="model_unavailable",
                retry_after=1 if served.batcher.restarting else None,  # an engine core's restart
            )
        return served

    async def drain(self, timeout: float) -> int:
        self.draining = True
        if self.jobs is not None:
            self.jobs.pause()  # batch-job lines still queued go back to pending, not computed now
        failed = await asyncio.gather(*(m.batcher.drain(timeout) for m in self.models.values()))
        return sum(failed)

    async def close(self) -> None:
        if self._event_task is not None:
            self._event_task.cancel()
        for m in self.models.values():
            await m.batcher.stop()
            if m.engine_thread is not None:
                m.engine_thread.close()


def gateway_state(conn: HTTPConnection) -> GatewayState:
    """The state of the gateway serving this request (create_app keeps it on `app.state.ferry`,
    and on the Gateway itself as `ferry`: Starlette's State looks attributes up through
    `__getattr__`, 1.4% of a front end's time under the zero-cost engines)."""
    app = conn.scope["app"]
    ferry = getattr(app, "ferry", None)
    return cast(GatewayState, ferry if ferry is not None else app.state.ferry)
