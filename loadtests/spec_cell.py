"""bench_chat's speculation cell (`--servers spec`): Ferry with `--speculation ngram` against
itself without, side by side in one run, and with `--vllm-python` vLLM with its `ngram`
speculative config where its CPU build runs it (it is recorded when it does not).

- One stream at a time: each prompt in turn, one request at a time, greedy, streamed,
  `max_tokens` (160) new tokens; copy-heavy prompts (correct a paragraph, edit a code
  block, extract sentences, repeat a list) and free-form ones (no copying) apart. Per
  request: its stream's tokens/s (completion tokens over the time from its first token to
  its last) and its mean inter-token time; medians over the prompts and rounds.
- Saturation: `clients` (64) closed-loop clients on bench_chat's short prompts
  (loadtests/saturation_cell.py), tokens/s, speculation on against off.

    python -m loadtests.bench_chat --servers spec --chat-model default --repeats 3 \\
        --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import json
import statistics
import time

import httpx

from .kv_blocks_cell import metric_sum
from .openloop import GatewayProcess
from .prefix_cell import peer_model_dir, vllm_server
from .saturation_cell import run_saturation

PARAGRAPH = (
    "The ferry leaves the harbour at seven every morning and crosses the bay in fourty minutes. "
    "Passengers can buy tickets at the office near the pier or on board, where a small cafe sells "
    "coffee, tea and sandwhiches. In winter the first crossing is cancelled when the wind is strong, "
    "and the company posts a notice on its website before six."
)
CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total * (1 + tax_rate)
    return round(total, 2)
"""
STORY = (
    "Mara kept the lighthouse on the northern cape. Every night she climbed the hundred steps to "
    "light the lamp. The river that ran past the tower carried boats from the mountains to the sea. "
    "One autumn a storm broke the lamp, and Mara guided the last boat home with a lantern. The river "
    "rose that night but the boat reached the harbour. In spring the town rebuilt the lamp."
)
COPY = (
    f"Correct the spelling mistakes in this paragraph and write the whole corrected paragraph:\n\n{PARAGRAPH}",
    f"Rename the variable `total` to `result` in this Python function and write the whole function:\n\n{CODE}",
    f"Copy, word for word, every sentence of this text that mentions the river:\n\n{STORY}",
    (
        "Repeat this list exactly, one item per line: apples, bread, milk, eggs, cheese, rice, "
        "tomatoes, onions, butter, coffee, tea, sugar, flour, salt, pepper, olive oil."
    ),
)
FREE = (
    "Write a short story about a dragon who learns to sail.",
    "What are three tips for sleeping well?",
    "Explain what a neural network is to a child.",
    "Describe a busy market in the morning.",
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def one_stream(url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(tokens/s from the first token to the last, mean inter-token seconds, tokens) of one request."""
    body = {
        "model": "ferry-tiny-chat",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                last = time.perf_counter()
                first = first or last
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    if first is None or last is None or tokens < 2 or last <= first:
        return 0.0, 0.0, tokens
    return (tokens - 1) / (last - first), (last - first) / (tokens - 1), tokens


def _streams(label: str, url: str, max_tokens: int) -> dict:
    one_stream(url, FREE[0], 8)  # warm
    row: dict = {"label": label}
    for kind, prompts in (("copy", COPY), ("free", FREE)):
        runs = [one_stream(url, p, max_tokens) for p in prompts]
        row[kind] = {
            "tok_s": statistics.median(r[0] for r in runs),
            "itl_ms": statistics.median(r[1] * 1000 for r in runs),
            "tokens": [r[2] for r in runs],
        }
        figures = row[kind]
        print(
            f"  {label:24s} {kind}: one stream {figures['tok_s']:6.1f} tok/s, "
            f"inter-token {figures['itl_ms']:6.1f} ms (tokens {figures['tokens']})",
            flush=True,
        )
    return row


def _spec_counts(url: str) -> str:
    drafted = metric_sum(url, ("ferry_spec_draft_tokens_total",))
    taken = metric_sum(url, ("ferry_spec_accepted_tokens_total",))
    steps = metric_sum(url, ("ferry_spec_steps_total",))
    rate = f", {taken / drafted:.0%} taken" if drafted else ""
    return f"drafted {drafted:.0f}, taken {taken:.0f}{rate}, steps {steps:.0f}"


def run_spec_cell(
    duration: float, vllm_python: str | None, repeats: int = 1, clients: int = 64, max_tokens: int = 160
) -> list[dict]:
    from engine.tiny_chat import ensure_tiny_chat

    print(f"Speculation (prompt lookup) against none: one stream at a time, {max_tokens} new tokens, greedy:")
    rows: list[dict] = []
    for round_ in range(repeats):
        for mode in ("ngram", "off"):
            flags = ["--embedding-model", "none", "--speculation", mode, "--max-running", str(clients)]
            with GatewayProcess(*flags) as gw:
                row = {**_streams(f"ferry speculation {mode}", gw.url, max_tokens), "round": round_}
                row["saturation"] = run_saturation(
                    f"ferry speculation {mode}", gw.url, "ferry-tiny-chat", clients, duration
                )
                print(f"  {'':24s} {_spec_counts(gw.url)}", flush=True)
                rows.append(row)
        if vllm_python:
            try:
                proc, url = vllm_server(
                    vllm_python,
                    peer_model_dir(ensure_tiny_chat()),
                    "--max-num-seqs",
                    str(clients),
                    "--speculative-config",
                    json.dumps(NGRAM),
                )
            except RuntimeError as exc:
                print(f"  vLLM with {json.dumps(NGRAM)} did not start: {str(exc).strip().splitlines()[-1:]}")
            else:
                try:
                    rows.append({**_streams("vllm ngram", url, max_tokens), "round": round_})
                finally:
                    proc.terminate()
                    proc.wait(60)
    _summary(rows, repeats)
    return rows


def _summary(rows: list[dict], repeats: int) -> None:
    print(f"Medians over {repeats} round(s), speculation on over off:")
    on = {r["round"]: r for r in rows if r["label"] == "ferry speculation ngram"}
    off = {r["round"]: r for r in rows if r["label"] == "ferry speculation off"}
    for kind in ("copy", "free"):
        speed = [on[k][kind]["tok_s"] / off[k][kind]["tok_s"] for k in on if off[k][kind]["tok_s"]]
        itl = [on[k][kind]["itl_ms"] / off[k][kind]["itl_ms"] for k in on if off[k][kind]["itl_ms"]]
        print(
            f"  {kind}: one stream {statistics.median(speed):.2f}x tokens/s, inter-token {statistics.median(itl):.2f}x"
            f" (rounds: {', '.join(f'{x:.2f}' for x in speed)})"
        )
    sat = [on[k]["saturation"]["tok_s"] / off[k]["saturation"]["tok_s"] for k in on if off[k]["saturation"]["tok_s"]]
    print(f"  saturation: {statistics.median(sat):.2f}x tokens/s (rounds: {', '.join(f'{x:.2f}' for x in sat)})")
    vllm = {r["round"]: r for r in rows if r["label"] == "vllm ngram"}
    if vllm:
        ratio = [on[k]["copy"]["tok_s"] / vllm[k]["copy"]["tok_s"] for k in vllm if vllm[k]["copy"]["tok_s"]]
        print(f"  copy, one stream, Ferry over vLLM ngram: {statistics.median(ratio):.2f}x")
