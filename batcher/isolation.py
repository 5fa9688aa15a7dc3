"""One bad input fails alone.

A call over several inputs that raises is retried on each half of them, recursively,
until the input that fails by itself is found; its exception takes its place among the
results and its batch mates get theirs. Used for an embeddings batch that runs out of
memory (gateway/models/start.py) and for a generation prefill group that fails
(batcher/scheduler.py). Runs on the engine's worker thread: the retries are engine calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def split_in_halves(
    run: Callable[[list[T]], Sequence[R]],
    items: list[T],
    *,
    retry_if: Callable[[Exception], bool] = lambda exc: True,
    after_failure: Callable[[list[T]], None] | None = None,
) -> list[R | Exception]:
    """`run(items)`, one result per item in order; if it raises an exception `retry_if`
    accepts, `after_failure(items)` undoes what the failed call may have left behind and
    each half is run the same way. Other exceptions propagate and fail every item."""
    try:
        results: list[R | Exception] = list(run(items))
    except Exception as exc:
        if not retry_if(exc):
            raise
        if after_failure is not None:
            after_failure(items)
        if len(items) == 1:
            return [exc]
        mid = (len(items) + 1) // 2
        first = split_in_halves(run, items[:mid], retry_if=retry_if, after_failure=after_failure)
        return first + split_in_halves(run, items[mid:], retry_if=retry_if, after_failure=after_failure)
    if len(results) != len(items):
        raise RuntimeError(f"engine returned {len(results)} results for {len(items)} inputs")
    return results
