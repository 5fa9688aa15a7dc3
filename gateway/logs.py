"""Structured logs: one JSON object per line, with whatever `extra` fields a call adds."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, TextIO

import orjson

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


_stock: logging.StreamHandler | None = None  # the handler setup_logging installed


def setup_logging(level: int = logging.INFO) -> None:
    global _stock
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger("ferry")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    _stock = handler


class LineWriter:
    """The lines of one turn of the event loop, written to `stream` in one write at its end."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lines: list[str] = []

    def add(self, line: str) -> None:
        if not self._lines:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop: nothing would flush it later
                self._lines.append(line)
                self.flush()
                return
        self._lines.append(line)

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        if lines:
            self.stream.write("".join(lines))
            self.stream.flush()


_writers: dict[int, LineWriter] = {}


def _direct_stream(logger: logging.Logger) -> TextIO | None:
    """The stream `logger`'s records end up on when nothing but setup_logging's handler is
    in the way (no filter, no other handler, no level below it): then a line can be written
    without a LogRecord. None: someone configured logging otherwise (a test's caplog, an
    embedding application), so records go through `logging`."""
    h = _stock
    if h is None or logger.handlers or logger.filters or not logger.propagate:
        return None
    parent = logger.parent
    if parent is None or parent.handlers != [h] or parent.filters or h.filters or h.level > logging.INFO:
        return None
    return h.stream


def log_line(logger: logging.Logger, msg: str, fields: dict[str, Any]) -> None:
    """One INFO line with `fields`, as JSONFormatter writes it. The access log writes one
    per request: through `logging` that took a LogRecord, a lock and a write with a flush
    each, 8% of a front end's time under load; written directly, the lines of one turn of
    the event loop share one write."""
    if not logger.isEnabledFor(logging.INFO):
        return
    stream = _direct_stream(logger)
    if stream is None:
        # logger.info() would also walk the stack for the caller's file and line, which the
        # JSON lines never show: the record is made directly.
        logger.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, msg, (), None, extra=fields))
        return
    out = {"ts": round(time.time(), 3), "level": "info", "logger": logger.name, "msg": msg, **fields}
    writer = _writers.get(id(stream))
    if writer is None or writer.stream is not stream:
        writer = _writers[id(stream)] = LineWriter(stream)
    writer.add(orjson.dumps(out, default=str).decode() + "\n")
