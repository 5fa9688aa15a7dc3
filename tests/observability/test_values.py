"""Metric values are right: after a known sequence of requests, counts, batch sizes,
reasons and (simulated) times match exactly.

The batcher-level scenarios run on a FakeClock, so every duration observed is simulated
time and exact; the gateway-level scenario crosses a real socket and asserts counts only.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry

from batcher.clock import FakeClock
from batcher.errors import DeadlineInfeasible, QueueFull, RequestTooLarge
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher
from batcher.scheduler import GenerationScheduler
from batcher.settings import BatchingSettings
from batcher.types import GenRequest, Priority
from engine.base import SamplingParams, sequence_request
from engine.fake import FakeGenerationEngine, SimulatedEngineThread, SimulatedExecutor


class Reader:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def __call__(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def hist(self, name: str, **labels: str) -> tuple[float, float]:
        """(count, sum) of one histogram series."""
        return self(name + "_count", **labels), self(name + "_sum", **labels)

    def bucket(self, name: str, le: str, **labels: str) -> float:
        return self(name + "_bucket", le=le, **labels)


FIXED, PER_ITEM = 0.010, 0.002  # the simulated engine: a batch of n items takes FIXED + PER_ITEM * n
STEP = 0.010  # the simulated generation engine: every iteration (prefill or decode step)


@pytest.mark.parametrize(("pads", "want"), [(True, 1 - 12 / 24), (False, 0.0)])
def test_the_padding_metric_counts_what_the_engine_computes(pads, want):
    """Rows of 2, 8 and 2 tokens padded to 8: half of 24 real. An engine that packs its rows
    (`pads=False`, engine/packed_encoder.py) computes no padding, and the metric says so;
    the tokens per batch are the real ones either way."""
    settings = BatchingSettings(max_batch_size=3, max_wait_ms=10, policy="fixed", default_budget_ms=None)

    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        engine = SimulatedExecutor(clock, fixed=FIXED, per_item=PER_ITEM)
        b = MicroBatcher("m", engine, settings, clock=clock, metrics=Metrics(registry), pads=lambda: pads)
        await b.start()
        items = b.submit_many(["a", "b", "c"], costs=[2, 8, 2])
        await clock.run_until_idle()
        await b.stop()
        assert all(i.finished for i in items)
        return registry

    v = Reader(asyncio.run(scenario()))
    assert v.hist("ferry_batch_size_tokens", model="m", phase="embed") == (1, 12)
    count, total = v.hist("ferry_batch_padding_ratio", model="m", phase="embed")
    assert count == 1 and total == pytest.approx(want)


def test_the_padding_metric_follows_an_engine_that_stops_packing():
    """An engine whose packed forward fails at run time pads from then on
    (engine/embeddings.py): the batcher asks before every batch."""
    settings = BatchingSettings(max_batch_size=2, max_wait_ms=10, policy="fixed", default_budget_ms=None)
    packing = [True]

    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        engine = SimulatedExecutor(clock, fixed=FIXED, per_item=PER_ITEM)
        b = MicroBatcher("m", engine, settings, clock=clock, metrics=Metrics(registry), pads=lambda: not packing[0])
        await b.start()
        b.submit_many(["a", "b"], costs=[2, 6])
        await clock.run_until_idle()
        packing[0] = False
        b.submit_many(["c", "d"], costs=[2, 6])
        await clock.run_until_idle()
        await b.stop()
        return registry

    v = Reader(asyncio.run(scenario()))
    count, total = v.hist("ferry_batch_padding_ratio", model="m", phase="embed")
    assert count == 2 and total == pytest.approx(0.0 + (1 - 8 / 12))


def test_micro_batcher_metrics_after_a_known_sequence():
    settings = BatchingSettings(
        max_batch_size=4, max_wait_ms=10, max_queue=6, policy="fixed", default_budget_ms=None, on_infeasible="serve"
    )
    gap = 0.004  # between the two items of step 2

    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        engine = SimulatedExecutor(clock, fixed=FIXED, per_item=PER_ITEM, fail_items={"bad"})
        b = MicroBatcher("m", engine, settings, clock=clock, metrics=Metrics(registry))
        await b.start()
        # 1. Four items fill a batch at once (one of them fails alone in the engine).
        first = b.submit_many(["a", "b", "c", "bad"])
        await clock.run_until_idle()
        # 2. Two items `gap` apart leave together when the oldest has waited max_wait.
        b.submit("e")
        await clock.advance(gap)
        b.submit("f")
        await clock.run_until_idle()
        # 3. A request of 7 items can never fit a queue of 6: refused as too large (a 422 at
        #    the gateway, counted there as invalid), not as a full queue.
        with pytest.raises(RequestTooLarge):
            b.submit_many(list("1234567"))
        # 3b. A full queue: 6 queued, the 7th item is refused.
        fill = b.submit_many(list("123456"))
        with pytest.raises(QueueFull):
            b.submit("7")
        for item in fill:
            b.cancel(item)
        # 4. A 5 ms budget against a 10 ms max_wait: admitted best-effort, expires queued.
        late = b.submit("h", budget=0.005)
        # 5. A batch-class item with room to spare meets its budget; 6. one is cancelled queued.
        ok = b.submit("j", budget=1.0, priority=Priority.BATCH)
        gone = b.submit("i")
        b.cancel(gone)
        await clock.run_until_idle()
        # 7. A live change, then a budget below the safety margin is refused at once.
        b.update(on_infeasible="reject", max_batch_size=8)
        with pytest.raises(DeadlineInfeasible):
            b.submit("k", budget=0.001)
        await b.stop()
        return registry, engine, first, late, ok

    registry, engine, _first, late, ok = asyncio.run(scenario())
    v = Reader(registry)
    assert [p for _, p in engine.runs] == [["a", "b", "c", "bad"], ["e", "f"], ["j"]]
    assert v("ferry_batches_total", model="m", reason="full") == 1
    assert v("ferry_batches_total", model="m", reason="max_wait") == 2
    assert v("ferry_batches_total", model="m", reason="deadline") == 0
    assert v.hist("ferry_batch_size_items", model="m", phase="embed") == (3, 7)
    assert [v.bucket("ferry_batch_size_items", le, model="m", phase="embed") for le in ("1.0", "2.0", "4.0")] == [
        1,
        2,
        3,
    ]
    assert v.hist("ferry_batch_size_tokens", model="m", phase="embed") == (3, 7)  # cost 1 per item
    assert v.hist("ferry_batch_padding_ratio", model="m", phase="embed") == (3, 0)
    count, total = v.hist("ferry_batch_execution_seconds", model="m", phase="embed")
    assert count == 3 and total == pytest.approx(sum(FIXED + PER_ITEM * n for n in (4, 2, 1)))
    assert v("ferry_cost_model_error_ratio_count", model="m", phase="embed") == 3
    assert v("ferry_cost_model_slowdown", model="m", phase="embed") == 1.0  # runs exactly as the prior predicts
    # Queue waits: a..bad 0 ms, e max_wait (10 ms), f 4 ms less; j (batch class) max_wait.
    count, total = v.hist("ferry_queue_wait_seconds", model="m", **{"class": "interactive"})
    assert count == 6 and total == pytest.approx(settings.max_wait + (settings.max_wait - gap))
    count, total = v.hist("ferry_queue_wait_seconds", model="m", **{"class": "batch"})
    assert count == 1 and total == pytest.approx(settings.max_wait)
    assert {s: v("ferry_items_total", model="m", status=s) for s in ("result", "error", "cancelled", "expired")} == {
        "result": 6,
        "error": 1,
        "cancelled": 7,
        "expired": 1,
    }  # 6 of the cancelled filled the queue in 3b
    assert v("ferry_engine_errors_total", model="m", phase="embed") == 1
    assert v("ferry_rejections_total", model="m", reason="queue_full") == 1
    assert v("ferry_rejections_total", model="m", reason="deadline_infeasible") == 1
    assert v("ferry_rejections_total", model="m", reason="invalid") == 0
    assert v("ferry_expired_total", model="m", **{"class": "interactive"}) == 1
    assert v("ferry_cancellations_total", model="m", phase="queued") == 7
    assert v("ferry_cancellations_total", model="m", phase="running") == 0
    assert v("ferry_slo_total", model="m", status="missed", **{"class": "interactive"}) == 1
    assert v("ferry_slo_total", model="m", status="met", **{"class": "batch"}) == 1
    assert v("ferry_slo_total", model="m", status="met", **{"class": "interactive"}) == 0  # the rest had no budget
    assert v("ferry_queue_depth", model="m", **{"class": "interactive"}) == 0
    assert v("ferry_config_changes_total", model="m") == 1
    assert v("ferry_setting_max_batch_size", model="m") == 8
    assert v("ferry_setting_max_wait_seconds", model="m") == pytest.approx(settings.max_wait)
    assert v("ferry_setting_max_queue", model="m") == 6
    assert v("ferry_setting_default_budget_seconds", model="m") is None  # no default budget: no SLO line
    assert late.outcome.name == "EXPIRED" and ok.outcome.name == "RESULT"


def test_generation_scheduler_metrics_after_a_known_sequence():
    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        engine = FakeGenerationEngine()
        settings = BatchingSettings(
            max_running=2, max_batch_size=4, max_wait_ms=0, default_budget_ms=None, on_infeasible="serve"
        )
        s = GenerationScheduler(
            "g",
            engine,
            SimulatedEngineThread(clock, engine, STEP, 0.0),
            settings,
            make_request=sequence_request,
            clock=clock,
            metrics=Metrics(registry),
        )
        await s.start()

        def request(max_tokens: int, prompt: list[int]) -> GenRequest:
            return GenRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))

        a = s.submit(request(1, [1, 2, 3]), cost=3)
        b = s.submit(request(3, [4, 5, 6, 7, 8]), cost=5)
        await clock.advance(0.001)  # both prefilled together in iteration 1 (one STEP)
        late = s.submit(request(2, [9]), budget=0.005)  # no room (max_running=2): expires queued
        await clock.run_until_idle()
        await s.stop()
        return registry, engine, a, b, late

    registry, engine, a, b, late = asyncio.run(scenario())
    v = Reader(registry)
    assert [kind for kind, _ in engine.calls] == ["add", "step", "step"]
    assert v("ferry_batches_total", model="g", reason="adaptive") == 1  # engine idle: admitted at once
    assert v.hist("ferry_batch_size_items", model="g", phase="prefill") == (1, 2)
    assert v.hist("ferry_batch_size_tokens", model="g", phase="prefill") == (1, 8)
    count, total = v.hist("ferry_batch_padding_ratio", model="g", phase="prefill")
    assert count == 1 and total == pytest.approx(1 - 8 / 10)  # prompts of 3 and 5 padded to 5
    assert v.hist("ferry_batch_size_items", model="g", phase="decode") == (2, 2)  # b alone, twice
    count, total = v.hist("ferry_batch_execution_seconds", model="g", phase="prefill")
    assert count == 1 and total == pytest.approx(STEP)
    assert v("ferry_batch_execution_seconds_count", model="g", phase="decode") == 2
    assert v("ferry_prompt_tokens_total", model="g") == 8
    assert v("ferry_generated_tokens_total", model="g") == 1 + 3
    # First tokens at the end of iteration 1 (one STEP after arrival), then one STEP per token:
    # a's one token and b's first, then b's two more.
    count, total = v.hist("ferry_time_to_first_token_seconds", model="g")
    assert count == 2 and total == pytest.approx(2 * STEP)
    count, total = v.hist("ferry_inter_token_latency_seconds", model="g")
    assert count == 2 and total == pytest.approx(2 * STEP)
    assert v("ferry_expired_total", model="g", **{"class": "interactive"}) == 1
    assert v("ferry_items_total", model="g", status="result") == 2
    assert v("ferry_items_total", model="g", status="expired") == 1
    assert v("ferry_engine_errors_total", model="g", phase="prefill") == 0
    assert v("ferry_engine_errors_total", model="g", phase="decode") == 0
    assert v("ferry_running_sequences", model="g") == 0
    assert v("ferry_waiting_sequences", model="g") == 0
    assert v("ferry_kv_cache_tokens", model="g") == 0
    assert a.future.result().completion_tokens == 1 and b.future.result().completion_tokens == 3
    assert late.outcome.name == "EXPIRED"


def test_prefix_cache_counters_after_a_known_sequence():
    """Each prefilled sequence adds its prompt tokens to the queries and its cached tokens
    (the fake engine's: the whole 16-token blocks an earlier prefill saw, never the last
    token) to the hits; its result carries its own count."""

    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        engine = FakeGenerationEngine(fail_prompts={99})
        settings = BatchingSettings(max_running=4, max_wait_ms=0, default_budget_ms=None)
        s = GenerationScheduler(
            "g",
            engine,
            SimulatedEngineThread(clock, engine, STEP, 0.0),
            settings,
            make_request=sequence_request,
            clock=clock,
            metrics=Metrics(registry),
        )
        v = Reader(registry)
        created = (v("ferry_prefix_cache_queries_total", model="g"), v("ferry_prefix_cache_hits_total", model="g"))
        await s.start()
        shared = list(range(1, 41))  # 40 tokens: two whole blocks and 8 more

        def run(prompt: list[int]):
            return s.submit(GenRequest(prompt, SamplingParams(max_tokens=2, temperature=0.0)), cost=len(prompt))

        items = [run([*shared, 41, 42])]  # 42 tokens, nothing cached yet
        await clock.run_until_idle()
        items.append(run([*shared, 50]))  # 41 tokens: its first two blocks are the first's
        items.append(run(list(range(1, 17))))  # 16 tokens: one block, but the last token is never served
        failed = run([99, *shared])  # its prefill fails: not counted
        await clock.run_until_idle()
        await s.stop()
        return created, v, [i.future.result().cached_tokens for i in items], failed

    created, v, cached, failed = asyncio.run(scenario())
    assert created == (0, 0)  # there from the start, at zero
    assert cached == [0, 32, 0]
    assert failed.outcome.name == "ERROR"
    assert v("ferry_prefix_cache_queries_total", model="g") == 42 + 41 + 16
    assert v("ferry_prefix_cache_hits_total", model="g") == 32


def test_gateway_request_metrics_after_a_known_sequence(fake_server_factory):
    budget_ms, patched_wait_ms = 3_000_000, 7
    s = fake_server_factory(
        max_batch_size=4, max_wait_ms=0, policy="fixed", max_queue=8, admin_token="t", default_budget_ms=budget_ms
    )  # budgets no wall clock can miss
    embed_url, chat_url = s.url + "/v1/embeddings", s.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as c:
        assert c.post(embed_url, json={"model": "fake-embed", "input": ["a b", "c", "d e f", "g"]}).status_code == 200
        assert c.post(embed_url, json={"model": "fake-embed", "input": "h"}).status_code == 200
        r = c.post(embed_url, json={"model": "fake-embed", "input": [str(i) for i in range(9)]})
        assert r.status_code == 422 and r.json()["error"]["code"] == "request_too_large"  # 9 > max_queue 8
        assert c.post(embed_url, json={"model": "fake-embed", "input": "x", "dimensions": 3}).status_code == 422
        assert c.post(embed_url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
        convs = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "tell me more"}]]
        r = c.post(chat_url, json={"model": "fake-chat", "messages": convs, "max_tokens": [1, 3]})
        assert r.status_code == 200, r.text
        r = c.patch(
            s.url + "/admin/models/fake-embed/batching",
            json={"max_wait_ms": patched_wait_ms},
            headers={"Authorization": "Bearer t"},
        )
        assert r.status_code == 200
    v = Reader(s.ferry.metrics.registry)
    emb = {"route": "/v1/embeddings", "model": "fake-embed"}
    assert v("ferry_requests_total", status="200", **emb) == 2
    assert not v("ferry_requests_total", status="429", **emb)
    assert v("ferry_requests_total", status="422", **emb) == 2
    assert v("ferry_requests_total", route="/v1/embeddings", model="", status="400") == 1
    assert v("ferry_requests_total", route="/v1/chat/completions", model="fake-chat", status="200") == 1
    assert v("ferry_request_duration_seconds_count", **emb) == 4  # every answer that named its model
    assert v("ferry_request_duration_seconds_count", route="/v1/chat/completions", model="fake-chat") == 1
    assert v("ferry_requests_in_flight", route="/v1/embeddings") == 0
    assert v("ferry_rejections_total", model="fake-embed", reason="queue_full") == 0
    assert v("ferry_rejections_total", model="fake-embed", reason="invalid") == 2  # requests refused before queuing
    assert v("ferry_rejections_total", model="", reason="invalid") == 1  # body never parsed
    assert v("ferry_batches_total", model="fake-embed", reason="full") == 1
    assert v("ferry_batches_total", model="fake-embed", reason="max_wait") == 1
    assert v.hist("ferry_batch_size_items", model="fake-embed", phase="embed") == (2, 5)
    tokens = sum(len(t) for t in s.ferry.models["fake-embed"].engine.tokenize(["a b", "c", "d e f", "g", "h"]))
    assert v.hist("ferry_batch_size_tokens", model="fake-embed", phase="embed") == (2, tokens)
    assert v("ferry_items_total", model="fake-embed", status="result") == 5
    assert v("ferry_slo_total", model="fake-embed", status="met", **{"class": "interactive"}) == 5
    chat = s.ferry.models["fake-chat"].engine
    prompt = sum(len(chat.encode_chat([{"role": "user", "content": t}])) for t in ("hello", "tell me more"))
    assert v("ferry_prompt_tokens_total", model="fake-chat") == prompt
    assert v("ferry_generated_tokens_total", model="fake-chat") == 4
    assert v("ferry_time_to_first_token_seconds_count", model="fake-chat") == 2
    assert v("ferry_inter_token_latency_seconds_count", model="fake-chat") == 2
    assert v.hist("ferry_batch_size_items", model="fake-chat", phase="prefill") == (1, 2)
    assert v.hist("ferry_batch_size_items", model="fake-chat", phase="decode") == (2, 2)
    assert v("ferry_items_total", model="fake-chat", status="result") == 2
    assert v("ferry_config_changes_total", model="fake-embed") == 1
    assert v("ferry_config_changes_total", model="fake-chat") == 0
    assert v("ferry_setting_max_wait_seconds", model="fake-embed") == pytest.approx(patched_wait_ms / 1000)
    assert v("ferry_setting_max_wait_seconds", model="fake-chat") == 0
    assert v("ferry_setting_default_budget_seconds", model="fake-chat") == budget_ms / 1000


def test_what_an_endpoint_picker_reads_while_sequences_run():
    """ferry_running_sequences and ferry_kv_cache_usage_ratio mid-run: the running rows'
    cache tokens (rows x longest row) over max_running x the model's context."""
    settings = BatchingSettings(max_running=4, max_wait_ms=0, default_budget_ms=None)

    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        engine = FakeGenerationEngine(max_context=64)
        s = GenerationScheduler(
            "g",
            engine,
            SimulatedEngineThread(clock, engine, STEP, 0.0),
            settings,
            make_request=sequence_request,
            clock=clock,
            metrics=Metrics(registry),
        )
        await s.start()
        v = Reader(registry)
        assert v("ferry_kv_cache_usage_ratio", model="g") == 0  # there from the start
        for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
            s.submit(GenRequest(prompt, SamplingParams(max_tokens=10, temperature=0.0)), cost=len(prompt))
        await clock.advance(STEP * 3.5)  # the prefill, then two decode steps
        mid = (v("ferry_running_sequences", model="g"), v("ferry_kv_cache_usage_ratio", model="g"), engine.kv_tokens)
        await clock.run_until_idle()
        await s.stop()
        return v, mid

    v, (running, ratio, kv_tokens) = asyncio.run(scenario())
    assert running == 2
    assert kv_tokens > 0 and ratio == pytest.approx(kv_tokens / (settings.max_running * 64))
    assert v("ferry_running_sequences", model="g") == 0 and v("ferry_kv_cache_usage_ratio", model="g") == 0


def test_an_embeddings_model_reports_its_batch_on_the_engine_as_running():
    settings = BatchingSettings(max_batch_size=4, max_wait_ms=0, policy="fixed", default_budget_ms=None)

    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        b = MicroBatcher(
            "e",
            SimulatedExecutor(clock, fixed=FIXED, per_item=PER_ITEM),
            settings,
            clock=clock,
            metrics=Metrics(registry),
        )
        b.metrics.publish_settings("e", settings)
        await b.start()
        v = Reader(registry)
        b.submit_many(["a", "b", "c"])
        await clock.advance(FIXED / 2)  # the batch of three is on the engine
        mid = v("ferry_running_sequences", model="e")
        await clock.run_until_idle()
        await b.stop()
        return v, mid

    v, mid = asyncio.run(scenario())
    assert mid == 3
    assert v("ferry_running_sequences", model="e") == 0
    assert v("ferry_kv_cache_usage_ratio", model="e") == 0  # no KV cache: 0, not absent
