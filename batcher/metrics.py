"""Every metric of the batching, defined once; the HTTP request metrics are the gateway's
(gateway/metrics/registry.py, whose `GatewayMetrics` adds them to these on one registry).

Names follow `ferry_<thing>_<unit>`; counters end in `_total`; labels stay in
{model, route, status, reason, phase, class, tenant, kind}. `tenant` is bounded: the tenants
named in the config file keep their names, the busiest others (TENANT_LABELS, re-ranked every
TENANT_RERANK seconds) theirs, and the rest are `other`; it is never an API key (the gateway
names a key's tenant, or labels it by a digest). Tests build a `Metrics` on a fresh
`CollectorRegistry` and read values with `registry.get_sample_value`.
The Grafana dashboard and alert rules use only these names, and every metric here is
drawn by at least one panel (tests/observability/test_catalogue.py checks both ways).
docs/operations.md explains each metric and panel to operators.

Label values:
- `status`: the item outcome (`result`, `error`, `cancelled`, `expired`) on
  `ferry_items_total`; `met` / `missed` on `ferry_slo_total`.
- `reason`: a dispatch reason (`full`, `max_wait`, `deadline`, `adaptive`, `drain`, `lane`) or a
  rejection reason (`queue_full`, `deadline_infeasible`, `invalid`, `shutting_down`).
- `phase`: the engine phase (`embed`, `prefill`, `decode`, a custom model's `predict`), or on
  `ferry_cancellations_total` where the item was when its client left (`queued`, `running`).
- `class`: the priority class (`interactive`, `batch`).

Counters whose label values are known up front are created at zero (`init_model`,
`init_phases`) so that `rate()`/`increase()` see the first event and alert expressions
return 0 rather than nothing.

Histogram buckets (seconds unless said otherwise) are chosen for this workload:
- LATENCY_BUCKETS: 0.5 ms (a queue hop on an idle server) to 60 s (a long generation on a
  busy CPU). Dense between 1 ms and 250 ms, where budgets and max_wait live and where an
  operator needs to tell 5 ms from 10 ms of queue wait; coarse beyond 1 s.
- STEP_BUCKETS: one engine call or one inter-token gap. A decode step of the tiny model is
  10-50 ms on 2 CPU cores, an embeddings batch of 32 about 150 ms; 1 ms to 2.5 s, dense
  from 5 to 150 ms. Execution time adds 5, 10 and 30 s for large prefills on CPU.
- SIZE_BUCKETS: items per batch. Every power of two up to 256 plus 12, 24, 48, so the
  default cap of 32 and the measured sweet spot of 16-32 fall on bucket edges.
- TOKEN_BUCKETS: real tokens per batch: one short sentence (16) to a full batch of long
  prompts (65536); powers of two match how operators set prefill_token_budget (2048).
- RATIO_BUCKETS: padding waste, a fraction in [0, 1]; 0 (no padding) is its own bucket.
- ERROR_BUCKETS: the cost model's relative error |predicted - actual| / actual, from 1 %
  (excellent) to 500 % (the model is lost; admission and deadline decisions suffer).
"""

from __future__ import annotations

import contextlib
from typing import Final

from prometheus_client import CollectorRegistry

from .fairness import Tenants
from .knobs import Knob, knobs
from .metric_types import Counter, Gauge, Histogram
from .settings import BatchingSettings
from .types import DispatchReason, Priority, Stage

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
EXECUTION_BUCKETS = (*STEP_BUCKETS, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)
ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)

# Gauges in prometheus-client's multiprocess mode (the front ends of `--api-workers N`,
# gateway/metrics/shared.py) are read over the processes alive: an amount summed (SUM), a
# setting or a figure every process that sets it holds alike, the largest (MAX; `ferry_jobs`
# is kept by the batch-job lease's holder, the others hold 0, and MAX never counts a job
# twice while the lease moves). Outside that mode the mode means nothing.
SUM: Final = "livesum"
MAX: Final = "livemax"

TENANT_LABELS = 16  # tenants with a label of their own beside those the config names
TENANT_RERANK = 10.0  # seconds between re-rankings of the busiest tenants
OTHER = "other"

# Rejection reasons known up front (others, like shutting_down, appear when they happen).
REJECTION_REASONS = ("queue_full", "deadline_infeasible", "invalid")
ITEM_STATUSES = ("result", "error", "cancelled", "expired")


