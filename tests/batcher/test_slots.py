"""How long a running sequence holds its slot (batcher/slots.py, `Lengths`): its token limit
until finished sequences show that most end earlier, then where those end."""

from __future__ import annotations

import pytest

from batcher.slots import LENGTHS_SEEN, Lengths


def test_the_limit_stands_until_enough_sequences_ended_early():
    lengths = Lengths()
    for _ in range(LENGTHS_SEEN - 1):
        lengths.add(20, 200)
    assert not lengths.known and lengths.steps_left(200, 0) == 200 and lengths.typical(200.0) == 200.0
    lengths.add(20, 200)
    assert lengths.known
    assert lengths.steps_left(200, 0) == 20  # every answer 20 tokens: no spread
    assert lengths.steps_left(200, 15) == 5
    assert lengths.steps_left(200, 40) == 5  # past where answers end: a quarter of a typical answer more
    assert lengths.steps_left(10, 0) == 10  # never beyond the limit
    assert lengths.typical(200.0) == pytest.approx(20.0)


def test_sequences_that_run_to_their_limit_keep_the_limits():
    lengths = Lengths()
    for _ in range(3 * LENGTHS_SEEN):
        lengths.add(64, 64)  # ignore_eos, or answers cut at max_tokens
    assert not lengths.known and lengths.steps_left(1000, 10) == 990


def test_a_spread_of_lengths_is_allowed_for_and_a_mix_weighs_the_limit():
    lengths = Lengths()
    for n in [10, 30] * LENGTHS_SEEN:
        lengths.add(n, 500)
    assert lengths.mean == pytest.approx(20.0, abs=1.0)
    assert lengths.steps_left(500, 0) == pytest.approx(30, abs=2)  # the mean plus one spread
    for _ in range(LENGTHS_SEEN):
        lengths.add(100, 100)  # a third run to their limit
    assert lengths.known and 0.5 < lengths.early_share < 1.0
    share = lengths.early_share
    assert lengths.typical(100.0) == pytest.approx(share * lengths.mean + (1 - share) * 100.0)


def test_a_tokens_interval_is_the_steps_over_the_tokens_it_gave():
    """Speculation: a step that gave its rows two tokens each (drafts taken) was two
    tokens' time, not one's: the measured interval a running sequence waits per token
    (`Slots.load` never predicts a token sooner) is half the gap between the steps."""
    from batcher.running import RunningSet
    from batcher.slots import Slots

    slots = Slots(object(), RunningSet())
    slots.decode_step(0.0)
    slots.decode_step(0.100)
    assert slots._token_interval == pytest.approx(0.100)
    slots.pause()
    slots.decode_step(1.0)
    slots.decode_step(1.100, tokens=2.0)
    assert slots._token_interval == pytest.approx(0.095)  # the moving average, 10% toward 0.05
