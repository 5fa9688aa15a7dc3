"""loadtests/sim_priority.py: the noisy engine and one short cell on the fake clock."""

from __future__ import annotations

import argparse
import asyncio

from batcher.clock import FakeClock
from loadtests.sim_priority import NoisyEngine, cell


def test_the_noisy_engine_runs_slow_batches_as_designed():
    clock = FakeClock()
    engine = NoisyEngine(clock, 0.010, 0.001, seed=3)

    async def times() -> list[float]:
        out = []
        for _ in range(3000):
            start = clock.now()
            task = asyncio.ensure_future(engine([None] * 2))
            await clock.run_until_idle()
            await task
            out.append((clock.now() - start) / 0.012)
        return out

    factors = asyncio.run(times())
    doubled = sum(f > 1.9 for f in factors) / len(factors)
    slowed = sum(1.3 < f < 1.4 for f in factors) / len(factors)
    assert 0.01 < doubled < 0.03 and 0.06 < slowed < 0.11 and min(factors) >= 1.0


def test_a_cell_serves_interactive_work_on_time_and_counts_what_it_offered():
    a = argparse.Namespace(fixed=0.009, per_item=0.0045, duration=3.0)
    counts = asyncio.run(cell(1.0, True, 0, a))
    assert counts["interactive"] > 0 and counts["batch_on_time"] > 0
    assert counts["interactive_on_time"] + counts["interactive_refused"] <= counts["interactive"]
    assert counts["interactive_on_time"] >= 0.9 * counts["interactive"]
