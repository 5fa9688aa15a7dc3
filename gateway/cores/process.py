"""Engine-core processes seen from the server (`ferry serve --engine-cores`): start one per
model, wait until it has loaded, watch it, drain it and stop it.

A core is a `Child` (gateway/cores/launch.py: a fresh interpreter, with no copy of the server's
threads, locks or event loop, that never imports the user's main module) that loads
`default_specs(cfg)[index]` itself, so the server never loads the weights. It dies with the
server: it stops when its end of the pipe closes, whatever ended the server (a SIGKILL
included).

A core that dies while the server is not draining or stopping (an exception, an OOM kill,
SIGKILL) is restarted by its `CoreRestarter` (docs/architecture.md, step 4): its requests in
flight end at once with `503 model_unavailable`, the model answers 503 (with Retry-After)
and /readyz is not ready until the new core, started with the model's current batching
settings and tenant policies (an admin PATCH's included), reports ready. Restarts are
bounded (gateway/cores/restarts.py: `MAX_RESTARTS` in `RESTART_WINDOW_S`, with backoff),
and a core that cannot load its model on a restart is not tried again: either way the
model stays unavailable and the log says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from batcher.settings import BatchingSettings

from ..config import ServerConfig
from ..metrics.registry import GatewayMetrics
from ..models.catalogue import ModelSpec
from ..models.kinds import CHAT
from ..models.start import ServedModel
from .client import CoreClient
from .launch import Child
from .proc import run_core, settings_file, tenants_file
from .restarts import RestartWindow

if TYPE_CHECKING:
    from ..metrics.shared import SupervisorMetrics

log = logging.getLogger("ferry.gateway")

# How long a core may take beyond its drain timeout, or to stop when told, before SIGKILL.
STOP_GRACE_S = 5.0


class CoreFailed(Exception):
    """An engine core that could not load its model; the message is the one line to show."""


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"engine core killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"engine core killed by signal {-code}"
    return f"engine core exited with code {code}"


class CoreProcess:
    """One engine core's process, seen from the server: started, awaited until it has loaded,
    watched, drained and stopped."""

    def __init__(
        self,
        cfg: ServerConfig,
        index: int,
        settings: BatchingSettings | None = None,
        tenants: dict[str, Any] | None = None,
    ):
        # The socket lives in a directory of the server's own, removed when the core stops.
        self.dir = tempfile.mkdtemp(prefix="ferry-core-")
        self.address = f"ipc://{self.dir}/core"
        self.settings_file = settings_file(self.address)
        self.process = Child(
            run_core,
            (cfg, index, self.address, None if settings is None else settings.to_dict(), tenants),
            name=f"ferry-core-{index}",
        )
        self.conn = self.process.conn  # the core's exit closes its end; ours closing ends the core
        self._exit: asyncio.Task | None = None

    def recorded_settings(self) -> BatchingSettings | None:
        """The batching settings the core last acknowledged (it records every applied
        admin PATCH, whichever front end sent it), or None if it recorded none."""
        try:
            with open(self.settings_file, encoding="utf-8") as f:
                return BatchingSettings(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None

    def recorded_tenants(self) -> dict[str, Any] | None:
        """The tenants' weights and quotas the core last had (an admin PATCH's, whichever
        front end sent it), or None if it recorded none."""
        try:
            with open(tenants_file(self.address), encoding="utf-8") as f:
                found = json.load(f)
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    async def ready(self) -> dict[str, Any]:
        """The core's report once it serves: its engine's facts and batching settings."""
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        fds = (self.conn.fileno(), self.process.sentinel)

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        for fd in fds:
            loop.add_reader(fd, wake)
        try:
            await woken
        finally:
            for fd in fds:
                loop.remove_reader(fd)
        try:
            status, info = self.conn.recv() if self.conn.poll() else ("exited", None)
        except (EOFError, OSError):
            status, info = "exited", None
        if status == "ready":
            return cast(dict[str, Any], info)
        if status == "failed":
            raise CoreFailed(info)
        await asyncio.to_thread(self.process.join, STOP_GRACE_S)
        why = self.process.last_words()  # its last error line, if it left one
        raise CoreFailed(f"{describe_exit(self.process.exitcode)} before its model loaded{f': {why}' if why else ''}")

    def watch(self, on_exit: Callable[[int | None], Awaitable[None]]) -> None:
        """When the process ends, call `on_exit` with its exit code."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def end() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(self.process.sentinel, end)

        async def exited() -> None:
            try:
                await ended
            finally:
                loop.remove_reader(self.process.sentinel)
            await asyncio.to_thread(self.process.join)
            await on_exit(self.process.exitcode)

        self._exit = asyncio.create_task(exited(), name=f"ferry-watch-{self.process.name}")

    async def drain(self, timeout: float) -> None:
        """Ask the core to finish its accepted work within `timeout` and exit; wait for that
        (and for the results it sent last)."""
        self._tell(("drain", timeout))
        await self._exited(timeout + STOP_GRACE_S)

    async def stop(self) -> None:
        self._tell(("drain", 0.0))  # no drain: fail what is left and exit
        await self._exited(STOP_GRACE_S)
        self.process.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def forget_peer(self, identity: bytes) -> None:
        """Tell the core that the front end whose sockets are named `identity` died: it
        cancels that front end's unfinished items and drops its later messages."""
        self._tell(("peer_gone", identity))

    def _tell(self, message: tuple) -> None:
        with contextlib.suppress(OSError, ValueError):  # gone already (or the pipe closed by an earlier stop)
            self.conn.send(message)

    async def _exited(self, within: float) -> None:
        """The process gone (killed if it is not within `within` s), and its watch done."""
        await asyncio.to_thread(self.process.stop_within, within)
        if self._exit is not None:  # None: never watched (it failed to start)
            await self._exit


