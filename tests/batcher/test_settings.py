"""BatchingSettings: each knob declared once, validated at construction with a message that
names it; the policy names and the ferry_setting_* gauges follow the declaration."""

from __future__ import annotations

import math
from typing import get_args

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from batcher.knobs import SettingsError, knobs
from batcher.metrics import Metrics
from batcher.policy import GENERATION_POLICIES, POLICIES
from batcher.settings import BatchingSettings, PolicyName

KNOBS = {k.name: k for k in knobs(BatchingSettings)}


def test_defaults():
    s = BatchingSettings()
    assert (s.max_batch_size, s.max_wait_ms, s.max_queue, s.policy) == (32, 5.0, 1024, "adaptive")
    assert (s.default_budget_ms, s.deadline_margin_ms, s.aging_ms, s.on_infeasible) == (
        10_000.0,
        10.0,
        2_000.0,
        "reject",
    )
    assert s.interactive_first is True  # on by default since admission counts on the measured drain
    assert (s.budget_scope, s.max_itl_ms, s.max_running, s.prefill_token_budget, s.mode) == (
        "ttft",
        None,
        128,  # 64 before 2026-12-07: 128 closed-loop clients on the real model were half refused
        2048,
        "continuous",
    )
    assert (s.max_wait, s.margin) == (0.005, 0.010)
    assert list(s.to_dict()) == list(KNOBS)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("max_batch_size", 0, "must be an integer between 1 and 1000000"),
        ("max_batch_size", 1_000_001, "must be an integer between 1 and 1000000"),
        ("max_batch_size", True, "must be an integer between 1 and 1000000"),  # a bool is not a number
        ("max_batch_size", 2.0, "must be an integer between 1 and 1000000"),
        ("max_queue", "5", "must be an integer between 1 and 1000000"),  # nor is a string
        ("max_running", -1, "must be an integer between 1 and 1000000"),
        ("prefill_token_budget", 0, "must be an integer between 1 and 1000000"),
        ("max_wait_ms", -0.5, "must be a number of milliseconds between 0 and 3600000"),
        ("max_wait_ms", 3_600_000, "must be a number of milliseconds between 0 and 3600000"),
        ("max_wait_ms", math.nan, "must be a number of milliseconds between 0 and 3600000"),
        ("deadline_margin_ms", math.inf, "must be a number of milliseconds between 0 and 3600000"),
        ("aging_ms", False, "must be a number of milliseconds between 0 and 3600000"),
        ("default_budget_ms", 0, "must be null or a number of milliseconds above 0"),
        ("max_itl_ms", "fast", "must be null or a number of milliseconds above 0"),
        ("interactive_first", 1, "must be true or false"),
        ("policy", "random", "must be one of fixed, deadline, adaptive"),
        ("on_infeasible", "maybe", "must be one of reject, serve"),
        ("budget_scope", "tpot", "must be one of ttft, total"),
        ("mode", "dynamic", "must be one of continuous, static"),
        ("max_batch", 4, "unknown setting"),
    ],
)
def test_a_bad_value_fails_at_construction_naming_the_setting(name, value, message):
    with pytest.raises(SettingsError) as info:
        BatchingSettings(**{name: value})
    assert (info.value.field, info.value.message) == (name, message)
    assert str(info.value) == f"{name}: {message}"


def test_numbers_within_bounds_are_accepted():
    s = BatchingSettings(max_wait_ms=0, max_batch_size=1_000_000, default_budget_ms=None, max_itl_ms=0.5)
    assert (s.max_wait_ms, s.max_batch_size, s.default_budget_ms, s.max_itl_ms) == (0, 1_000_000, None, 0.5)


def test_updated_validates_and_refuses_unknown_names():
    s = BatchingSettings()
    assert s.updated(max_batch_size=4, policy="fixed").to_dict() == {
        **s.to_dict(),
        "max_batch_size": 4,
        "policy": "fixed",
    }
    with pytest.raises(SettingsError, match="max_wait_ms: must be"):
        s.updated(max_wait_ms=-1)
    with pytest.raises(SettingsError) as info:
        s.updated(max_batch=4)
    assert (info.value.field, info.value.message) == ("max_batch", "unknown setting")
    assert s == BatchingSettings()  # the original is unchanged


def test_settings_are_frozen():
    s = BatchingSettings()
    with pytest.raises(ValidationError, match="frozen"):
        s.max_batch_size = 4  # type: ignore[misc]
    assert s.max_batch_size == 32


def test_every_policy_name_has_a_dispatch_and_an_admission_policy():
    names = set(get_args(PolicyName))
    assert KNOBS["policy"].choices == get_args(PolicyName)
    assert set(POLICIES) == names == set(GENERATION_POLICIES)


def test_every_knob_is_fully_declared():
    for k in KNOBS.values():
        assert k.help, k.name
        assert k.requirement.startswith("must be"), k.name
        if k.name.endswith("_ms"):
            assert k.unit == "ms", k.name
        if k.nullable:
            assert k.null, f"{k.name}: say what null means"
    assert KNOBS["mode"].option == "batching"  # the flag --batching and env FERRY_BATCHING


def test_the_setting_gauges_are_the_declared_ones():
    m = Metrics(CollectorRegistry())
    exposed = {f.name for f in m.registry.collect() if f.name.startswith("ferry_setting_")}
    declared = {k.gauge_name for k in KNOBS.values() if k.gauge}
    # The names dashboards and alerts use (grafana/); a declaration must not rename them.
    assert (
        exposed
        == declared
        == {
            "ferry_setting_max_batch_size",
            "ferry_setting_max_wait_seconds",
            "ferry_setting_max_queue",
            "ferry_setting_default_budget_seconds",
        }
    )


def test_publish_settings_sets_the_gauges_in_base_units_and_drops_null_ones():
    m = Metrics(CollectorRegistry())

    def v(name: str) -> float | None:
        return m.registry.get_sample_value(name, {"model": "m"})

    m.publish_settings("m", BatchingSettings(max_batch_size=8, max_wait_ms=10, max_queue=6, default_budget_ms=250))
    assert (v("ferry_setting_max_batch_size"), v("ferry_setting_max_queue")) == (8, 6)
    assert v("ferry_setting_max_wait_seconds") == pytest.approx(0.010)
    assert v("ferry_setting_default_budget_seconds") == pytest.approx(0.250)
    m.publish_settings("m", BatchingSettings(default_budget_ms=None))
    assert v("ferry_setting_default_budget_seconds") is None  # no default budget: no SLO line
    assert v("ferry_setting_max_batch_size") == 32
