"""The locust users `ferry tune` sends load with: interactive chat (streamed), batch chat
and embeddings, each paced by the open-loop arrivals (tuner/arrivals.py), with latency
counted from the scheduled arrival. Every response is checked; a failure is named after its
error code. Picked up by locust through tuner/locustfile.py, which imports them."""

from __future__ import annotations

import json
import time

from locust import FastHttpUser, tag, task

from tuner.arrivals import LOAD
from tuner.options import RUN_OPTIONS
from tuner.report import REPORT
from tuner.traffic import BATCH_ENTRY, EMBED_ENTRY, STREAM_ENTRY, TTFT_ENTRY, question, sentence

MAX_SSE_LINES = 100_000


def _error_code(resp) -> str:
    try:
        body = json.loads(resp.text or "{}")
        return str(body.get("error", {}).get("code") or "")
    except Exception:  # any unreadable body just has no code
        return ""


def _fail_http(resp) -> None:
    code = _error_code(resp) if resp.status_code else ""
    detail = (
        f"HTTP {resp.status_code} {code}".strip()
        if resp.status_code
        else f"connection error: {type(resp.error).__name__}"
    )
    resp.failure(detail)


def _check_results(resp, field: str, n: int, what: str) -> None:
    """A JSON answer must be a 200 with one result a conversation or input: `n` under `field`."""
    if resp.status_code != 200:
        _fail_http(resp)
        return
    try:
        results = json.loads(resp.text)[field]
    except (ValueError, KeyError, TypeError):
        resp.failure("bad response body")
        return
    if len(results) != n:
        resp.failure(f"expected {n} {what}")


class FerryUser(FastHttpUser):
    """Base: open-loop pacing in `wait_time`, latency from the scheduled arrival."""

    abstract = True
    key = ""
    network_timeout = 120.0
    connection_timeout = 10.0
    insecure = False

    def on_start(self) -> None:
        self._slot: float | None = None
        self._n = 0

    def wait_time(self) -> float:
        sched = LOAD.schedule
        if not sched.open_loop:
            return RUN_OPTIONS.think_time if RUN_OPTIONS.ns is not None else 0.0
        LOAD.started.wait()  # arrivals start once every user is spawned (killed here on stop)
        slot = LOAD.pacers[self.key].claim()
        if slot is None:  # arrivals are over: idle until the run stops
            return 3600.0
        self._slot = slot
        return max(0.0, slot - time.perf_counter())

    def arrival(self) -> float | None:
        """The scheduled arrival time of the request to send now (None: not yet paced)."""
        if not LOAD.schedule.open_loop:
            return time.perf_counter()
        slot, self._slot = self._slot, None
        if slot is not None:
            REPORT.lag(max(0.0, time.perf_counter() - slot))
        return slot

    def next_index(self) -> int:
        self._n += 1
        return hash((id(self), self._n)) & 0xFFFF

    @staticmethod
    def budget_headers(ms: float) -> dict[str, str]:
        return {"X-Ferry-Latency-Budget-Ms": f"{ms:g}"} if ms and ms > 0 else {}


class InteractiveChatUser(FerryUser):
    """A person chatting: one conversation, streamed, with a latency budget on TTFT."""

    key = "interactive"
    weight = 1

    @tag("chat", "interactive", "stream")
    @task
    def chat_stream(self) -> None:
        start = self.arrival()
        if start is None:
            return
        body = {
            "model": RUN_OPTIONS.ferry_chat_model,
            "messages": [{"role": "user", "content": question(self.next_index())}],
            "max_tokens": RUN_OPTIONS.chat_max_tokens,
            "temperature": 0,
            "stream": True,
        }
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=self.budget_headers(RUN_OPTIONS.interactive_budget_ms),
            stream=True,
            catch_response=True,
            name=STREAM_ENTRY,
        ) as resp:
            ttft, problem, nbytes = None, None, 0
            if resp.status_code == 200:
                ttft, problem, nbytes = read_stream(resp, start)
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            resp.request_meta["response_length"] = nbytes
            if resp.status_code != 200:
                _fail_http(resp)
            elif problem or ttft is None:  # read_stream names a problem whenever no token came
                resp.failure(problem)
            else:
                resp.success()
                self.environment.events.request.fire(
                    request_type="SSE",
                    name=TTFT_ENTRY,
                    response_time=ttft * 1000,
                    response_length=0,
                    exception=None,
                    context={},
                    response=None,
                    url=None,
                    start_time=time.time(),
                )


