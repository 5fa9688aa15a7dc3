"""The JSON log lines (gateway/logs.py): the access log's direct path writes the lines of one
turn of the event loop in one write, in the shape JSONFormatter gives a record, and steps
aside for any other logging configuration."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys

import orjson
import pytest

from gateway import logs


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


@pytest.fixture
def stock(monkeypatch):
    """setup_logging on a stream of our own; the loggers as they were afterwards."""
    root, access = logging.getLogger("ferry"), logging.getLogger("ferry.access")
    saved = (root.handlers[:], root.level, root.propagate, access.handlers[:], access.level, logs._stock)
    stream = CountingStream()
    monkeypatch.setattr(sys, "stderr", stream)
    logs.setup_logging()
    yield stream
    root.handlers[:], root.level, root.propagate, access.handlers[:], access.level, logs._stock = saved


@contextlib.contextmanager
def only_the_stock_handler():
    """pytest's log capture adds its handlers while a test runs; as `ferry serve` runs,
    setup_logging's handler is the only one."""
    root = logging.getLogger("ferry")
    others = [h for h in root.handlers if h is not logs._stock]
    for h in others:
        root.removeHandler(h)
    try:
        yield
    finally:
        for h in others:
            root.addHandler(h)


def test_lines_of_one_turn_share_one_write_in_the_formatters_shape(stock):
    access = logging.getLogger("ferry.access")

    async def one_turn() -> None:
        for i in range(3):
            logs.log_line(access, "request", {"request_id": f"r{i}", "status": 200})
        assert stock.writes == 0  # written when the turn ends
        await asyncio.sleep(0)

    with only_the_stock_handler():
        asyncio.run(one_turn())
    lines = [orjson.loads(line) for line in stock.getvalue().splitlines()]
    assert stock.writes == 1 and [line["request_id"] for line in lines] == ["r0", "r1", "r2"]
    record = access.makeRecord(access.name, logging.INFO, __file__, 0, "request", (), None, extra={"status": 200})
    through_logging = orjson.loads(logs.JSONFormatter().format(record))
    assert lines[0].keys() == through_logging.keys() | {"request_id"}
    assert {k: lines[0][k] for k in ("level", "logger", "msg", "status")} == {
        k: through_logging[k] for k in ("level", "logger", "msg", "status")
    }
    with only_the_stock_handler():
        logs.log_line(access, "request", {"request_id": "no-loop"})  # outside a loop: written at once
    assert stock.writes == 2 and orjson.loads(stock.getvalue().splitlines()[-1])["request_id"] == "no-loop"


def test_any_other_configuration_gets_log_records(stock):
    access = logging.getLogger("ferry.access")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    with only_the_stock_handler():
        access.addHandler(Keep())
        logs.log_line(access, "request", {"request_id": "r1", "status": 200})
        assert [(r.getMessage(), r.request_id) for r in seen] == [("request", "r1")]  # type: ignore[attr-defined]
        access.setLevel(logging.WARNING)
        logs.log_line(access, "request", {"request_id": "r2"})
        assert len(seen) == 1 and "r2" not in stock.getvalue()
