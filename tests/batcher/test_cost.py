"""The cost model: fitted online, robust to the noise of a shared CPU."""
from __future__ import annotations

import numpy as np
import pytest

from batcher.cost import CostModel, LinearCost


def test_fits_fixed_plus_per_token_from_observed_batches():
    m = CostModel(LinearCost(0.05, 0.0, 0.0))
    rng = np.random.default_rng(0)
    for _ in range(64):
        n = int(rng.integers(1, 33))
        tokens = n * int(rng.integers(12, 20))
        m.observe(n, tokens, 0.008 + 0.0005 * tokens)
    assert m.params.fixed == pytest.approx(0.008, rel=1e-6)
    assert m.params.per_token == pytest.approx(0.0005, rel=1e-6)
    assert m.predict(16, 16 * 15) == pytest.approx(0.008 + 0.0005 * 240)


def test_outliers_from_contention_do_not_distort_the_fit():
    m = CostModel()
    rng = np.random.default_rng(1)
    for k in range(128):
        n = int(rng.integers(1, 33))
        slow = 8.0 if k % 10 == 0 else 1.0  # one batch in ten hit by a busy neighbour
        m.observe(n, 0, (0.010 + 0.002 * n) * slow)
    assert m.params.fixed == pytest.approx(0.010, rel=0.05)
    assert m.params.per_item == pytest.approx(0.002, rel=0.05)


def test_relative_error_of_the_prior_prediction_is_reported():
    m = CostModel(LinearCost(0.010, 0.0, 0.0))
    assert m.observe(4, 0, 0.020) == pytest.approx(0.5)


def test_coefficients_stay_non_negative():
    m = CostModel()
    for n in range(1, 20):
        m.observe(n, 0, 0.05 - 0.001 * n)  # nonsense: bigger batches faster
    assert m.params.fixed >= 0 and m.params.per_item >= 0
