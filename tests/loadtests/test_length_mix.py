"""loadtests/length_mix.py and loadtests/vllm_pooling.py: their pure helpers (no model, no server)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from loadtests.length_mix import (
    LONG_WORDS,
    MAX_WORDS,
    MEDIAN_WORDS,
    P90_TOKENS,
    SHORT_WORDS,
    SPECIAL_TOKENS,
    WORDS,
    cosine,
    make_texts,
    padded_tokens,
    padding_share,
    plan_batches,
    token_stats,
    word_count,
)
from loadtests.vllm_pooling import command
from tuner.percentile import percentile


def test_texts_are_seeded_and_differ_by_seed_and_distribution():
    assert make_texts("longtail", 50, seed=3) == make_texts("longtail", 50, seed=3)
    assert make_texts("longtail", 50, seed=3) != make_texts("longtail", 50, seed=4)
    assert make_texts("longtail", 50) != make_texts("bimodal", 50)
    assert all(w in WORDS for t in make_texts("bimodal", 20) for w in t.lower().split())


def test_longtail_word_counts_have_the_median_p90_and_cap_asked_for():
    rng = random.Random(1)
    counts = [word_count(rng, "longtail") for _ in range(20_000)]
    assert min(counts) >= 1 and max(counts) <= MAX_WORDS
    assert abs(percentile(counts, 50) - MEDIAN_WORDS) <= 1
    assert abs(percentile(counts, 90) + SPECIAL_TOKENS - P90_TOKENS) <= 3  # one token per word


def test_bimodal_is_half_queries_half_passages():
    rng = random.Random(2)
    counts = [word_count(rng, "bimodal") for _ in range(4000)]
    short = [c for c in counts if c <= SHORT_WORDS[1]]
    assert all(SHORT_WORDS[0] <= c <= SHORT_WORDS[1] for c in short)
    assert all(LONG_WORDS[0] <= c <= LONG_WORDS[1] for c in counts if c > SHORT_WORDS[1])
    assert 0.45 < len(short) / len(counts) < 0.55


def test_unknown_distribution_is_refused():
    with pytest.raises(ValueError, match="unknown distribution"):
        word_count(random.Random(0), "uniform")


def test_arrival_and_sorted_batches_keep_every_item_once():
    lengths = [5, 200, 7, 9, 150, 6, 8]
    arrival = plan_batches(lengths, "arrival", size=3)
    assert arrival == [[0, 1, 2], [3, 4, 5], [6]]
    ordered = plan_batches(lengths, "sorted", size=3)
    assert [[lengths[i] for i in b] for b in ordered] == [[5, 6, 7], [8, 9, 150], [200]]
    with pytest.raises(ValueError, match="unknown plan"):
        plan_batches(lengths, "random")


def test_budget_batches_stay_within_the_padded_token_budget():
    rng = random.Random(4)
    lengths = [rng.randint(3, 300) for _ in range(500)]
    batches = plan_batches(lengths, "budget", budget=2048)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) * longest <= 2048 or len(b) == 1
    # cut as late as the budget allows: the next item would not have fitted
    for b, nxt in itertools.pairwise(batches):
        assert (len(b) + 1) * lengths[nxt[0]] > 2048
    assert plan_batches([3000, 10], "budget", budget=2048) == [[1], [0]]  # too long: alone
    assert plan_batches([], "budget") == []


def test_padding_counts_rows_times_longest_row():
    lengths = [4, 10, 6]
    real, padded = padded_tokens(lengths, [[0, 1], [2]])
    assert (real, padded) == (20, 2 * 10 + 6)
    assert padding_share(real, padded) == pytest.approx(6 / 26)
    assert padding_share(0, 0) == 0.0
    sorted_real, sorted_padded = padded_tokens(lengths, plan_batches(lengths, "sorted", size=2))
    assert sorted_real == real and sorted_padded == 2 * 6 + 10


def test_token_stats_and_cosine():
    st = token_stats([10, 20, 30, 40, 100])
    assert (st["p50"], st["p90"], st["max"], st["mean"]) == (30, 100, 100, 40)
    assert cosine([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 3.0]) == pytest.approx(0.0)
    assert math.isclose(cosine([0.0], [0.0]), 0.0)


def test_vllm_command_selects_the_pooling_runner_and_the_served_name():
    cmd = command("/venv/bin/python", "/models/minilm", "served/name", 8123, "--max-num-seqs", "64")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--runner") + 1] == "pooling"
    assert cmd[cmd.index("--served-model-name") + 1] == "served/name"
    assert cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[-2:] == ["--max-num-seqs", "64"]
