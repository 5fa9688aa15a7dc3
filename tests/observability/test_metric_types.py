"""Metric children cached by label values (batcher/metric_types.py) count exactly what
prometheus-client's own would, and a removed series starts afresh."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from batcher.metric_types import Counter, Gauge, Histogram


def test_cached_children_are_the_same_series_whatever_the_call():
    r = CollectorRegistry()
    c = Counter("t_requests_total", "t", ["route", "status"], registry=r)
    c.labels("/a", "200").inc()
    c.labels("/a", "200").inc(2)
    c.labels(route="/a", status="200").inc()  # by name: the same child
    c.labels("/a", "500").inc()
    assert r.get_sample_value("t_requests_total", {"route": "/a", "status": "200"}) == 4
    assert r.get_sample_value("t_requests_total", {"route": "/a", "status": "500"}) == 1
    h = Histogram("t_seconds", "t", ["route"], buckets=(0.1, 1.0), registry=r)
    h.labels("/a").observe(0.05)
    h.labels("/a").observe(0.5)
    assert r.get_sample_value("t_seconds_count", {"route": "/a"}) == 2
    assert r.get_sample_value("t_seconds_bucket", {"route": "/a", "le": "0.1"}) == 1


def test_a_removed_or_cleared_series_is_made_afresh():
    r = CollectorRegistry()
    g = Gauge("t_setting", "t", ["model"], registry=r)
    g.labels("m").set(5)
    g.remove("m")
    assert r.get_sample_value("t_setting", {"model": "m"}) is None
    g.labels("m").set(7)
    assert r.get_sample_value("t_setting", {"model": "m"}) == 7
    g.clear()
    assert r.get_sample_value("t_setting", {"model": "m"}) is None
    g.labels("m").inc()
    assert r.get_sample_value("t_setting", {"model": "m"}) == 1
