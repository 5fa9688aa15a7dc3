"""The gateway's metrics: HTTP requests by route, status and latency, and the restarts of
the engine cores the server watches (`--engine-cores`).

Everything else (queues, batches, generation, SLO, settings, batch jobs) is the batcher's,
in batcher/metrics.py. `GatewayMetrics` is both on one registry, so that one /metrics
scrape shows everything; the same conventions hold (see batcher/metrics.py), and
tests/observability/test_catalogue.py checks both modules against grafana/.

Label values:
- `route`: the route template (`/v1/embeddings`, `/v1/chat/completions`, ...).
- `status`: the HTTP status code.
- `model`: empty when the request named no model (or its body could not be parsed);
  `ferry_request_duration_seconds` is observed only for requests that named one.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from batcher.metric_types import Counter, Gauge, Histogram
from batcher.metrics import LATENCY_BUCKETS, Metrics

# Counted by the server that watches its engine cores (gateway/cores/process.py); with
# several front ends, by the supervisor (gateway/metrics/shared.py, SupervisorMetrics).
CORE_RESTARTS = (
    "ferry_engine_core_restarts_total",
    "Engine cores restarted after an unexpected exit (--engine-cores).",
)


class GatewayMetrics(Metrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(registry)
        r = self.registry
        self.requests = Counter(
            "ferry_requests_total",
            "HTTP requests by route, model and status code.",
            ["route", "model", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "ferry_request_duration_seconds",
            "End-to-end request latency.",
            ["route", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "ferry_requests_in_flight",
            "Requests being served now.",
            ["route"],
            registry=r,
            multiprocess_mode="livesum",  # several front ends: their sum (batcher/metrics.py)
        )
        self.core_restarts = Counter(*CORE_RESTARTS, ["model"], registry=r)
        self._series: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def series(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered. A lookup costs 2-3 us (validation, a
        tuple, a lock) and a request makes four; the gateway never removes these series,
        and their labels are bounded (routes, served models, status codes)."""
        key = (metric, labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child
