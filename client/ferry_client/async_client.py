"""`AsyncFerryClient`: the asyncio twin of `FerryClient`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx

from ._json import dumps, loads
from .calls import DEFAULT_URL, Call, ClientBase
from .errors import FerryError, connect_error, from_response
from .responses import ChatResponse, CompletionResponse
from .streaming import AsyncChatStream
from .tensors import infer_body, read_outputs


class AsyncFerryClient(ClientBase):
    """The asyncio twin of FerryClient: every method is awaited; `await client.chat(...,
    stream=True)` returns an AsyncChatStream (`async for prompt_index, delta in stream`)."""

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
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        super().__init__(base_url, api_key, timeout, retries, max_retry_wait, headers, on_retry)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    close = aclose

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    async def __aenter__(self) -> AsyncFerryClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _send(self, method: str, path: str, body: dict | None = None, *, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            attempt += 1
            try:
                req = self._http.build_request(method, path, content=None if body is None else dumps(body))
                r = await self._http.send(req, stream=stream)
            except httpx.HTTPError as exc:
                err = connect_error(exc)
            else:
                if r.status_code < 400:
                    return r
                if stream:
                    await r.aread()
                    await r.aclose()
                err = from_response(r)
            delay = self._retry_delay(attempt, err)
            if delay is None:
                raise err
            if self.on_retry is not None:
                self.on_retry(attempt, err, delay)
            await self._sleep(delay)

    async def _run(self, call: Call) -> Any:
        r = await self._send("POST", call.path, call.body, stream=call.stream)
        if call.stream:
            return AsyncChatStream(r, self._assembler(call, r), ChatResponse if call.chat else CompletionResponse)
        return self._result(call, r)

    async def chat(
        self, model: str, conversations: Any, *, stream: bool = False, include_usage: bool | None = None, **params: Any
    ) -> Any:
        """See FerryClient.chat."""
        return await self._run(self._chat_call(model, conversations, stream, include_usage, params))

    async def completions(
        self, model: str, prompts: Any, *, stream: bool = False, include_usage: bool | None = None, **params: Any
    ) -> Any:
        """See FerryClient.completions."""
        return await self._run(self._completions_call(model, prompts, stream, include_usage, params))

    async def embed(self, model: str, texts: Any, *, numpy: bool = False, **params: Any) -> Any:
        """See FerryClient.embed."""
        return await self._run(self._embed_call(model, texts, numpy, params))

    async def infer(
        self,
        model: str,
        inputs: dict[str, Any],
        *,
        outputs: list[str] | None = None,
        numpy: bool = False,
        request_id: str | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """See FerryClient.infer."""
        meta = self._metadata.get(model)
        if meta is None:
            meta = self._metadata[model] = loads((await self._send("GET", f"/v2/models/{model}")).content)
        body, single = infer_body(model, meta, inputs, outputs, request_id, params)
        r = await self._send("POST", f"/v2/models/{model}/infer", body)
        return read_outputs(loads(r.content), single, numpy)

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._send("GET", "/v1/models")).json()["data"]]

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_ready(self, timeout: float = 60.0, interval: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while not await self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} not ready after {timeout} s")
            await asyncio.sleep(interval)
