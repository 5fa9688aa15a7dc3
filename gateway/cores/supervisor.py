"""`ferry serve --api-workers N` (N >= 2): N front-end processes in front of the engine cores,
under a small supervisor process (docs/architecture.md, "Step 5, as built").

The supervisor is the `ferry serve` process itself (`serve_front_ends`). It holds no HTTP
app and loads no model: it takes the data directory's lock (the front ends share the job
store, and its `worker_lease` picks the one that runs batch jobs), binds and listens on
host:port, starts one engine core per model and waits for each to load
(gateway/cores/process.py: `CoreProcess`, and `CoreRestarter`, which restarts a core that dies
with the settings it last acknowledged, bounded; a core that cannot load its model makes
`ferry serve` exit 1 with one line), then starts N front ends (each a `Child`,
gateway/cores/launch.py). Each front end runs the gateway app under uvicorn on the one
listening socket, handed to it as uvicorn's own
multi-worker mode does (the kernel gives each connection to one of them), with a
CoreClient to every core (gateway/server.py, `serve_front_end`); a front end accepts only once
attached to every core (gateway/app.py's lifespan), so a replacement never answers 503
not_ready beside a sibling that serves.

Control: one pipe per front end. The supervisor tells every front end, in order,
`("lost", index, reason, clean, restarting)` as soon as it sees a core exit (its process
sentinel), and `("reconnect", index, address)` once the replacement serves: each front end
ends its requests in flight for that model at once with `503 model_unavailable` and
reports the model not ready on /readyz until then. The pipe's end tells a front end that
its supervisor is gone (it stops); a front end's exit closes its end, and the supervisor
replaces a front end that exits while it is not draining (bounded as cores are).

A front end's sockets to the cores are named `front-<index>.<generation>` (`identity`; a
replacement's generation is one more). When one dies, the supervisor tells every core on
its pipe, `("peer_gone", identity)` (gateway/cores/core.py, `EngineCore.forget_peer`):
the core cancels that front end's queued and running items, since no client can hear
their results any more.

Metrics: the supervisor makes `<run dir>/metrics`, where every front end (and the
supervisor, its `ferry_engine_core_restarts_total`) keeps its series in prometheus-client's
multiprocess files, read whole by a /metrics scrape of any front end; when a front end
exits the supervisor marks it dead there, so its live gauges go while its counts stay
(gateway/metrics/shared.py).

SIGTERM (or SIGINT) to the supervisor drains in order: every front end gets SIGTERM, stops
accepting (503, /readyz draining) and finishes what it has in flight within
`--drain-timeout`; once they have exited, the cores finish what they accepted and exit;
then the supervisor exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from batcher.settings import BatchingSettings

from ..config import ServerConfig
from ..jobs.store import StoreLocked, lock_data_dir
from ..metrics.shared import SupervisorMetrics, metrics_dir, process_gone, share_metrics
from ..models.catalogue import default_specs
from .launch import Child
from .listen import listening_socket
from .process import STOP_GRACE_S, CoreFailed, CoreProcess, CoreRestarter, describe_exit
from .restarts import RestartWindow

log = logging.getLogger("ferry.gateway")

# A front end lingers this long at most after its drain (gateway/server.py), answering 503.
FRONT_END_LINGER_S = 5.0


class CoreRelay:
    """The supervisor's account of one model's engine core, which relays its deaths and
    restarts to every front end: the `CoreObserver` its `CoreRestarter` reports to."""

    def __init__(self, index: int, address: str, info: dict[str, Any], fronts: FrontEnds):
        self.index, self.address, self.fronts = index, address, fronts
        self.facts = info["facts"]
        self.model: str = self.facts["name"]
        self._settings = BatchingSettings(**info["settings"])
        self.failed: str | None = None
        self.restarting = False

    @property
    def settings(self) -> BatchingSettings:
        return self._settings  # a restart prefers what the core recorded (CoreProcess.recorded_settings)

    def view(self) -> dict[str, Any]:
        """What a front end starting now attaches with (gateway/cores/process.py, attach_core)."""
        return {
            "address": self.address,
            "facts": self.facts,
            "settings": self._settings.to_dict(),
            "failed": self.failed,
            "restarting": self.restarting,
        }

    async def lost(self, reason: str, *, clean: bool = False, restarting: bool = False) -> None:
        if self.fronts.leaving:
            return  # the drain stops the cores; the front ends are gone by then
        self.failed, self.restarting = reason, restarting
        log.error("engine core of %s lost: %s", self.model, reason)
        self.fronts.tell(("lost", self.index, reason, clean, restarting))

    async def reconnect(self, address: str) -> None:
        self.address, self.failed, self.restarting = address, None, False
        self.fronts.tell(("reconnect", self.index, address))


class FrontEnds:
    """The N front-end processes: started, replaced when one dies, drained."""

    def __init__(self, cfg: ServerConfig, sock: socket.socket, run_dir: str):
        self.cfg, self.sock, self.run_dir = cfg, sock, run_dir
        self.cores: list[CoreRelay] = []
        self.restarters: list[CoreRestarter] = []  # the cores' (to tell of a front end's death)
        self.generations: dict[int, int] = {}  # index -> how many front ends held it before
        self.procs: dict[int, Child] = {}  # index -> its front end now
        self.conns: dict[int, Any] = {}  # index -> our end of its pipe
        self.leaving = False
        self.restarts = RestartWindow()
        self.fatal: str | None = None
        self.failed = asyncio.Event()  # set with `fatal`: the supervisor stops
        self._tasks: set[asyncio.Task] = set()

    def identity(self, index: int) -> str:
        """The socket identity of the front end at `index` now: its index and generation
        (a replacement's differs from the one it replaces, so a core never confuses them)."""
        return f"front-{index}.{self.generations.get(index, 0)}"

    def start(self, index: int) -> None:
        if index in self.procs:  # a replacement
            self.generations[index] = self.generations.get(index, 0) + 1
        views = [{**c.view(), "identity": self.identity(index)} for c in self.cores]
        proc = Child(
            run_front_end,
            (self.cfg, index, self.sock.fileno(), views, metrics_dir(self.run_dir)),
            name=f"ferry-front-{index}",
            pass_fds=(self.sock.fileno(),),
        )
        self.procs[index], self.conns[index] = proc, proc.conn
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def end() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(proc.sentinel, end)
        task = asyncio.create_task(self._watch(index, proc, ended), name=f"ferry-watch-front-{index}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, index: int, proc: Any, ended: asyncio.Future) -> None:
        try:
            await ended
        finally:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        await asyncio.to_thread(proc.join)
        process_gone(proc.pid, metrics_dir(self.run_dir))  # its live gauges go; its counts stay
        self.conns.pop(index, None)
        proc.close()
        # Its clients are gone with it: every core cancels what it still runs or queues for it.
        for restarter in self.restarters:
            restarter.forget_peer(self.identity(index).encode())
        if self.leaving:
            return
        reason = describe_exit(proc.exitcode).replace("engine core", f"front end {index}")
        now = time.monotonic()
        if not self.restarts.allows(now):
            replaced = f"{len(self.restarts)} replacements in the last {self.restarts.seconds:g} s"
            self.fatal = f"{reason}; not replaced: {replaced}"
            log.error("%s", self.fatal)
            self.failed.set()
            return
        delay = self.restarts.begin(now)
        log.warning("%s; replacing it", reason)
        await asyncio.sleep(delay)
        if not self.leaving:
            self.start(index)

    def tell(self, message: tuple) -> None:
        for conn in list(self.conns.values()):
            with contextlib.suppress(OSError, ValueError):  # a front end that just died
                conn.send(message)

    async def drain(self, timeout: float) -> None:
        """SIGTERM to every front end; wait for them to finish what is in flight and exit."""
        self.leaving = True
        procs = [p for p in self.procs.values() if p.is_alive()]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        end = time.monotonic() + timeout + FRONT_END_LINGER_S + STOP_GRACE_S
        for p in procs:
            late = functools.partial(log.warning, "front end %s did not stop in time; killing it", p.name)
            await asyncio.to_thread(p.stop_within, max(0.0, end - time.monotonic()), STOP_GRACE_S, before_kill=late)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def run_front_end(
    control: Any,
    cfg: ServerConfig,
    index: int,
    sock_fd: int,
    cores: list[dict],
    shared_metrics: str,
) -> None:
    """The process target of one front end, serving on the inherited listening socket
    `sock_fd`; its metrics are kept in `shared_metrics`, the server's metrics directory
    (gateway/metrics/shared.py), from before any is made."""
    share_metrics(shared_metrics)
    sock = socket.socket(fileno=sock_fd)
    from ..logs import setup_logging
    from ..server import serve_front_end

    setup_logging()
    sys.exit(serve_front_end(cfg, sock, control, cores, shared_metrics))


def serve_front_ends(cfg: ServerConfig) -> int:
    """`ferry serve` with `--api-workers` 2 or more: supervise the cores and the front ends
    until SIGTERM; 0 after a drain, 1 with one line on stderr when it cannot serve."""
    return asyncio.run(supervise(cfg))


def _say(line: str) -> None:
    print(f"ferry: {line}", file=sys.stderr)


async def _all_ready(cores: list[CoreProcess]) -> list[dict[str, Any] | BaseException]:
    """Each core's report once it serves, or what it failed with, in the cores' order."""
    return await asyncio.gather(*(core.ready() for core in cores), return_exceptions=True)


async def supervise(
    cfg: ServerConfig,
    *,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[int], None] | None = None,
    report: Callable[[str], None] = _say,
) -> int:
    """The supervisor's life, until SIGTERM or SIGINT (in the main thread) or `stop` is set.
    `on_listening(port)`: once the socket is bound (embedded mode asks for port 0).
    `report(line)`: why it cannot serve (default: one line on stderr)."""
    try:
        lock_fd = lock_data_dir(cfg.data_dir)
    except (StoreLocked, OSError) as exc:
        report(str(exc))
        return 1
    try:
        sock = listening_socket(cfg.host, cfg.port, inheritable=True)
    except OSError as exc:  # its strerror names the address
        os.close(lock_fd)
        report(exc.strerror or str(exc))
        return 1
    if on_listening is not None:
        on_listening(sock.getsockname()[1])
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    run_dir = tempfile.mkdtemp(prefix="ferry-run-")
    os.mkdir(metrics_dir(run_dir))  # every front end's series, and the supervisor's
    metrics = SupervisorMetrics(metrics_dir(run_dir))  # ferry_engine_core_restarts_total
    fronts = FrontEnds(cfg, sock, run_dir)
    restarters = fronts.restarters
    code = 0
    try:
        # Every model's core loads side by side: each is a process of its own.
        cores = [CoreProcess(cfg, index) for index, _spec in enumerate(default_specs(cfg))]
        all_loaded = asyncio.create_task(_all_ready(cores))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([all_loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not all_loaded.done():  # SIGTERM while loading: nothing accepted yet
            all_loaded.cancel()
            with contextlib.suppress(asyncio.CancelledError, CoreFailed):
                await all_loaded
            await asyncio.gather(*(core.stop() for core in cores))
            return 0
        failed = next((r for r in all_loaded.result() if isinstance(r, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*(core.stop() for core in cores))
            if not isinstance(failed, CoreFailed):
                raise failed
            report(str(failed))
            return 1
        for index, (core, info) in enumerate(zip(cores, all_loaded.result(), strict=True)):
            relay = CoreRelay(index, core.address, cast(dict[str, Any], info), fronts)
            restarter = CoreRestarter(cfg, index, core, metrics)
            restarter.watch(relay)
            restarters.append(restarter)
            fronts.cores.append(relay)
            metrics.core_restarts.labels(relay.model)
        for i in range(cfg.api_workers):
            fronts.start(i)
        log.info(
            "serving on %s:%d: %d front ends, engine cores for %s",
            cfg.host,
            sock.getsockname()[1],
            cfg.api_workers,
            ", ".join(c.model for c in fronts.cores),
        )
        stopping = asyncio.create_task(stop.wait())
        failing = asyncio.create_task(fronts.failed.wait())
        await asyncio.wait([stopping, failing], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failing.cancel()
        if fronts.fatal is not None:
            report(fronts.fatal)
            code = 1
        log.info("draining for up to %.1f s", cfg.drain_timeout)
        started = time.monotonic()
        await fronts.drain(cfg.drain_timeout)
        left = max(0.0, cfg.drain_timeout - (time.monotonic() - started))
        await asyncio.gather(*(r.drain(left) for r in restarters))
        log.info("stopped")
        return code
    finally:
        fronts.leaving = True
        for p in fronts.procs.values():
            await asyncio.to_thread(p.stop_within, 0.0, STOP_GRACE_S)  # killed at once if it lives
            p.close()
        for r in restarters:
            await r.stop()
        metrics.close()
        sock.close()
        os.close(lock_fd)
        shutil.rmtree(run_dir, ignore_errors=True)
