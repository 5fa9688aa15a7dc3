"""`FerryClient`: the synchronous client."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from ._json import dumps, loads
from .calls import DEFAULT_URL, Call, ClientBase
from .errors import FerryError, connect_error, from_response
from .responses import ChatResponse, CompletionResponse
from .streaming import ChatStream
from .tensors import infer_body, read_outputs


class FerryClient(ClientBase):
    """Synchronous client. Thread-safe; use one per process and `close()` it (or `with`).

    base_url: the gateway (`http://host:port`, a trailing `/v1` is accepted); api_key: sent
    as `Authorization: Bearer`; timeout: seconds (or an httpx.Timeout) per request, between
    chunks for streams; retries: how often a 429/503 or a failed connect is retried,
    waiting Retry-After (or a short backoff without one); max_retry_wait: longest single
    wait; a Retry-After beyond it raises at once; on_retry(attempt, error, delay): called
    before each retry's wait.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = 120.0,
        retries: int = 0,
        *,
        max_retry_wait: float = 30.0,
        headers: dict[str, str] | None = None,
        on_retry: Callable[[int, FerryError, float], None] | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        super().__init__(base_url, api_key, timeout, retries, max_retry_wait, headers, on_retry)
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport)

    # lifecycle
    def close(self) -> None:
        self._http.close()

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    def __enter__(self) -> FerryClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    # transport with retries
    def _send(self, method: str, path: str, body: dict | None = None, *, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            attempt += 1
            try:
                req = self._http.build_request(method, path, content=None if body is None else dumps(body))
                r = self._http.send(req, stream=stream)
            except httpx.HTTPError as exc:
                err = connect_error(exc)
            else:
                if r.status_code < 400:
                    return r
                if stream:
                    r.read()
                    r.close()
                err = from_response(r)
            delay = self._retry_delay(attempt, err)
            if delay is None:
                raise err
            if self.on_retry is not None:
                self.on_retry(attempt, err, delay)
            self._sleep(delay)

    def _run(self, call: Call) -> Any:
        r = self._send("POST", call.path, call.body, stream=call.stream)
        if call.stream:
            return ChatStream(r, self._assembler(call, r), ChatResponse if call.chat else CompletionResponse)
        return self._result(call, r)

    # the API
    def chat(
        self, model: str, conversations: Any, *, stream: bool = False, include_usage: bool | None = None, **params: Any
    ) -> Any:
        """Chat completions for one conversation or a list of them, in ONE request.

        conversations: a conversation (list of {"role", "content"} dicts), a list of
        conversations, or strings (each a one-message user conversation). params: any
        field of /v1/chat/completions (temperature, top_p, max_completion_tokens or
        max_tokens, stop, seed, n, latency_budget_ms, priority, on_infeasible, user, ...), each a scalar
        for every prompt or a list with one value per prompt (`stop` per prompt is a list
        of lists: a list of strings applies to every prompt).

        Returns a ChatResponse for one conversation, else a list in prompt order. With
        stream=True, a ChatStream of `(prompt_index, delta)` StreamEvents (usage included
        unless include_usage=False).
        """
        return self._run(self._chat_call(model, conversations, stream, include_usage, params))

    def completions(
        self, model: str, prompts: Any, *, stream: bool = False, include_usage: bool | None = None, **params: Any
    ) -> Any:
        """Text completions for one prompt (str) or a list of them, in ONE request; as `chat`."""
        return self._run(self._completions_call(model, prompts, stream, include_usage, params))

    def embed(self, model: str, texts: Any, *, numpy: bool = False, **params: Any) -> Any:
        """Embeddings in input order: one vector for a str, else a list of vectors.

        Vectors are lists of floats; numpy=True gives float32 arrays instead (shape (dim,)
        for a str, (len(texts), dim) for a list), transferred as exact float32.
        params: dimensions, latency_budget_ms, priority, on_infeasible, user.
        """
        return self._run(self._embed_call(model, texts, numpy, params))

    def infer(
        self,
        model: str,
        inputs: dict[str, Any],
        *,
        outputs: list[str] | None = None,
        numpy: bool = False,
        request_id: str | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """A custom model's outputs over the Open Inference Protocol (docs/custom-models.md).

        inputs: each declared input by name, rows first (lists or numpy arrays; one row's
        values without the list give one row's outputs without it). Datatypes come from
        the model's metadata, fetched once. outputs: the names to return (default: all).
        params: latency_budget_ms, priority, and any other request parameter. Returns each
        output by name, nested lists (numpy=True: numpy arrays).
        """
        meta = self._metadata.get(model)
        if meta is None:
            meta = self._metadata[model] = loads(self._send("GET", f"/v2/models/{model}").content)
        body, single = infer_body(model, meta, inputs, outputs, request_id, params)
        r = self._send("POST", f"/v2/models/{model}/infer", body)
        return read_outputs(loads(r.content), single, numpy)

    def models(self) -> list[str]:
        """The served model ids."""
        return [m["id"] for m in self._send("GET", "/v1/models").json()["data"]]

    def ready(self) -> bool:
        """Whether /readyz answers 200 (models loaded, not draining)."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.1) -> None:
        """Block until the gateway is ready; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} not ready after {timeout} s")
            time.sleep(interval)