class CoreObserver(Protocol):
    """Whoever is told of an engine core's deaths and restarts: the server's CoreClient, or
    with several front ends the supervisor's `CoreRelay` (gateway/cores/supervisor.py),
    which tells every front end."""

    model: str
    failed: str | None
    restarting: bool

    @property
    def settings(self) -> BatchingSettings: ...

    async def lost(self, reason: str, *, clean: bool = False, restarting: bool = False) -> None: ...

    async def reconnect(self, address: str) -> None: ...


class CoreRestarter:
    """Restarts one model's engine core when it dies unexpectedly (see the module's
    docstring), and drains or stops the one that runs now: the `core` of a CoreClient."""

    def __init__(
        self,
        cfg: ServerConfig,
        index: int,
        core: CoreProcess,
        metrics: GatewayMetrics | SupervisorMetrics | None = None,
    ):
        self.cfg, self.index, self.core, self.metrics = cfg, index, core, metrics
        self.observer: CoreObserver | None = None
        self.restarts = RestartWindow()
        self._leaving = False
        self._restart: asyncio.Task | None = None

    def watch(self, observer: CoreObserver) -> None:
        self.observer = observer
        self.core.watch(self._exited)

    async def _exited(self, code: int | None) -> None:
        assert self.observer is not None
        reason = describe_exit(code)
        if self._leaving:
            await self.observer.lost(reason, clean=code == 0)
            return
        now = time.monotonic()
        if not self.restarts.allows(now):
            reason += f"; not restarted: {len(self.restarts)} restarts in the last {self.restarts.seconds:g} s"
            await self.observer.lost(reason, clean=code == 0)
            return
        await self.observer.lost(reason + "; restarting", clean=code == 0, restarting=True)
        delay = self.restarts.begin(now)
        self._restart = asyncio.create_task(self._start_again(reason, delay), name=f"ferry-restart-{self.index}")

    async def _start_again(self, reason: str, delay: float) -> None:
        observer = self.observer
        assert observer is not None
        await asyncio.sleep(delay)
        if self._leaving:
            return
        log.warning("engine core of %s restarting (%s, restart %d)", observer.model, reason, len(self.restarts))
        if self.metrics is not None:
            self.metrics.core_restarts.labels(observer.model).inc()
        old = self.core
        settings = old.recorded_settings() or observer.settings  # read before its directory goes
        tenants = old.recorded_tenants()
        await old.stop()  # reaped already; this removes its socket's directory
        core = self.core = CoreProcess(self.cfg, self.index, settings, tenants)
        try:
            await core.ready()
        except CoreFailed as exc:
            if not self._leaving:  # not started again: it would fail the same way
                log.error("engine core of %s not restarted: %s", observer.model, exc)
                await observer.lost(f"{reason}; the restarted core failed: {exc}")
            await core.stop()
            return
        if self._leaving:
            await core.stop()
            return
        await observer.reconnect(core.address)
        core.watch(self._exited)
        log.info("engine core of %s restarted", observer.model)

    def forget_peer(self, identity: bytes) -> None:
        """A front end died (`--api-workers N`): its work in the core now is wasted."""
        self.core.forget_peer(identity)

    async def drain(self, timeout: float) -> None:
        self._leaving = True
        await self.core.drain(timeout)
        await self._settled()

    async def stop(self) -> None:
        self._leaving = True
        await self.core.stop()
        await self._settled()

    async def _settled(self) -> None:
        """A restart under way ends (its new core is stopped) before the server goes on."""
        if self._restart is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restart
            await self.core.stop()


