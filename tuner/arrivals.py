"""Open-loop arrivals for locust: a constant arrival rate or stepped rates.

Locust is closed-loop by nature: each user sends a request, waits for the answer, then
waits `wait_time` and sends the next. When the server slows down, the users slow down
with it and stop sending: the requests that *would* have arrived during the slow spell
are never sent and never measured (coordinated omission), so percentiles look far
better than what real, independent clients would see.

Here arrivals come from a schedule instead: every user class has a `Pacer` that hands out
arrival times (Poisson by default, or evenly spaced) at the target rate, independently of
how fast responses come back. A pool of users takes them: a free user claims the next
arrival time, sleeps until then (in locust's `wait_time`, where a stop kills it at once)
and sends. Latency is measured from the *scheduled* arrival time, not from the moment a
user got round to sending, so if every user is busy when an arrival is due, the wait for
a free user is counted as latency, exactly as a queue in front of the server would be.
The pool is sized to `rate x --pool-latency-s` so that this rarely happens; the report
counts late starts so a too-small pool is visible.

`ArrivalRateShape` sizes that pool, and ends the run after `-t/--run-time` (measured from
the first arrival, once every user is spawned) or after the last step. With
`--arrival-rate 0` and no steps it is an ordinary closed-loop run of `-u` users.

One process only: the pacers live in this process (`locust --processes` or a distributed
master/worker run would multiply the rate by the number of workers).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from locust import LoadTestShape

MAX_STEPS = 100


def parse_steps(text: str | None) -> list[tuple[float, float]]:
    """'40:10,120:10' -> [(40.0, 10.0), (120.0, 10.0)]: rate (req/s) for a duration (s)."""
    steps: list[tuple[float, float]] = []
    for part in (text or "").replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            rate_s, dur_s = part.split(":")
            rate, dur = float(rate_s), float(dur_s.rstrip("s"))
        except ValueError:
            raise ValueError(f"bad rate step {part!r}: expected RATE:SECONDS, e.g. 40:10") from None
        if rate < 0 or dur <= 0 or not math.isfinite(rate) or not math.isfinite(dur):
            raise ValueError(f"bad rate step {part!r}: rate >= 0 and seconds > 0")
        steps.append((rate, dur))
    if len(steps) > MAX_STEPS:
        raise ValueError(f"at most {MAX_STEPS} rate steps")
    return steps


@dataclass
class ArrivalSchedule:
    """Total arrival rate over time: constant (`rate`, optionally for `duration` s) or steps."""

    rate: float = 0.0
    steps: list[tuple[float, float]] = field(default_factory=list)
    duration: float | None = None  # -t/--run-time, from the first arrival

    @property
    def open_loop(self) -> bool:
        return bool(self.steps) or self.rate > 0

    @property
    def max_rate(self) -> float:
        return max((r for r, _ in self.steps), default=self.rate)

    @property
    def end(self) -> float | None:
        """Seconds after the first arrival when arrivals stop (None: never)."""
        ends = [d for d in (self.duration, sum(d for _, d in self.steps) if self.steps else None) if d]
        return min(ends) if ends else None

    def rate_at(self, t: float) -> float:
        if not self.steps:
            return self.rate
        acc = 0.0
        for rate, dur in self.steps:
            acc += dur
            if t < acc:
                return rate
        return 0.0

    def next_change(self, t: float) -> float | None:
        """The next step boundary after t (None if the rate never changes again)."""
        acc = 0.0
        for _, dur in self.steps:
            acc += dur
            if acc > t:
                return acc
        return None


class Pacer:
    """Hands out arrival times for one user class: `share` of the schedule's rate."""

    def __init__(self, schedule: ArrivalSchedule, share: float = 1.0, poisson: bool = True, seed: int = 0):
        self.schedule, self.share, self.poisson = schedule, share, poisson
        self.rng = random.Random(seed)
        self.t0: float | None = None
        self.next_offset = 0.0  # seconds after t0 of the next unclaimed arrival
        self.claimed = 0

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.next_offset = self._gap(0.0)

    def _draw(self, rate: float) -> float:
        return self.rng.expovariate(rate) if self.poisson else 1.0 / rate

    def _gap(self, t: float) -> float:
        """Seconds from t to the next arrival; a step of rate 0 is skipped (bounded loop)."""
        at = t
        for _ in range(MAX_STEPS + 2):
            rate = self.schedule.rate_at(at) * self.share
            if rate > 0:
                if at == t:
                    return self._draw(rate)
                # first arrival of a new step: memoryless for Poisson, at the boundary if even
                return (at - t) + (self.rng.expovariate(rate) if self.poisson else 0.0)
            nxt = self.schedule.next_change(at)
            if nxt is None:
                return math.inf
            at = nxt
        return math.inf

    def claim(self) -> float | None:
        """The next arrival time (time.perf_counter() clock), or None once arrivals end."""
        if self.t0 is None:
            return None
        end = self.schedule.end
        offset = self.next_offset
        if not math.isfinite(offset) or (end is not None and offset >= end):
            return None
        self.next_offset = offset + self._gap(offset)
        self.claimed += 1
        return self.t0 + offset

    def unclaimed_before(self, offset: float, limit: int = 10_000_000) -> int:
        """Arrivals scheduled before `offset` s that no user claimed (every user was busy).
        They count as offered load that was never served. Consumes the schedule: call at the end."""
        n = 0
        while n < limit and math.isfinite(self.next_offset) and self.next_offset < offset:
            self.next_offset += self._gap(self.next_offset)
            n += 1
        return n


