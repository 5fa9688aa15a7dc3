"""Engine-core processes seen from the server (`ferry serve --engine-cores`): start one per
model, wait until it has loaded, watch it, drain it and stop it.

A core is a `spawn`ed child (a fresh interpreter: no copy of the server's threads, locks
or event loop) that loads `default_specs(cfg)[index]` itself, so the server never loads
the weights. It dies with the server: it stops when its end of the pipe closes, whatever
ended the server (a SIGKILL included). A core that dies is not restarted yet
(docs/architecture.md, step 4): its model answers `503 model_unavailable` from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import shutil
import signal
import tempfile
from typing import Any, cast

from batcher.settings import BatchingSettings

from . import engine_core
from .config import ServerConfig
from .model_loading import ModelSpec, ServedModel
from .remote_batcher import RemoteBatcher

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
    def __init__(self, cfg: ServerConfig, index: int):
        mp = multiprocessing.get_context("spawn")
        # The socket lives in a directory of the server's own, removed when the core stops.
        self.dir = tempfile.mkdtemp(prefix="ferry-core-")
        self.address = f"ipc://{self.dir}/core"
        self.conn, child = mp.Pipe()
        self.process = mp.Process(
            target=engine_core.run_core, args=(cfg, index, self.address, child), name=f"ferry-core-{index}", daemon=True
        )
        self.process.start()
        child.close()  # the core holds the only other end: its exit closes the pipe, and ours closes its
        self._exit: asyncio.Task | None = None

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
        raise CoreFailed(f"{describe_exit(self.process.exitcode)} before its model loaded")

    def watch(self, batcher: RemoteBatcher) -> None:
        """When the process ends, tell `batcher` (every request still open then fails)."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def end() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(self.process.sentinel, end)

        async def on_exit() -> None:
            try:
                await ended
            finally:
                loop.remove_reader(self.process.sentinel)
            await asyncio.to_thread(self.process.join)
            code = self.process.exitcode
            await batcher.lost(describe_exit(code), clean=code == 0)

        self._exit = asyncio.create_task(on_exit(), name=f"ferry-watch-{self.process.name}")

    async def drain(self, timeout: float) -> None:
        """Ask the core to finish its accepted work within `timeout` and exit; wait for that
        (and for the results it sent last)."""
        self._tell(("drain", timeout))
        await self._exited(timeout + STOP_GRACE_S)

    async def stop(self) -> None:
        self._tell(("drain", 0.0))  # no drain: fail what is left and exit
        await self._exited(STOP_GRACE_S)
        self.conn.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _tell(self, message: tuple) -> None:
        with contextlib.suppress(OSError, ValueError):  # gone already (or the pipe closed by an earlier stop)
            self.conn.send(message)

    async def _exited(self, within: float) -> None:
        if self._exit is None:  # never watched (it failed to start): just reap it
            await asyncio.to_thread(self.process.join, within)
        else:
            try:
                await asyncio.wait_for(asyncio.shield(self._exit), within)
                return
            except asyncio.TimeoutError:
                pass
        if self.process.is_alive():
            self.process.kill()
        if self._exit is not None:
            await self._exit
        else:
            await asyncio.to_thread(self.process.join)


async def start_in_core(spec: ModelSpec, index: int, cfg: ServerConfig) -> ServedModel:
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
    batcher = RemoteBatcher(engine.name, core.address, BatchingSettings(**info["settings"]), core=core)
    await batcher.start()
    core.watch(batcher)
    return ServedModel(engine.name, spec.kind, engine, batcher, None)
