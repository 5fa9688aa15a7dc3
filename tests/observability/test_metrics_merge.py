"""gateway/metrics/merge.py: the server's registry and its cores' texts as one exposition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics.merge import merged_exposition


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


def test_vllm_compat_gauges_sum_each_model_and_label_it_model_name():
    r = CollectorRegistry()
    depth = Gauge("ferry_queue_depth", "Depth.", ["model", "class"], registry=r)
    depth.labels("a", "interactive").set(3)
    depth.labels("a", "batch").set(4)
    depth.labels("b", "interactive").set(1)
    Gauge("ferry_running_sequences", "Running.", ["model"], registry=r).labels("a").set(2)
    core = CollectorRegistry()  # model b in an engine core
    Gauge("ferry_running_sequences", "Running.", ["model"], registry=core).labels("b").set(5)
    Gauge("ferry_kv_cache_usage_ratio", "KV.", ["model"], registry=core).labels("b").set(0.25)
    text = merged_exposition(r, [generate_latest(core).decode()], compat="vllm").decode()
    got = {
        (s.name, s.labels.get("model_name")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:")
    }
    assert got == {
        ("vllm:num_requests_waiting", "a"): 7,
        ("vllm:num_requests_waiting", "b"): 1,
        ("vllm:num_requests_running", "a"): 2,
        ("vllm:num_requests_running", "b"): 5,
        ("vllm:kv_cache_usage_perc", "b"): 0.25,
    }
    assert "# TYPE vllm:kv_cache_usage_perc gauge" in text
    assert "vllm:" not in merged_exposition(r, []).decode()  # only when asked


def test_vllm_compat_prefix_cache_counters_are_ferrys_by_model_name():
    """`vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` are counters as vLLM exports
    them (`..._total`, label `model_name`), with Ferry's values, engine cores' included."""
    r = CollectorRegistry()
    Counter("ferry_prefix_cache_queries_total", "Queries.", ["model"], registry=r).labels("a").inc(100)
    Counter("ferry_prefix_cache_hits_total", "Hits.", ["model"], registry=r).labels("a").inc(64)
    core = CollectorRegistry()
    Counter("ferry_prefix_cache_queries_total", "Queries.", ["model"], registry=core).labels("b").inc(10)
    Counter("ferry_prefix_cache_hits_total", "Hits.", ["model"], registry=core).labels("b")
    text = merged_exposition(r, [generate_latest(core).decode()], compat="vllm").decode()
    got = {
        (s.name, s.labels.get("model_name")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:prefix")
    }
    assert got == {
        ("vllm:prefix_cache_queries_total", "a"): 100,
        ("vllm:prefix_cache_queries_total", "b"): 10,
        ("vllm:prefix_cache_hits_total", "a"): 64,
        ("vllm:prefix_cache_hits_total", "b"): 0,
    }
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert "vllm:prefix" not in merged_exposition(r, []).decode()


def test_vllm_compat_speculation_counters_are_ferrys_by_model_name():
    """`vllm:spec_decode_num_draft_tokens` and `..._num_accepted_tokens` as vLLM exports
    them, with the values of Ferry's speculation counters, engine cores' included."""
    r = CollectorRegistry()
    core = CollectorRegistry()
    Counter("ferry_spec_draft_tokens_total", "Drafted.", ["model"], registry=core).labels("b").inc(40)
    Counter("ferry_spec_accepted_tokens_total", "Taken.", ["model"], registry=core).labels("b").inc(26)
    text = merged_exposition(r, [generate_latest(core).decode()], compat="vllm").decode()
    got = {
        (s.name, s.labels.get("model_name")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:spec")
    }
    assert got == {
        ("vllm:spec_decode_num_draft_tokens_total", "b"): 40,
        ("vllm:spec_decode_num_accepted_tokens_total", "b"): 26,
    }
