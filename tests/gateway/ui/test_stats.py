"""/ui/stats' figures after known sequences: a MicroBatcher on a FakeClock with a simulated
engine, snapshots taken at known (simulated) times, so rates, quantiles and costs are exact."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_text

from batcher.clock import FakeClock
from batcher.cost import cost_report
from batcher.errors import QueueFull
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher
from batcher.scheduler import GenerationScheduler
from batcher.settings import BatchingSettings
from batcher.types import GenRequest, Priority
from engine.base import SamplingParams, sequence_request
from engine.fake import FakeGenerationEngine, SimulatedEngineThread, SimulatedExecutor
from gateway.metrics.merge import merged_families
from gateway.metrics.registry import GatewayMetrics
from gateway.ui.stats import WINDOW_S, ModelInfo, StatsRing, quantile

FIXED, PER_ITEM = 0.010, 0.002  # the simulated engine: a batch of n items takes FIXED + PER_ITEM * n


def cost(n: int) -> float:
    return FIXED + PER_ITEM * n


def test_quantile_interpolates_within_the_bucket_of_the_rank():
    buckets = [(1.0, 2.0), (2.0, 6.0), (math.inf, 8.0)]  # cumulative: 2 in (0,1], 4 in (1,2], 2 above
    assert quantile(0.5, buckets) == pytest.approx(1.0 + (4 - 2) / (6 - 2))  # rank 4: halfway through (1,2]
    assert quantile(0.25, buckets) == pytest.approx(1.0)  # rank 2: the top of the first bucket
    assert quantile(0.99, buckets) == 2.0  # rank in +Inf: the largest finite bound, as Prometheus says
    assert quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert quantile(0.5, []) is None


def info(b: MicroBatcher) -> ModelInfo:
    return ModelInfo("m", "embedding", b.settings.to_dict(), cost_report(b.cost_models))


def test_stats_after_a_known_sequence():
    settings = BatchingSettings(
        max_batch_size=4, max_wait_ms=10, max_queue=6, policy="fixed", default_budget_ms=None, on_infeasible="serve"
    )

    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        ring = StatsRing(window=WINDOW_S, clock=clock.now)
        engine = SimulatedExecutor(clock, fixed=FIXED, per_item=PER_ITEM)
        b = MicroBatcher("m", engine, settings, clock=clock, metrics=Metrics(registry))
        await b.start()
        t0 = clock.now()
        snaps = [ring.stats(registry.collect(), [info(b)])]
        b.submit_many(["a", "b", "c", "d"])  # a full batch at once
        b.submit("e")
        await clock.advance(0.004)
        b.submit("f")  # e and f leave together when e has waited max_wait
        await clock.run_until_idle()
        fill = b.submit_many(list("123456"))
        with pytest.raises(QueueFull):
            b.submit("7")
        for item in fill:
            b.cancel(item)
        b.submit("h", budget=0.005)  # below max_wait under `fixed`: expires queued
        b.submit("j", budget=1.0, priority=Priority.BATCH)  # leaves alone after max_wait, in budget
        await clock.run_until_idle()
        await clock.advance(t0 + 2.0 - clock.now())
        snaps.append(ring.stats(registry.collect(), [info(b)]))
        b.update(max_batch_size=8)
        await clock.advance(1.0)
        snaps.append(ring.stats(registry.collect(), [info(b)]))
        await clock.advance(WINDOW_S + 1.0)  # every snapshot is now older than the window
        snaps.append(ring.stats(registry.collect(), [info(b)]))
        await b.stop()
        return snaps

    first, second, third, late = asyncio.run(scenario())
    # The first snapshot has nothing to compare with: no window, no rates.
    assert first["window_s"] is None and first["models"][0]["rates"] == {"arrivals": None, "completions": None}

    assert second["window_s"] == pytest.approx(2.0)
    m = second["models"][0]
    assert m["name"] == "m" and m["kind"] == "embedding"
    assert m["outcomes"] == {"cancelled": 6, "error": 0, "expired": 1, "result": 7}
    assert m["rejections"] == {"deadline_infeasible": 0, "invalid": 0, "queue_full": 1}
    # Arrivals: the 14 items that ended and the one refused; nothing is left queued.
    assert m["rates"]["arrivals"] == pytest.approx((7 + 6 + 1 + 1) / 2.0)
    assert m["rates"]["completions"] == pytest.approx(7 / 2.0)
    assert m["dispatch"] == {"adaptive": 0, "deadline": 0, "drain": 0, "full": 1, "lane": 0, "max_wait": 2}
    sizes = {b["le"]: b["count"] for b in m["batch_sizes"]["embed"]}
    assert (sizes["1"], sizes["2"], sizes["4"], sum(sizes.values())) == (1, 1, 1, 3)
    assert m["expired"] == {"batch": 0, "interactive": 1}
    assert m["slo"]["interactive"] == {"met": 0, "missed": 1, "attainment": 0.0}
    assert m["slo"]["batch"] == {"met": 1, "missed": 0, "attainment": 1.0}
    assert m["queue"]["depth"] == 0
    # Queue waits: a-d 0 ms; e and f wait for the engine, busy with a-d until cost(4) = 18 ms
    # (e 18 ms, f 14 ms: both in the bucket (10, 25] ms); j max_wait, 10 ms, in (5, 10] ms.
    # p50 (rank 3.5 of 7) is 3.5/4 of the first bucket (le 0.5 ms); p99 (rank 6.93, above the
    # 5 waits up to 10 ms) is (6.93 - 5) / 2 of the way through (10, 25] ms.
    assert 0.010 < cost(4) - 0.004 < cost(4) <= 0.025
    wait = m["latency"]["queue_wait"]
    assert wait["count"] == 7
    assert wait["p50_ms"] == pytest.approx(0.5 * 3.5 / 4)
    assert wait["p99_ms"] == pytest.approx(10.0 + 15.0 * (0.99 * 7 - 5) / 2)
    assert m["latency"]["request"] is None  # no HTTP here: the gateway's histogram is empty
    assert "ttft" not in m["latency"] and "itl" not in m["latency"]  # an embeddings model generates no tokens
    # The cost chart: the fitted line, and the mean batch since the previous snapshot.
    embed = m["cost"]["embed"]
    assert embed["predicted"][0] == [1, pytest.approx(embed["fixed_ms"] + embed["per_item_ms"])]
    assert embed["observed"]["batches"] == 3
    assert embed["observed"]["items"] == pytest.approx(7 / 3)
    assert embed["observed"]["ms"] == pytest.approx((cost(4) + cost(2) + cost(1)) / 3 * 1e3)
    assert m["knobs"]["max_batch_size"] == 4 and m["config_changes"] == 0

    # A live change shows in the knobs and the change counter; the window still starts at t0.
    m3 = third["models"][0]
    assert third["window_s"] == pytest.approx(3.0) and third["interval_s"] == pytest.approx(1.0)
    assert m3["knobs"]["max_batch_size"] == 8 and m3["config_changes"] == 1
    assert m3["rates"]["completions"] == pytest.approx(7 / 3.0)
    assert m3["cost"]["embed"]["observed"] is None  # no batch since the previous snapshot

    # After a quiet spell longer than the window there is no baseline left.
    assert late["window_s"] is None and late["models"][0]["rates"]["completions"] is None


def test_chat_figures_after_a_known_sequence():
    """A chat model's time to first token, inter-token latency and running sequences. Every
    engine call (a prefill, a decode step) takes STEP on the fake clock."""
    step = 0.015
    settings = BatchingSettings(max_running=2, max_batch_size=2, max_wait_ms=0, default_budget_ms=None)

    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        ring = StatsRing(window=WINDOW_S, clock=clock.now)
        engine = FakeGenerationEngine()
        sched = GenerationScheduler(
            "c",
            engine,
            SimulatedEngineThread(clock, engine, step, 0.0),
            settings,
            make_request=sequence_request,
            clock=clock,
            metrics=Metrics(registry),
        )

        def snapshot():
            return ring.stats(registry.collect(), [ModelInfo("c", "chat", sched.settings.to_dict(), None)])

        await sched.start()
        snaps = [snapshot()]
        items = [
            sched.submit(GenRequest([1, 2, 3], SamplingParams(max_tokens=n, temperature=0.0)), cost=3) for n in (2, 4)
        ]
        await clock.advance(0.020)  # both prefilled together (their first tokens at 15 ms), now decoding
        snaps.append(snapshot())
        await clock.run_until_idle()  # a's second token at 30 ms; b's at 30, 45 and 60 ms
        snaps.append(snapshot())
        await sched.stop()
        return snaps, [i.future.result().completion_tokens for i in items]

    (first, running, done), tokens = asyncio.run(scenario())
    assert tokens == [2, 4]
    m = first["models"][0]
    assert m["kind"] == "chat" and m["latency"]["ttft"] is None and m["latency"]["itl"] is None
    assert m["queue"]["running"] == 0

    assert m["prefix_cache"] == {"queries": 0, "hits": 0, "hit_rate": None}  # no prompt yet

    m = running["models"][0]
    assert m["prefix_cache"] == {"queries": 6, "hits": 0, "hit_rate": 0.0}  # two 3-token prompts, nothing cached
    assert m["queue"]["running"] == 2 and m["queue"]["waiting"] == 0 and m["queue"]["depth"] == 0
    assert m["rates"]["arrivals"] == pytest.approx(2 / 0.020)  # both held, none ended yet
    # Both first tokens came 15 ms after arrival, in the bucket (10, 25] ms: p50 (rank 1 of 2)
    # is halfway through it, p99 (rank 1.98) 0.99 of the way.
    assert m["latency"]["ttft"] == {"count": 2, "p50_ms": pytest.approx(17.5), "p99_ms": pytest.approx(24.85)}
    assert m["latency"]["itl"] is None  # no second token yet

    m = done["models"][0]
    assert m["queue"]["running"] == 0 and m["outcomes"]["result"] == 2
    assert m["latency"]["ttft"]["count"] == 2
    # Four gaps of 15 ms (one of a, three of b), in the bucket (10, 20] ms: p50 (rank 2 of 4)
    # halfway through, p99 (rank 3.96) 0.99 of the way.
    assert m["latency"]["itl"] == {"count": 4, "p50_ms": pytest.approx(15.0), "p99_ms": pytest.approx(19.9)}
    assert m["rates"]["completions"] == pytest.approx(2 / (4 * step))


def test_stats_over_an_engine_core_match_those_of_the_core_itself():
    """With --engine-cores the page reads the server's registry merged with each core's text,
    as /metrics does: the figures are the core's own."""
    core = Metrics(CollectorRegistry())
    server = GatewayMetrics(CollectorRegistry())
    core.init_model("m")
    for n in (4, 2, 1):
        core.batch_size.labels("m", "embed").observe(n)
        core.batches.labels("m", "full").inc()
    core.items.labels("m", "result").inc(7)
    server.requests.labels("/v1/embeddings", "m", "200").inc(3)
    for s in (0.02, 0.03, 0.2):
        server.request_latency.labels("/v1/embeddings", "m").observe(s)
    model = ModelInfo("m", "embedding", BatchingSettings().to_dict(), None)

    clock = FakeClock()
    ring = StatsRing(clock=clock.now)
    ring.stats([], [model])  # an empty baseline: every figure is the whole sequence
    asyncio.run(clock.advance(1.0))
    text = openmetrics_text(core.registry).decode()
    merged = ring.stats(merged_families(server.registry, [text]), [model])["models"][0]
    assert merged["rates"]["completions"] == pytest.approx(7.0)
    assert merged["dispatch"]["full"] == 3
    assert {b["le"]: b["count"] for b in merged["batch_sizes"]["embed"]}["4"] == 1
    assert merged["latency"]["request"]["count"] == 3  # the server's own histogram, beside the core's


