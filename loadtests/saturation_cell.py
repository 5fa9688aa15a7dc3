"""bench_chat's saturation cell: generated tokens/s when `clients` closed-loop clients keep
the server full. Each client sends a short chat prompt for 64 new tokens (greedy,
`ignore_eos`, so every answer is 64 tokens on any server), streamed, and sends the next as
soon as one ends. Tokens are counted as they arrive, inside a fixed window after a warm-up
(each streamed chunk weighs its answer's `usage.completion_tokens` over its chunks): on a
real model an answer takes tens of seconds at 64 clients, and counting whole answers that
end in the window moved the figure in steps of 2x. The same load goes to Ferry and, with
`--vllm-python`, to vLLM's CPU build on the same model (loadtests/prefix_cell.py starts it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable

import httpx

from tuner.percentile import percentile

PROMPTS = (  # short chat prompts, shared with bench_chat's other cells
    "Tell me about ferries.",
    "What is a harbour?",
    "Write a line about rivers.",
    "Explain latency.",
    "Name three boats.",
    "Why batch requests?",
    "Describe the sea at night.",
    "Count to five.",
)


def short_prompt(k: int, i: int) -> str:
    """Client k's i-th prompt: the short ones in turn."""
    return PROMPTS[(k + i) % len(PROMPTS)]


async def _client(
    http: httpx.AsyncClient,
    model: str,
    k: int,
    max_tokens: int,
    until: float,
    out: list,
    prompt: Callable[[int, int], str] = short_prompt,
) -> None:
    i = 0
    while time.perf_counter() < until:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt(k, i)}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        i += 1
        t0 = time.perf_counter()
        arrivals: list[float] = []  # when each chunk carrying text came
        record = [0, 0.0, 0.0, 0, arrivals, k]  # status, end, latency, tokens, arrivals (filled in as it goes), client
        out.append(record)
        tokens = 0
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    arrivals.append(time.perf_counter())
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            status = resp.status_code
        done = time.perf_counter()
        record[:4] = [status, done, done - t0, tokens]


def run_saturation(
    label: str,
    url: str,
    model: str,
    clients: int,
    duration: float,
    max_tokens: int = 64,
    prompt: Callable[[int, int], str] = short_prompt,
    warmup: float | None = None,
    group: Callable[[int], str] | None = None,
) -> dict:
    """Tokens/s streamed within `duration` s after a warm-up (`warmup` s, default a third of
    the window; a request's tokens are counted where they arrived, whether or not it ended
    in the window). Client k's i-th request asks `prompt(k, i)`; with `group`, the tokens/s
    of each group of clients too (`tok_s_by`)."""
    warmup = duration / 3 if warmup is None else warmup

    async def main() -> tuple[list, float, float]:
        out: list = []
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            start = time.perf_counter()
            window = (start + warmup, start + warmup + duration)
            until = window[1]
            tasks = [
                asyncio.create_task(_client(http, model, k, max_tokens, until, out, prompt)) for k in range(clients)
            ]
            await asyncio.wait(tasks, timeout=until - time.perf_counter())
            for t in tasks:  # answers still streaming at the window's end: counted so far, then dropped
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return out, *window

    out, lo, hi = asyncio.run(main())
    inside = [o for o in out if lo <= o[1] <= hi]
    ok = [o for o in inside if o[0] == 200]
    # Tokens a chunk carries: its answer's usage over its chunks; for answers cut off at the
    # window's end, the mean of the finished ones.
    finished = [(o[3], len(o[4])) for o in out if o[0] == 200 and o[4]]
    per_chunk = sum(t for t, _ in finished) / max(1, sum(n for _, n in finished))
    streamed: Counter[str] = Counter()
    for status, _, _, tokens, arrivals, k in out:
        if status in (0, 200) and arrivals:
            weight = tokens / len(arrivals) if status == 200 else per_chunk
            streamed[group(k) if group else ""] += weight * sum(lo <= t <= hi for t in arrivals)
    row = {
        "label": label,
        "clients": clients,
        "tok_s": sum(streamed.values()) / (hi - lo),
        "tok_s_by": {g: n / (hi - lo) for g, n in streamed.items()},
        "p50_ms": percentile([o[2] * 1000 for o in ok], 50),
        "ok": len(ok),
        "sent": len(inside),
    }
    refused = Counter(o[0] for o in inside if o[0] != 200)
    print(
        f"  {label:28s} {clients:4d} clients: {row['tok_s']:8.1f} tok/s  p50 {row['p50_ms']:8.1f} ms"
        f"  ok {row['ok']}/{row['sent']}" + (f" (others by status: {dict(refused)})" if refused else ""),
        flush=True,
    )
    return row
