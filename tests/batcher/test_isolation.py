"""split_in_halves: a failing call is retried by halves until the input that fails alone
is found; only that input fails."""

from __future__ import annotations

import pytest

from batcher.isolation import split_in_halves


class Flaky:
    """Fails any call that contains a bad input; records every call."""

    def __init__(self, bad: set[int], error: type[Exception] = RuntimeError) -> None:
        self.bad, self.error = bad, error
        self.calls: list[list[int]] = []

    def __call__(self, items: list[int]) -> list[str]:
        self.calls.append(list(items))
        if self.bad & set(items):
            raise self.error(f"bad input among {items}")
        return [f"ok {i}" for i in items]


def test_one_bad_input_fails_alone_and_the_halves_are_retried_in_order():
    run = Flaky({5})
    results = split_in_halves(run, list(range(8)))
    assert [r if isinstance(r, str) else "error" for r in results] == [
        "ok 0",
        "ok 1",
        "ok 2",
        "ok 3",
        "ok 4",
        "error",
        "ok 6",
        "ok 7",
    ]
    assert isinstance(results[5], RuntimeError)
    assert run.calls == [list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], [4, 5], [4], [5], [6, 7]]


def test_several_bad_inputs_each_fail_alone_and_an_odd_group_splits_larger_half_first():
    run = Flaky({0, 4})
    results = split_in_halves(run, list(range(5)))
    assert [isinstance(r, Exception) for r in results] == [True, False, False, False, True]
    assert run.calls[1] == [0, 1, 2] and [3, 4] in run.calls  # depth first


def test_after_failure_sees_every_failed_group_before_its_halves_run():
    run, failed = Flaky({2}), []
    split_in_halves(run, [1, 2, 3], after_failure=lambda group: failed.append((list(group), len(run.calls))))
    assert failed == [([1, 2, 3], 1), ([1, 2], 2), ([2], 4)]


def test_an_error_retry_if_refuses_propagates_without_retrying():
    run = Flaky({1}, error=ValueError)
    with pytest.raises(ValueError):
        split_in_halves(run, [0, 1, 2], retry_if=lambda exc: isinstance(exc, MemoryError))
    assert run.calls == [[0, 1, 2]]


def test_a_refused_error_in_a_half_fails_the_whole_call():
    calls = []

    def run(items: list[int]) -> list[int]:
        calls.append(items)
        if len(items) > 2:
            raise MemoryError("too big")
        if 3 in items:
            raise ValueError("broken")
        return items

    with pytest.raises(ValueError):
        split_in_halves(run, [0, 1, 2, 3], retry_if=lambda exc: isinstance(exc, MemoryError))
    assert calls == [[0, 1, 2, 3], [0, 1], [2, 3]]


def test_a_result_count_that_does_not_match_the_inputs_is_an_error():
    with pytest.raises(RuntimeError, match="2 results for 3 inputs"):
        split_in_halves(lambda items: items[:2], [1, 2, 3])
