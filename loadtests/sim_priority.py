"""Interactive first on a noisy engine: a SIMULATION on the fake clock, not a measurement
(issue: Admission and priority that hold).

The priority cells of `bench_latency` (interactive requests at 10% of capacity with a
100 ms budget, batch-class ones at 100/150/200% with 1 s) fed to Ferry's own MicroBatcher
(`adaptive`, interactive first, the default margin) over a simulated engine whose batch of n
items takes `fixed + per_item * n` seconds times a random factor: one batch in fifty runs
2x, one in twelve 1.35x, the rest 1.0-1.1x (the shape of a CPU shared with a load
generator and an HTTP front end). The cost model is fitted online, as in `ferry serve`.

It simulates interactive first without the interactive lane (`interactive_lane: false`;
one batch at a time, batch-class batches cut by the reserve): the lane's benefit comes from
the operating system sharing the cores between two engine threads, which the fake clock
does not model; `bench_latency --cells priority` measures it.

Two variants side by side on the same arrivals: batches around interactive work sized on
the cost model's 99th-percentile slowdown (`tail`, as shipped) and on its 90th (`slowdown`,
as before). With `--fixed 0.022 --per-item 0.002` the engine is the fixed-cost-heavy one the
real host turned into under contention (docs/benchmarks.md).

    python -m loadtests.sim_priority [--seeds 3] [--duration 30] [--fixed 0.009 --per-item 0.0045]

Prints, per batch-class load and variant, the share of interactive requests answered
within their budget, interactive refusals, and batch-class goodput as a share of capacity
(16-item batches, no noise).
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from prometheus_client import CollectorRegistry

from batcher.clock import FakeClock
from batcher.cost import CostModel
from batcher.errors import BatchingError
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher
from batcher.settings import BatchingSettings
from batcher.types import Priority

INTERACTIVE_SHARE, INTERACTIVE_BUDGET, BATCH_BUDGET = 0.1, 0.100, 1.0


class NoisyEngine:
    """A batch of n items takes (fixed + per_item * n) * a random factor of simulated time."""

    def __init__(self, clock: FakeClock, fixed: float, per_item: float, seed: int) -> None:
        self.clock, self.fixed, self.per_item, self.rng = clock, fixed, per_item, random.Random(seed)

    async def __call__(self, payloads: list[Any]) -> list[Any]:
        u = self.rng.random()
        factor = 2.0 if u < 0.02 else 1.35 if u < 0.02 + 1 / 12 else 1.0 + 0.1 * self.rng.random()
        await self.clock.sleep((self.fixed + self.per_item * len(payloads)) * factor)
        return list(payloads)


class NinetiethOnly(CostModel):
    """The cost model before: every batch sized on the 90th percentile."""

    @property
    def tail(self) -> float:
        return self.slowdown


async def cell(load: float, tail: bool, seed: int, a: argparse.Namespace) -> dict[str, int]:
    clock = FakeClock()
    settings = BatchingSettings(policy="adaptive", max_batch_size=32, max_wait_ms=10, max_queue=10_000)
    engine = NoisyEngine(clock, a.fixed, a.per_item, seed + 1)
    batcher = MicroBatcher("m", engine, settings, clock=clock, metrics=Metrics(CollectorRegistry()))
    if not tail:
        batcher.cost.__class__ = NinetiethOnly
    capacity = 16 / (a.fixed + a.per_item * 16)
    rng = random.Random(seed)
    rates = {Priority.INTERACTIVE: INTERACTIVE_SHARE * capacity, Priority.BATCH: load * capacity}
    next_at = {p: clock.now() + rng.expovariate(r) for p, r in rates.items()}
    end = clock.now() + a.duration
    counts = {"interactive": 0, "interactive_refused": 0, "interactive_on_time": 0, "batch_on_time": 0}
    await batcher.start()
    while True:
        priority = min(next_at, key=next_at.__getitem__)
        if next_at[priority] > end:
            break
        await clock.advance(next_at[priority] - clock.now())
        next_at[priority] += rng.expovariate(rates[priority])
        interactive = priority is Priority.INTERACTIVE
        budget = INTERACTIVE_BUDGET if interactive else BATCH_BUDGET
        counts["interactive"] += interactive
        try:
            (item,) = batcher.submit_many([None], budget=budget, priority=priority)
        except BatchingError:
            counts["interactive_refused"] += interactive
            continue
        key = "interactive_on_time" if interactive else "batch_on_time"

        def done(fut: asyncio.Future, key: str = key, arrival: float = clock.now(), budget: float = budget) -> None:
            if not fut.cancelled() and fut.exception() is None and clock.now() - arrival <= budget:
                counts[key] += 1

        item.result_future.add_done_callback(done)
    await clock.run_until_idle()
    await batcher.stop()
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--duration", type=float, default=30.0, help="simulated seconds per cell")
    p.add_argument("--fixed", type=float, default=0.009, help="seconds per batch")
    p.add_argument("--per-item", type=float, default=0.0045, help="seconds per item")
    p.add_argument("--loads", default="1.0,1.5,2.0", help="batch-class load, share of capacity")
    a = p.parse_args()
    capacity = 16 / (a.fixed + a.per_item * 16)
    print(f"engine {a.fixed * 1e3:g} ms + {a.per_item * 1e3:g} ms/item, capacity {capacity:.0f} items/s")
    for load in (float(x) for x in a.loads.split(",")):
        for tail in (False, True):
            runs = [asyncio.run(cell(load, tail, seed, a)) for seed in range(a.seeds)]
            offered = sum(r["interactive"] for r in runs)
            on_time = sum(r["interactive_on_time"] for r in runs) / max(offered, 1)
            refused = sum(r["interactive_refused"] for r in runs)
            goodput = sum(r["batch_on_time"] for r in runs) / (a.seeds * a.duration) / capacity
            sized = "99th percentile (tail)" if tail else "90th percentile      "
            print(
                f"  batch-class {load:4.0%}  sized on the {sized}  interactive on time {on_time:6.1%}"
                f"  refused {refused:3d}  batch-class goodput {goodput:.2f} of capacity",
                flush=True,
            )


if __name__ == "__main__":
    main()
