"""The batcher reaches the engine only through its own protocols: engines satisfy them
by shape, and no batcher module imports the engine (or torch, or the HTTP layers)."""

from __future__ import annotations

import ast
from pathlib import Path

from batcher.protocols import SteppingEngine
from engine.fake import FakeGenerationEngine


def test_the_fake_generation_engine_is_a_batcher_generation_engine():
    assert isinstance(FakeGenerationEngine(), SteppingEngine)
    assert not isinstance(object(), SteppingEngine)


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
