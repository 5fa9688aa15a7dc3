"""Helpers for the batch-job tests: upload a JSONL file, create a batch, poll it."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from ..waiting import wait_until


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines)


def chat_line(cid: str, content: str, **body: Any) -> dict:
    body = {"model": "fake-chat", "messages": [{"role": "user", "content": content}], "max_tokens": 3, **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion_line(cid: str, prompt: Any, **body: Any) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "fake-chat", "prompt": prompt, "max_tokens": 4, **body},
    }


def embed_line(cid: str, text: Any, **body: Any) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "fake-embed", "input": text, **body},
    }


class Api:
    def __init__(self, url: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def upload(self, lines: list[Any]) -> str:
        r = self.http.post(
            "/v1/files", files={"file": ("in.jsonl", jsonl(lines), "application/jsonl")}, data={"purpose": "batch"}
        )
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def create(self, lines: list[Any], endpoint: str = "*", window: str = "24h", expect: int = 200) -> dict:
        fid = self.upload(lines)
        r = self.http.post(
            "/v1/batches", json={"input_file_id": fid, "endpoint": endpoint, "completion_window": window}
        )
        assert r.status_code == expect, r.text
        return r.json()

    def get(self, batch_id: str) -> dict:
        r = self.http.get(f"/v1/batches/{batch_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait(
        self, batch_id: str, until: Any = ("completed", "cancelled", "expired", "failed"), timeout: float = 30.0
    ) -> dict:
        """Poll until `until(batch)` (a callable) or the status is one of `until`."""
        check = until if callable(until) else (lambda b: b["status"] in until)
        last: dict = {}

        def arrived() -> dict | None:
            nonlocal last
            last = self.get(batch_id)
            return last if check(last) else None

        return wait_until(arrived, timeout=timeout, message=lambda: f"batch {batch_id} to get there; last seen: {last}")

    def content(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        r = self.http.get(f"/v1/files/{file_id}/content")
        assert r.status_code == 200, r.text
        return [orjson.loads(x) for x in r.content.splitlines() if x.strip()]


@pytest.fixture
def jobs_server(fake_server_factory, tmp_path):
    """A fake-engine gateway with its data dir under tmp_path; returns (server, Api)."""

    def start(embed=None, chat=None, **config):
        config.setdefault("data_dir", str(tmp_path / "data"))
        s = fake_server_factory(embed, chat, **config)
        return s, Api(s.url)

    return start
