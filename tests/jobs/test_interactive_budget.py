"""While a batch job keeps the micro-batcher full, interactive requests still meet their
latency budgets. Simulated time (FakeClock + SimulatedExecutor): nothing here depends on
the speed of the machine.

The job side mirrors gateway.jobs.runner: at most LINES_IN_FLIGHT batch-class items
queued or running, each replaced as soon as it finishes, with the completion window as
its budget."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import random

from prometheus_client import CollectorRegistry

from batcher.clock import FakeClock
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher
from batcher.settings import BatchingSettings
from batcher.types import Outcome, Priority
from engine.fake import SimulatedExecutor
from gateway.jobs.runner import LINES_IN_FLIGHT

BUDGET = 0.150  # interactive latency budget, seconds
WINDOW = 24 * 3600.0  # the job's completion window
FIXED, PER_ITEM, SIZE = 0.010, 0.002, 16  # the simulated engine, and the batch size


def batch_time(n: int) -> float:
    return FIXED + PER_ITEM * n


def test_batch_job_fills_capacity_while_interactive_budgets_hold():
    async def scenario():
        clock = FakeClock()
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        engine = SimulatedExecutor(clock, fixed=FIXED, per_item=PER_ITEM)  # a full batch: batch_time(SIZE) = 42 ms
        settings = BatchingSettings(max_batch_size=SIZE, max_wait_ms=5.0, default_budget_ms=None)
        b = MicroBatcher("m", engine, settings, clock=clock, metrics=metrics)
        await b.start()

        job_items = []

        async def job(total: int) -> None:
            in_flight: set[asyncio.Future] = set()
            submitted = 0
            while submitted < total or in_flight:
                while len(in_flight) < LINES_IN_FLIGHT and submitted < total:
                    item = b.submit(("batch", submitted), priority=Priority.BATCH, budget=WINDOW)
                    job_items.append(item)
                    in_flight.add(item.future)
                    submitted += 1
                _, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)

        runner = asyncio.create_task(job(100_000))
        rng = random.Random(7)
        interactive = []
        t_end = clock.now() + 3.0
        while clock.now() < t_end:
            for _ in range(rng.choice((0, 1, 1, 2))):  # bursts of up to 2 arrivals per 4 ms tick
                interactive.append(b.submit(("interactive", len(interactive)), budget=BUDGET))
            await clock.advance(0.004)
        await clock.advance(1.0)
        runner.cancel()
        await b.stop()
        await clock.settle()
        for item in job_items:  # the items stop() failed: nobody is waiting for them
            if item.future.done() and not item.future.cancelled():
                item.future.exception()
        return b, interactive, job_items, engine, registry

    _b, interactive, job_items, engine, registry = asyncio.run(scenario())

    # Every interactive request was served, within its budget (the batcher's own SLO count).
    assert len(interactive) > 400
    assert all(i.outcome is Outcome.RESULT for i in interactive)
    met = registry.get_sample_value("ferry_slo_total", {"model": "m", "class": "interactive", "status": "met"})
    missed = registry.get_sample_value("ferry_slo_total", {"model": "m", "class": "interactive", "status": "missed"})
    assert met == len(interactive) and not missed
    # Interactive work is never passed over: no batch item left the queue while an
    # interactive item that arrived earlier was still waiting.
    batch_dispatches = sorted(i.dispatched_at for i in job_items if i.dispatched_at is not None)
    for i in interactive:
        k = bisect.bisect_right(batch_dispatches, i.arrival)
        assert k == len(batch_dispatches) or batch_dispatches[k] >= i.dispatched_at
    # Meanwhile the job used the capacity left over: every engine call was a full batch
    # and the engine was never idle for want of work.
    done = sum(1 for i in job_items if i.outcome is Outcome.RESULT)
    assert done > 600
    assert all(len(p) == SIZE for _, p in engine.runs[1:])  # the first left at once, alone: the engine was idle
    starts = [t for t, _ in engine.runs]
    assert all(b_ - a <= batch_time(SIZE) + 1e-9 for a, b_ in itertools.pairwise(starts))
