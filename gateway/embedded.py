"""Embedded mode: a whole Ferry gateway inside your process, for scripts and notebooks.

    from gateway import Ferry

    with Ferry(models=["embeddings", "chat"], max_batch_size=16) as ferry:
        client = ferry.client()
        vectors = client.embed("sentence-transformers/all-MiniLM-L6-v2", ["hello", "goodbye"])

`Ferry` runs uvicorn with the gateway app in a background thread with its own event loop
(`_InProcessRunner`) on a free 127.0.0.1 port (or `port=`): everything the HTTP server does
works unchanged, shared by threads or processes. Entering waits until /readyz is 200;
leaving stops the server and its models' threads, leaving no thread or open port behind.

`Ferry(api_workers=2, ...)` runs the process set of `ferry serve --api-workers 2` instead
(`_ProcessSetRunner`): the supervisor in a thread of yours, engine cores and front ends as
child processes, all drained and exited on leaving. `state` is None then; `models` comes
from `/v1/models`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, cast

import httpx

from ferry_client import AsyncFerryClient, FerryClient

from .config import ServerConfig
from .cores.listen import listening_socket
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
_DEFAULT_NAMES = {  # the built-in models' served names: (kind, the setting each stands for)
    "sentence-transformers/all-MiniLM-L6-v2": (EMBEDDING, "default"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": (CHAT, "default"),
    "ferry-tiny-chat": (CHAT, "tiny"),
}
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
    a built-in model's served name (MiniLM's, SmolLM2's, "ferry-tiny-chat"; or "chat:tiny");
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
            kind, value = _DEFAULT_NAMES[entry]
        elif sep and kind_word.lower() in _EMBEDDING_WORDS | _CHAT_WORDS and rest:
            kind = EMBEDDING if kind_word.lower() in _EMBEDDING_WORDS else CHAT
            # A built-in model's name stands for its setting only under its own kind.
            value = _DEFAULT_NAMES[rest][1] if _DEFAULT_NAMES.get(rest, (None,))[0] == kind else rest
            value = value.lower() if value.lower() in ("default", "tiny") else value
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
    specs: ModelSpecs to serve instead of `models` (fake engines, engines you built yourself).
    metrics: a GatewayMetrics (default: a fresh registry: several Ferry instances coexist).
    ready_timeout: seconds to wait for the models to load (raises RuntimeError beyond).
    log_level: level of uvicorn's own loggers (None leaves logging alone).
    settings: any ServerConfig field, e.g. max_batch_size=16, api_keys=["secret"] (or api_key=).
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
        self.host, self.specs, self.metrics = host, specs, metrics
        self.ready_timeout, self.log_level = float(ready_timeout), log_level
        self._clients: list[Any] = []
        self._started = False
        # The topology, chosen once: the app in this process, or the process set of --api-workers.
        self._runner: _Runner
        if self.config.api_workers > 1:
            if specs is not None:
                raise TypeError("api_workers >= 2 serves models= (loaded by the cores); specs cannot cross processes")
            self.config.engine_cores = True
            self._runner = _ProcessSetRunner(self.config, self.ready_timeout)
        else:
            self._runner = _InProcessRunner(self.config, self.ready_timeout, specs, metrics, log_level)

    # -- addresses ---------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port given, or once started the one it listens on (a free one for port=0)."""
        return self.config.port

    @property
    def url(self) -> str:
        """http://host:port, for FerryClient and curl."""
        return _url(self.host, self.port)

    @property
    def base_url(self) -> str:
        """http://host:port/v1, for the official openai client."""
        return self.url + "/v1"

    @property
    def running(self) -> bool:
        return self._runner.running

    @property
    def app(self) -> Starlette | None:
        """The gateway app serving in this process (None before start, and with api_workers >= 2)."""
        return self._runner.app

    @property
    def state(self) -> GatewayState | None:
        """The gateway's process state: models, batchers, metrics."""
        return self._runner.state

    @property
    def models(self) -> list[str]:
        """The served model ids (once started)."""
        return self._runner.models

    # -- clients -----------------------------------------------------------------------
    def client(self, **kw: Any) -> FerryClient:
        """A FerryClient for this gateway (closed when the Ferry stops). kw: FerryClient options."""
        c = FerryClient(self.url, **self._client_options(kw))
        self._clients.append(c)
        return c

    def async_client(self, **kw: Any) -> AsyncFerryClient:
        """An AsyncFerryClient for this gateway; close it in its own event loop
        (`async with ferry.async_client() as client:`)."""
        return AsyncFerryClient(self.url, **self._client_options(kw))

    def _client_options(self, kw: dict[str, Any]) -> dict[str, Any]:
        if not self.running:
            raise RuntimeError("this Ferry is not running; use `with Ferry(...) as ferry:` or call start()")
        if "api_key" not in kw and self.config.api_keys:
            kw["api_key"] = self.config.api_keys[0]
        return kw

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
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            self._runner.start()
        except BaseException:
            self.stop()
            raise
        log.info("ferry embedded gateway ready on %s serving %s", self.url, ", ".join(self.models))
        return self

    def stop(self) -> None:
        """Stop serving: close this Ferry's clients, let the server finish open requests and
        drain the batchers, join its thread and close the socket. Idempotent."""
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()
        self._clients.clear()
        self._runner.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else ("stopped" if self._started else "not started")
        return f"<Ferry {self.url} {state} models={self.models}>"


