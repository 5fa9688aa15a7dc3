"""An engine core's process: load one model, report on the pipe, serve its `EngineCore`
(gateway/cores/core.py) until told to stop, as vLLM v1's `EngineCoreProc` wraps `EngineCore`.
The queue, admission, policies, cost model and engine run in this process, so torch never
waits on the interpreter lock of a process that parses HTTP (nothing here imports
starlette).

`gateway/cores/process.py` starts `run_core` as a `Child` (gateway/cores/launch.py) with a
pipe. On the pipe the core reports `("ready", facts)` or `("failed", one line)` once, then
takes `("drain", seconds)` and `("peer_gone", identity)` (with `--api-workers N`, the
supervisor saw the front end whose sockets are named `identity` die:
`EngineCore.forget_peer`); the pipe's end (the server gone) stops the core at once.
SIGTERM drains too; SIGINT is ignored, the server decides when its cores stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
from typing import Any

from batcher.metrics import Metrics

from ..config import ServerConfig
from ..models.catalogue import ModelSpec, default_specs
from ..models.diagnosis import failure_line
from ..models.kinds import CHAT, CUSTOM
from ..models.start import GIL_SWITCH_INTERVAL_S, ServedModel, start_local
from .core import TENANTS_FILE, EngineCore

# How long a core whose server is gone may take to stop cleanly before it exits anyway.
GONE_EXIT_S = 5.0

log = logging.getLogger("ferry.core")


def settings_file(address: str) -> str:
    """Where the core at `address` (ipc://DIR/core) records the batching settings it
    acknowledged, so that whoever restarts it (gateway/cores/process.py) starts the new one
    with them, whichever front end changed them."""
    return os.path.join(os.path.dirname(address.removeprefix("ipc://")), "settings.json")


def tenants_file(address: str) -> str:
    """Where the core at `address` records its tenants' weights and quotas (an admin PATCH
    of /admin/tenants changes them), beside its settings, for a restart to start from."""
    return os.path.join(os.path.dirname(address.removeprefix("ipc://")), TENANTS_FILE)


def run_core(
    conn: Any,
    cfg: ServerConfig,
    index: int,
    address: str,
    settings: dict[str, Any] | None = None,
    tenants: dict[str, Any] | None = None,
) -> None:
    """The process target: load `default_specs(cfg)[index]`, report on `conn`, serve.
    `settings`, `tenants`: the batching settings and tenant policies to start with (a
    restarted core's, as its model last had them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..logs import setup_logging

    setup_logging()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the engine thread hands every batch back to this loop
    cfg = with_core_threads(cfg)
    sys.exit(asyncio.run(_run(cfg, default_specs(cfg)[index], address, conn, settings, tenants)))


def with_core_threads(cfg: ServerConfig) -> ServerConfig:
    """`--torch-threads` auto (None) in an engine core: the cores this process may use less
    one for each front end, at least one. A front end parsing HTTP on a core one of the
    engine's threads spins on slows the whole forward (each op waits for its slowest
    thread): on 2 vCPUs, two threads beside a busy front end kept 91% of interactive
    requests on time where one kept 99%, and served no more (docs/benchmarks.md)."""
    if cfg.torch_threads is not None:
        return cfg
    return dataclasses.replace(cfg, torch_threads=max(1, len(os.sched_getaffinity(0)) - cfg.api_workers))


def facts(served: ServedModel[Any]) -> dict[str, Any]:
    """What the front end's half of the engine (the spec's `front`) is built from."""
    engine = served.engine
    if served.kind == CHAT:
        return {"name": engine.name, "max_context": engine.max_context}
    if served.kind == CUSTOM:
        return engine.facts()
    return {
        "name": engine.name,
        "dim": engine.dim,
        "max_length": engine.max_length,
        "vocab_size": getattr(engine, "vocab_size", None),
    }


async def _run(
    cfg: ServerConfig,
    spec: ModelSpec,
    address: str,
    conn: Any,
    settings: dict[str, Any] | None,
    tenants: dict[str, Any] | None = None,
) -> int:
    try:
        metrics = Metrics()
        served, batcher = await start_local(spec, cfg, metrics)
        if settings is not None and settings != batcher.settings.to_dict():
            batcher.update(**settings)
        if tenants is not None:  # (an admin PATCH's, kept over the config file's)
            batcher.update(tenants=tenants)
        grammars = getattr(served.engine, "grammars", None)
        path = settings_file(address) if address.startswith("ipc://") else None
        core = EngineCore(
            batcher,
            address,
            registry=metrics.registry,
            grammars=grammars,
            settings_path=path,
            # A custom model's cost hints need the class, which only the core has made.
            cost_of=served.engine.costs if served.kind == CUSTOM else None,
        )
        core.record_settings()  # what a restart starts from until an admin PATCH changes it
    except Exception as exc:
        log.debug("model loading failed", exc_info=True)
        conn.send(("failed", failure_line(spec, exc)))
        return 1
    conn.send(("ready", {"facts": facts(served), "settings": batcher.settings.to_dict()}))
    gc.collect()
    gc.freeze()  # this process is the core's alone (see GatewayState.load)
    loop = asyncio.get_running_loop()
    stop: asyncio.Future = loop.create_future()

    def from_server() -> None:
        try:
            command, value = conn.recv()
        except (EOFError, OSError):  # the server is gone: nobody can take results any more
            command, value = "gone", 0.0
        if command == "peer_gone":
            core.forget_peer(value)
        elif not stop.done() and command in ("drain", "gone"):
            stop.set_result(value)
        if command == "gone":
            # Nobody can take results any more: stop cleanly, but never outlive the server
            # by more than GONE_EXIT_S, whatever the clean stop waits on (a fresh-clone CI
            # run once left a chat core idle after its server was SIGKILLed).
            watchdog = threading.Timer(GONE_EXIT_S, os._exit, args=(0,))
            watchdog.daemon = True
            watchdog.start()

    loop.add_reader(conn.fileno(), from_server)

    def on_sigterm() -> None:
        if not stop.done():
            stop.set_result(cfg.drain_timeout)

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    serving = asyncio.create_task(core.serve())
    timeout = await stop
    loop.remove_reader(conn.fileno())
    if timeout > 0:
        failed = await batcher.drain(timeout)
        if failed:
            log.warning("drain timeout: %d accepted items ended with an error", failed)
    serving.cancel()
    await batcher.stop()
    if served.engine_thread is not None:
        served.engine_thread.close()
    await core.close()
    core.ctx.term()  # waits up to LINGER_MS for the last results to leave
    log.info("engine core of %s stopped", served.name)
    return 0
