"""The figures of the live page (`GET /ui/stats`), computed from Ferry's own metrics.

Every figure comes from the samples one `/metrics` scrape carries (the server's registry
merged with its engine cores', gateway/metrics/merge.py), plus each model's current
batching settings and fitted cost model (what the admin GET answers; no token, prompt or
key is among them). No Prometheus is needed.

Rates and latency quantiles are over a recent window, from a short ring of cumulative
snapshots kept by the server: each `/ui/stats` request takes a snapshot, keeps those at
most `window` seconds old and compares the newest with the oldest kept. A page polling
every second thus sees the last 10 s; the first request after a quiet spell (no snapshot
left in the window) has no rates yet (null). Quantiles are estimated from the histogram
buckets' increase over the window the way Prometheus' `histogram_quantile` does: linear
within the bucket that holds the rank. The observed batches of the cost chart are the
mean batch of each phase since the previous snapshot (one point per poll).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric

from batcher.types import Priority

WINDOW_S = 10.0
QUANTILES = (0.5, 0.99)
CURVE_POINTS = 48  # predicted batch times drawn per phase

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, dict[Labels, float]]  # sample name -> labels -> value


@dataclass(frozen=True)
class ModelInfo:
    """What the page shows of a served model besides its metrics."""

    name: str
    kind: str  # "embedding" or "chat"
    settings: dict[str, Any]
    cost_model: dict[str, dict[str, float]] | None  # batcher/cost.py's cost_report, per phase


def flatten(families: Iterable[Metric]) -> Samples:
    out: Samples = {}
    for family in families:
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    return out


class _View:
    """Sums and differences over one model's samples."""

    def __init__(self, now: Samples, then: Samples | None, model: str):
        self.now, self.then, self.model = now, then, model

    def _sum(self, samples: Samples | None, name: str, match: dict[str, str]) -> float:
        if samples is None:
            return 0.0
        total = 0.0
        for labels, value in samples.get(name, {}).items():
            d = dict(labels)
            if d.get("route", "").startswith("/admin"):
                continue  # request figures are the model's API calls, not the operator's
            if d.get("model") == self.model and all(d.get(k) == v for k, v in match.items()):
                total += value
        return total

    def current(self, name: str, **match: str) -> float:
        return self._sum(self.now, name, match)

    def delta(self, name: str, **match: str) -> float:
        """Increase over the window (a counter that went down was reset: its new value)."""
        now, then = self._sum(self.now, name, match), self._sum(self.then, name, match)
        return now - then if now >= then else now

    def by_label(self, name: str, label: str, **match: str) -> dict[str, float]:
        values = {dict(k).get(label) for k in self.now.get(name, {}) if dict(k).get("model") == self.model}
        return {v: self.delta(name, **{label: v}, **match) for v in sorted(v for v in values if v is not None)}

    def buckets(self, name: str, **match: str) -> list[tuple[float, float]]:
        """(upper bound, increase of the cumulative count) of a histogram, by bound."""
        bounds = {
            dict(k)["le"]
            for k in self.now.get(name + "_bucket", {})
            if dict(k).get("model") == self.model and all(dict(k).get(a) == b for a, b in match.items())
        }
        return sorted((float(le), self.delta(name + "_bucket", le=le, **match)) for le in bounds)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (bound, count) pairs, +Inf last:
    the rank's bucket, linear within it (from 0 for the first); in +Inf, the largest bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _latency(view: _View, name: str) -> dict[str, Any] | None:
    buckets = view.buckets(name)
    count = buckets[-1][1] if buckets else 0.0
    if count <= 0:
        return None
    out: dict[str, Any] = {"count": count}
    for q in QUANTILES:
        value = quantile(q, buckets)
        out[f"p{round(q * 100)}_ms"] = None if value is None else value * 1e3
    return out


