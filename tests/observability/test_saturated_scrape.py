"""What an endpoint picker reads (`ferry_queue_depth`, `ferry_running_sequences`,
`ferry_kv_cache_usage_ratio` and, with `--metrics-compat vllm`, vLLM's three gauges) from a
replica saturated with chat requests over fake engines: /metrics answers every scrape and
its values are the queue and the running batch, in-process and with engine cores. (Its
latency under load is measured by loadtests/bench_metrics_scrape.py, not asserted here.)"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.fake import FakeGenerationEngine
from tests.gateway.cores.test_core import serve
from tests.waiting import wait_until

MAX_RUNNING = 2
REQUESTS = 40  # each runs MAX_TOKENS steps: far more work than the replica finishes during the test
MAX_TOKENS = 400
STEP_S = 0.05  # MAX_TOKENS steps: 20 s, far longer than the scrapes take


class Flood:
    """REQUESTS chat requests sent at once from a thread of their own; `stop()` hangs them
    all up (the server cancels what it has not finished)."""

    def __init__(self, url: str):
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.statuses: list[int] = []
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=httpx.Limits(max_connections=None)) as c:

            async def one(i: int) -> None:
                body = {
                    "model": "fake-chat",
                    "messages": [{"role": "user", "content": f"question {i}"}],
                    "max_tokens": MAX_TOKENS,
                }
                r = await c.post("/v1/chat/completions", json=body)
                self.statuses.append(r.status_code)

            self.tasks = [asyncio.create_task(one(i)) for i in range(REQUESTS)]
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def stop(self) -> None:
        def cancel() -> None:
            for t in self.tasks:
                t.cancel()

        self.loop.call_soon_threadsafe(cancel)
        self.thread.join(30)


def scrape(url: str) -> dict[str, dict[str, float]]:
    """Each family's samples by model (`model`, or `model_name` for vLLM's), summed over other labels."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            model = s.labels.get("model", s.labels.get("model_name"))
            if model is not None:
                out[s.name][model] += s.value
    return out


def check_saturated(url: str) -> None:
    def saturated() -> bool:
        m = scrape(url)  # the running pair admitted, and prefilled (the KV gauge follows the first step)
        return (
            m["ferry_queue_depth"]["fake-chat"] >= REQUESTS - MAX_RUNNING
            and m["ferry_kv_cache_usage_ratio"]["fake-chat"] > 0
        )

    wait_until(saturated, timeout=60, message="every request beyond the cap to queue, the first two prefilled")
    for _ in range(20):  # the picker scrapes every 50 ms: every scrape answers, with the queue as it is
        m = scrape(url)
        waiting = m["ferry_queue_depth"]["fake-chat"]
        assert waiting == REQUESTS - MAX_RUNNING  # nothing finishes in MAX_TOKENS steps
        assert m["ferry_running_sequences"]["fake-chat"] == MAX_RUNNING
        ratio = m["ferry_kv_cache_usage_ratio"]["fake-chat"]
        assert 0 < ratio <= 1
        assert m["vllm:num_requests_waiting"]["fake-chat"] == waiting
        assert m["vllm:num_requests_running"]["fake-chat"] == MAX_RUNNING
        assert m["vllm:kv_cache_usage_perc"]["fake-chat"] == ratio
        for counter in ("prefix_cache_queries_total", "prefix_cache_hits_total"):  # vLLM's counters too
            assert m["vllm:" + counter]["fake-chat"] == m["ferry_" + counter]["fake-chat"]
        assert m["ferry_kv_cache_usage_ratio"]["fake-embed"] == 0  # embeddings keep no KV cache
        assert m["vllm:num_requests_waiting"]["fake-embed"] == 0


SETTINGS = {"max_running": MAX_RUNNING, "max_queue": 1000, "default_budget_ms": None, "drain_timeout": 1.0}


def test_a_saturated_server_answers_every_scrape_with_its_queue(fake_server_factory):
    server = fake_server_factory(chat=FakeGenerationEngine(step_delay=STEP_S), metrics_compat="vllm", **SETTINGS)
    flood = Flood(server.url)
    try:
        check_saturated(server.url)
    finally:
        flood.stop()
    wait_until(lambda: scrape(server.url)["ferry_queue_depth"]["fake-chat"] == 0, message="hung-up requests to leave")


def test_with_engine_cores_too():
    args = ["--engine-cores", "--metrics-compat", "vllm", "--max-running", str(MAX_RUNNING), "--max-queue", "1000"]
    with serve(*args, "--default-budget-ms", "none", delay=STEP_S) as gw:
        flood = Flood(gw.url)
        try:
            check_saturated(gw.url)
        finally:
            flood.stop()
