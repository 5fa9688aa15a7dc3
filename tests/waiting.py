"""Waiting for what another thread, task or process will do, in one place: every wait in
the suite is bounded and, when it gives up, says what never happened.

The bound is a limit on how long to keep looking, not a claim about speed: a wait that
succeeds returns as soon as the condition holds, so a generous bound costs nothing on a
fast machine and keeps a loaded one from failing spuriously.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# A description of what is awaited ("the first batch to reach the engine"), or a function
# that writes one when the wait gives up (to show the last state seen).
Message = str | Callable[[], str]

TIMEOUT = 30.0
INTERVAL = 0.02


def _give_up(message: Message, timeout: float) -> AssertionError:
    text = message() if callable(message) else message
    return AssertionError(f"gave up after {timeout:g} s waiting for {text}")


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = TIMEOUT,
    interval: float = INTERVAL,
    message: Message = "the condition",
) -> T:
    """Call `predicate` until it returns something truthy, and return that. After `timeout`
    seconds raise AssertionError naming `message`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _give_up(message, timeout)
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = TIMEOUT,
    interval: float = INTERVAL,
    message: Message = "the condition",
) -> T:
    """`wait_until` for a coroutine: sleeps with `asyncio.sleep`, so the event loop (and
    whatever the predicate waits for on it) keeps running."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _give_up(message, timeout)
        await asyncio.sleep(interval)
