"""Embedded mode: a whole Ferry gateway inside your process, for scripts and notebooks.

    from gateway import Ferry

    with Ferry(models=["embeddings", "chat"], max_batch_size=16) as ferry:
        client = ferry.client()
        vectors = client.embed("sentence-transformers/all-MiniLM-L6-v2", ["hello", "goodbye"])

`Ferry` runs uvicorn with the gateway app in a background thread with its own event loop,
listening on a free 127.0.0.1 port (or the `port=` given), so everything the HTTP server
does (micro-batching across callers, admission, metrics on /metrics) works unchanged and
several threads or processes can share it. Entering waits until /readyz is 200; leaving
stops the server, finishes the models' worker threads and closes the socket, leaving no
thread and no open port behind.

`Ferry(api_workers=2, ...)` runs the whole process set of `ferry serve --api-workers 2`
instead (gateway/cores/supervisor.py): the supervisor in a background thread of yours, the
engine cores and front ends as child processes. Entering waits until every front end is
ready; leaving drains them all and waits until every process has exited. `state` is None
then (the models live in other processes); `models` comes from `/v1/models`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import httpx

from ferry_client import AsyncFerryClient, FerryClient

from .config import ServerConfig
from .models.catalogue import ModelSpec
from .models.kinds import CHAT, EMBEDDING, kind_of_architectures, looks_like_path

if TYPE_CHECKING:
    import uvicorn
    from starlette.applications import Starlette

    from .metrics.registry import GatewayMetrics
    from .state import GatewayState

log = logging.getLogger("ferry.embedded")

__all__ = ["Ferry"]

_EMBEDDING_WORDS = {"embeddings", "embedding", "embed"}
_CHAT_WORDS = {"chat", "completions", "generation", "llm"}
_DEFAULT_NAMES = {"sentence-transformers/all-MiniLM-L6-v2": EMBEDDING, "ferry-tiny-chat": CHAT}
_SETTINGS = {f.name for f in dataclasses.fields(ServerConfig)} - {"host", "port"}


def _infer_kind(name: str) -> str:
    """Embeddings or chat, from a model's Hugging Face config (its architectures)."""
    hint = f"write 'embeddings:{name}' or 'chat:{name}'"
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                archs = json.load(f).get("architectures") or []
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot tell whether {name!r} is an embeddings or a chat model ({type(exc).__name__}: {exc}); {hint}"
            ) from None
        return kind_of_architectures(list(archs))
    if looks_like_path(name) or os.path.exists(path):
        raise ValueError(f"model {name!r}: no such model directory; {hint} once it exists")
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(name)
    except Exception as exc:  # any failure means we cannot tell
        raise ValueError(
            f"cannot tell whether {name!r} is an embeddings or a chat model ({type(exc).__name__}); {hint}"
        ) from None
    return kind_of_architectures(list(getattr(cfg, "architectures", None) or []))