class LoadState:
    """What the locustfile, its users and the shape share (one locust process)."""

    def __init__(self) -> None:
        self.schedule = ArrivalSchedule()
        self.pacers: dict[str, Pacer] = {}
        self.weights: dict[str, float] = {}
        self.pool_size = 0
        self.pool_latency_s = 2.0
        self.max_pool = 1000
        self.t0: float | None = None  # first arrival (perf_counter)
        self.t_stop: float | None = None
        self._started = None  # gevent Event, created lazily (inside the locust process)

    def configure(
        self,
        schedule: ArrivalSchedule,
        weights: dict[str, float],
        *,
        poisson: bool = True,
        seed: int = 0,
        pool_size: int = 0,
        pool_latency_s: float = 2.0,
        max_pool: int = 1000,
    ) -> None:
        options: dict[str, Any] = {
            "poisson": poisson,
            "seed": seed,
            "pool_size": pool_size,
            "pool_latency_s": pool_latency_s,
            "max_pool": max_pool,
        }
        self._config = (schedule, weights, options)
        self.schedule = schedule
        self.weights = {k: w for k, w in weights.items() if w > 0}
        total = sum(self.weights.values()) or 1.0
        self.pacers = {
            name: Pacer(schedule, w / total, poisson, seed + i)
            for i, (name, w) in enumerate(sorted(self.weights.items()))
        }
        self.pool_latency_s, self.max_pool = pool_latency_s, max_pool
        self.pool_size = pool_size or self.auto_pool()
        self.t0 = self.t_stop = None

    def auto_pool(self) -> int:
        """Enough users that an arrival rarely finds them all busy: rate x latency, plus
        two spare per class, within [classes, max_pool]."""
        n = len(self.weights) or 1
        want = math.ceil(self.schedule.max_rate * self.pool_latency_s) + 2 * n
        return max(n, min(self.max_pool, want))

    def restart(self) -> None:
        """A new test in the same process (web UI): the same schedule from the start."""
        if getattr(self, "_config", None) is not None:
            schedule, weights, kw = self._config
            self.configure(schedule, weights, **kw)
        if self._started is not None:
            self._started.clear()

    @property
    def started(self):
        if self._started is None:
            from gevent.event import Event

            self._started = Event()
        return self._started

    def start(self) -> None:
        """Called once every user is spawned: the first arrival is now."""
        if self.t0 is not None:
            return
        self.t0 = time.perf_counter()
        for pacer in self.pacers.values():
            pacer.start(self.t0)
        self.started.set()

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else time.perf_counter() - self.t0


LOAD = LoadState()


class ArrivalRateShape(LoadTestShape):
    """Keeps a pool of users sized for the highest arrival rate; stops after -t (counted from
    the first arrival) or the last rate step. Closed loop (`-u` users) when no rate is set."""

    use_common_options = True  # this shape reads -t, and -u/-r in closed-loop mode

    def tick(self):
        assert self.runner is not None, "locust gives a shape its runner before the first tick"
        opts = self.runner.environment.parsed_options
        run_time = getattr(opts, "run_time", None) if opts is not None else None
        sched = LOAD.schedule
        if not sched.open_loop:
            users = max(1, int(getattr(opts, "num_users", None) or 1))
            spawn = float(getattr(opts, "spawn_rate", None) or users)
            if run_time and self.get_run_time() >= run_time:
                return None
            return users, spawn
        end = sched.end
        if LOAD.t0 is not None and end is not None and LOAD.elapsed() >= end:
            return None
        if LOAD.t0 is None and run_time and self.get_run_time() >= run_time + 60:
            return None  # spawning never completed: give up rather than hang
        pool = LOAD.pool_size
        return pool, float(max(pool * 4, 1))
