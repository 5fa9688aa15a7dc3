"""bench_chat's saturation cell: generated tokens/s when `clients` closed-loop clients keep
the server full. Each client sends a short chat prompt for 64 new tokens (greedy,
`ignore_eos`, so every answer is 64 tokens on any server), not streamed, and sends the next
as soon as one returns; tokens are counted from `usage.completion_tokens` over a fixed
window after a warm-up. The same load goes to Ferry and, with `--vllm-python`, to vLLM's
CPU build on the same model (loadtests/prefix_cell.py starts it).
"""

from __future__ import annotations

import asyncio
import time

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


async def _client(http: httpx.AsyncClient, model: str, k: int, max_tokens: int, until: float, out: list) -> None:
    i = 0
    while time.perf_counter() < until:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[(k + i) % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        i += 1
        t0 = time.perf_counter()
        resp = await http.post("/v1/chat/completions", json=body)
        done = time.perf_counter()
        tokens = (resp.json().get("usage") or {}).get("completion_tokens", 0) if resp.status_code == 200 else 0
        out.append((resp.status_code, done, done - t0, tokens))


def run_saturation(label: str, url: str, model: str, clients: int, duration: float, max_tokens: int = 64) -> dict:
    """Tokens/s of the answers completed within `duration` s after a warm-up of a third of it."""

    async def main() -> tuple[list, float, float]:
        out: list = []
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            start = time.perf_counter()
            window = (start + duration / 3, start + duration / 3 + duration)
            until = window[1]
            await asyncio.gather(*(_client(http, model, k, max_tokens, until, out) for k in range(clients)))
            return out, *window

    out, lo, hi = asyncio.run(main())
    inside = [o for o in out if lo <= o[1] <= hi]
    ok = [o for o in inside if o[0] == 200]
    row = {
        "label": label,
        "clients": clients,
        "tok_s": sum(o[3] for o in ok) / (hi - lo),
        "p50_ms": percentile([o[2] * 1000 for o in ok], 50),
        "ok": len(ok),
        "sent": len(inside),
    }
    print(
        f"  {label:28s} {clients:4d} clients: {row['tok_s']:8.1f} tok/s  p50 {row['p50_ms']:8.1f} ms"
        f"  ok {row['ok']}/{row['sent']}",
        flush=True,
    )
    return row
