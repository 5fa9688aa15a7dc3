"""One /metrics scrape over the server and its engine cores (`--engine-cores`).

Each core keeps its batching metrics (batcher/metrics.py) in its own registry; on every
scrape the server asks each core for its families (`CoreClient.scrape`, msgpack: parsing
a core's text took most of a scrape) and merges them with its own registry here. Families
are merged by name, so each family's HELP and TYPE appear once; samples with the same
name and labels in several processes are added up (a counter incremented in two processes
scrapes as the sum; a batching series is the core's alone, since the server's registry
holds no batching series of a model served by a core). The `_created` sample of such a
series keeps the earliest time. A core that does not answer (lost, stopping) leaves its
series out of that scrape.

`--metrics-compat vllm` adds three gauges and two counters under vLLM's names, derived
from the merged families on every scrape (so they hold with engine cores or without): what
an endpoint picker left at its vLLM defaults reads (`VLLM_COMPAT`), and vLLM's prefix-cache
counters (`VLLM_COUNTERS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.cores.wire import MetricFamily

# vLLM's name -> (Ferry's gauge it reads, its help). Each is summed by model (the queue depth
# over its priority classes) and labelled `model_name`, as vLLM labels it.
VLLM_COMPAT: dict[str, tuple[str, str]] = {
    "vllm:num_requests_waiting": ("ferry_queue_depth", "Requests waiting (ferry_queue_depth, every class)."),
    "vllm:num_requests_running": ("ferry_running_sequences", "Requests running (ferry_running_sequences)."),
    "vllm:kv_cache_usage_perc": (
        "ferry_kv_cache_usage_ratio",
        "KV-cache usage, 1 is 100 percent (ferry_kv_cache_usage_ratio).",
    ),
}

# vLLM's counters -> (Ferry's counter family, its help), likewise by model as `model_name`.
VLLM_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:prefix_cache_queries": (
        "ferry_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (ferry_prefix_cache_queries_total).",
    ),
    "vllm:prefix_cache_hits": (
        "ferry_prefix_cache_hits",
        "Prompt tokens served from the prefix cache (ferry_prefix_cache_hits_total).",
    ),
    "vllm:num_preemptions": (
        "ferry_preemptions",
        "Running sequences preempted for KV-cache memory (ferry_preemptions_total).",
    ),
    "vllm:spec_decode_num_draft_tokens": (
        "ferry_spec_draft_tokens",
        "Draft tokens verified by speculative decoding (ferry_spec_draft_tokens_total).",
    ),
    "vllm:spec_decode_num_accepted_tokens": (
        "ferry_spec_accepted_tokens",
        "Draft tokens verification took (ferry_spec_accepted_tokens_total).",
    ),
}


def merged_exposition(
    registry: CollectorRegistry, scraped: Iterable[str | list[MetricFamily]], compat: str = "none"
) -> bytes:
    """The text format of `registry`'s families with those of each core merged in: its
    `MetricFamily` list, or its text (OpenMetrics, which, unlike Prometheus' text format,
    keeps a counter's `_created` in its family and so parses back into the families
    `registry.collect()` yields); with `compat="vllm"`, vLLM's gauges (`VLLM_COMPAT`) too."""
    return generate_latest(_Fixed(merged_families(registry, scraped, compat)))


def merged_families(
    registry: CollectorRegistry, scraped: Iterable[str | list[MetricFamily]], compat: str = "none"
) -> list[Metric]:
    """The families `merged_exposition` writes (the live page, gateway/ui/stats.py, reads
    the same figures as the scrape)."""
    families: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], Sample] = {}
    sources = [
        registry.collect(),
        *(text_string_to_metric_families(s) if isinstance(s, str) else map(_family, s) for s in scraped),
    ]
    for source in sources:
        for family in source:
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                key = (family.name, s.name, tuple(sorted(s.labels.items())))
                seen = values.get(key)
                if seen is None:
                    values[key] = s
                elif s.name.endswith("_created"):
                    values[key] = seen._replace(value=min(seen.value, s.value))
                else:
                    values[key] = seen._replace(value=seen.value + s.value)
    for (name, _, _), s in values.items():
        families[name].samples.append(s)
    if compat == "vllm":
        families.update({f.name: f for f in vllm_families(families)})
    return list(families.values())


def metric_families(registry: CollectorRegistry) -> list[MetricFamily]:
    """The registry's families as an engine core or a peer front end sends them to be merged."""
    return [
        MetricFamily(f.name, f.documentation, f.type, f.unit, [(s.name, s.labels, s.value) for s in f.samples])
        for f in registry.collect()
    ]


def _family(f: MetricFamily) -> Metric:
    family = Metric(f.name, f.help, f.type, f.unit)
    family.samples = [Sample(name, labels, value) for name, labels, value in f.samples]
    return family


def vllm_families(families: dict[str, Metric]) -> list[Metric]:
    """vLLM's gauges (`VLLM_COMPAT`) and counters (`VLLM_COUNTERS`) from Ferry's, one
    sample per model (a counter's `_total`; its `_created` is left out)."""
    out = []
    kinds = [(VLLM_COMPAT, "gauge", ""), (VLLM_COUNTERS, "counter", "_total")]
    for compat, kind, suffix in kinds:
        for name, (source, help_text) in compat.items():
            family = Metric(name, help_text, kind)
            by_model: dict[str, float] = {}
            for s in families[source].samples if source in families else []:
                if s.name == source + suffix:
                    by_model[s.labels.get("model", "")] = by_model.get(s.labels.get("model", ""), 0.0) + s.value
            for model, value in by_model.items():
                family.add_sample(name + suffix, {"model_name": model}, value)
            out.append(family)
    return out


class _Fixed:
    """A collector of families already built, in the shape generate_latest takes."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