def resolve_models(models: Any) -> tuple[str, str]:
    """(embedding_model, chat_model) settings for `models`, each "default", an id/path or "none".

    models: None (both defaults); "embeddings"/"chat" (the built-in default of that kind);
    a served default name ("sentence-transformers/all-MiniLM-L6-v2", "ferry-tiny-chat");
    "embeddings:<id or path>" / "chat:<id or path>"; a bare Hugging Face id or local path
    (kind read from its config); or a dict {"embeddings": id, "chat": id}. A list names at
    most one model per kind; a kind not named is not served.
    """
    if models is None:
        return "default", "default"
    if isinstance(models, dict):
        items: Iterable[str] = [f"{k}:{v}" for k, v in models.items()]
    elif isinstance(models, str):
        items = [models]
    else:
        items = list(models)
    chosen: dict[str, str] = {}
    for entry in items:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"models: expected model names, got {entry!r}")
        entry = entry.strip()
        kind_word, sep, rest = entry.partition(":")
        if entry.lower() in _EMBEDDING_WORDS:
            kind, value = EMBEDDING, "default"
        elif entry.lower() in _CHAT_WORDS:
            kind, value = CHAT, "default"
        elif entry in _DEFAULT_NAMES:
            kind, value = _DEFAULT_NAMES[entry], "default"
        elif sep and kind_word.lower() in _EMBEDDING_WORDS | _CHAT_WORDS and rest:
            kind = EMBEDDING if kind_word.lower() in _EMBEDDING_WORDS else CHAT
            value = "default" if rest in _DEFAULT_NAMES or rest.lower() == "default" else rest
        else:
            kind, value = _infer_kind(entry), entry
        if kind in chosen and chosen[kind] != value:
            raise ValueError(
                f"models: two {kind} models ({chosen[kind]!r} and {value!r}); one Ferry serves one of each kind"
            )
        chosen[kind] = value
    if not chosen:
        raise ValueError("models: nothing to serve")
    return chosen.get(EMBEDDING, "none"), chosen.get(CHAT, "none")


