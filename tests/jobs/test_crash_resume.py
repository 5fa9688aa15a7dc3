"""SIGKILL the real `ferry serve` process mid-job, restart it on the same data dir: the
job completes, every line is in the output exactly once, and no line committed before
the kill is computed again. The subprocess serves the fake engines (FERRY_FAKE_ENGINES),
which append every input they compute to FERRY_FAKE_LOG."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx

from engine.fake import fake_tokens

from ..waiting import wait_until
from .conftest import Api, chat_line, embed_line

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(data: Path, log: Path, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "FERRY_FAKE_ENGINES": "1",
        "FERRY_FAKE_DELAY": "0.02",
        "FERRY_FAKE_LOG": str(log),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        "--data-dir",
        str(data),
        "--no-warmup",
        "--max-batch-size",
        "2",
        "--max-running",
        "2",
    ]
    with open(log.with_suffix(".stderr"), "wb") as err:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)

    def ready() -> bool:
        assert proc.poll() is None, log.with_suffix(".stderr").read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, timeout=60, interval=0.05, message="ferry serve to become ready")
    except AssertionError:
        proc.kill()
        raise
    return proc


def computed(log: Path) -> Counter:
    """How many times each marker ("c<i>" / "e<i>") reached an engine. An embeddings
    engine in an engine core sees only ids, which it logs spelled out: mapped back here."""
    spelled = {" ".join(map(str, fake_tokens(f"mark-e{i}"))): f"mark-e{i}" for i in range(100)}
    out: Counter = Counter()
    if log.exists():
        for line in log.read_text().splitlines():
            kind, _, text = line.partition("\t")
            line = f"{kind}\t{spelled.get(text, text)}"
            for word in line.replace("<", " ").replace(">", " ").split():
                if word.startswith("mark-"):
                    out[word] += 1
    return out


def test_sigkill_mid_job_then_restart_runs_every_line_exactly_once(tmp_path):
    data, log1, log2 = tmp_path / "data", tmp_path / "run1.log", tmp_path / "run2.log"
    lines = []
    for i in range(30):
        lines.append(chat_line(f"c{i}", f"mark-c{i}", max_tokens=3))
        lines.append(embed_line(f"e{i}", f"mark-e{i}"))
    port = free_port()
    proc = serve(data, log1, port)
    try:
        api = Api(f"http://127.0.0.1:{port}")
        batch = api.create(lines)
        api.wait(batch["id"], lambda b: b["request_counts"]["completed"] >= 12)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    db = sqlite3.connect(data / "ferry.db")
    committed = {cid for (cid,) in db.execute("SELECT custom_id FROM lines WHERE status = 'completed'")}
    db.close()
    assert 12 <= len(committed) < 60, "the kill should land mid-job"

    port = free_port()
    proc = serve(data, log2, port)
    try:
        api = Api(f"http://127.0.0.1:{port}")
        done = api.wait(batch["id"], timeout=60)
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
        out = api.content(done["output_file_id"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    # Output: every line exactly once, with the result a direct request gives.
    assert Counter(o["custom_id"] for o in out) == Counter(line["custom_id"] for line in lines)
    for o in out:
        body = o["response"]["body"]
        if o["custom_id"].startswith("c"):
            assert body["choices"][0]["message"]["content"] == "w0 w1 w2 "
        else:
            assert len(body["data"][0]["embedding"]) == 8
    # Store: every line completed once, counts equal rows.
    db = sqlite3.connect(data / "ferry.db")
    rows = Counter(cid for (cid,) in db.execute("SELECT custom_id FROM lines WHERE status = 'completed'"))
    assert rows == Counter(line["custom_id"] for line in lines)
    assert db.execute("SELECT completed, failed, status FROM batches").fetchall() == [(60, 0, "completed")]
    db.close()
    # Engines: nothing committed before the kill ran again after the restart; every line ran.
    first, second = computed(log1), computed(log2)
    markers = {f"mark-{line['custom_id']}" for line in lines}
    assert not {f"mark-{cid}" for cid in committed} & set(second)
    assert set(first) | set(second) == markers
    assert all(n == 1 for n in second.values())