def test_the_prefix_cache_hit_rate_and_preemptions_are_over_the_window_for_chat_models_only():
    metrics = Metrics(CollectorRegistry())
    metrics.init_prefix_cache("c")
    chat = ModelInfo("c", "chat", BatchingSettings().to_dict(), None)
    embed = ModelInfo("e", "embedding", BatchingSettings().to_dict(), None)
    clock = FakeClock()
    ring = StatsRing(clock=clock.now)
    metrics.prefix_cache_queries.labels("c").inc(1000)  # before the window
    ring.stats(metrics.registry.collect(), [chat, embed])
    asyncio.run(clock.advance(1.0))
    metrics.prefix_cache_queries.labels("c").inc(200)
    metrics.prefix_cache_hits.labels("c").inc(150)
    metrics.preemptions.labels("c").inc(3)
    metrics.kv_usage.labels("c").set(0.5)
    c, e = ring.stats(metrics.registry.collect(), [chat, embed])["models"]
    assert c["prefix_cache"] == {"queries": 200, "hits": 150, "hit_rate": 0.75}
    assert c["kv"] == {"usage": 0.5, "preemptions": 3}  # the KV budget's use now, preemptions in the window
    assert "prefix_cache" not in e and "kv" not in e
    assert c["speculation"] == {"drafted": 0, "acceptance": None, "steps_share": None}  # --speculation off


