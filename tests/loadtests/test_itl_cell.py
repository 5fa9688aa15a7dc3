"""loadtests/itl_cell.py: its pure helpers (no server)."""

from __future__ import annotations

import random

import pytest

from loadtests.itl_cell import LONG_PROMPT_CHARS, gaps_ms, long_prompt, split_phases, with_flag


def test_gaps_skip_the_wait_for_the_first_delta_and_stamp_the_later_one():
    assert gaps_ms([]) == []
    assert gaps_ms([1.0]) == []
    gaps = gaps_ms([1.0, 1.010, 1.030])
    assert [t for t, _ in gaps] == [1.010, 1.030]
    assert [g for _, g in gaps] == pytest.approx([10.0, 20.0])


def test_a_gap_counts_in_the_phase_of_its_later_delta():
    gaps = [(0.5, 1.0), (1.0, 2.0), (1.9, 3.0), (2.0, 4.0), (2.9, 5.0), (3.0, 6.0)]
    assert split_phases(gaps, 1.0, 2.0, 3.0) == ([2.0, 3.0], [4.0, 5.0])


def test_long_prompts_have_their_length_and_never_repeat():
    rng = random.Random(0)
    prompts = [long_prompt(rng) for _ in range(20)]
    assert all(len(p) == LONG_PROMPT_CHARS for p in prompts)
    assert len({p[:32] for p in prompts}) == 20  # distinct from the first block on
    assert long_prompt(random.Random(5)) == long_prompt(random.Random(5))


def test_with_flag_replaces_or_appends():
    assert with_flag(["--a", "1", "--max-running", "128"], "--max-running", "64") == ["--a", "1", "--max-running", "64"]
    assert with_flag(["--a", "1"], "--max-running", "64") == ["--a", "1", "--max-running", "64"]
