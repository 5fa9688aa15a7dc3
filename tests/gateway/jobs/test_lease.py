"""The batch-job lease with several front ends on one data directory: only the
holder runs jobs, a batch created through another front end is adopted by the holder, a
dead holder's lease expires and another front end takes over, and no line runs twice.
Two gateways in one process stand for two front ends; the lease's clock is injected, so
nothing here waits for a lease to expire."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from engine.fake import FakeEmbeddingEngine
from gateway.config import ServerConfig
from gateway.jobs.lease import LEASE_TTL_S
from gateway.jobs.service import BatchJobs
from gateway.jobs.validate import BatchCreate
from gateway.metrics.registry import GatewayMetrics
from gateway.models.catalogue import ModelSpec
from gateway.models.kinds import EMBEDDING
from gateway.state import GatewayState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def front_end(data_dir: Path, clock: Clock) -> tuple[GatewayState, BatchJobs, FakeEmbeddingEngine]:
    engine = FakeEmbeddingEngine()
    cfg = ServerConfig(data_dir=str(data_dir), warmup=False, api_workers=2, engine_cores=False)
    ferry = GatewayState(cfg, GatewayMetrics(), [ModelSpec(EMBEDDING, lambda: engine, source="fake-embed")])
    await ferry.load()
    jobs = ferry.jobs = BatchJobs(ferry, clock=clock)
    assert jobs.lease.shared and not jobs.lease.holding
    return ferry, jobs, engine


def lines(n: int) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "fake-embed", "input": f"line {i}"},
            }
        )
        + b"\n"
        for i in range(n)
    )


async def create(jobs: BatchJobs, n: int) -> str:
    f = await jobs.upload(lines(n), "in.jsonl", "batch")
    row = await jobs.create(BatchCreate(input_file_id=f["id"], endpoint="/v1/embeddings"))
    return row["id"]


async def finished(jobs: BatchJobs, batch_id: str) -> dict:
    for _ in range(2000):
        row = await jobs.get(batch_id)
        if row["status"] in ("completed", "cancelled", "failed", "expired"):
            return row
        await asyncio.sleep(0.005)
    raise AssertionError(f"batch {batch_id} did not finish: {row}")


async def close(*pairs: tuple[GatewayState, BatchJobs]) -> None:
    for ferry, jobs in pairs:
        await jobs.close()
        await ferry.close()


def test_one_holder_runs_a_job_created_through_another_front_end(tmp_path):
    async def scenario() -> None:
        clock = Clock()
        a_state, a, a_engine = await front_end(tmp_path, clock)
        b_state, b, b_engine = await front_end(tmp_path, clock)
        try:
            assert await a.lease.tick() is False  # no store yet: nothing to hold
            batch_id = await create(b, 5)  # B is no holder: it stores the job and does not run it
            assert not b.runner.jobs
            assert await a.lease.tick() is True and await b.lease.tick() is False
            row = await finished(b, batch_id)  # A adopted it
            assert (row["status"], row["completed"]) == ("completed", 5)
            assert sum(a_engine.calls) == 5 and b_engine.calls == []
            holder = await a.store.read(a.store.lease)
            assert holder is not None and holder[0] == a.lease.holder
            await close((a_state, a))  # a clean stop gives the lease up: B takes over at once
            assert await b.lease.tick() is True
        finally:
            await close((b_state, b))

    asyncio.run(scenario())


def test_a_dead_holders_lease_expires_and_another_front_end_finishes_its_job(tmp_path):
    async def scenario() -> None:
        clock = Clock()
        a_state, a, _ = await front_end(tmp_path, clock)
        b_state, b, b_engine = await front_end(tmp_path, clock)
        try:
            await a.ensure_open()
            assert await a.lease.tick() is True
            # A stands for a front end that stalls (or died) with its job unstarted: it
            # neither renews its lease nor runs the job's lines.
            for served in a_state.models.values():
                await served.batcher.drain(0.0)
            batch_id = await create(b, 4)
            assert await b.lease.tick() is False
            clock.now += LEASE_TTL_S - 0.5
            assert await b.lease.tick() is False  # not expired yet
            clock.now += 1.0
            assert await b.lease.tick() is True  # expired: B takes over and runs the job
            row = await finished(b, batch_id)
            assert (row["status"], row["completed"], row["failed"]) == ("completed", 4, 0)
            assert sum(b_engine.calls) == 4
            assert await a.lease.tick() is False and not a.lease.holding  # the old holder learns it lost the lease
            assert not a.runner.jobs
        finally:
            await close((a_state, a), (b_state, b))

    asyncio.run(scenario())
