"""bench_chat's inter-token-latency cell: do running streams keep their pace while long
prompts arrive?

`streams` streaming chat clients (16) run in a closed loop, each asking for `max_tokens`
(128) new tokens, greedy, to a short prompt of its own (the random model may end early on
EOS: the client then simply starts its next request; the API has no `ignore_eos`). The
client stamps every content delta on arrival; inter-token latency (ITL) is the gap
between consecutive deltas of one response (the wait for the first one is not an ITL).

After a warm-up (streams started, staggered, and one long prompt), two phases of
`duration` seconds each:

- steady: only the streams;
- long prompts: the streams go on and, every `period` seconds (1.0), one more request
  arrives with a ~900-token prompt (~1220 characters of random letter-words, a new
  seeded draw each, so no prefix cache can serve it), not streamed, max_tokens 1.

A gap counts in the phase in which its later delta arrived. Reported per server: ITL
p50/p99 of each phase, p99(long prompts)/p99(steady) (the claim to check: within 2x), and
the long prompts' time to answer p50 (from their scheduled send) with their median prompt
tokens (`usage.prompt_tokens`).

Servers, one after another on the same machine: Ferry with its token-budgeted steps
(default flags), Ferry prefilling every prompt whole in one step (`--max-batch-tokens
1000000`), and with `--vllm-python` vLLM's CPU build (chunked prefill by default; its venv
as in loadtests/prefix_cell.py). Each Ferry server gets bench_chat's common flags with
`--max-running 64`.

    python -m loadtests.bench_chat --servers itl [--duration 10] [--itl-streams 16] [--itl-period 1.0]
    python -m loadtests.bench_chat --servers itl --vllm-python /tmp/vllm-venv/bin/python

The clients are aiohttp, as in loadtests/openloop.py: on two shared cores httpx's CPU cost
per chunk would show up in the very gaps being measured.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tuner.percentile import percentile

from .openloop import GatewayProcess

MODEL = "ferry-tiny-chat"
LONG_PROMPT_CHARS = 1220  # ~900 tokens of ferry-tiny-chat's byte-level BPE (measured: 877-898)
STREAM_PROMPTS = (
    "Tell me about ferries.",
    "What is a harbour?",
    "Write a line about rivers.",
    "Describe the sea at night.",
)
# (label, extra `ferry serve` flags); the whole-prompt flag makes every prefill one step.
FERRY_CONFIGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ferry, token-budgeted steps", ()),
    ("ferry, steps not packed", ("--no-packed-steps",)),
    ("ferry, whole prompts per step", ("--max-batch-tokens", "1000000")),
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def long_prompt(rng: random.Random, chars: int = LONG_PROMPT_CHARS) -> str:
    """`chars` characters of random letter-words (2-8 letters): each draw is new text, so
    no prefix cache serves it, and the tokenizer finds few long merges in it."""
    words: list[str] = []
    n = 0
    while n <= chars:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8)))
        words.append(word)
        n += len(word) + 1
    return " ".join(words)[:chars]


def gaps_ms(stamps: list[float]) -> list[tuple[float, float]]:
    """(arrival of the later delta, gap in ms) for each pair of consecutive deltas."""
    return [(b, (b - a) * 1000) for a, b in itertools.pairwise(stamps)]


def split_phases(gaps: list[tuple[float, float]], start: float, middle: float, end: float) -> tuple[list, list]:
    """The gaps of [start, middle) and of [middle, end), by the arrival of the later delta."""
    steady = [g for t, g in gaps if start <= t < middle]
    loaded = [g for t, g in gaps if middle <= t < end]
    return steady, loaded


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    """`flags` with `name value` set to `value` (replaced where present, else appended)."""
    out = list(flags)
    if name in out:
        out[out.index(name) + 1] = value
        return out
    return [*out, name, value]


@dataclass
class Record:
    stamps: list[list[float]] = field(default_factory=list)  # content-delta arrivals per response
    deltas: int = 0  # content deltas of the responses that reported usage
    tokens: int = 0  # their completion tokens (usage): tokens/delta > 1 means chunks coalesced
    errors: int = 0
    long: list[tuple[int, float, int]] = field(default_factory=list)  # (status, seconds, prompt tokens)


async def _stream_once(session: aiohttp.ClientSession, body: dict, rec: Record) -> None:
    stamps: list[float] = []
    usage = None
    async with session.post(
        "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        if r.status != 200:
            await r.read()
            rec.errors += 1
            await asyncio.sleep(0.1)
            return
        try:
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                event = orjson.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        stamps.append(now)
        finally:
            rec.stamps.append(stamps)  # kept when cancelled at the end: its gaps so far count
            if usage is not None:  # a whole response: its tokens against its deltas
                rec.tokens += usage
                rec.deltas += len(stamps)


async def _stream_client(
    session: aiohttp.ClientSession, k: int, delay: float, max_tokens: int, rec: Record, stop: asyncio.Event
) -> None:
    await asyncio.sleep(delay)
    r = 0
    while not stop.is_set():
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{STREAM_PROMPTS[k % len(STREAM_PROMPTS)]} ({k}.{r})"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r += 1
        try:
            await _stream_once(session, body, rec)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            rec.errors += 1
            await asyncio.sleep(0.1)


async def _long_request(session: aiohttp.ClientSession, prompt: str, scheduled: float, rec: Record | None) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0}
    status, tokens = 0, 0
    try:
        async with session.post(
            "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            status = r.status
            payload = await r.read()
            if status == 200:
                tokens = (orjson.loads(payload).get("usage") or {}).get("prompt_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
    if rec is not None:
        rec.long.append((status, time.perf_counter() - scheduled, tokens))


async def _measure(
    url: str, streams: int, duration: float, period: float, max_tokens: int, warmup: float, seed: int
) -> tuple[Record, float, float, float]:
    rng = random.Random(seed)
    rec = Record()
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=streams + int(duration / period) + 8)
    async with aiohttp.ClientSession(
        base_url=url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        # Warm-up, not counted: one long prompt (its prefill shapes), the streams staggered in.
        await _long_request(session, long_prompt(rng), time.perf_counter(), None)
        clients = [
            asyncio.create_task(_stream_client(session, k, k * warmup / (2 * streams), max_tokens, rec, stop))
            for k in range(streams)
        ]
        await asyncio.sleep(warmup)
        start = time.perf_counter()
        middle = start + duration
        end = middle + duration
        await asyncio.sleep(max(0.0, middle - time.perf_counter()))
        pending = []
        i = 0
        while middle + i * period < end:
            scheduled = middle + i * period
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            pending.append(asyncio.create_task(_long_request(session, long_prompt(rng), scheduled, rec)))
            i += 1
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        await asyncio.wait_for(asyncio.gather(*pending), timeout=300)
        stop.set()
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    return rec, start, middle, end


def run_itl(
    label: str,
    url: str,
    streams: int = 16,
    duration: float = 10.0,
    period: float = 1.0,
    max_tokens: int = 128,
    warmup: float = 3.0,
    seed: int = 0,
) -> dict:
    """Both phases against the server at `url`; prints and returns one row."""
    rec, start, middle, end = asyncio.run(_measure(url, streams, duration, period, max_tokens, warmup, seed))
    steady: list[float] = []
    loaded: list[float] = []
    for stamps in rec.stamps:
        s, lo = split_phases(gaps_ms(stamps), start, middle, end)
        steady += s
        loaded += lo
    ok = [x for x in rec.long if x[0] == 200]
    row: dict[str, Any] = {
        "label": label,
        "steady_p50": percentile(steady, 50),
        "steady_p99": percentile(steady, 99),
        "long_p50": percentile(loaded, 50),
        "long_p99": percentile(loaded, 99),
        "steady_n": len(steady),
        "long_n": len(loaded),
        "prompt_p50_ms": percentile([x[1] * 1000 for x in ok], 50),
        "prompt_tokens": percentile([x[2] for x in ok], 50),
        "prompts_ok": len(ok),
        "prompts_sent": len(rec.long),
        "stream_errors": rec.errors,
        "tokens_per_delta": rec.tokens / max(1, rec.deltas),
    }
    row["ratio"] = row["long_p99"] / row["steady_p99"]
    print_row(row)
    return row


HEADER = (
    f"  {'server':31s} {'ITL steady p50/p99':>20s} {'ITL w/ long p50/p99':>20s} {'p99 ratio':>10s}"
    f" {'long prompt p50':>16s}"
)


def print_row(row: dict) -> None:
    print(
        f"  {row['label']:31s} {row['steady_p50']:10.1f}/{row['steady_p99']:6.1f} ms"
        f" {row['long_p50']:10.1f}/{row['long_p99']:6.1f} ms {row['ratio']:9.2f}x {row['prompt_p50_ms']:13.0f} ms"
        f"   ({row['steady_n']}+{row['long_n']} gaps, {row['prompts_ok']}/{row['prompts_sent']} long prompts"
        f" of {row['prompt_tokens']:.0f} tokens, {row['tokens_per_delta']:.2f} tokens/delta,"
        f" {row['stream_errors']} stream errors)",
        flush=True,
    )


def run_itl_cells(
    common: list[str], duration: float, streams: int = 16, period: float = 1.0, vllm_python: str = ""
) -> list[dict]:
    """The cell: each Ferry configuration, then vLLM when `vllm_python` is given."""
    print(
        f"Inter-token latency of {streams} streams (max_tokens 128), {duration:g} s steady, then {duration:g} s"
        f" with a ~900-token prompt every {period:g} s:"
    )
    print(HEADER, flush=True)
    flags = with_flag(common, "--max-running", "64")
    rows = []
    for label, extra in FERRY_CONFIGS:
        try:
            gw = GatewayProcess(*flags, *extra)
        except RuntimeError as exc:  # e.g. a flag this build of Ferry does not know yet
            last = (str(exc).strip().splitlines() or [""])[-1]
            print(f"  {label:31s} skipped, the gateway did not start: {last}", flush=True)
            continue
        with gw:
            rows.append(run_itl(label, gw.url, streams, duration, period))
    if vllm_python:
        from engine.tiny_chat import ensure_tiny_chat

        from .prefix_cell import vllm_server

        proc, url = vllm_server(vllm_python, ensure_tiny_chat())
        try:
            rows.append(run_itl("vllm, chunked prefill", url, streams, duration, period))
        finally:
            proc.terminate()
            proc.wait(60)
    return rows
