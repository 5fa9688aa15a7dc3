"""The SQLite store of batch jobs (standard library `sqlite3`), one file under `--data-dir`.

What is kept: uploaded files (their bytes), jobs (status, timestamps, request counts) and
one row per input line (its request, its status, its output line once finished).

Durability rules that make restarts safe:

- A line's result and the job's request counts change in the same transaction, and a
  line moves out of `pending` only once (`... WHERE status = 'pending'`), so a result is
  never recorded twice and counts always equal the rows.
- Lines still `pending` after a crash are exactly the ones that were not committed; the
  job worker runs them again on restart. A line committed before the crash is never run again.
- WAL journal with synchronous=NORMAL: a commit survives the process being killed
  (SIGKILL); a power cut may lose the last few commits, which then simply run again.

Threading: SQLite calls block, so none runs on the event loop. Every write goes through
one writer thread (one connection, so writes never contend); reads go through one reader
thread with its own connection (WAL lets it read while the writer commits). The job worker
groups line results that finish together into one transaction (group commit), so a
commit per line costs one thread hop shared by many lines. `Store.write` / `Store.read`
are the async entry points; the plain methods below run on those threads.

A lock file (`flock`) keeps a second server from running the same jobs from the same
data directory; replicas each need their own `--data-dir`. The front ends of one server
(`--api-workers N`, N >= 2) share the directory: their supervisor holds the lock, each
opens the store with `exclusive=False`, and exactly one of them runs jobs, the holder of
the `worker_lease` row (`take_lease`, renewed every few seconds in a transaction; a dead
holder's lease expires and another front end takes over).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson

T = TypeVar("T")

DB_NAME = "ferry.db"
LOCK_NAME = "ferry.lock"
SCHEMA_VERSION = 2  # 2: files and batches carry the API key they belong to (`owner`)

# Line statuses. `pending` = not (yet) committed.
PENDING, COMPLETED, FAILED, CANCELLED, EXPIRED = "pending", "completed", "failed", "cancelled", "expired"
# Job statuses (OpenAI's).
JOB_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    id         TEXT NOT NULL UNIQUE,
    purpose    TEXT NOT NULL,
    filename   TEXT NOT NULL,
    bytes      INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    kind       TEXT NOT NULL,            -- upload | output | error
    batch_id   TEXT,                     -- output and error files: their job
    content    BLOB,                     -- uploads only; output/error files are built from lines
    owner      TEXT                      -- the API key's digest (endpoint.key_owner); NULL: no keys
);
CREATE TABLE IF NOT EXISTS batches (
    seq               INTEGER PRIMARY KEY AUTOINCREMENT,
    id                TEXT NOT NULL UNIQUE,
    input_file_id     TEXT NOT NULL,
    endpoint          TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    expires_ts        REAL NOT NULL,     -- precise end of the window (unix seconds)
    metadata          TEXT,
    status            TEXT NOT NULL,
    created_at        INTEGER NOT NULL,
    in_progress_at    INTEGER,
    finalizing_at     INTEGER,
    completed_at      INTEGER,
    failed_at         INTEGER,
    expired_at        INTEGER,
    cancelling_at     INTEGER,
    cancelled_at      INTEGER,
    output_file_id    TEXT,
    error_file_id     TEXT,
    errors            TEXT,
    total             INTEGER NOT NULL,
    completed         INTEGER NOT NULL DEFAULT 0,
    failed            INTEGER NOT NULL DEFAULT 0,
    owner             TEXT
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id    TEXT NOT NULL,
    line        INTEGER NOT NULL,        -- 1-based line number in the input file
    custom_id   TEXT NOT NULL,
    url         TEXT NOT NULL,
    body        TEXT NOT NULL,           -- the request body (JSON)
    status      TEXT NOT NULL DEFAULT 'pending',
    result      TEXT,                    -- the output or error line (JSON), once finished
    finished_at REAL,
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_by_status ON lines (batch_id, status, line);
CREATE TABLE IF NOT EXISTS worker_lease (
    id      INTEGER PRIMARY KEY CHECK (id = 1),  -- one row: one job worker per data directory
    holder  TEXT NOT NULL,
    expires REAL NOT NULL                        -- unix seconds
);
"""

