"""The gateway being tuned, seen from outside: its admin API (read and change a model's
batching settings) and its Prometheus /metrics, scraped before and after each cell."""

from __future__ import annotations

import time
from typing import Any

import httpx

REASONS = ("full", "max_wait", "deadline", "adaptive", "drain", "lane")  # label values of ferry_batches_total
REJECTIONS = ("queue_full", "deadline_infeasible")  # of ferry_rejections_total


class TunedGateway:
    """The admin API and /metrics of the gateway `ferry tune` sweeps."""

    def __init__(self, host: str, token: str | None):
        self.host = host
        self.http = httpx.Client(base_url=host, timeout=10.0)
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}

    def close(self) -> None:
        self.http.close()

    def models(self) -> list[dict]:
        r = self.http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"]

    def _admin_url(self, model: str) -> str:
        return f"/admin/models/{model}/batching"

    def settings(self, model: str) -> dict:
        r = self.http.get(self._admin_url(model), headers=self.auth)
        if r.status_code in (401, 404):
            hint = (
                ""
                if r.status_code == 401 or r.json().get("error", {}).get("code") == "model_not_found"
                else " (is the gateway running with --admin-token?)"
            )
            raise SystemExit(
                f"ferry tune: admin API: HTTP {r.status_code} {r.json().get('error', {}).get('message', '')}{hint}"
            )
        r.raise_for_status()
        return r.json()

    def patch(self, model: str, **changes: Any) -> dict:
        r = self.http.patch(self._admin_url(model), headers=self.auth, json=changes)
        if r.status_code != 200:
            raise SystemExit(f"ferry tune: setting {changes} refused: HTTP {r.status_code} {r.text[:300]}")
        return r.json()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return parse_metrics(self.http.get("/metrics").text)

    def drain(self, model: str, timeout: float = 30.0) -> None:
        """Wait (bounded) until the model's queue is empty and nothing is in flight."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            queued = sum(
                v
                for (name, labels), v in m.items()
                if name == "ferry_queue_depth" and dict(labels).get("model") == model
            )
            flying = sum(
                v
                for (name, labels), v in m.items()
                if name == "ferry_requests_in_flight" and dict(labels).get("route", "").startswith("/v1/")
            )
            if queued == 0 and flying == 0:
                return
            time.sleep(0.2)


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_delta(before: dict, after: dict, name: str, model: str, **match: str) -> float:
    total = 0.0
    for key, value in after.items():
        n, labels = key
        if n != name:
            continue
        d = dict(labels)
        if d.get("model") != model or any(d.get(k) != v for k, v in match.items()):
            continue
        total += value - before.get(key, 0.0)
    return total


def ferry_figures(before: dict, after: dict, model: str) -> dict[str, float | None]:
    def mean(name: str, **match: str) -> float | None:
        n = metric_delta(before, after, name + "_count", model, **match)
        return metric_delta(before, after, name + "_sum", model, **match) / n if n > 0 else None

    size = mean("ferry_batch_size_items", phase="embed")
    if size is None:
        size = mean("ferry_batch_size_items", phase="prefill")
    wait = mean("ferry_queue_wait_seconds")
    out: dict[str, float | None] = {
        "mean_batch_size": _round(size, 2),
        "mean_decode_batch": _round(mean("ferry_batch_size_items", phase="decode"), 2),
        "batches": metric_delta(before, after, "ferry_batches_total", model),
        "expired": metric_delta(before, after, "ferry_expired_total", model),
        "mean_queue_wait_ms": _round(wait * 1000 if wait is not None else None, 2),
    }
    for r in REASONS:
        out[f"dispatch_{r}"] = metric_delta(before, after, "ferry_batches_total", model, reason=r)
    for r in REJECTIONS:
        out[f"rejected_{r}"] = metric_delta(before, after, "ferry_rejections_total", model, reason=r)
    return out


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)
