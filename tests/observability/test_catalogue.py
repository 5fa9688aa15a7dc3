"""The metric catalogue and grafana/ agree: every name a panel or alert uses exists in
batcher/metrics.py or gateway/metrics/registry.py, every metric there is drawn by a panel, and the names follow the
conventions. Also the static shape of the dashboard, provisioning and scrape config."""

from __future__ import annotations

import re

import pytest
import yaml
from prometheus_client import CollectorRegistry

from batcher.metrics import Metrics
from gateway.metrics.registry import GatewayMetrics

from .artifacts import (
    ALLOWED_LABELS,
    GRAFANA,
    PROMETHEUS_CONFIG,
    Query,
    alert_queries,
    all_panels,
    base_name,
    catalogue,
    dashboard_queries,
    every_query,
    load_alerts,
    load_dashboard,
    metric_names,
    panel_queries,
    sides_to_evaluate,
    split_comparison,
    substitute,
)


def test_every_name_used_in_grafana_exists_in_the_metrics_modules():
    known = catalogue()
    unknown = {}
    for q in every_query():
        for name in metric_names(q.expr):
            if base_name(name, known) not in known:
                unknown.setdefault(name, []).append(q.where)
    assert not unknown, f"names used in grafana/ but not defined in batcher/ or gateway/metrics/registry.py: {unknown}"


def test_every_metric_in_the_modules_is_drawn_by_a_panel():
    known = catalogue()
    drawn = {base_name(n, known) for q in panel_queries(load_dashboard()) for n in metric_names(q.expr)}
    assert not set(known) - drawn, f"metrics no panel uses: {sorted(set(known) - drawn)}"


def test_names_units_and_labels_follow_the_conventions():
    name = re.compile(r"^ferry_[a-z0-9_]+$")
    for family in GatewayMetrics(CollectorRegistry()).registry.collect():
        exposed = family.name + "_total" if family.type == "counter" else family.name
        assert name.match(exposed), exposed
        # Base units only: durations in seconds, never milliseconds.
        assert not re.search(r"_(ms|milliseconds|micros|minutes)(_|$)", exposed), exposed
        if family.type == "histogram":
            assert re.search(r"_(seconds|items|tokens|ratio)$", exposed), exposed
        if family.type == "counter":
            assert exposed.endswith("_total")
        else:
            assert not exposed.endswith("_total"), exposed
    m = GatewayMetrics(CollectorRegistry())
    for attr, metric in vars(m).items():
        labels = getattr(metric, "_labelnames", None)
        if labels is not None:
            assert set(labels) <= ALLOWED_LABELS, (attr, labels)


def test_the_batcher_metrics_know_nothing_of_http():
    batcher = Metrics(CollectorRegistry())
    labels = {label for metric in vars(batcher).values() for label in getattr(metric, "_labelnames", ())}
    assert "route" not in labels
    http = {f.name for f in GatewayMetrics(CollectorRegistry()).registry.collect()} - {
        f.name for f in batcher.registry.collect()
    }
    server = {"ferry_engine_core_restarts"}  # counted by the server, which watches its engine cores
    assert http == {"ferry_requests", "ferry_request_duration_seconds", "ferry_requests_in_flight"} | server


def test_histogram_suffixes_map_to_their_histogram_only():
    known = catalogue()
    assert base_name("ferry_batch_size_items_bucket", known) == "ferry_batch_size_items"
    assert base_name("ferry_queue_wait_seconds_count", known) == "ferry_queue_wait_seconds"
    # A counter named ..._count would not be mistaken for a histogram series.
    assert base_name("ferry_requests_total_count", known) == "ferry_requests_total_count"
    assert metric_names('rate(ferry_x_total{reason="ferry_not_a_name"}[1m])') == {"ferry_x_total"}


@pytest.mark.parametrize(
    "expr, sides",
    [
        ("sum(rate(ferry_a_total[5m])) > 0", ["sum(rate(ferry_a_total[5m]))"]),
        ('a{x=~"b|c", y!="d"} / on (model) group_left b > bool 0.8', ['a{x=~"b|c", y!="d"} / on (model) group_left b']),
        (
            "histogram_quantile(0.99, x) > on (model) max by (model) (y)",
            ["histogram_quantile(0.99, x)", "max by (model) (y)"],
        ),
        ("sum by (le) (rate(z[1m]))", ["sum by (le) (rate(z[1m]))"]),
    ],
)
def test_comparison_split(expr, sides):
    assert sides_to_evaluate(expr) == sides


def test_alert_rules_cover_the_required_conditions():
    rules = {r["alert"]: r for g in load_alerts()["groups"] for r in g["rules"]}
    assert set(rules) == {
        "FerryLatencyP99OverSLO",
        "FerryHighRejectionRate",
        "FerryQueueSaturated",
        "FerryEngineErrors",
        "FerryDeadlineMisses",
        "FerryKvCacheFull",
    }
    needs = {
        "FerryLatencyP99OverSLO": "ferry_request_duration_seconds_bucket",
        "FerryHighRejectionRate": "ferry_rejections_total",
        "FerryQueueSaturated": "ferry_queue_depth",
        "FerryEngineErrors": "ferry_engine_errors_total",
        "FerryDeadlineMisses": "ferry_slo_total",
        "FerryKvCacheFull": "ferry_kv_cache_usage_ratio",
    }
    for name, metric in needs.items():
        assert metric in rules[name]["expr"], name
        assert split_comparison(rules[name]["expr"]) is not None, f"{name} is not a threshold condition"
        assert rules[name]["annotations"]["summary"] and rules[name]["labels"]["severity"]
    assert len(alert_queries(load_alerts())) == len(rules)


def test_dashboard_has_variables_rows_and_setting_change_annotations():
    d = load_dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["includeAll"] and variables["model"]["multi"]
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == [
        "Traffic",
        "Latency vs SLO",
        "Batching",
        "Queue",
        "Generation",
        "Knobs",
        "Batch jobs",
        "Tenants",
        "Speculation",
    ]
    notes = [a for a in d["annotations"]["list"] if a.get("expr")]
    assert any("ferry_config_changes_total" in a["expr"] for a in notes)
    for p in all_panels(d):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p.get("description"), f"panel {p['title']!r} needs a description for operators"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            # Every per-model series is filtered by the model variable.
            # ferry_requests_in_flight is labelled by route only; batch jobs span models.
            if not any(m in t["expr"] for m in ("ferry_requests_in_flight", "ferry_jobs", "ferry_job_lines_total")):
                assert "$model" in t["expr"], (p["title"], t["expr"])
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids))


def test_substitution_leaves_no_template_variables():
    for q in dashboard_queries():
        assert "$" not in substitute(q.expr, "a|b"), q


def test_provisioning_and_scrape_config():
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    assert ds["datasources"][0]["jsonData"]["timeInterval"] == "1s"
    prov = yaml.safe_load((GRAFANA / "provisioning/dashboards/ferry.yml").read_text())
    assert prov["providers"][0]["type"] == "file"
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "ferry")
    assert job["scrape_interval"] == "1s"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert cfg["rule_files"] == ["alerts.yml"]


def test_query_list_is_complete():
    qs = every_query()
    assert all(isinstance(q, Query) and q.expr.strip() for q in qs)
    assert len(panel_queries(load_dashboard())) >= 30
