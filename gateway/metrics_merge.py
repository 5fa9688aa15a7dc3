"""One /metrics scrape over the server and its engine cores (`--engine-cores`).

Each core keeps its batching metrics (batcher/metrics.py) in its own registry; on every
scrape the server asks each core for its text (`RemoteBatcher.scrape`) and merges it with
its own registry here. Families are merged by name, so each family's HELP and TYPE appear
once; samples with the same name and labels in several processes are added up (a counter
incremented in two processes scrapes as the sum; a batching series is the core's alone,
since the server's registry holds no batching series of a model served by a core). The
`_created` sample of such a series keeps the earliest time. A core that does not answer
(lost, stopping) leaves its series out of that scrape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def merged_exposition(registry: CollectorRegistry, texts: Iterable[str]) -> bytes:
    """The text format of `registry`'s families with those parsed from `texts` (OpenMetrics,
    which, unlike Prometheus' text format, keeps a counter's `_created` in its family and
    so parses back into the families `registry.collect()` yields) merged in."""
    return generate_latest(_Fixed(merged_families(registry, texts)))


def merged_families(registry: CollectorRegistry, texts: Iterable[str]) -> list[Metric]:
    """The families of `registry` and of `texts`, merged as `merged_exposition` says (the
    live page, gateway/ui_stats.py, reads the same figures as the scrape)."""
    families: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], Sample] = {}
    sources = [registry.collect(), *(text_string_to_metric_families(t) for t in texts)]
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
    return list(families.values())


class _Fixed:
    """A collector of families already built, in the shape generate_latest takes."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
