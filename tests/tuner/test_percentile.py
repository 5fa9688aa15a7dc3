"""One percentile definition (nearest rank) for the tuner and the benchmarks."""

from __future__ import annotations

import math

import pytest

from loadtests.openloop import Sample, summarise
from tuner.percentile import percentile


@pytest.mark.parametrize(
    "values, q, expected",
    [
        (list(range(1, 101)), 99, 99),
        (list(range(1, 101)), 50, 50),
        ([10, 20, 30, 40], 50, 20),  # an observed value: interpolation would say 25
        ([40, 10, 30, 20], 75, 30),  # order does not matter
        ([10, 20, 30, 40], 100, 40),
        ([10, 20, 30, 40], 0, 10),
        ([7.5], 99, 7.5),
    ],
)
def test_nearest_rank(values, q, expected):
    assert percentile(values, q) == expected


def test_no_values_is_nan():
    assert math.isnan(percentile([], 99))


def test_the_benchmarks_summarise_with_it():
    samples = [Sample(sent=i, latency=ms / 1000, status=200) for i, ms in enumerate([10, 20, 30, 40])]
    s = summarise(samples, duration=4)
    assert s["p50_ms"] == pytest.approx(20) and s["p99_ms"] == pytest.approx(40)
