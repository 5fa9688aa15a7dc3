"""The batcher reaches the engine only through its own protocols: engines satisfy them
by shape, and no batcher module imports the engine (or torch, or the HTTP layers)."""

from __future__ import annotations

import ast
from pathlib import Path

from batcher.iteration import packs
from batcher.protocols import SteppingEngine
from batcher.running import RunningSet
from batcher.types import GenRequest, Priority, WorkItem
from engine.base import SamplingParams
from engine.fake import FakeChunkingEngine, FakeGenerationEngine, FakePackingEngine


def test_the_fake_generation_engine_is_a_batcher_generation_engine():
    assert isinstance(FakeGenerationEngine(), SteppingEngine)
    assert not isinstance(object(), SteppingEngine)


def test_packs_remembers_the_engines_shape_and_reads_its_switch_each_time():
    engine = FakePackingEngine()
    assert packs(engine) and packs(engine)  # the second answer from what was remembered
    engine.packs_steps = False  # `--no-packed-steps`, changed live
    assert not packs(engine)
    engine.packs_steps = True
    assert packs(engine)
    assert not packs(FakeChunkingEngine())  # no step_with_prefill
    assert not packs(object())


def test_the_running_set_counts_its_batch_class_sequences_as_they_come_and_go():
    def item(priority: Priority, max_tokens: int) -> WorkItem:
        return WorkItem(GenRequest([1, 2], SamplingParams(max_tokens=max_tokens)), 0.0, priority=priority)

    running = RunningSet()
    a, b, c = item(Priority.BATCH, 7), item(Priority.INTERACTIVE, 3), item(Priority.BATCH, 5)
    running.join([a, b, c])
    assert running.has_batch_class()
    assert [s.limit for s in running.values()] == [7, 3, 5]
    running.drop(a.id)
    running.drop(a.id)  # not running any more: counted once
    assert running.has_batch_class()
    running.leave(c.id)
    assert not running.has_batch_class()
    running.leave(b.id)
    running.join([item(Priority.BATCH, 1)])
    assert running.has_batch_class()


def test_batcher_package_imports_neither_the_engine_nor_the_server_layers():
    forbidden = {"engine", "gateway", "torch", "transformers", "starlette", "uvicorn"}
    for path in (Path(__file__).parents[2] / "batcher").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & forbidden, f"{path.name} imports {names}"
