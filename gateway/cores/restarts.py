"""The bound on restarts, one for engine cores (gateway/cores/process.py, `CoreRestarter`) and
front ends (gateway/cores/supervisor.py, `FrontEnds`): at most `MAX_RESTARTS` within
`RESTART_WINDOW_S`, each after a backoff that doubles. Past the bound the thing stays down:
one that keeps dying would otherwise cycle forever."""

from __future__ import annotations

import collections

# At most this many restarts of one thing within this many seconds.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
# The wait before a restart: this, doubled for each earlier restart in the window.
RESTART_BACKOFF_S = 0.25


class RestartWindow:
    """The recent restarts of one thing: whether another may begin (`allows`), then its
    backoff (`begin`)."""

    def __init__(self) -> None:
        self.most, self.seconds, self.backoff = MAX_RESTARTS, RESTART_WINDOW_S, RESTART_BACKOFF_S
        self.starts: collections.deque[float] = collections.deque()  # when each recent restart began

    def __len__(self) -> int:
        """Restarts within the window (as of the last `allows`)."""
        return len(self.starts)

    def allows(self, now: float) -> bool:
        """Whether another restart may begin at `now`: fewer than `most` in the window before it."""
        while self.starts and now - self.starts[0] > self.seconds:
            self.starts.popleft()
        return len(self.starts) < self.most

    def begin(self, now: float) -> float:
        """Count a restart that `allows` let begin at `now`; returns the wait before it."""
        delay = self.backoff * 2 ** len(self.starts)
        self.starts.append(now)
        return delay