# uvicorn's settings for an embedded server: logging stays the host program's.
_UVICORN: dict[str, Any] = {"log_config": None, "access_log": False, "lifespan": "on", "timeout_graceful_shutdown": 5}


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Runner(abc.ABC):
    """One topology of a Ferry, serving `cfg` (its port becomes the one listened on) from a thread
    with an event loop of its own: `start` returns once it serves, or raises leaving what it
    started to `stop`, which is idempotent. `app`: the gateway app, if it runs in this process."""

    app: Starlette | None = None

    def __init__(self, cfg: ServerConfig, ready_timeout: float):
        self.cfg, self.ready_timeout = cfg, ready_timeout
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the thread's
        self.result: Any = None  # what the thread's coroutine returned
        self.error: BaseException | None = None  # or what it raised

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def state(self) -> GatewayState | None:
        return None if self.app is None else cast("GatewayState", self.app.state.ferry)

    @property
    def models(self) -> list[str]:
        return [] if self.state is None else list(self.state.models)

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def _thread(self, main: Callable[[], Coroutine[Any, Any, Any]], name: str) -> threading.Thread:
        self.thread = threading.Thread(target=self._run, args=(main,), name=name, daemon=True)
        self.thread.start()
        return self.thread

    def _run(self, main: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """The thread's body: `main()` in a new event loop, closed with what it started."""
        loop = self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self.result = loop.run_until_complete(main())
        except BaseException as exc:  # uvicorn exits with SystemExit on startup failure
            self.error = exc
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()


class _InProcessRunner(_Runner):
    """uvicorn serving the gateway app, its models and batchers in this process."""

    def __init__(self, cfg: ServerConfig, ready_timeout: float, specs: Any, metrics: Any, log_level: str | None):
        super().__init__(cfg, ready_timeout)
        self.specs: list[ModelSpec] | None = specs
        self.metrics: GatewayMetrics | None = metrics
        self.log_level = log_level
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self._threads_before: set[threading.Thread] = set()

    def start(self) -> None:
        # Imported on start, so that `from gateway import Ferry` stays cheap.
        import uvicorn

        from .app import create_app
        from .metrics.registry import GatewayMetrics

        self._threads_before = set(threading.enumerate())
        cfg = self.cfg
        try:
            sock = self._sock = listening_socket(cfg.host, cfg.port)
        except OSError as exc:
            raise OSError(exc.errno, f"Ferry {exc.strerror}") from None
        cfg.port = sock.getsockname()[1]
        self.app = create_app(cfg, self.specs, self.metrics or GatewayMetrics())
        config = uvicorn.Config(self.app, host=cfg.host, port=cfg.port, log_level=self.log_level, **_UVICORN)
        server = self._server = uvicorn.Server(config)
        thread = self._thread(lambda: server.serve(sockets=[sock]), f"ferry-embedded-{cfg.port}")
        self._wait_ready(server, thread)

    def _wait_ready(self, server: uvicorn.Server, thread: threading.Thread) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the Ferry server failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ferry server did not start within {self.ready_timeout} s")
            time.sleep(0.01)
        with httpx.Client(base_url=_url(self.cfg.host, self.cfg.port), timeout=5.0) as http:
            while True:
                state = self.state
                if state is not None and state.load_error:
                    raise RuntimeError(f"Ferry models failed to load: {state.load_error}")
                if state is not None and state.ready:
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get("/readyz").status_code == 200:
                            return
                if not thread.is_alive():
                    raise RuntimeError(f"the Ferry server stopped while loading: {self.error!r}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Ferry models not ready within {self.ready_timeout} s (raise ready_timeout= for large models)"
                    )
                time.sleep(0.02)

    def stop(self) -> None:
        server, thread = self._server, self.thread
        if server is not None:
            server.should_exit = True
            if thread is not None and thread.is_alive():
                thread.join(self.cfg.drain_timeout + 15.0)
                if thread.is_alive():
                    log.warning("ferry embedded server did not stop in time; forcing exit")
                    server.force_exit = True
                    thread.join(10.0)
        if self._sock is not None:
            self._sock.close()
        _stop_progress_monitor(self._threads_before)


class _ProcessSetRunner(_Runner):
    """The `--api-workers` supervisor; `models` is what /v1/models answered once it served."""

    def __init__(self, cfg: ServerConfig, ready_timeout: float):
        super().__init__(cfg, ready_timeout)
        self._stop = asyncio.Event()  # set in its loop: the supervisor drains and returns
        self._listening = threading.Event()
        self._failure: list[str] = []  # why the supervisor cannot serve, one line each
        self._names: list[str] = []

    @property
    def models(self) -> list[str]:
        return list(self._names)

    def start(self) -> None:
        from .cores.supervisor import supervise

        def listening(port: int) -> None:
            self.cfg.port = port
            self._listening.set()

        thread = self._thread(
            lambda: supervise(self.cfg, stop=self._stop, on_listening=listening, report=self._failure.append),
            f"ferry-embedded-supervisor-{self.cfg.port}",
        )
        deadline = time.monotonic() + self.ready_timeout
        while not self._listening.wait(0.02):
            if not thread.is_alive():
                raise OSError(f"Ferry cannot serve: {'; '.join(self._failure) or 'the supervisor stopped'}")
        with httpx.Client(base_url=_url(self.cfg.host, self.cfg.port), timeout=5.0) as http:
            ready = 0  # in a row, on fresh connections: each may reach any front end
            while ready < 4 * self.cfg.api_workers:
                if not thread.is_alive():
                    raise RuntimeError(f"Ferry models failed to load: {'; '.join(self._failure) or self.result}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Ferry not ready within {self.ready_timeout} s")
                ok = False
                with contextlib.suppress(httpx.HTTPError):
                    ok = http.get("/readyz", headers={"Connection": "close"}).status_code == 200
                ready = ready + 1 if ok else 0
                if not ok:
                    time.sleep(0.05)
            headers = {"Authorization": f"Bearer {self.cfg.api_keys[0]}"} if self.cfg.api_keys else {}
            self._names = [m["id"] for m in http.get("/v1/models", headers=headers).json()["data"]]

    def stop(self) -> None:
        loop, thread = self.loop, self.thread
        if loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(self._stop.set)
            thread.join(self.cfg.drain_timeout + 30.0)
            if thread.is_alive():
                log.warning("ferry embedded supervisor did not stop in time")


def _stop_progress_monitor(threads_before: set[threading.Thread]) -> None:
    """Model loading draws tqdm progress bars, whose first use starts a process-wide
    monitor thread that never ends by itself. Stop it if we started it (it is not among
    `threads_before`) and no bar is open (tqdm starts a new one with the next bar)."""
    for t in threading.enumerate():
        if t in threads_before or t.name != "tqdm_monitor" or not hasattr(t, "tqdm_cls"):
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
