"""The SQLite store on its own: exactly-once line results, finalisation, the data-dir lock."""

from __future__ import annotations

import asyncio
import re

import orjson
import pytest

from gateway.jobs import store as st
from gateway.jobs.validate import parse_window


def run(coro):
    return asyncio.run(coro)


def make_batch(s: st.Store, n: int) -> str:
    row = _batch_row(n)
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


def test_the_worker_lease_has_one_holder_until_it_expires_or_is_released(tmp_path):
    async def scenario():
        first = st.Store(tmp_path, exclusive=False)
        second = st.Store(tmp_path, exclusive=False)  # two front ends of one server
        await first.open()
        await second.open()
        try:
            seen = [
                await first.write(first.take_lease, "a", 100.0, 5.0),
                await second.write(second.take_lease, "b", 101.0, 5.0),  # held by a until 105
                await first.write(first.take_lease, "a", 103.0, 5.0),  # renewed until 108
                await second.write(second.take_lease, "b", 107.9, 5.0),
                await second.write(second.take_lease, "b", 108.0, 5.0),  # expired: b takes it
                await first.write(first.take_lease, "a", 109.0, 5.0),
            ]
            held = await first.read(first.lease)
            await second.write(second.release_lease, "a")  # not a's any more: nothing happens
            await second.write(second.release_lease, "b")
            after = await first.read(first.lease)
            return seen, held, after, await first.write(first.take_lease, "a", 110.0, 5.0)
        finally:
            await first.close()
            await second.close()

    seen, held, after, again = run(scenario())
    assert seen == [True, False, True, False, True, False]
    assert held == ("b", 113.0) and after is None and again is True


def test_front_ends_share_the_directory_their_server_holds(tmp_path):
    fd = st.lock_data_dir(tmp_path)  # the supervisor's
    try:
        with pytest.raises(st.StoreLocked):
            st.lock_data_dir(tmp_path)  # another server

        async def shared() -> bool:
            s = st.Store(tmp_path, exclusive=False)
            await s.open()
            await s.close()
            return True

        assert run(shared())
    finally:
        import os

        os.close(fd)


def test_a_schema_1_store_opens_with_owners_and_its_jobs_belong_to_no_key(tmp_path):
    """A data directory written before keys owned jobs gains the `owner` columns at open;
    its files and batches keep NULL (no key's), and a finished batch's files take its owner."""
    import sqlite3

    s1 = sqlite3.connect(tmp_path / st.DB_NAME)
    old_schema = re.sub(r",([^,\n]*)\n\s*owner\s+TEXT[^\n]*", r"\1", st.SCHEMA)  # the columns dropped
    assert "owner" not in old_schema.split("worker_lease")[0]
    s1.executescript(old_schema)
    s1.execute(
        "INSERT INTO files (id, purpose, filename, bytes, created_at, kind) "
        "VALUES ('file-old', 'batch', 'a', 1, 1, 'upload')"
    )
    s1.execute("PRAGMA user_version = 1")
    s1.commit()
    s1.close()

    async def scenario():
        s = st.Store(tmp_path)
        await s.open()
        try:
            old = await s.read(s.get_file, "file-old")
            row = {**_batch_row(2), "owner": "k1"}
            await s.write(s.create_batch, row, [(1, "c1", "/v1/embeddings", "{}")])
            await s.write(s.commit_lines, [(row["id"], 1, st.COMPLETED, "{}")])
            info = await s.write(s.finalize, row["id"], "completed", None)
            out = await s.read(s.get_file, info["output"])
            mine = await s.read(s.list_batches, None, 10, "k1")
            theirs = await s.read(s.list_batches, None, 10, "k2")
            return old, out, mine, theirs
        finally:
            await s.close()

    old, out, mine, theirs = run(scenario())
    assert old["owner"] is None and out["owner"] == "k1"
    assert [b["id"] for b in mine[0]] == ["batch_x"] and theirs == ([], False)


def _batch_row(n: int) -> dict:
    return {
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
