"""gateway/cores/restarts.py: restarts bounded within a window, each after a doubling backoff."""

from __future__ import annotations

from gateway.cores.restarts import MAX_RESTARTS, RESTART_BACKOFF_S, RESTART_WINDOW_S, RestartWindow


def test_restarts_are_allowed_up_to_the_bound_each_after_twice_the_wait() -> None:
    window = RestartWindow()
    delays = []
    for now in range(MAX_RESTARTS):
        assert window.allows(float(now))
        delays.append(window.begin(float(now)))
    assert delays == [RESTART_BACKOFF_S * 2**i for i in range(MAX_RESTARTS)]
    assert not window.allows(float(MAX_RESTARTS)) and len(window) == MAX_RESTARTS


def test_restarts_older_than_the_window_no_longer_count() -> None:
    window = RestartWindow()
    for now in range(MAX_RESTARTS):
        window.allows(float(now))
        window.begin(float(now))
    later = RESTART_WINDOW_S + 0.5  # past the first restart's window only
    assert window.allows(later) and len(window) == MAX_RESTARTS - 1
    assert window.begin(later) == RESTART_BACKOFF_S * 2 ** (MAX_RESTARTS - 1)
