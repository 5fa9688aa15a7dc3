"""GGUF chat models (engine/gguf.py): which sources are GGUF files, the float32 copy made once
and kept by the file's identity, and a file transformers cannot dequantize refused in one
line naming why, the server exiting non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.gguf import GGUFError, builtin_smollm2_file, dequantized_dir, ensure_dequantized, gguf_file
from loadtests.openloop import free_port

ROOT = Path(__file__).parents[2]


def write_gguf(path: Path, architecture: str) -> Path:
    """A small GGUF file of `architecture` with one float32 tensor."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_source_is_a_file_or_a_directory_holding_one(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    file = write_gguf(one / "m.Q4_0.gguf", "llama")
    assert gguf_file(str(file)) == file
    assert gguf_file(str(one)) == file
    plain = tmp_path / "plain"  # an ordinary model directory, even with a GGUF file beside it
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    write_gguf(plain / "x.gguf", "llama")
    assert gguf_file(str(plain)) is None
    assert gguf_file("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a Hub id
    two = tmp_path / "two"
    two.mkdir()
    write_gguf(two / "a.gguf", "llama")
    write_gguf(two / "b.gguf", "llama")
    with pytest.raises(GGUFError, match="holds 2 GGUF files; name one"):
        gguf_file(str(two))
    with pytest.raises(GGUFError, match="does not exist"):
        gguf_file(str(tmp_path / "missing.gguf"))


def test_the_float32_copy_is_keyed_by_the_files_identity(tmp_path):
    file = write_gguf(tmp_path / "m.gguf", "llama")
    first = dequantized_dir(file, tmp_path / "cache")
    assert first == dequantized_dir(file, tmp_path / "cache") and first.name.startswith("gguf-m-")
    os.utime(file, ns=(1, 1))  # the file replaced in place: a new copy
    assert dequantized_dir(file, tmp_path / "cache") != first


def test_a_file_transformers_cannot_dequantize_is_one_clear_line(tmp_path):
    file = write_gguf(tmp_path / "odd.gguf", "rwkv9")
    with pytest.raises(GGUFError, match="architecture rwkv9 is not supported") as caught:
        ensure_dequantized(file, tmp_path / "cache")
    assert "\n" not in str(caught.value)
    assert not any((tmp_path / "cache").iterdir())  # no half-made copy left behind


@pytest.mark.model
def test_the_server_exits_non_zero_naming_the_architecture(tmp_path):
    file = write_gguf(tmp_path / "odd.gguf", "rwkv9")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FERRY_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("FERRY_FAKE_ENGINES", None)
    serve = ["serve", "--port", str(free_port()), "--embedding-model", "none", "--chat-model", str(file)]
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *serve, "--data-dir", str(tmp_path / "data")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode != 0
    assert f"cannot load the chat model {file}: GGUF file {file} cannot be dequantized" in done.stderr + done.stdout
    assert "architecture rwkv9 is not supported" in done.stderr + done.stdout


@pytest.mark.model
def test_the_built_in_model_is_the_packages_file_made_float32_once():
    file = builtin_smollm2_file()
    assert file.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and file.stat().st_size > 90_000_000
    directory = Path(ensure_dequantized(file))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
    assert "quantization_config" not in (directory / "config.json").read_text()
    assert ensure_dequantized(file) == str(directory)  # kept: the second call makes nothing