class TenantLabels:
    """The `tenant` label of a tenant's series: its name if the config file names it or it is
    among the TENANT_LABELS busiest others (re-ranked every TENANT_RERANK s, per model), else
    `other`."""

    def __init__(self) -> None:
        self.named: set[str] = set()
        self._top: dict[str, set[str]] = {}
        self._ranked: dict[str, float] = {}

    def label(self, model: str, tenants: Tenants, name: str, now: float) -> str:
        if name in self.named:
            return name
        top = self._top.setdefault(model, set())
        if now - self._ranked.get(model, -TENANT_RERANK) >= TENANT_RERANK:
            self._ranked[model] = now
            top.clear()
            top.update(n for n in tenants.busiest(TENANT_LABELS, now) if n not in self.named)
        if name not in top and len(top) < TENANT_LABELS:
            top.add(name)
        return name if name in top else OTHER


def _setting_help(k: Knob) -> str:
    unit = " in seconds" if k.unit == "ms" else ""
    absent = f"; absent when null ({k.null})" if k.nullable else ""
    return f"Current {k.name}{unit}{absent}."


# A chat engine's own counts, per model: read from the engine after each iteration.
ENGINE_COUNTERS = (
    (
        "ferry_prefix_cache_queries_total",
        "Prompt tokens of prefilled sequences looked up in the prefix cache (every prompt token).",
    ),
    (
        "ferry_prefix_cache_hits_total",
        "Prompt tokens of prefilled sequences whose KV the prefix cache served (not computed again).",
    ),
    (
        "ferry_preemptions_total",
        (
            "Running sequences preempted because the KV cache was full (kv_cache_mb): recomputed, "
            "mostly from the prefix cache, when there is room; batch-class sequences yield first."
        ),
    ),
    (
        "ferry_spec_draft_tokens_total",
        (
            "Draft tokens verified by speculative decoding (--speculation): proposed for running "
            "sequences and checked in their step's forward."
        ),
    ),
    (
        "ferry_spec_accepted_tokens_total",
        "Draft tokens that verification took (the model's own choice): tokens gained over one a step.",
    ),
    (
        "ferry_spec_steps_total",
        (
            "Engine steps that verified drafts (against the decode steps, "
            'ferry_batch_size_items_count{phase="decode"}: the share of steps that speculated).'
        ),
    ),
)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = r
        self._initialised: set[str] = set()
        # Queue
        self.queue_depth = Gauge(
            "ferry_queue_depth", "Items waiting in the queue.", ["model", "class"], registry=r, multiprocess_mode=SUM
        )
        self.queue_wait = Histogram(
            "ferry_queue_wait_seconds",
            "Time an item waited before dispatch.",
            ["model", "class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "ferry_rejections_total",
            "Items refused before queuing: queue_full, deadline_infeasible (admission), invalid (bad input, "
            "counted by the gateway; model is empty when the body could not be parsed).",
            ["model", "reason"],
            registry=r,
        )
        self.expired = Counter(
            "ferry_expired_total",
            "Items whose deadline passed while they waited (never computed).",
            ["model", "class"],
            registry=r,
        )
        self.cancellations = Counter(
            "ferry_cancellations_total",
            "Items cancelled by their client, by where they were (phase=queued or running).",
            ["model", "phase"],
            registry=r,
        )
        self.items = Counter("ferry_items_total", "Items by terminal outcome.", ["model", "status"], registry=r)
        # Batches
        self.batches = Counter("ferry_batches_total", "Batches dispatched, by reason.", ["model", "reason"], registry=r)
        self.batch_size = Histogram(
            "ferry_batch_size_items", "Items per engine call.", ["model", "phase"], buckets=SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "ferry_batch_size_tokens",
            "Real (unpadded) tokens per engine call.",
            ["model", "phase"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "ferry_batch_execution_seconds",
            "Engine time per call.",
            ["model", "phase"],
            buckets=EXECUTION_BUCKETS,
            registry=r,
        )
        self.padding = Histogram(
            "ferry_batch_padding_ratio",
            "Padded tokens over total tokens per batch.",
            ["model", "phase"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.cost_error = Histogram(
            "ferry_cost_model_error_ratio",
            "Relative error of the cost model's prediction per batch.",
            ["model", "phase"],
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.slowdown = Gauge(
            "ferry_cost_model_slowdown",
            "90th percentile of observed / predicted batch time lately, within 1-1.5: "
            "what interactive deadlines and admission allow for.",
            ["model", "phase"],
            registry=r,
            multiprocess_mode=MAX,
        )
        self.first_token_slowdown = Gauge(
            "ferry_first_token_slowdown",
            "Generation: 90th percentile of observed / predicted time to first token lately, per class, "
            "within 1-4: what admission's first-token promises allow for.",
            ["model", "class"],
            registry=r,
            multiprocess_mode=MAX,
        )
        self.engine_errors = Counter(
            "ferry_engine_errors_total", "Engine calls or items that failed.", ["model", "phase"], registry=r
        )
        # Generation
        self.ttft = Histogram(
            "ferry_time_to_first_token_seconds",
            "Arrival to first generated token.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ferry_inter_token_latency_seconds",
            "Gap between consecutive tokens of a sequence.",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            "ferry_generated_tokens_total", "Completion tokens generated.", ["model"], registry=r
        )
        self.prompt_tokens = Counter("ferry_prompt_tokens_total", "Prompt tokens processed.", ["model"], registry=r)
        (
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.preemptions,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
            self.spec_steps,
        ) = (Counter(name, doc, ["model"], registry=r) for name, doc in ENGINE_COUNTERS)
        self.running = Gauge(
            "ferry_running_sequences",
            "Requests being computed: a chat model's running sequences, an embeddings model's items "
            "in the batch on its engine.",
            ["model"],
            registry=r,
            multiprocess_mode=SUM,
        )
        self.waiting = Gauge(
            "ferry_waiting_sequences", "Sequences waiting to be admitted.", ["model"], registry=r, multiprocess_mode=SUM
        )
        self.kv_tokens = Gauge(
            "ferry_kv_cache_tokens",
            "KV-cache token positions the running rows hold (`--kv-layout blocks`: their blocks, each row's "
            "tokens rounded up to a 16-token block; `rectangle`: rows x longest row, padding included), "
            "shared prefixes held once and prompts prefilling.",
            ["model"],
            registry=r,
            multiprocess_mode=SUM,
        )
        self.kv_usage = Gauge(
            "ferry_kv_cache_usage_ratio",
            "Share (0-1) of the KV-cache memory in use: blocks in use over the pool's (`--kv-layout blocks`), "
            "or the running rows x longest row over the --kv-cache-mb budget in tokens (`rectangle`); "
            "no budget: cache tokens over max_running x the model's context; "
            "0 for embeddings models (no KV cache).",
            ["model"],
            registry=r,
            multiprocess_mode=SUM,
        )
        # SLO
        self.slo = Counter(
            "ferry_slo_total",
            "Finished items within their latency budget (status=met) or not (missed).",
            ["model", "class", "status"],
            registry=r,
        )
        # Tenants (batcher/fairness.py)
        self.tenant_tokens = Counter(
            "ferry_tenant_tokens_total",
            "Tokens computed for each tenant: kind=input (prompt tokens prefilled, inputs embedded) or "
            "output (tokens generated).",
            ["model", "tenant", "kind"],
            registry=r,
        )
        self.tenant_queue_depth = Gauge(
            "ferry_tenant_queue_depth",
            "Items of each tenant waiting in the queue.",
            ["model", "tenant"],
            registry=r,
            multiprocess_mode=SUM,
        )
        self.tenant_refusals = Counter(
            "ferry_tenant_refusals_total",
            "Requests' items refused at once, by tenant and reason (deadline_infeasible, queue_full, tenant_quota).",
            ["model", "tenant", "reason"],
            registry=r,
        )
        self.tenant_fairness = Gauge(
            "ferry_tenant_fairness_ratio",
            "Jain's index over the active tenants' weighted service in the last minute: 1 when each got "
            "service in proportion to its weight, 1/n when one got all; absent with fewer than two tenants.",
            ["model"],
            registry=r,
            multiprocess_mode=MAX,
        )
        self.tenant_held_rows = Counter(
            "ferry_tenant_held_rows_total",
            "Running rows left out of a decode step because their tenant was ahead of its fair share "
            "(fair_hold_margin; KV in blocks): one per row per step, so that the others' steps came sooner.",
            ["model"],
            registry=r,
        )
        self.tenant_labels = TenantLabels()
        self._tenant_depths: dict[str, set[str]] = {}
        # Knobs: a gauge per setting declared with gauge=True (batcher/settings.py).
        self.setting_gauges = {
            k.name: (k, Gauge(k.gauge_name, _setting_help(k), ["model"], registry=r, multiprocess_mode=MAX))
            for k in knobs(BatchingSettings)
            if k.gauge
        }
        self.config_changes = Counter(
            "ferry_config_changes_total", "Live batching-setting changes.", ["model"], registry=r
        )
        # Batch jobs (gateway/jobs): jobs in the store by status, lines finished by status.
        self.jobs = Gauge(
            "ferry_jobs", "Batch jobs in the store, by status.", ["status"], registry=r, multiprocess_mode=MAX
        )
        self.job_lines = Counter(
            "ferry_job_lines_total",
            "Batch-job lines finished, by status (cancelled/expired: never run).",
            ["status"],
            registry=r,
        )

    def publish_settings(self, model: str, s: BatchingSettings) -> None:
        self.init_model(model)
        for name, (knob, gauge) in self.setting_gauges.items():
            value = getattr(s, name)
            if value is not None:
                gauge.labels(model).set(value * knob.gauge_scale)
            else:  # a null setting (no default budget: no SLO line) has no series
                with contextlib.suppress(KeyError):
                    gauge.remove(model)

    def init_model(self, model: str) -> None:
        """Create the model's counters whose label values are known, at zero (idempotent)."""
        if model in self._initialised:
            return
        self._initialised.add(model)
        self.config_changes.labels(model)
        # What an endpoint picker reads of every model (docs/operations.md), there from the start.
        self.running.labels(model)
        self.kv_usage.labels(model)
        for reason in REJECTION_REASONS:
            self.rejections.labels(model, reason)
        for reason in DispatchReason:
            self.batches.labels(model, reason.value)
        for status in ITEM_STATUSES:
            self.items.labels(model, status)
        for stage in Stage:
            self.cancellations.labels(model, stage.value)
        for p in Priority:
            self.expired.labels(model, p.label)
            self.queue_depth.labels(model, p.label)
            for status in ("met", "missed"):
                self.slo.labels(model, p.label, status)

    # -- tenants -------------------------------------------------------------------
    def tenant_label(self, model: str, tenants: Tenants, name: str, now: float) -> str:
        return self.tenant_labels.label(model, tenants, name, now)

    def tenant_served(
        self, model: str, tenants: Tenants, name: str, input_tokens: int, output_tokens: int, now: float
    ) -> None:
        label = self.tenant_label(model, tenants, name, now)
        if input_tokens > 0:
            self.tenant_tokens.labels(model, label, "input").inc(input_tokens)
        if output_tokens > 0:
            self.tenant_tokens.labels(model, label, "output").inc(output_tokens)

    def tenant_refused(self, model: str, tenants: Tenants, name: str, reason: str, items: int, now: float) -> None:
        self.tenant_refusals.labels(model, self.tenant_label(model, tenants, name, now), reason).inc(items)

    def publish_tenants(self, model: str, tenants: Tenants, depths: dict[str, int], now: float) -> None:
        """Each tenant's queue depth (0 for those that had items before) and the fairness index."""
        by_label: dict[str, int] = {}
        for name, n in depths.items():
            label = self.tenant_label(model, tenants, name, now)
            by_label[label] = by_label.get(label, 0) + n
        shown = self._tenant_depths.setdefault(model, set())
        for label in shown - set(by_label):
            self.tenant_queue_depth.labels(model, label).set(0)
        for label, n in by_label.items():
            self.tenant_queue_depth.labels(model, label).set(n)
        shown |= set(by_label)
        index = tenants.jain(now)
        if index is None:
            with contextlib.suppress(KeyError):
                self.tenant_fairness.remove(model)
        else:
            self.tenant_fairness.labels(model).set(index)

    def set_first_token_slowdown(self, model: str, factors: dict[Priority, float]) -> None:
        for p, factor in factors.items():
            self.first_token_slowdown.labels(model, p.label).set(factor)

    def init_phases(self, model: str, *phases: str) -> None:
        """Create the engine-error counters of the phases a batcher runs, at zero."""
        for phase in phases:
            self.engine_errors.labels(model, phase)

    def init_prefix_cache(self, model: str) -> None:
        """Create a generation model's engine counters at zero (an engine without a
        prefix cache keeps its hits at 0)."""
        self.prefix_cache_queries.labels(model)
        self.prefix_cache_hits.labels(model)
        self.preemptions.labels(model)
        self.tenant_held_rows.labels(model)
        for counter in (self.spec_draft_tokens, self.spec_accepted_tokens, self.spec_steps):
            counter.labels(model)
