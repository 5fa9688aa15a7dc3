"""From server-sent events to `StreamEvent`s: SSE decoding, then the assembly that pairs a
prompt's "error" finish with its error event and the last finish with the usage chunk."""

from __future__ import annotations

from ._json import loads
from .errors import APIConnectionError, FerryError, make_error
from .responses import Usage


class StreamEvent(tuple):
    """One streamed delta: unpacks as `(prompt_index, delta)`.

    Attributes: `prompt_index`, `delta` (new text, may be ""), `finish_reason` (set on the
    prompt's final event: "stop", "length" or "error"), `candidate` (0 .. n-1), `error`
    (a typed FerryError when this prompt failed), `usage` (on the stream's very last event
    when usage was requested: the whole request's token counts).
    """

    finish_reason: str | None
    candidate: int
    error: FerryError | None
    usage: Usage | None

    def __new__(
        cls,
        prompt_index: int | None,
        delta: str,
        finish_reason: str | None = None,
        candidate: int = 0,
        error: FerryError | None = None,
        usage: Usage | None = None,
    ):
        self = super().__new__(cls, (prompt_index, delta))
        self.finish_reason, self.candidate, self.error, self.usage = finish_reason, candidate, error, usage
        return self

    @property
    def prompt_index(self) -> int | None:
        return self[0]

    @property
    def delta(self) -> str:
        return self[1]

    def __repr__(self) -> str:
        extra = "".join(
            f", {k}={getattr(self, k)!r}" for k in ("finish_reason", "candidate", "error", "usage") if getattr(self, k)
        )
        return f"StreamEvent(prompt_index={self[0]!r}, delta={self[1]!r}{extra})"

    def __reduce__(self):
        return (StreamEvent, (self[0], self[1], self.finish_reason, self.candidate, self.error, self.usage))


class SSEDecoder:
    """Server-sent events: `data:` lines (joined by newlines) up to a blank line make one event."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def line(self, line: str) -> str | None:
        line = line.rstrip("\r")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        return self.line("")


class EventAssembler:
    """Turns decoded SSE payloads into StreamEvents: merges a prompt's "error" finish with
    the error event that follows it, and the last finish with the usage chunk."""

    def __init__(self, n_prompts: int, n: int | list[int], want_usage: bool, chat: bool, request_id: str | None):
        counts = n if isinstance(n, list) else [max(n, 1)] * n_prompts
        self.first = [sum(counts[:p]) for p in range(len(counts))]  # each prompt's first choice index
        self.total = sum(counts)
        self.want_usage, self.chat, self.request_id = want_usage, chat, request_id
        self.finished = 0
        self.held: StreamEvent | None = None
        self.done = False
        self.usage: Usage | None = None
        self.id: str | None = None
        self.model: str | None = None

    def _prompt_of(self, k: int) -> int:
        """The prompt of choice `k` (a server that does not say: choices are prompt-major)."""
        return max([p for p, first in enumerate(self.first) if first <= k] or [0])

    def feed(self, data: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if data == "[DONE]":
            self.done = True
            return self._release(out)
        try:
            msg = loads(data)
        except ValueError:
            raise APIConnectionError(f"malformed stream event: {data[:200]!r}", request_id=self.request_id) from None
        if not isinstance(msg, dict):
            return out
        if "error" in msg:
            err = make_error(None, msg, request_id=self.request_id)
            held = self.held
            if (
                held is not None
                and held.finish_reason == "error"
                and held.error is None
                and held.prompt_index == err.prompt_index
            ):
                self.held = None  # the prompt's "error" finish, now with its error
                self._emit(out, StreamEvent(held.prompt_index, held.delta, "error", held.candidate, err))
            else:
                self._release(out)
                self.finished += 1
                self._emit(out, StreamEvent(err.prompt_index, "", "error", 0, err))
            return out
        if self.id is None and msg.get("id"):
            self.id, self.model = msg.get("id"), msg.get("model")
        choices = msg.get("choices") or []
        if not choices:
            usage = Usage.of(msg.get("usage"))
            if usage is not None:
                self.usage = usage
                h, self.held = self.held, None
                if h is not None:
                    out.append(StreamEvent(h.prompt_index, h.delta, h.finish_reason, h.candidate, h.error, usage))
                else:
                    out.append(StreamEvent(None, "", None, 0, None, usage))
            return out
        self._release(out)
        for c in choices:
            k = int(c.get("index", 0))
            p = int(c.get("prompt_index", self._prompt_of(k)))
            text = ((c.get("delta") or {}).get("content") if self.chat else c.get("text")) or ""
            start = self.first[p] if 0 <= p < len(self.first) else k
            ev = StreamEvent(p, text, c.get("finish_reason"), max(0, k - start))
            if ev.finish_reason is not None:
                self.finished += 1
                if isinstance(c.get("error"), dict):  # a failed prompt's final chunk
                    err = make_error(c["error"].get("status"), {"error": c["error"]}, request_id=self.request_id)
                    self._emit(out, StreamEvent(p, text, "error", ev.candidate, err))
                    continue
                if ev.finish_reason == "error":
                    self._release(out)
                    self.held = ev  # its error event comes next
                    continue
            if ev.delta or ev.finish_reason is not None:
                self._emit(out, ev)
        return out

    def _emit(self, out: list[StreamEvent], ev: StreamEvent) -> None:
        """Hold the stream's last finish back for the usage chunk that follows it."""
        if ev.finish_reason is not None and self.want_usage and self.finished >= self.total:
            self._release(out)
            self.held = ev
        else:
            out.append(ev)

    def _release(self, out: list[StreamEvent]) -> list[StreamEvent]:
        if self.held is not None:
            out.append(self.held)
            self.held = None
        return out

    def end(self) -> list[StreamEvent]:
        out = self._release([])
        if not self.done:
            raise APIConnectionError("the stream ended before [DONE]", request_id=self.request_id)
        return out
