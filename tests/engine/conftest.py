"""One tiny chat model per test session, built into a temporary cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_chat import CACHE_NAME, ensure_tiny_chat

    return Path(ensure_tiny_chat(tmp_path_factory.mktemp("ferry-cache") / CACHE_NAME))


@pytest.fixture(scope="session")
def _shared_engine(tiny_chat_dir: Path):
    from engine.generation import HFGenerationEngine

    return HFGenerationEngine(str(tiny_chat_dir), name="ferry-tiny-chat", max_running=16)


@pytest.fixture
def engine(_shared_engine):
    """The session's engine, checked empty before and emptied after each test."""
    assert _shared_engine.running == 0, "a previous test left sequences running"
    yield _shared_engine
    _shared_engine.remove(_shared_engine.running_ids)
