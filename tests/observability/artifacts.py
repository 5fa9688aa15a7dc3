"""Read the queries out of grafana/: dashboard panels, annotations, variables, alert rules.

Shared by the catalogue test (names) and the Prometheus end-to-end test (evaluation).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from gateway.metrics.registry import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "ferry.json"
ALERTS = GRAFANA / "alerts.yml"
PROMETHEUS_CONFIG = GRAFANA / "prometheus.yml"

# `tenant` is bounded by the batcher (batcher/metrics.py: named tenants, the busiest others, `other`).
ALLOWED_LABELS = {"model", "route", "status", "reason", "phase", "class", "tenant", "kind"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_NAME = re.compile(r"\bferry_[a-zA-Z0-9_]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*$")
# Vector-matching modifiers that may follow a binary comparison operator.
_MODIFIER = re.compile(r"^\s*(bool\b|(on|ignoring|group_left|group_right)\b\s*(\([^)]*\))?)")


@dataclass(frozen=True)
class Query:
    where: str  # "panel 'Queue depth' A", "alert FerryEngineErrors", ...
    expr: str


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def load_alerts() -> dict:
    return yaml.safe_load(ALERTS.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside collapsed rows
    return out


def panel_queries(dashboard: dict) -> list[Query]:
    return [
        Query(f"panel {p['title']!r} {t.get('refId', '')}", t["expr"])
        for p in all_panels(dashboard)
        for t in p.get("targets", [])
        if t.get("expr")
    ]


def annotation_queries(dashboard: dict) -> list[Query]:
    return [Query(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if a.get("expr")]


def variable_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(variable name, metric selector, label) of each label_values(...) variable."""
    out = []
    for v in dashboard["templating"]["list"]:
        if v.get("type") != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = _LABEL_VALUES.match(q)
        assert m, f"variable {v['name']}: unsupported query {q!r}"
        out.append((v["name"], m.group(1), m.group(2)))
    return out


def alert_queries(alerts: dict) -> list[Query]:
    return [
        Query(f"alert {r.get('alert') or r.get('record')}", r["expr"]) for g in alerts["groups"] for r in g["rules"]
    ]


def dashboard_queries() -> list[Query]:
    d = load_dashboard()
    return (
        panel_queries(d)
        + annotation_queries(d)
        + [Query(f"variable ${name}", sel) for name, sel, _ in variable_queries(d)]
    )


def every_query() -> list[Query]:
    return dashboard_queries() + alert_queries(load_alerts())


def metric_names(expr: str) -> set[str]:
    """Names of ferry_ metrics in a PromQL expression (string literals ignored)."""
    return set(_NAME.findall(_STRING.sub('""', expr)))


def catalogue() -> dict[str, str]:
    """Exposed name -> type for every metric a gateway exports (counters with `_total`)."""
    out = {}
    for family in GatewayMetrics(CollectorRegistry()).registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = family.type
    return out


def base_name(name: str, known: dict[str, str]) -> str:
    """Map histogram series (`_bucket`, `_sum`, `_count`) to the histogram's name."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and known.get(name[: -len(suffix)]) == "histogram":
            return name[: -len(suffix)]
    return name


def substitute(expr: str, models: str, rate_interval: str = "1m", range_: str = "5m") -> str:
    """Fill Grafana's template variables the way Grafana would for one time range."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__range", range_)
        .replace("$__interval", "1s")
        .replace("${model}", models)
        .replace("$model", models)
    )


def split_comparison(expr: str) -> tuple[str, str, str] | None:
    """Split at the top-level comparison operator: (left, operator, right), or None.

    Comparisons bind loosest in PromQL, so an alert condition `A > on (model) B` or
    `A > 0.05` is split into its two sides; modifiers (`bool`, `on (...)`,
    `group_left`) are dropped from the right side so it evaluates alone.
    """
    masked = _STRING.sub(lambda m: "_" * len(m.group(0)), expr)
    depth, i, found = 0, 0, None
    while i < len(masked):
        c = masked[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            op = next((o for o in COMPARISONS if masked.startswith(o, i)), None)
            if op is not None and not masked.startswith("=~", i) and not masked.startswith("!~", i):
                found = (i, op)  # keep the last one: a > b > c parses as (a > b) > c
                i += len(op)
                continue
        i += 1
    if found is None:
        return None
    at, op = found
    right = expr[at + len(op) :]
    while (m := _MODIFIER.match(right)) and m.group(0).strip():
        right = right[m.end() :]
    return expr[:at].strip(), op, right.strip()


def is_number(expr: str) -> bool:
    try:
        float(expr)
        return True
    except ValueError:
        return False


def sides_to_evaluate(expr: str) -> list[str]:
    """What must return data for a query to be meaningful: the expression itself, or for a
    comparison (alert condition) each side that is not a plain threshold number."""
    parts = split_comparison(expr)
    if parts is None:
        return [expr]
    left, _, right = parts
    return [s for s in (left, right) if not is_number(s)]