def test_speculation_is_the_drafts_taken_and_the_steps_that_drafted_over_the_window():
    metrics = Metrics(CollectorRegistry())
    metrics.init_prefix_cache("c")
    chat = ModelInfo("c", "chat", BatchingSettings().to_dict(), None)
    clock = FakeClock()
    ring = StatsRing(clock=clock.now)
    metrics.spec_draft_tokens.labels("c").inc(500)  # before the window
    ring.stats(metrics.registry.collect(), [chat])
    asyncio.run(clock.advance(1.0))
    metrics.spec_draft_tokens.labels("c").inc(40)
    metrics.spec_accepted_tokens.labels("c").inc(30)
    metrics.spec_steps.labels("c").inc(10)
    for _ in range(40):
        metrics.batch_size.labels("c", "decode").observe(1)
    (c,) = ring.stats(metrics.registry.collect(), [chat])["models"]
    assert c["speculation"] == {"drafted": 40, "acceptance": 0.75, "steps_share": 0.25}


def test_batch_tokens_and_padding_are_over_the_window_per_phase():
    metrics = Metrics(CollectorRegistry())
    embed = ModelInfo("e", "embedding", BatchingSettings().to_dict(), None)
    clock = FakeClock()
    ring = StatsRing(clock=clock.now)
    metrics.batch_size.labels("e", "embed").observe(4)  # before the window
    metrics.batch_tokens.labels("e", "embed").observe(400)
    metrics.padding.labels("e", "embed").observe(0.9)
    ring.stats(metrics.registry.collect(), [embed])
    asyncio.run(clock.advance(1.0))
    for tokens, padding in ((100, 0.1), (300, 0.3)):
        metrics.batch_size.labels("e", "embed").observe(8)
        metrics.batch_tokens.labels("e", "embed").observe(tokens)
        metrics.padding.labels("e", "embed").observe(padding)
    (e,) = ring.stats(metrics.registry.collect(), [embed])["models"]
    assert e["tokens"]["embed"] == {"batches": 2, "tokens_per_batch": 200.0, "padding": pytest.approx(0.2)}
