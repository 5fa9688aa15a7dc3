"""bench_chat's KV-blocks cell: a few long conversations among many short ones, in a KV
space about twice what their tokens need, against Ferry's KV in blocks (`--kv-layout
blocks`, the default), the rectangle it replaced (`--kv-layout rectangle`) and, with
`--vllm-python`, vLLM with the same KV space.

The load: `clients` closed-loop clients (64), `long` of them (4) with a conversation of
~1,800 prompt tokens each, the rest with one of ~150; every request asks `max_tokens` (96)
new tokens, greedy, `ignore_eos`, streamed; a client sends its conversation again as soon
as its answer ends (the prefix cache serves the repeats on every server), with a 600 s
budget at Ferry (vLLM has none: this measures the KV space, not admission) and a prefix
cache that holds every conversation (1 GiB beside the KV space; vLLM's cache is its KV
space); every conversation is prefilled once before the clients start, unmeasured, and the
window opens 45 s after they do. Tokens/s are
counted as they arrive inside the window (loadtests/saturation_cell.py), in all and for the
long conversations apart (a layout that starves them shows), with the server's
preemptions over the run (`ferry_preemptions_total`; vLLM's
`vllm:num_preemptions_total`).

The KV space: twice the conversations' summed prompt tokens (4 x 1,800 + 60 x 150 = 16,200),
`--kv-cache-mb 1424` for Ferry (SmolLM2-135M-Instruct keeps 46,080 bytes a token in float32:
32,400 tokens; the 64 conversations and their answers hold 22,344 at once); vLLM takes whole
GiB only (`VLLM_CPU_KVCACHE_SPACE`): 2 GiB, more than Ferry's. The rectangle keeps every row
as wide as the longest: with a long conversation running, 17 rows fit.

    python -m loadtests.bench_chat --servers kvblocks --chat-model default --duration 40 \\
        --repeats 3 --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import asyncio
import os
import statistics
from typing import Any, cast

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .openloop import GatewayProcess
from .prefix_cell import WORDS, peer_model_dir, vllm_server
from .saturation_cell import run_saturation


def _text(k: int, words: int) -> str:
    """Conversation k's text of `words` words (its own: no two share a prefix past a few tokens)."""
    return f"Conversation {k}. " + " ".join(
        f"{WORDS[(i * (k + 3)) % len(WORDS)]}{(i * 31 + k) % 97}" for i in range(words)
    )


def conversations(model_dir: str, clients: int, long: int, long_tokens: int, short_tokens: int) -> list[str]:
    """Each client's prompt, sized in the model's own chat template to about its tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def tokens(text: str) -> int:
        messages = [{"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return len(cast(Any, encoded)["input_ids"])  # a BatchEncoding (typed as its other forms)

    def sized(k: int, target: int) -> str:
        lo, hi = 1, target
        while lo < hi:  # the most words whose prompt is within the target
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if tokens(_text(k, mid)) <= target else (lo, mid - 1)
        return _text(k, lo)

    return [sized(k, long_tokens if k < long else short_tokens) for k in range(clients)]


def metric_sum(url: str, names: tuple[str, ...]) -> float:
    """The sum of the samples named `names` in one /metrics scrape of `url`."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names)


PREEMPTIONS = ("ferry_preemptions_total", "vllm:num_preemptions_total")
# Ferry's budget for these requests: none that matters (vLLM has no deadlines): what is
# measured is how many conversations the KV space runs at once, not admission.
NO_DEADLINE_MS = 600_000
# After every conversation's first prefill (`_prime`: ~16,000 prompt tokens, ~45 s on 2
# vCPUs), a warm-up longer than one answer (96 tokens at 64 rows) before the window opens.
WARMUP_S = 45.0
# Ferry's prefix cache holds every conversation (16,200 tokens, 746 MB on SmolLM2), beside
# the KV space; vLLM's lies inside its KV space (its blocks are its cache).
PREFIX_CACHE_MB = 1024


