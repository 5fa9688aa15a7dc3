"""Streams: `ChatStream` / `AsyncChatStream` yield `(prompt_index, delta)` events as the
server sends them; `gather_stream` / `agather_stream` collect them into one response per
prompt."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Generator, Iterable, Iterator
from typing import Any

import httpx

from .errors import FerryError, transport_error
from .events import EventAssembler, SSEDecoder, StreamEvent
from .responses import ChatResponse, Choice, RequestInfo, Response, Usage


class _StreamBase:
    def __init__(self, response: httpx.Response, assembler: EventAssembler, cls: type[Response]):
        self.response = response
        self._asm = assembler
        self._cls = cls
        self._info = RequestInfo.of(None, response.headers)

    @property
    def info(self) -> RequestInfo:
        """Request facts: X-Request-Id from the headers; id and model once the first chunk is read."""
        return dataclasses.replace(self._info, id=self._asm.id, model=self._asm.model)

    @property
    def request_id(self) -> str | None:
        return self.info.request_id

    @property
    def usage(self) -> Usage | None:
        """The whole request's usage, once the stream has been read to the end."""
        return self._asm.usage


class ChatStream(_StreamBase):
    """Iterate for `StreamEvent`s, i.e. `(prompt_index, delta)` pairs, as the server sends them.

    Close it (or use `with`) to hang up early: the server then cancels the prompts'
    remaining work. `gather()` reads the rest and returns one response per prompt.
    """

    def __init__(self, response: httpx.Response, assembler: EventAssembler, cls: type[Response]):
        super().__init__(response, assembler, cls)
        self._it = self._events()

    def _events(self) -> Generator[StreamEvent, None, None]:
        sse = SSEDecoder()
        try:
            try:
                for line in self.response.iter_lines():
                    data = sse.line(line)
                    if data is not None:
                        yield from self._asm.feed(data)
                        if self._asm.done:
                            break
                data = sse.flush()
                if data is not None:
                    yield from self._asm.feed(data)
            except httpx.HTTPError as exc:
                raise transport_error(exc) from exc
            yield from self._asm.end()
        finally:
            self.response.close()

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._it)

    def close(self) -> None:
        self._it.close()
        self.response.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def gather(self) -> list[Response]:
        return gather_stream(self)


class AsyncChatStream(_StreamBase):
    """The async twin of ChatStream: `async for prompt_index, delta in stream`."""

    def __init__(self, response: httpx.Response, assembler: EventAssembler, cls: type[Response]):
        super().__init__(response, assembler, cls)
        self._it = self._events()

    async def _events(self) -> AsyncGenerator[StreamEvent, None]:
        sse = SSEDecoder()
        try:
            try:
                async for line in self.response.aiter_lines():
                    data = sse.line(line)
                    if data is not None:
                        for ev in self._asm.feed(data):
                            yield ev
                        if self._asm.done:
                            break
                data = sse.flush()
                if data is not None:
                    for ev in self._asm.feed(data):
                        yield ev
            except httpx.HTTPError as exc:
                raise transport_error(exc) from exc
            for ev in self._asm.end():
                yield ev
        finally:
            await self.response.aclose()

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        return await self._it.__anext__()

    async def aclose(self) -> None:
        await self._it.aclose()
        await self.response.aclose()

    async def __aenter__(self) -> AsyncChatStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def gather(self) -> list[Response]:
        return await agather_stream(self)


class _Gatherer:
    def __init__(self, cls: type[Response]):
        self.cls = cls
        self.parts: dict[int, dict[int, list[str]]] = {}
        self.finish: dict[tuple[int, int], str | None] = {}
        self.errors: dict[tuple[int, int], FerryError] = {}
        self.usage: Usage | None = None

    def add(self, ev: Any) -> None:
        p, delta = ev[0], ev[1]
        usage = getattr(ev, "usage", None)
        if usage is not None:
            self.usage = usage
        if p is None:
            return
        j = getattr(ev, "candidate", 0)
        self.parts.setdefault(p, {}).setdefault(j, []).append(delta or "")
        fr = getattr(ev, "finish_reason", None)
        if fr is not None:
            self.finish[(p, j)] = fr
        err = getattr(ev, "error", None)
        if err is not None:
            self.errors[(p, j)] = err

    def result(self, info: RequestInfo | None) -> list[Response]:
        out = []
        for p in sorted(self.parts):
            choices = [
                Choice(j, "".join(bits), self.finish.get((p, j)), self.errors.get((p, j)))
                for j, bits in sorted(self.parts[p].items())
            ]
            out.append(self.cls(p, choices, self.usage, info))
        return out


def gather_stream(events: Iterable[Any]) -> list[Response]:
    """Read a stream to its end and return one response per prompt, in prompt order.

    `events` is what `chat(..., stream=True)` / `completions(..., stream=True)` return (or
    any iterable of `(prompt_index, delta)` pairs). Each response's text is the
    concatenation of its deltas, its finish_reason that of its final event, `.usage` the
    request's usage when it was streamed, and `.error` the typed error of a prompt that
    failed mid-stream. Always a list, also for a single prompt.
    """
    if hasattr(events, "__aiter__") and not hasattr(events, "__iter__"):
        raise TypeError("gather_stream() got an async stream; use `await agather_stream(events)`")
    g = _Gatherer(getattr(events, "_cls", ChatResponse))
    for ev in events:
        g.add(ev)
    return g.result(getattr(events, "info", None))


async def agather_stream(events: AsyncIterable[Any]) -> list[Response]:
    """`gather_stream` for async streams (`AsyncFerryClient.chat(..., stream=True)`)."""
    g = _Gatherer(getattr(events, "_cls", ChatResponse))
    async for ev in events:
        g.add(ev)
    return g.result(getattr(events, "info", None))