def sse_lines(resp):
    """Lines of a streamed response as they arrive (bounded)."""
    raw = getattr(resp, "_response", None)
    if raw is not None and hasattr(raw, "readline"):
        for _ in range(MAX_SSE_LINES):
            line = raw.readline(b"\n")
            if not line:
                return
            yield line.decode("utf-8", "replace").rstrip("\r\n")
        return
    buf = ""
    for chunk in resp.iter_content(chunk_size=256):  # fallback: may batch lines, delaying TTFT
        buf += chunk if isinstance(chunk, str) else chunk.decode("utf-8", "replace")
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            yield line.rstrip("\r")


def read_stream(resp, start: float) -> tuple[float | None, str | None, int]:
    """Read an SSE chat stream: (time to first content token in s, problem or None, bytes)."""
    ttft, done, nbytes = None, False, 0
    for line in sse_lines(resp):
        nbytes += len(line) + 1
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            obj = json.loads(data)
        except ValueError:
            return ttft, "bad SSE event", nbytes
        if "error" in obj:
            return ttft, f"stream error {obj['error'].get('code') or ''}".strip(), nbytes
        for choice in obj.get("choices") or []:
            if choice.get("error") or choice.get("finish_reason") == "error":
                return ttft, "stream error", nbytes
            if ttft is None and (choice.get("delta") or {}).get("content"):
                ttft = time.perf_counter() - start
    if not done:
        return ttft, "stream ended without [DONE]", nbytes
    if ttft is None:
        return ttft, "no token in stream", nbytes
    return ttft, None, nbytes


class BatchChatUser(FerryUser):
    """An offline job: several conversations in one request, priority batch."""

    key = "batch"
    weight = 1

    @tag("chat", "batch")
    @task
    def batch_chat(self) -> None:
        start = self.arrival()
        if start is None:
            return
        k = max(1, RUN_OPTIONS.batch_conversations)
        i = self.next_index()
        body = {
            "model": RUN_OPTIONS.ferry_chat_model,
            "messages": [[{"role": "user", "content": question(i + j)}] for j in range(k)],
            "max_tokens": RUN_OPTIONS.batch_max_tokens,
            "temperature": 0,
            "priority": "batch",
        }
        if RUN_OPTIONS.batch_budget_ms > 0:
            body["latency_budget_ms"] = RUN_OPTIONS.batch_budget_ms
        with self.client.post("/v1/chat/completions", json=body, catch_response=True, name=BATCH_ENTRY) as resp:
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            _check_results(resp, "choices", k, "choices")


class EmbeddingsUser(FerryUser):
    """Search or RAG traffic: one short text (or --embed-inputs) per request."""

    key = "embed"
    weight = 1

    @tag("embeddings", "embed")
    @task
    def embed(self) -> None:
        start = self.arrival()
        if start is None:
            return
        n = max(1, RUN_OPTIONS.embed_inputs)
        i = self.next_index()
        body = {
            "model": RUN_OPTIONS.ferry_embed_model,
            "input": sentence(i) if n == 1 else [sentence(i + j) for j in range(n)],
        }
        with self.client.post(
            "/v1/embeddings",
            json=body,
            headers=self.budget_headers(RUN_OPTIONS.embed_budget_ms),
            catch_response=True,
            name=EMBED_ENTRY,
        ) as resp:
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            _check_results(resp, "data", n, "embeddings")