def _prime(url: str, prompts: list[str]) -> None:
    """Every conversation prefilled once (one new token each, all at once), unmeasured: the
    window then sees the conversations running, their repeats served from the prefix cache."""

    async def one(http: httpx.AsyncClient, text: str) -> None:
        body = {"model": "ferry-tiny-chat", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        (await http.post("/v1/chat/completions", json=body)).raise_for_status()

    async def main() -> None:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
            await asyncio.gather(*(one(http, text) for text in prompts))

    asyncio.run(main())


def _measure(label: str, url: str, prompts: list[str], long: int, duration: float, max_tokens: int) -> dict:
    _prime(url, prompts)
    before = metric_sum(url, PREEMPTIONS)
    row = run_saturation(
        label,
        url,
        "ferry-tiny-chat",
        len(prompts),
        duration,
        max_tokens,
        lambda k, i: prompts[k],
        WARMUP_S,
        lambda k: "long" if k < long else "short",
    )
    row["preemptions"] = metric_sum(url, PREEMPTIONS) - before
    by = row["tok_s_by"]
    print(
        f"  {'':28s} long conversations {by.get('long', 0.0):.1f} tok/s, short {by.get('short', 0.0):.1f} tok/s, "
        f"preemptions {row['preemptions']:.0f}",
        flush=True,
    )
    return row


def run_kv_blocks_cell(
    duration: float,
    vllm_python: str | None,
    repeats: int = 1,
    clients: int = 64,
    long: int = 4,
    kv_mb: int = 1424,
    max_tokens: int = 96,
) -> list[dict]:
    from engine.tiny_chat import ensure_tiny_chat

    model_dir = peer_model_dir(ensure_tiny_chat())
    prompts = conversations(model_dir, clients, long, 1800, 150)

    vllm_gib = -(-kv_mb // 1024)  # vLLM's KV space in whole GiB, at least Ferry's
    print(
        f"KV in blocks vs the rectangle ({long} conversations of ~1,800 tokens among {clients - long} of ~150, "
        f"{max_tokens} new tokens each, closed loop, {kv_mb} MiB of KV, vLLM {vllm_gib} GiB):"
    )
    rows = []
    for round_ in range(repeats):
        for layout in ("blocks", "rectangle"):
            flags = ["--embedding-model", "none", "--kv-layout", layout, "--kv-cache-mb", str(kv_mb)]
            flags += ["--default-budget-ms", str(NO_DEADLINE_MS), "--prefix-cache-mb", str(PREFIX_CACHE_MB)]
            with GatewayProcess(*flags, "--max-running", str(clients)) as gw:
                rows.append(
                    {**_measure(f"ferry {layout}", gw.url, prompts, long, duration, max_tokens), "round": round_}
                )
        if vllm_python:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(vllm_gib)
            proc, url = vllm_server(vllm_python, model_dir, "--max-num-seqs", str(clients))
            try:
                rows.append({**_measure("vllm", url, prompts, long, duration, max_tokens), "round": round_})
            finally:
                proc.terminate()
                proc.wait(60)
    print(f"Medians over {repeats} round(s):")
    base = {r["round"]: r for r in rows if r["label"] == "ferry blocks"}
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = {r["round"]: r for r in rows if r["label"] == label}
        long_s = statistics.median(r["tok_s_by"].get("long", 0.0) for r in mine.values())
        line = (
            f"  {label:20s} {statistics.median(r['tok_s'] for r in mine.values()):8.1f} tok/s "
            f"(long conversations {long_s:.1f}), "
            f"preemptions {statistics.median(r['preemptions'] for r in mine.values()):.0f}"
        )
        if label != "ferry blocks":
            ratios = [base[k]["tok_s"] / mine[k]["tok_s"] for k in mine if mine[k]["tok_s"]]
            each = ", ".join(f"{x:.2f}" for x in ratios)
            line += f"  blocks / {label}: {statistics.median(ratios):.2f}x (rounds: {each})"
        print(line, flush=True)
    return rows
