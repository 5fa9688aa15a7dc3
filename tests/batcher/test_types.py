"""The batcher's shared vocabulary."""

from __future__ import annotations

from batcher.types import TokenCount


def test_token_count_is_real_tokens_and_tokens_padded_to_the_longest():
    tokens = TokenCount.of([3, 5])
    assert (tokens.real, tokens.padded) == (8, 10)
    assert tokens.padding_ratio == 1 - 8 / 10
    assert TokenCount.of([4, 4]).padding_ratio == 0.0
    assert TokenCount.of([]) == TokenCount(0, 0) and TokenCount.of([]).padding_ratio == 0.0
