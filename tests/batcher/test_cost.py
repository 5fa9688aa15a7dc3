"""The cost model: fitted online, robust to the noise of a shared CPU."""

from __future__ import annotations

import numpy as np
import pytest

from batcher.cost import (
    MAX_PROMISE_SLOWDOWN,
    MAX_SLOWDOWN,
    MAX_TAIL,
    Calibration,
    CostModel,
    LinearCost,
    PackedChunkCost,
)


def test_fits_fixed_plus_per_token_from_observed_batches():
    fixed, per_token = 0.008, 0.0005  # what the observed batches really cost
    m = CostModel(LinearCost(0.05, 0.0, 0.0))
    rng = np.random.default_rng(0)
    for _ in range(64):
        n = int(rng.integers(1, 33))
        tokens = n * int(rng.integers(12, 20))
        m.observe(n, tokens, fixed + per_token * tokens)
    assert m.params.fixed == pytest.approx(fixed, rel=1e-6)
    assert m.params.per_token == pytest.approx(per_token, rel=1e-6)
    assert m.predict(16, 16 * 15) == pytest.approx(fixed + per_token * 16 * 15)


def _like_lengths(rng: np.random.Generator, k: int) -> list[tuple[int, int, int]]:
    """(rows, longest row, padded tokens) of batches of like lengths within 2,048 tokens."""
    out = []
    for _ in range(k):
        longest = int(rng.integers(8, 257))
        n = int(rng.integers(1, max(1, 2048 // longest) + 1))
        out.append((n, longest, n * longest))
    return out


def test_a_quadratic_fit_learns_that_attention_grows_with_length_squared():
    """Batches whose rows cost more per token the longer they are (attention): the
    quadratic fit finds the term and predicts long and short batches alike; a line through
    them misses both."""
    fixed, per_token, per_token_row = 0.004, 0.0002, 2e-7
    rng = np.random.default_rng(2)
    quad, line = CostModel(quadratic=True), CostModel()
    for n, longest, tokens in _like_lengths(rng, 128):
        seconds = fixed + per_token * tokens + per_token_row * n * longest * longest
        quad.observe(n, tokens, seconds)
        line.observe(n, tokens, seconds)
    assert quad.params.per_token_row == pytest.approx(per_token_row, rel=1e-3)
    assert quad.params.fixed == pytest.approx(fixed, rel=1e-3)
    for n, longest in ((8, 250), (64, 16), (1, 12)):
        want = fixed + per_token * n * longest + per_token_row * n * longest * longest
        assert quad.predict(n, n * longest) == pytest.approx(want, rel=1e-3)
    errors = [
        abs(line.predict(n, n * L) / (fixed + per_token * n * L + per_token_row * n * L * L) - 1)
        for n, L in ((8, 250), (64, 16), (1, 12))
    ]
    assert max(errors) > 0.1


def test_a_quadratic_fit_keeps_the_line_where_the_square_does_not_pay():
    """Costs linear in tokens, or batches of one length (the square then collinear with
    tokens): the fit stays the line, per_token_row 0."""
    rng = np.random.default_rng(3)
    linear, one_length = CostModel(quadratic=True), CostModel(quadratic=True)
    for n, _longest, tokens in _like_lengths(rng, 64):
        linear.observe(n, tokens, 0.005 + 0.0003 * tokens * (1 + 0.01 * rng.standard_normal()))
        one_length.observe(n, n * 20, 0.005 + 0.0003 * n * 20 + 2e-7 * n * 400)
    assert linear.params.per_token_row == 0.0
    assert linear.params.per_token == pytest.approx(0.0003, rel=0.05)
    assert one_length.params.per_token_row == 0.0
    assert one_length.predict(10, 200) == pytest.approx(0.005 + 0.0003 * 200 + 2e-7 * 4000, rel=1e-6)


def test_outliers_from_contention_do_not_distort_the_fit():
    fixed, per_item = 0.010, 0.002  # what the observed batches cost when undisturbed
    m = CostModel()
    rng = np.random.default_rng(1)
    for k in range(128):
        n = int(rng.integers(1, 33))
        slow = 8.0 if k % 10 == 0 else 1.0  # one batch in ten hit by a busy neighbour
        m.observe(n, 0, (fixed + per_item * n) * slow)
    assert m.params.fixed == pytest.approx(fixed, rel=0.05)
    assert m.params.per_item == pytest.approx(per_item, rel=0.05)


def test_relative_error_of_the_prior_prediction_is_reported():
    m = CostModel(LinearCost(0.010, 0.0, 0.0))
    assert m.observe(4, 0, 0.020) == pytest.approx(0.5)  # predicted 10 ms, took 20: off by half the time taken


def test_coefficients_stay_non_negative():
    m = CostModel()
    for n in range(1, 20):
        m.observe(n, 0, 0.05 - 0.001 * n)  # nonsense: bigger batches faster
    assert m.params.fixed >= 0 and m.params.per_item >= 0


def test_slowdown_is_the_90th_percentile_of_observed_over_predicted_and_bounded():
    m = CostModel(LinearCost(0.010, 0.0, 0.0), refit_every=10**9)
    assert m.slowdown == 1.0
    for i in range(100):  # 80 batches on time, 20 taking 1.3x what was predicted
        m.observe(1, 0, 0.013 if i % 5 == 0 else 0.010)
    m.refit()  # the fit moves with the slow batches too; the slowdown was measured before it
    assert m.slowdown == pytest.approx(1.3)
    faster = CostModel(LinearCost(0.010, 0.0, 0.0), refit_every=10**9)
    for _ in range(10):
        faster.observe(1, 0, 0.005)
    faster.refit()
    assert faster.slowdown == 1.0  # never below 1: batches that run fast promise nothing more
    stalled = CostModel(LinearCost(0.010, 0.0, 0.0), refit_every=10**9)
    for _ in range(10):
        stalled.observe(1, 0, 0.100)
    stalled.refit()
    assert stalled.slowdown == MAX_SLOWDOWN  # bounded (1.5), though these ran 10x slower


def test_tail_is_the_99th_percentile_never_below_the_slowdown_and_bounded():
    m = CostModel(LinearCost(0.010, 0.0, 0.0), refit_every=10**9)
    assert m.tail == 1.0
    for i in range(200):  # 3 batches in 200 take 1.8x, 1 in 10 1.2x
        m.observe(1, 0, 0.018 if i in (0, 70, 140) else 0.012 if i % 10 == 5 else 0.010)
    m.refit()
    assert m.slowdown == pytest.approx(1.2)
    assert m.tail == pytest.approx(1.8)
    stalled = CostModel(LinearCost(0.010, 0.0, 0.0), refit_every=10**9)
    for _ in range(10):
        stalled.observe(1, 0, 0.100)
    stalled.refit()
    assert stalled.tail == MAX_TAIL  # bounded (2), though these ran 10x slower
    steady = CostModel(LinearCost(0.010, 0.0, 0.0), refit_every=10**9)
    for _ in range(50):
        steady.observe(1, 0, 0.013)
    steady.refit()
    assert steady.tail == steady.slowdown == pytest.approx(1.3)


def test_a_warm_up_seed_fits_without_judging_the_prior():
    m = CostModel(LinearCost(0.001, 0.0, 0.0))  # a prior ten times too fast
    m.seed([(1, 10, 0.012), (4, 40, 0.018), (16, 160, 0.042)])
    assert m.predict(4, 40) == pytest.approx(0.018, rel=0.01)
    assert m.slowdown == 1.0


def test_a_calibration_is_the_90th_percentile_of_observed_over_predicted_bounded_and_deaf_to_tiny_predictions():
    c = Calibration(refresh_every=1)
    assert c.factor == 1.0
    for i in range(100):  # 80 on time, 20 coming 1.2x as late as predicted
        c.observe(0.100, 0.120 if i % 5 == 0 else 0.100)
    assert c.factor == pytest.approx(1.2)
    for _ in range(256):  # a window later: early ones promise nothing sooner
        c.observe(0.100, 0.050)
    assert c.factor == 1.0
    for _ in range(256):  # twice as late (chat at twice its capacity): past the cost models' cap
        c.observe(0.100, 0.200)
    assert c.factor == pytest.approx(2.0) and c.factor > MAX_SLOWDOWN
    for _ in range(256):
        c.observe(0.100, 1.0)
    assert c.factor == MAX_PROMISE_SLOWDOWN  # bounded (4), though these came 10x late
    deaf = Calibration(refresh_every=1)
    for _ in range(50):  # a 5 ms prediction that took 15: fixed costs the deadline margin covers
        deaf.observe(0.005, 0.015)
    assert deaf.factor == 1.0


def test_a_promise_tightens_as_soon_as_first_tokens_come_late_and_relaxes_as_the_window_forgets():
    """A load step: 256 first tokens on time, then 8 twice as late as predicted. Over the
    whole window they are 3%, under its 90th percentile; over the last 64 judged, 12.5%:
    the promise stretches at once (the first seconds after a rate doubles are when admitted
    requests came late). 64 on time later the recent ones are clean, and the window's 3%
    no longer stretches it."""
    c = Calibration(refresh_every=1)
    for _ in range(256):
        c.observe(0.100, 0.100)
    for _ in range(8):
        c.observe(0.100, 0.200)
    assert c.factor == pytest.approx(2.0)
    assert c.factor_for(0.1) == pytest.approx(2.0)
    for _ in range(64):
        c.observe(0.100, 0.100)
    assert c.factor == 1.0 and c.factor_for(0.1) == 1.0


def test_a_prediction_is_stretched_by_what_predictions_like_it_missed_by():
    """First tokens late by a fixed 100 ms beyond short (50 ms) and long (400 ms)
    predictions: the short ones' ratio (3x) is their own; a long prediction is stretched by
    the long ones' (1.25x), not by the 3x that one factor over all would give it. Too few
    predictions alike: the factor over all."""
    c = Calibration(refresh_every=1)
    for i in range(200):
        predicted = 0.05 if i % 2 else 0.4
        c.observe(predicted, predicted + 0.1)
    assert c.factor == pytest.approx(3.0)
    assert c.factor_for(0.05) == pytest.approx(3.0)
    assert c.factor_for(0.4) == pytest.approx(1.25)
    assert c.factor_for(0.3) == pytest.approx(1.25)  # within a factor 2 of 0.4, not of 0.05
    assert c.factor_for(5.0) == c.factor  # none alike: the factor over all


def test_what_chunks_add_to_a_packed_step_is_measured_apart_from_the_prefill_model():
    chunks = PackedChunkCost(min_seen=8, refresh_every=1)
    assert chunks.predict(40) is None
    # Short chat prompts, alike: each step 45 ms longer than its rows alone, 40-48 tokens each.
    for i in range(8):
        chunks.observe(0.120 + 0.045, 0.120, 40 + i, per_token=0.0005)
    _fixed, per_token = chunks.params
    assert per_token == 0.0005  # the tokens do not spread: the prefill model's per-token cost
    assert chunks.predict(44) == pytest.approx(0.045, abs=0.003)  # the rest is a fixed part
    # A prefill model that prices a token above what whole chunks add is not believed.
    cheap = PackedChunkCost(min_seen=8, refresh_every=1)
    for _ in range(8):
        cheap.observe(0.104, 0.100, 3, per_token=0.010)
    assert cheap.predict(3) == pytest.approx(0.004)
    # Chunks that spread: a line through them.
    spread = PackedChunkCost(min_seen=8, refresh_every=1)
    for tokens in range(16, 512, 24):
        spread.observe(0.100 + 0.020 + 0.001 * tokens, 0.100, tokens, per_token=0.005)
    assert spread.params == pytest.approx((0.020, 0.001))
    assert spread.predict(0) is not None and spread.predict(1000) == pytest.approx(1.020)