class Ferry:
    """A Ferry gateway in this process, for the duration of a `with` block.

    models: what to serve (see `resolve_models`; default: both built-in models).
    host, port: where to listen (default 127.0.0.1 and a free port).
    specs: a list of gateway.models.catalogue.ModelSpec to serve instead of `models` (fake engines
    in tests, or engines you built yourself). metrics: a gateway.metrics.registry.GatewayMetrics (default:
    a fresh registry, so several Ferry instances can coexist).
    ready_timeout: seconds to wait for the models to load (raises RuntimeError beyond).
    log_level: level of uvicorn's own loggers (None leaves logging alone).
    settings: any gateway.config.ServerConfig field, e.g. max_batch_size=16,
    max_wait_ms=2, policy="deadline", api_keys=["secret"] (or api_key="secret").
    """

    def __init__(
        self,
        models: Any = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        specs: list[ModelSpec] | None = None,
        metrics: GatewayMetrics | None = None,
        ready_timeout: float = 120.0,
        log_level: str | None = "warning",
        **settings: Any,
    ):
        if "api_key" in settings:
            key = settings.pop("api_key")
            settings["api_keys"] = list(settings.get("api_keys") or []) + ([key] if key else [])
        if isinstance(settings.get("api_keys"), str):
            settings["api_keys"] = [k.strip() for k in settings["api_keys"].split(",") if k.strip()]
        unknown = sorted(set(settings) - _SETTINGS)
        if unknown:
            raise TypeError(
                f"Ferry() got unknown setting(s) {', '.join(unknown)}; valid settings: {', '.join(sorted(_SETTINGS))}"
            )
        if specs is not None and models is not None:
            raise TypeError("give models= or specs=, not both")
        if specs is None and ("embedding_model" in settings or "chat_model" in settings):
            if models is not None:
                raise TypeError("give models= or embedding_model=/chat_model=, not both")
        elif specs is None:
            settings["embedding_model"], settings["chat_model"] = resolve_models(models)
        if not (0 <= int(port) < 65536):
            raise ValueError(f"port must be in 0..65535, got {port}")
        self.config = ServerConfig(host=host, port=int(port), **settings)
        try:  # fail here, naming the setting, rather than in the server thread
            dataclasses.replace(self.config, port=self.config.port or 1).validate()
        except SystemExit as exc:
            raise ValueError(str(exc)) from None
        self.host, self.port = host, int(port)
        self.specs, self.metrics = specs, metrics
        self.ready_timeout, self.log_level = float(ready_timeout), log_level
        self.app: Starlette | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._error: BaseException | None = None
        self._clients: list[Any] = []
        self._started = False
        # api_workers >= 2: the supervisor's loop, its stop event, its exit code and failure line
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._listening = threading.Event()
        self._code: int | None = None
        self._failure: list[str] = []
        self._names: list[str] = []
        if self.config.api_workers > 1:
            if specs is not None:
                raise TypeError("api_workers >= 2 serves models= (loaded by the cores); specs cannot cross processes")
            self.config.engine_cores = True
        self._threads_before: set[threading.Thread] = set()

    # -- addresses ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        """http://host:port, for FerryClient and curl."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """http://host:port/v1, for the official openai client."""
        return self.url + "/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def state(self) -> GatewayState | None:
        """The gateway's process state: models, batchers, metrics."""
        return None if self.app is None else cast("GatewayState", self.app.state.ferry)

    @property
    def models(self) -> list[str]:
        """The served model ids (once started)."""
        if self.config.api_workers > 1:
            return list(self._names)
        return [] if self.state is None else list(self.state.models)

    # -- clients -----------------------------------------------------------------------
    def _key(self, kw: dict) -> None:
        if "api_key" not in kw and self.config.api_keys:
            kw["api_key"] = self.config.api_keys[0]

    def client(self, **kw: Any) -> FerryClient:
        """A FerryClient for this gateway (closed when the Ferry stops). kw: FerryClient options."""
        self._require_running()
        self._key(kw)
        c = FerryClient(self.url, **kw)
        self._clients.append(c)
        return c

    def async_client(self, **kw: Any) -> AsyncFerryClient:
        """An AsyncFerryClient for this gateway; close it in its own event loop
        (`async with ferry.async_client() as client:`)."""
        self._require_running()
        self._key(kw)
        return AsyncFerryClient(self.url, **kw)

    def _require_running(self) -> None:
        if not self.running:
            raise RuntimeError("this Ferry is not running; use `with Ferry(...) as ferry:` or call start()")

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> Ferry:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    async def __aenter__(self) -> Ferry:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.stop)

    def start(self) -> Ferry:
        """Start serving and wait until ready. Raises OSError if the port is taken,
        RuntimeError if the models fail to load or are not ready in `ready_timeout`."""
        if self._started:
            raise RuntimeError("this Ferry was already started; create a new one")
        self._started = True
        # Imported on start, so that `from gateway import Ferry` stays cheap.
        import uvicorn

        from .app import create_app
        from .metrics.registry import GatewayMetrics

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._threads_before = set(threading.enumerate())
        if self.config.api_workers > 1:
            return self._start_workers()
        sock = self._sock = self._bind()
        self.port = sock.getsockname()[1]
        self.config.port = self.port
        try:
            self.app = create_app(self.config, self.specs, self.metrics or GatewayMetrics())
            config = uvicorn.Config(
                self.app,
                host=self.host,
                port=self.port,
                log_config=None,
                log_level=self.log_level,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=5,
            )
            server = self._server = uvicorn.Server(config)
            thread = self._thread = threading.Thread(
                target=self._serve, args=(server, sock), name=f"ferry-embedded-{self.port}", daemon=True
            )
            thread.start()
            self._wait_ready(server, thread)
        except BaseException:
            self.stop()
            raise
        log.info("ferry embedded gateway ready on %s serving %s", self.url, ", ".join(self.models))
        return self

    # -- several front ends (api_workers >= 2) ------------------------------------------
    def _start_workers(self) -> Ferry:
        thread = self._thread = threading.Thread(
            target=self._supervise, name=f"ferry-embedded-supervisor-{self.port}", daemon=True
        )
        thread.start()
        try:
            deadline = time.monotonic() + self.ready_timeout
            while not self._listening.wait(0.02):
                if not thread.is_alive():
                    raise OSError(f"Ferry cannot serve: {'; '.join(self._failure) or 'the supervisor stopped'}")
            with httpx.Client(base_url=self.url, timeout=5.0) as http:
                ready = 0  # in a row, on fresh connections: each may reach any front end
                while ready < 4 * self.config.api_workers:
                    if not thread.is_alive():
                        raise RuntimeError(f"Ferry models failed to load: {'; '.join(self._failure) or self._code}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"Ferry not ready within {self.ready_timeout} s")
                    try:
                        ok = http.get("/readyz", headers={"Connection": "close"}).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    ready = ready + 1 if ok else 0
                    if not ok:
                        time.sleep(0.05)
                headers = {"Authorization": f"Bearer {self.config.api_keys[0]}"} if self.config.api_keys else {}
                self._names = [m["id"] for m in http.get("/v1/models", headers=headers).json()["data"]]
        except BaseException:
            self.stop()
            raise
        log.info("ferry embedded gateway ready on %s serving %s", self.url, ", ".join(self.models))
        return self

    def _supervise(self) -> None:
        from .cores.supervisor import supervise

        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._stop = asyncio.Event()

        def listening(port: int) -> None:
            self.port = self.config.port = port
            self._listening.set()

        try:
            self._code = loop.run_until_complete(
                supervise(self.config, stop=self._stop, on_listening=listening, report=self._failure.append)
            )
        except BaseException as exc:
            self._error = exc
        finally:
            try:
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def _stop_workers(self) -> None:
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(stop.set)
            thread.join(self.config.drain_timeout + 30.0)
            if thread.is_alive():
                log.warning("ferry embedded supervisor did not stop in time")

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"Ferry cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None
        return sock

    def _serve(self, server: uvicorn.Server, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        except BaseException as exc:  # uvicorn exits with SystemExit on startup failure
            self._error = exc
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())  # model-loading threads
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def _wait_ready(self, server: uvicorn.Server, thread: threading.Thread) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the Ferry server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ferry server did not start within {self.ready_timeout} s")
            time.sleep(0.01)
        with httpx.Client(base_url=self.url, timeout=5.0) as http:
            while True:
                state = self.state
                if state is not None and state.load_error:
                    raise RuntimeError(f"Ferry models failed to load: {state.load_error}")
                if state is not None and state.ready:
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get("/readyz").status_code == 200:
                            return
                if not thread.is_alive():
                    raise RuntimeError(f"the Ferry server stopped while loading: {self._error!r}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Ferry models not ready within {self.ready_timeout} s (raise ready_timeout= for large models)"
                    )
                time.sleep(0.02)

    def stop(self) -> None:
        """Stop serving: close this Ferry's clients, let uvicorn finish open requests and
        drain the batchers, join the server thread and close the socket. Idempotent."""
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()
        self._clients.clear()
        if self.config.api_workers > 1:
            self._stop_workers()
            return
        server, thread = self._server, self._thread
        if server is not None:
            server.should_exit = True
        if server is not None and thread is not None and thread.is_alive():
            thread.join(self.config.drain_timeout + 15.0)
            if thread.is_alive():
                log.warning("ferry embedded server did not stop in time; forcing exit")
                server.force_exit = True
                thread.join(10.0)
        if self._sock is not None:
            self._sock.close()
        self._stop_progress_monitor()

    def _stop_progress_monitor(self) -> None:
        """Model loading draws tqdm progress bars, whose first use starts a process-wide
        monitor thread that never ends by itself. Stop it if we started it and no bar is
        open (tqdm starts a new one with the next bar)."""
        for t in threading.enumerate():
            if t in self._threads_before or t.name != "tqdm_monitor" or not hasattr(t, "tqdm_cls"):
                continue
            monitor: Any = t  # tqdm's TMonitor, with its own tqdm_cls and exit()
            cls = monitor.tqdm_cls
            with contextlib.suppress(Exception):
                with cls.get_lock():
                    if cls._instances:
                        continue
                    if getattr(cls, "monitor", None) is t:
                        cls.monitor = None
                monitor.exit()

    def __repr__(self) -> str:
        state = "running" if self.running else ("stopped" if self._started else "not started")
        return f"<Ferry {self.url} {state} models={self.models}>"