BATCH_COLUMNS = (
    "id",
    "input_file_id",
    "endpoint",
    "completion_window",
    "expires_ts",
    "metadata",
    "status",
    "created_at",
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "output_file_id",
    "error_file_id",
    "errors",
    "total",
    "completed",
    "failed",
    "owner",
)
FILE_COLUMNS = ("id", "purpose", "filename", "bytes", "created_at", "kind", "batch_id", "owner")


class StoreLocked(RuntimeError):
    """Another process holds the data directory."""


def line_id(batch_id: str, line: int) -> str:
    """Stable id of one line's output record."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def lock_data_dir(data_dir: str | os.PathLike) -> int:
    """Hold the data directory for this server: the open lock file, its `flock` taken.
    Raises StoreLocked if another process holds it; closing the fd releases it."""
    path = Path(data_dir)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        import fcntl  # POSIX only; elsewhere the lock is skipped

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # pragma: no cover
        pass
    except OSError:
        os.close(fd)
        raise StoreLocked(f"data directory {path} is in use by another Ferry process") from None
    return fd


class Store:
    """`exclusive`: take the data directory's lock (one process per directory). The front
    ends of one server open it with False: their supervisor holds the lock for them all."""

    def __init__(self, data_dir: str | os.PathLike, *, exclusive: bool = True):
        self.dir = Path(data_dir)
        self.exclusive = exclusive
        self.path = self.dir / DB_NAME
        self._local = threading.local()
        self._writer: ThreadPoolExecutor | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._lock_fd: int | None = None
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._writer is not None

    def exists(self) -> bool:
        return self.path.exists()

    async def open(self) -> None:
        if self.is_open:
            return
        writer = ThreadPoolExecutor(1, thread_name_prefix="ferry-jobs-db-w")
        try:
            await asyncio.get_running_loop().run_in_executor(writer, self._open_sync)
        except BaseException:
            writer.shutdown(wait=False)
            raise
        self._writer = writer
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ferry-jobs-db-r")

    def _open_sync(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.exclusive:
            self._lock_fd = lock_data_dir(self.dir)
        conn = self._conn()
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path} was written by a newer Ferry (schema {version} > {SCHEMA_VERSION})")
        conn.executescript(SCHEMA)
        for table in ("files", "batches"):  # schema 1: made before keys owned jobs (theirs stay NULL)
            if "owner" not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=OFF")
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    async def close(self) -> None:
        writer, reader = self._writer, self._reader
        self._writer = self._reader = None
        for ex in (reader, writer):
            if ex is not None:
                await asyncio.get_running_loop().run_in_executor(ex, self._close_thread)
                ex.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _close_thread(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -- async entry points -----------------------------------------------------------
    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        if self._writer is None:
            raise RuntimeError("job store is closed")
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        if self._reader is None:
            raise RuntimeError("job store is closed")
        return await asyncio.get_running_loop().run_in_executor(self._reader, fn, *args)

    @contextlib.contextmanager
    def _tx(self):
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # -- files --------------------------------------------------------------------------
    def insert_file(self, row: dict, content: bytes | None) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT INTO files (id, purpose, filename, bytes, created_at, kind, batch_id, content, owner) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row["id"],
                    row["purpose"],
                    row["filename"],
                    row["bytes"],
                    row["created_at"],
                    row["kind"],
                    row.get("batch_id"),
                    content,
                    row.get("owner"),
                ),
            )

    def get_file(self, file_id: str) -> dict | None:
        r = self._conn().execute(f"SELECT {', '.join(FILE_COLUMNS)} FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if r is None else dict(r)

    def delete_upload(self, file_id: str) -> bool:
        """An uploaded file and its content gone (a batch made from it keeps its lines)."""
        with self._tx() as c:
            return c.execute("DELETE FROM files WHERE id = ? AND kind = 'upload'", (file_id,)).rowcount > 0

    def file_content(self, file_id: str) -> bytes | None:
        c = self._conn()
        r = c.execute("SELECT kind, batch_id, content FROM files WHERE id = ?", (file_id,)).fetchone()
        if r is None:
            return None
        if r["kind"] == "upload":
            return bytes(r["content"])
        return b"".join(line + b"\n" for line in self._result_lines(c, r["batch_id"], r["kind"]))

    def _result_lines(self, c: sqlite3.Connection, batch_id: str, kind: str) -> Iterable[bytes]:
        if kind == "output":
            rows = c.execute(
                "SELECT result FROM lines WHERE batch_id = ? AND status = ? ORDER BY line", (batch_id, COMPLETED)
            )
            for r in rows:
                yield r["result"].encode()
            return
        rows = c.execute(
            "SELECT line, custom_id, status, result FROM lines WHERE batch_id = ? AND status IN (?, ?, ?) "
            "ORDER BY line",
            (batch_id, FAILED, CANCELLED, EXPIRED),
        )
        for r in rows:
            if r["result"] is not None:
                yield r["result"].encode()
            else:
                yield orjson.dumps(unrun_line(batch_id, r["line"], r["custom_id"], r["status"]))

    # -- batches ------------------------------------------------------------------------
    def create_batch(self, row: dict, lines: list[tuple[int, str, str, str]]) -> None:
        """The job and all its lines, in one transaction."""
        with self._tx() as c:
            cols = [k for k in BATCH_COLUMNS if k in row]
            c.execute(
                f"INSERT INTO batches ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", [row[k] for k in cols]
            )
            c.executemany(
                "INSERT INTO lines (batch_id, line, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
                ((row["id"], n, cid, url, body) for n, cid, url, body in lines),
            )

    def get_batch(self, batch_id: str) -> dict | None:
        r = self._conn().execute(f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if r is None else dict(r)

    def list_batches(self, after: str | None, limit: int, owner: str | None = None) -> tuple[list[dict], bool] | None:
        """Newest first; `after` is the id of the last batch of the previous page (None if
        unknown). With `owner`, that key's batches only."""
        c = self._conn()
        where, args = ("owner = ?", [owner]) if owner is not None else ("1", [])
        if after is not None:
            r = c.execute(f"SELECT seq FROM batches WHERE id = ? AND {where}", (after, *args)).fetchone()
            if r is None:
                return None
            where, args = f"{where} AND seq < ?", [*args, r["seq"]]
        rows = c.execute(
            f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE {where} ORDER BY seq DESC LIMIT ?",
            (*args, limit + 1),
        ).fetchall()
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[dict]:
        statuses = ", ".join("?" * len(ACTIVE))
        q = f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE status IN ({statuses}) ORDER BY seq"
        return [dict(r) for r in self._conn().execute(q, ACTIVE)]

    def status_counts(self) -> dict[str, int]:
        return {r[0]: r[1] for r in self._conn().execute("SELECT status, COUNT(*) FROM batches GROUP BY status")}

    def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...] | None = None) -> bool:
        """Move a job to `status`, stamping `<status>_at`; with `only_from`, only from those."""
        now = int(time.time())
        stamp = f", {status}_at = COALESCE({status}_at, ?)" if f"{status}_at" in BATCH_COLUMNS else ""
        args: list[Any] = [status] + ([now] if stamp else []) + [batch_id]
        q = f"UPDATE batches SET status = ?{stamp} WHERE id = ?"
        if only_from:
            q += f" AND status IN ({', '.join('?' * len(only_from))})"
            args += list(only_from)
        with self._tx() as c:
            return c.execute(q, args).rowcount == 1

    # -- the job worker's lease (several front ends on one data directory) -----------------
    def take_lease(self, holder: str, now: float, ttl: float) -> bool:
        """Take the lease, or renew it, for `holder` until `now + ttl`, in one transaction.
        True if `holder` holds it now: it was free, expired (`expires <= now`) or its own."""
        with self._tx() as c:
            row = c.execute("SELECT holder, expires FROM worker_lease WHERE id = 1").fetchone()
            if row is not None and row["holder"] != holder and row["expires"] > now:
                return False
            c.execute(
                "INSERT INTO worker_lease (id, holder, expires) VALUES (1, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET holder = excluded.holder, expires = excluded.expires",
                (holder, now + ttl),
            )
            return True

    def release_lease(self, holder: str) -> None:
        """Give the lease up (a front end stopping), so another takes over without waiting."""
        with self._tx() as c:
            c.execute("DELETE FROM worker_lease WHERE id = 1 AND holder = ?", (holder,))

    def lease(self) -> tuple[str, float] | None:
        """(holder, expires), or None when nobody holds it."""
        row = self._conn().execute("SELECT holder, expires FROM worker_lease WHERE id = 1").fetchone()
        return None if row is None else (row["holder"], row["expires"])

    # -- lines ----------------------------------------------------------------------------
    def pending_lines(self, batch_id: str, after: int, limit: int) -> list[dict]:
        rows = self._conn().execute(
            "SELECT line, custom_id, url, body FROM lines WHERE batch_id = ? AND status = ? AND line > ? "
            "ORDER BY line LIMIT ?",
            (batch_id, PENDING, after, limit),
        )
        return [dict(r) for r in rows]

    def commit_lines(self, results: list[tuple[str, int, str, str]]) -> list[bool]:
        """Record finished lines (batch_id, line, status, result JSON) in one transaction.

        Returns, per line, whether it was recorded (False: it was no longer pending)."""
        out = []
        now = time.time()
        with self._tx() as c:
            for batch_id, line, status, result in results:
                n = c.execute(
                    "UPDATE lines SET status = ?, result = ?, finished_at = ? "
                    "WHERE batch_id = ? AND line = ? AND status = ?",
                    (status, result, now, batch_id, line, PENDING),
                ).rowcount
                if n == 1:
                    col = "completed" if status == COMPLETED else "failed"
                    c.execute(f"UPDATE batches SET {col} = {col} + 1 WHERE id = ?", (batch_id,))
                out.append(n == 1)
        return out

    def finalize(self, batch_id: str, status: str, unrun: str | None, errors: str | None = None) -> dict:
        """End a job: lines still pending become `unrun` (cancelled/expired), the output and
        error files are registered, and the job takes its final status, all at once.
        Returns how many lines were swept, and the file ids."""
        now = int(time.time())
        with self._tx() as c:
            swept = 0
            if unrun is not None:
                swept = c.execute(
                    "UPDATE lines SET status = ?, finished_at = ? WHERE batch_id = ? AND status = ?",
                    (unrun, time.time(), batch_id, PENDING),
                ).rowcount
            files: dict[str, str | None] = {"output": None, "error": None}
            for kind, statuses in (("output", (COMPLETED,)), ("error", (FAILED, CANCELLED, EXPIRED))):
                n = c.execute(
                    f"SELECT COUNT(*) FROM lines WHERE batch_id = ? AND status IN ({', '.join('?' * len(statuses))})",
                    (batch_id, *statuses),
                ).fetchone()[0]
                if not n:
                    continue
                size = sum(len(b) for b in self._result_lines(c, batch_id, kind)) + n
                fid = file_id_for(batch_id, kind)
                c.execute(
                    "INSERT OR IGNORE INTO files (id, purpose, filename, bytes, created_at, kind, batch_id, owner) "
                    "VALUES (?, 'batch_output', ?, ?, ?, ?, ?, (SELECT owner FROM batches WHERE id = ?))",
                    (fid, f"{batch_id}_{kind}.jsonl", size, now, kind, batch_id, batch_id),
                )
                files[kind] = fid
            c.execute(
                f"UPDATE batches SET status = ?, {status}_at = COALESCE({status}_at, ?), output_file_id = ?, "
                "error_file_id = ?, errors = COALESCE(?, errors) WHERE id = ?",
                (status, now, files["output"], files["error"], errors, batch_id),
            )
        return {"swept": swept, **files}


def file_id_for(batch_id: str, kind: str) -> str:
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


def unrun_line(batch_id: str, line: int, custom_id: str, status: str) -> dict:
    """The error-file record of a line that never ran (job cancelled or expired first)."""
    code, why = (
        ("batch_cancelled", "the batch was cancelled before this request ran")
        if status == CANCELLED
        else ("batch_expired", "the batch's completion window ended before this request ran")
    )
    return {
        "id": line_id(batch_id, line),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": why},
    }