def _distribution(buckets: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Per-bucket counts (not cumulative): batches of size in (previous bound, bound]."""
    out, below = [], 0.0
    for bound, count in buckets:
        out.append({"le": "+Inf" if math.isinf(bound) else f"{bound:g}", "count": count - below})
        below = count
    return out


def _cost(view: _View, last: _View, info: ModelInfo) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase, fit in (info.cost_model or {}).items():
        items = view.delta("ferry_batch_size_items_sum", phase=phase)
        tokens = view.delta("ferry_batch_size_tokens_sum", phase=phase)
        # Tokens per item in the window, so a fit on tokens (embed, prefill) draws against size.
        per_item_tokens = tokens / items if items > 0 else 0.0
        if fit.get("per_token_ms", 0.0) > 0 and per_item_tokens == 0.0:
            items_all = view.current("ferry_batch_size_items_sum", phase=phase)
            tokens_all = view.current("ferry_batch_size_tokens_sum", phase=phase)
            per_item_tokens = tokens_all / items_all if items_all > 0 else 0.0
        cap = int(info.settings.get("max_running" if phase == "decode" else "max_batch_size", 32) or 32)
        top = max(2 * cap, 8)
        step = max(1, math.ceil(top / CURVE_POINTS))
        curve = [
            [
                n,
                fit["fixed_ms"]
                + fit["per_item_ms"] * n
                + fit["per_token_ms"] * n * per_item_tokens
                + fit.get("per_token_row_ms", 0.0) * n * per_item_tokens**2,  # tokens^2 / items
            ]
            for n in range(1, top + 1, step)
        ]
        batches = last.delta("ferry_batch_size_items_count", phase=phase)
        observed = None
        if batches > 0:
            observed = {
                "batches": batches,
                "items": last.delta("ferry_batch_size_items_sum", phase=phase) / batches,
                "ms": last.delta("ferry_batch_execution_seconds_sum", phase=phase) / batches * 1e3,
            }
        out[phase] = {**fit, "tokens_per_item": per_item_tokens, "predicted": curve, "observed": observed}
    return out


def model_stats(view: _View, last: _View, info: ModelInfo, seconds: float | None) -> dict[str, Any]:
    def rate(x: float) -> float | None:
        return x / seconds if seconds else None

    outcomes = view.by_label("ferry_items_total", "status")
    rejections = view.by_label("ferry_rejections_total", "reason")
    in_system = ("ferry_queue_depth", "ferry_running_sequences")  # waiting sequences are the queue
    held = sum(view.current(n) - view._sum(view.then, n, {}) for n in in_system) if view.then is not None else 0.0
    # Every item that reached the model either finished, was refused, or is still held.
    arrivals = sum(outcomes.values()) + sum(rejections.values()) + held
    slo = {}
    for p in Priority:
        met = view.delta("ferry_slo_total", **{"class": p.label, "status": "met"})
        missed = view.delta("ferry_slo_total", **{"class": p.label, "status": "missed"})
        slo[p.label] = {"met": met, "missed": missed, "attainment": met / (met + missed) if met + missed else None}
    latency = {"request": _latency(view, "ferry_request_duration_seconds")}
    latency["queue_wait"] = _latency(view, "ferry_queue_wait_seconds")
    if info.kind == "chat":
        latency["ttft"] = _latency(view, "ferry_time_to_first_token_seconds")
        latency["itl"] = _latency(view, "ferry_inter_token_latency_seconds")
    phases = sorted({dict(k).get("phase") or "" for k in view.now.get("ferry_batch_size_items_count", {})})
    out: dict[str, Any] = {
        "name": info.name,
        "kind": info.kind,
        "rates": {
            "arrivals": rate(max(arrivals, 0.0)),
            "completions": rate(outcomes.get("result", 0.0)),
        },
        "outcomes": outcomes,
        "latency": latency,
        "queue": {
            "depth": view.current("ferry_queue_depth"),
            "by_class": {p.label: view.current("ferry_queue_depth", **{"class": p.label}) for p in Priority},
            "running": view.current("ferry_running_sequences"),
            "waiting": view.current("ferry_waiting_sequences"),
        },
        "batch_sizes": {
            ph: _distribution(view.buckets("ferry_batch_size_items", phase=ph))
            for ph in phases
            if ph and view.current("ferry_batch_size_items_count", phase=ph) > 0
        },
        "dispatch": view.by_label("ferry_batches_total", "reason"),
        "rejections": rejections,
        "expired": view.by_label("ferry_expired_total", "class"),
        "slo": slo,
        "knobs": info.settings,
        "cost": _cost(view, last, info),
        "tokens": {ph: _tokens(view, ph) for ph in phases if ph},
        "config_changes": view.current("ferry_config_changes_total"),
        "tenants": _tenants(view, seconds),
    }
    if info.kind == "chat":
        out["prefix_cache"] = _prefix_cache(view)
        # The running sequences' KV against its budget now, and the preemptions in the window.
        out["kv"] = {
            "usage": view.current("ferry_kv_cache_usage_ratio"),
            "preemptions": view.delta("ferry_preemptions_total"),
        }
        # Speculation in the window: the drafts verified that were taken, and the share of
        # decode steps that verified any (none where --speculation is off).
        drafted = view.delta("ferry_spec_draft_tokens_total")
        steps = view.delta("ferry_batch_size_items_count", phase="decode")
        out["speculation"] = {
            "drafted": drafted,
            "acceptance": view.delta("ferry_spec_accepted_tokens_total") / drafted if drafted else None,
            "steps_share": view.delta("ferry_spec_steps_total") / steps if steps else None,
        }
    return out


def _tenants(view: _View, seconds: float | None) -> dict[str, Any]:
    """Each tenant's tokens/s by kind in the window, its queued items and refusals, and the
    fairness index (batcher/fairness.py)."""
    names = {
        dict(k).get("tenant")
        for k in view.now.get("ferry_tenant_tokens_total", {})
        if dict(k).get("model") == view.model
    }
    by: dict[str, Any] = {}
    for name in sorted(n for n in names if n is not None):
        by[name] = {
            "input_per_s": view.delta("ferry_tenant_tokens_total", tenant=name, kind="input") / seconds
            if seconds
            else None,
            "output_per_s": view.delta("ferry_tenant_tokens_total", tenant=name, kind="output") / seconds
            if seconds
            else None,
            "queued": view.current("ferry_tenant_queue_depth", tenant=name),
            "refused": view.delta("ferry_tenant_refusals_total", tenant=name),
        }
    fair = [v for k, v in view.now.get("ferry_tenant_fairness_ratio", {}).items() if dict(k).get("model") == view.model]
    return {"by_tenant": by, "fairness": fair[0] if fair else None}


def _tokens(view: _View, phase: str) -> dict[str, float | None]:
    """One phase's batches in the window: real tokens per batch and the mean share of each
    batch that was padding (None without batches)."""
    batches = view.delta("ferry_batch_size_tokens_count", phase=phase)
    padded = view.delta("ferry_batch_padding_ratio_count", phase=phase)
    return {
        "batches": batches,
        "tokens_per_batch": view.delta("ferry_batch_size_tokens_sum", phase=phase) / batches if batches else None,
        "padding": view.delta("ferry_batch_padding_ratio_sum", phase=phase) / padded if padded else None,
    }


def _prefix_cache(view: _View) -> dict[str, float | None]:
    """Prompt tokens of the sequences prefilled in the window, those the prefix cache served,
    and their share (None without prompts)."""
    queries = view.delta("ferry_prefix_cache_queries_total")
    hits = view.delta("ferry_prefix_cache_hits_total")
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries > 0 else None}


class StatsRing:
    """The ring of recent snapshots behind `/ui/stats` (see the module's docstring)."""

    def __init__(self, window: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window, self.clock = window, clock
        self._ring: deque[tuple[float, Samples]] = deque()

    def stats(self, families: Iterable[Metric], models: Iterable[ModelInfo]) -> dict[str, Any]:
        now = self.clock()
        samples = flatten(families)
        while self._ring and now - self._ring[0][0] > self.window:
            self._ring.popleft()
        then_t, then = self._ring[0] if self._ring else (now, None)
        last_t, last = self._ring[-1] if self._ring else (now, None)
        self._ring.append((now, samples))
        seconds = now - then_t if then is not None and now > then_t else None
        return {
            "window_s": seconds,
            "interval_s": now - last_t if last is not None else None,
            "models": [
                model_stats(_View(samples, then, m.name), _View(samples, last, m.name), m, seconds) for m in models
            ],
        }
