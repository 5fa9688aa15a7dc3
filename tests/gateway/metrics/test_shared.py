"""The metrics directory of a server with several front ends (gateway/metrics/shared.py),
over real processes: two front ends' counters scrape as their sum beside the supervisor's
series and a core's; no gauge comes out per process; a front end that is gone keeps its
counts in the scrape while its live gauges leave it; the live page reads the same figures."""

from __future__ import annotations

import multiprocessing

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from batcher.settings import BatchingSettings
from gateway.metrics.merge import merged_exposition, merged_families, metric_families
from gateway.metrics.shared import SupervisorMetrics, process_gone, share_metrics, shared_registry
from gateway.ui.stats import ModelInfo, StatsRing

ROUTE = ("/v1/embeddings", "fake-embed")


def front_end(path: str, requests: int) -> None:
    """What a front end does with its metrics: `requests` requests answered 200, one still in
    flight, and every gauge of the catalogue set once (a front end sets few of them)."""
    share_metrics(path)
    from prometheus_client import Gauge

    from gateway.metrics.registry import GatewayMetrics

    m = GatewayMetrics()
    for _ in range(requests):
        m.requests.labels(*ROUTE, "200").inc()
        m.request_latency.labels(*ROUTE).observe(0.01)
    m.core_restarts.labels("fake-embed")  # at zero, as every front end makes it
    gauges = [g for g in vars(m).values() if isinstance(g, Gauge)]
    gauges += [g for _, g in m.setting_gauges.values()]
    for g in gauges:
        g.labels(*("x" for _ in g._labelnames)).set(1)
    m.in_flight.labels(ROUTE[0]).set(1)


def scrape(registry: CollectorRegistry, core: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = merged_exposition(registry, [metric_families(core)]).decode()
    assert text.count("# TYPE ferry_requests_total counter") == 1
    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert "pid" not in s.labels, s
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, key
            samples[key] = s.value
    return samples


def test_every_front_ends_counts_scrape_summed_and_outlive_it_while_its_gauges_go(tmp_path):
    path = str(tmp_path)
    supervisor = SupervisorMetrics(path)
    supervisor.core_restarts.labels("fake-embed").inc()
    mp = multiprocessing.get_context("spawn")
    fronts = [mp.Process(target=front_end, args=(path, n)) for n in (4, 3)]
    for p in fronts:
        p.start()
    for p in fronts:
        p.join(60)
        assert p.exitcode == 0
    core = CollectorRegistry()  # a core's series, scraped over its socket
    Counter("ferry_batches_total", "Batches.", ["model"], registry=core).labels("fake-embed").inc(2)
    registry = shared_registry(path)

    requests = ("ferry_requests_total", (("model", "fake-embed"), ("route", "/v1/embeddings"), ("status", "200")))
    count = ("ferry_request_duration_seconds_count", (("model", "fake-embed"), ("route", "/v1/embeddings")))
    in_flight = ("ferry_requests_in_flight", (("route", "/v1/embeddings"),))
    restarts = ("ferry_engine_core_restarts_total", (("model", "fake-embed"),))
    jobs = ("ferry_jobs", (("status", "x"),))
    before = scrape(registry, core)
    assert before[requests] == before[count] == 7.0
    assert before[restarts] == 1.0
    assert before[("ferry_batches_total", (("model", "fake-embed"),))] == 2.0
    assert before[in_flight] == 2.0  # livesum: one in each front end
    assert before[jobs] == 1.0  # livemax: every front end reads the same store

    process_gone(fronts[0].pid, path)
    after = scrape(registry, core)
    assert after[requests] == after[count] == 7.0  # the dead front end's counts stay
    assert after[in_flight] == 1.0  # its request in flight does not
    supervisor.close()

    # The live page reads the same merged families (gateway/routes/system.py, all_families).
    ring = StatsRing(clock=lambda: 0.0)
    model = ModelInfo("fake-embed", "embedding", BatchingSettings().to_dict(), None)
    ring.stats([], [model])  # an empty baseline: every figure is the whole sequence
    figures = ring.stats(merged_families(registry, [metric_families(core)]), [model])["models"][0]
    assert figures["latency"]["request"]["count"] == 7
