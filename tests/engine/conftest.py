"""One tiny chat model per test session, built into a temporary cache directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.generation import HFGenerationEngine

BLOCK = 16  # the prefix cache block of the `pair` engines


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


# -- a second model: a Llama with grouped-query attention ---------------------------------


def build_gqa_llama(path: Path, tokenizer_from: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention: 4 query heads per KV head
        max_position_embeddings=1024,
        tie_word_embeddings=False,  # tied ones make a random model repeat one token
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


@pytest.fixture(scope="session", params=["tiny-chat", "gqa-llama"])
def model_path(request, tiny_chat_dir: Path, tmp_path_factory) -> Path:
    if request.param == "tiny-chat":
        return tiny_chat_dir
    path = tmp_path_factory.mktemp("gqa-llama")
    build_gqa_llama(path, tiny_chat_dir)
    return path


@pytest.fixture(scope="session")
def pair(model_path: Path) -> Iterator[tuple[HFGenerationEngine, HFGenerationEngine]]:
    """(cache on, cache off) engines of one model; the cache-off one runs its steps apart
    (`packed_steps=False`), so it is the plain decode that packed steps are checked against."""
    on = HFGenerationEngine(str(model_path), max_running=16, prefix_block=BLOCK)
    off = HFGenerationEngine(str(model_path), max_running=16, prefix_caching=False, packed_steps=False)
    yield on, off
    for engine in (on, off):
        engine.remove(engine.running_ids)


@pytest.fixture
def nan_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `new_empty` buffer (KV slots, a pending prompt's buffer, a prefix served into
    it) full of NaN: the engine allocates them unzeroed, so a cell read before it is
    written would turn the logits into NaN and the outputs into nonsense. (Fresh memory
    from the operating system reads as zeros, which would hide such a read.)"""
    new_empty = torch.Tensor.new_empty

    def nan_filled(self: torch.Tensor, *size, **kwargs) -> torch.Tensor:
        return new_empty(self, *size, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", nan_filled)
