"""The front end's tokenizer (engine/embedding_tokenizer.py) makes exactly the engine's ids,
without importing torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from engine.embedding_tokenizer import EmbeddingTokenizer

TEXTS = [
    "a ferry",
    "",
    "  Héllo,   WORLD!!  naïve café ",
    "emoji 🚢 and 中文 text",
    "word " * 400,
    "latency budgets decide when a batch must go, not a timer alone",
]


@pytest.fixture(scope="module")
def engine():
    from engine.embeddings import HFEmbeddingEngine

    return HFEmbeddingEngine(torch_threads=1, torchscript=False)


@pytest.mark.parametrize("fast", [True, False])
def test_the_same_ids_as_the_engine_with_or_without_tokenizer_json(engine, tmp_path, fast):
    from engine.embeddings import default_model_path

    path = default_model_path()
    if not fast:  # a model directory without tokenizer.json: transformers' tokenizer
        for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
            shutil.copy(os.path.join(path, name), tmp_path / name)
        path = str(tmp_path)
    tok = EmbeddingTokenizer(path, name=engine.name, dim=engine.dim, max_length=engine.max_length)
    assert tok.tokenize(TEXTS) == engine.tokenize(TEXTS)
    assert len(tok.tokenize(["word " * 400])[0]) == engine.max_length


def test_loading_it_does_not_import_torch():
    code = (
        "import sys; from engine.embedding_tokenizer import EmbeddingTokenizer; "
        "from engine.embeddings import default_model_path; "
        "EmbeddingTokenizer(default_model_path(), name='m', dim=384, max_length=256).tokenize(['x']); "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