async def start_in_core(
    spec: ModelSpec, index: int, cfg: ServerConfig, metrics: GatewayMetrics | None = None
) -> ServedModel:
    """Serve `spec` (the `index`-th of `default_specs(cfg)`) from its own engine core."""
    if spec.front is None:
        raise CoreFailed(f"the {spec.kind} model {spec.source or '(unnamed)'} cannot run in an engine core")
    core = CoreProcess(cfg, index)
    try:
        info = await core.ready()
        engine = await asyncio.to_thread(spec.front, info["facts"])
    except BaseException:
        await core.stop()
        raise
    restarter = CoreRestarter(cfg, index, core, metrics)
    batcher = CoreClient(
        engine.name,
        core.address,
        BatchingSettings(**info["settings"]),
        core=restarter,
        tokenizer=_detokenizer(spec, engine),
    )
    await batcher.start()
    restarter.watch(batcher)
    return ServedModel(engine.name, spec.kind, engine, batcher, None)


class AttachedCore:
    """The `core` of a front end's CoreClient for an engine core the supervisor owns
    (`--api-workers N`, `attach_core`): stopping leaves the core alone."""

    def __init__(self) -> None:
        self.batcher: CoreClient | None = None

    async def drain(self, timeout: float) -> None:
        """Wait for this front end's own requests in flight to end (the core keeps serving the others)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        # Polled: "no request of this front end in flight" is a count no event signals.
        while self.batcher is not None and self.batcher.in_flight and loop.time() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        return None


async def attach_core(spec: ModelSpec, view: dict[str, Any]) -> tuple[ServedModel, CoreClient]:
    """Serve `spec` from the engine core its supervisor started (`--api-workers N`); `view`
    is the supervisor's account of it (gateway/cores/supervisor.py, `CoreRelay.view`).
    Returns the client too: the supervisor's word on the core reaches it (GatewayState)."""
    assert spec.front is not None
    engine = await asyncio.to_thread(spec.front, view["facts"])
    control = AttachedCore()
    identity = view.get("identity")
    address, failed = view["address"], view["failed"]
    batcher = CoreClient(
        engine.name,
        address,
        BatchingSettings(**view["settings"]),
        core=control,
        tokenizer=_detokenizer(spec, engine),
        identity=None if identity is None else identity.encode(),
    )
    control.batcher = batcher
    await batcher.start()
    if failed:  # lost before this front end started: unavailable until it is back
        await batcher.lost(failed, restarting=view["restarting"])
    else:  # the core's settings now (another front end may have changed them since it started)
        with contextlib.suppress(Exception):
            await batcher.update()
    # The supervisor's word that came while this front end attached (GatewayState skips it
    # for a model not attached yet, and the view holds it): applied until nothing more came
    # meanwhile. Returning from here, the caller records the client before the next event.
    while (view["address"], view["failed"]) != (address, failed):
        address, failed = view["address"], view["failed"]
        if failed:
            await batcher.lost(failed, restarting=view["restarting"])
        else:
            await batcher.reconnect(address)
    return ServedModel(engine.name, spec.kind, engine, batcher, None), batcher


def _detokenizer(spec: ModelSpec, engine: Any) -> Any:
    """A chat model's front end detokenizes what its core generates; embeddings need none."""
    return engine if spec.kind == CHAT else None
