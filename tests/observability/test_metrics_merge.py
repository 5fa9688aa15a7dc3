"""gateway/metrics_merge.py: the server's registry and its cores' texts as one exposition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics_merge import merged_exposition


def registry_with(batches: float, depth: float | None, model: str = "m") -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("ferry_batches_total", "Batches.", ["model"], registry=r).labels(model).inc(batches)
    g = Gauge("ferry_queue_depth", "Depth.", ["model"], registry=r)
    if depth is not None:
        g.labels(model).set(depth)
    return r


def samples(text: bytes) -> dict[tuple[str, str], float]:
    out = {}
    for f in text_string_to_metric_families(text.decode()):
        for s in f.samples:
            key = (s.name, s.labels.get("model", ""))
            assert key not in out, key
            out[key] = s.value
    return out


def test_a_counter_incremented_in_two_processes_scrapes_as_the_sum():
    server = registry_with(2, None)
    core = generate_latest(registry_with(3, 7)).decode()
    merged = merged_exposition(server, [core])
    got = samples(merged)
    assert got[("ferry_batches_total", "m")] == 5
    assert got[("ferry_queue_depth", "m")] == 7
    assert merged.decode().count("# TYPE ferry_batches_total") == 1


def test_series_of_different_cores_stay_apart():
    server = CollectorRegistry()
    texts = [generate_latest(registry_with(1, 4, "a")).decode(), generate_latest(registry_with(2, 5, "b")).decode()]
    got = samples(merged_exposition(server, texts))
    assert got[("ferry_batches_total", "a")] == 1 and got[("ferry_batches_total", "b")] == 2
    assert got[("ferry_queue_depth", "a")] == 4 and got[("ferry_queue_depth", "b")] == 5
