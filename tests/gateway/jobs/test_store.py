"""The SQLite store on its own: exactly-once line results, finalisation, the data-dir lock."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.jobs import store as st
from gateway.jobs.validate import parse_window


def run(coro):
    return asyncio.run(coro)


def make_batch(s: st.Store, n: int) -> str:
    row = {
        "id": "batch_x",
        "input_file_id": "file-x",
        "endpoint": "*",
        "completion_window": "24h",
        "expires_ts": 1e12,
        "metadata": None,
        "status": "in_progress",
        "created_at": 1,
        "in_progress_at": 1,
        "total": n,
    }
    s.create_batch(row, [(i, f"c{i}", "/v1/embeddings", "{}") for i in range(1, n + 1)])
    return row["id"]


def test_a_line_is_recorded_once_and_counts_follow(tmp_path):
    async def scenario():
        s = st.Store(tmp_path)
        await s.open()
        try:
            bid = await s.write(make_batch, s, 4)
            first = await s.write(s.commit_lines, [(bid, 1, st.COMPLETED, '{"a":1}'), (bid, 2, st.FAILED, '{"b":2}')])
            again = await s.write(s.commit_lines, [(bid, 1, st.COMPLETED, '{"a":"twice"}')])
            pending = await s.read(s.pending_lines, bid, 0, 10)
            info = await s.write(s.finalize, bid, "cancelled", st.CANCELLED)
            batch = await s.read(s.get_batch, bid)
            out = await s.read(s.file_content, info["output"])
            err = await s.read(s.file_content, info["error"])
            out_meta = await s.read(s.get_file, info["output"])
            return first, again, pending, info, batch, out, err, out_meta
        finally:
            await s.close()

    first, again, pending, info, batch, out, err, out_meta = run(scenario())
    assert first == [True, True] and again == [False]
    assert [p["line"] for p in pending] == [3, 4]
    assert info["swept"] == 2
    assert (batch["status"], batch["completed"], batch["failed"], batch["total"]) == ("cancelled", 1, 1, 4)
    assert (
        batch["cancelled_at"] and batch["output_file_id"] == info["output"] and batch["error_file_id"] == info["error"]
    )
    assert out == b'{"a":1}\n' and out_meta["bytes"] == len(out) and out_meta["purpose"] == "batch_output"
    records = [orjson.loads(x) for x in err.splitlines()]
    assert records[0] == {"b": 2}
    assert [r["custom_id"] for r in records[1:]] == ["c3", "c4"]
    assert {r["error"]["code"] for r in records[1:]} == {"batch_cancelled"}


def test_a_second_process_cannot_open_the_same_data_dir(tmp_path):
    async def scenario():
        a, b = st.Store(tmp_path), st.Store(tmp_path)
        await a.open()
        try:
            with pytest.raises(st.StoreLocked):
                await b.open()
        finally:
            await a.close()
        await b.open()  # released on close (and by the OS when a process dies)
        await b.close()

    run(scenario())


@pytest.mark.parametrize("value, seconds", [("24h", 86400.0), ("30m", 1800.0), ("90s", 90.0), ("1s", 1.0)])
def test_completion_window(value, seconds):
    assert parse_window(value) == seconds


@pytest.mark.parametrize("value", ["", "24", "0h", "1d", "-1h", "1.5h", "169h"])
def test_bad_completion_window(value):
    from gateway.errors import APIError

    with pytest.raises(APIError):
        parse_window(value)
