from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from batcher.clock import FakeClock
from batcher.cost import CostModel, LinearCost
from batcher.metrics import Metrics
from batcher.microbatcher import MicroBatcher
from batcher.settings import BatchingSettings
from engine.fake import SimulatedExecutor


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class Rig:
    """A micro-batcher on a fake clock with a simulated engine (latency a + b*n)."""

    def __init__(self, fixed: float = 0.010, per_item: float = 0.002, **settings: Any):
        settings.setdefault("default_budget_ms", None)
        settings.setdefault("policy", "fixed")
        self.clock = FakeClock()
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.engine = SimulatedExecutor(self.clock, fixed, per_item)
        self.batcher = MicroBatcher("m", self.engine, BatchingSettings(**settings), clock=self.clock, metrics=self.metrics)

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    @property
    def batches(self) -> list[list[Any]]:
        return [payloads for _, payloads in self.engine.runs]


FIXED, PER_ITEM = 0.010, 0.002


def exact_rig(**kw: Any) -> Rig:
    """A rig whose cost model knows the simulated engine exactly and never refits."""
    r = Rig(fixed=FIXED, per_item=PER_ITEM, **kw)
    r.batcher.cost = CostModel(LinearCost(FIXED, PER_ITEM, 0.0), refit_every=10**9)
    return r


@pytest.fixture
def rig_factory():
    return Rig
