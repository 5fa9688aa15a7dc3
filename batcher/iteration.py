"""The engine's side of one generation iteration, run on the worker thread: drop the
sequences that left, one decode step of the running ones, then the batched prefill of the
prompts joining now (a failing group retried by halves). Also the warm-up's profile, and
what an iteration measured: its time split between its two phases, into the metrics and
the cost models."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

from .cost import CostModel, PackedChunkCost
from .isolation import split_in_halves
from .metrics import Metrics
from .protocols import ChunkingEngine, MakeRequest, PackingEngine, PrefillRequest, SequenceStep, SteppingEngine
from .settings import BatchingSettings
from .types import TokenCount

WARMUP_SIZES = (1, 4, 8)
MIN_CHUNK = 32  # prompt tokens a budgeted prefill computes at least per step, whatever the decode rows
WARMUP_PROMPT = "Ferry warms up the engine with an ordinary prompt."


@dataclass(slots=True)
class PrefillWork:
    """What an iteration's prefill did: rows (prompts or chunks), their tokens (the batch
    metric's: whole prompts, or the chunks fed), what its forwards computed (real, and
    padded to each forward's widest row: the cost model's), and the prompt tokens looked
    up in the prefix cache and served by it."""

    rows: int = 0
    tokens: TokenCount = field(default_factory=lambda: TokenCount(0, 0))
    computed: TokenCount = field(default_factory=lambda: TokenCount(0, 0))
    queried: int = 0
    hits: int = 0


@dataclass(slots=True)
class IterationResult:
    outputs: list[SequenceStep]
    failed: dict[int, Exception]
    prefill_seconds: float
    decode_seconds: float
    decoded_rows: int
    # Of each sequence whose prefill finished now: prompt tokens the prefix cache served.
    cached: dict[int, int] = field(default_factory=dict)
    prefill: PrefillWork = field(default_factory=PrefillWork)
    # The decode step and the prefill ran as one forward (a packed step): the worker could
    # not time them apart, and `decode_seconds` holds the shared time.
    packed: bool = False
    # Tokens the decode step gave its rows: more than `decoded_rows` where drafts were taken
    # (speculation, engine/speculation.py). 0: one a row.
    decoded_tokens: int = 0

    @property
    def tokens_a_row(self) -> float:
        """What the decode step gave each row, on average: 1, more where drafts were taken."""
        return max(self.decoded_tokens, self.decoded_rows) / self.decoded_rows if self.decoded_rows else 1.0

    def apportion(
        self, total: float, costs: dict[str, CostModel] | None = None, packed_chunk: PackedChunkCost | None = None
    ) -> None:
        """Charge the iteration's clock time (thread hop included) to its two phases, in the
        proportion the worker thread measured, or, for a packed step, in the proportion the
        cost models predict for its two parts; the clock is the one the tests can drive.

        A packed step that carried chunks is shown to `packed_chunk` (cost.PackedChunkCost).
        Its share of the step is still what the decode model learns: taught the step less what
        its chunks add, the two fits would learn each other's errors back, and only steps
        without chunks would pin them (under load nearly every step carries chunks)."""
        measured = self.prefill_seconds + self.decode_seconds
        share = self.decode_seconds / measured if measured > 0 else (1.0 if self.decoded_rows else 0.0)
        if self.packed and costs is not None:
            # (The decode model's time a token: a step whose rows took drafts gave more.)
            decode = costs["decode"].predict(self.decoded_rows) * self.tokens_a_row
            prefill = costs["prefill"].predict(self.prefill.rows, self.prefill.computed.padded)
            shared = self.decode_seconds / measured if measured > 0 else 1.0
            share = shared * decode / (decode + prefill) if decode + prefill > 0 else shared
        if not self.decoded_rows:
            share = 0.0
        self.decode_seconds, self.prefill_seconds = total * share, total * (1.0 - share)
        chunk = self.prefill.computed.padded
        if not (self.packed and self.decoded_rows and chunk and packed_chunk is not None and costs is not None):
            return
        rows_alone = costs["decode"].predict(self.decoded_rows) * self.tokens_a_row
        packed_chunk.observe(total, rows_alone, chunk, costs["prefill"].params.per_token)

    def record(self, requests: list[PrefillRequest], m: Metrics, model: str, costs: dict[str, CostModel]) -> None:
        """Each phase's batch metrics, and its measured time to its cost model; the new
        prompts' tokens to the prompt counter."""
        if self.decoded_rows:
            m.batch_size.labels(model, "decode").observe(self.decoded_rows)
            m.batch_seconds.labels(model, "decode").observe(self.decode_seconds)
            # The decode model predicts the time between a row's tokens (what admission, the
            # slots and the inter-token targets read it as): a step that gave rows several
            # tokens (drafts taken) counts as that many steps of one.
            per_token = self.decode_seconds / self.tokens_a_row
            m.cost_error.labels(model, "decode").observe(costs["decode"].observe(self.decoded_rows, 0, per_token))
        work = self.prefill
        if work.rows:
            m.batch_size.labels(model, "prefill").observe(work.rows)
            m.batch_tokens.labels(model, "prefill").observe(work.tokens.real)
            m.padding.labels(model, "prefill").observe(work.tokens.padding_ratio)
            m.batch_seconds.labels(model, "prefill").observe(self.prefill_seconds)
            m.cost_error.labels(model, "prefill").observe(
                costs["prefill"].observe(work.rows, work.computed.padded, self.prefill_seconds)
            )
            m.slowdown.labels(model, "prefill").set(costs["prefill"].slowdown)
        if requests:
            m.prompt_tokens.labels(model).inc(sum(len(q.prompt_ids) for q in requests))
        if work.queried:  # the prefix cache: prompt tokens looked up, and served from it
            m.prefix_cache_queries.labels(model).inc(work.queried)
            m.prefix_cache_hits.labels(model).inc(work.hits)


@dataclass(slots=True)
class Chunking:
    """How an iteration prefills on an engine that takes prompts a chunk at a time
    (`ChunkingEngine`): at most `budget` prompt tokens (None: every waiting prompt whole),
    the sequences `first` ahead of the rest; `ceiling`: the seconds a step may take with
    optional work (drafts: an engine's `step_ceiling`), None for no bound."""

    budget: int | None
    first: list[int] = field(default_factory=list)
    ceiling: float | None = None


def packs(engine: object) -> TypeGuard[PackingEngine]:
    """Whether `engine` runs a decode step and the prompt chunks as one forward. Admission
    asks per request: whether the engine has the methods is remembered per engine (checking
    a runtime protocol walks every member, ~20 us), `packs_steps` is read each time."""
    try:
        packing = _PACKING[engine]
    except KeyError:
        packing = _PACKING[engine] = isinstance(engine, PackingEngine)
    except TypeError:  # an engine that cannot be weakly referenced or hashed: not remembered
        packing = isinstance(engine, PackingEngine)
    return packing and bool(getattr(engine, "packs_steps", False))


_PACKING: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()


def chunk_budget(
    s: BatchingSettings, decoding: int, prefill: CostModel, decode: CostModel, packed: bool = False
) -> int | None:
    """Prompt tokens an iteration's prefill may compute beside `decoding` decode rows:
    `max_batch_tokens` less the decode rows, or (unset) what the prefill cost model says
    fits in the time of the decode step (and in what `max_itl_ms` leaves of it), so a
    running stream's token interval at most doubles while prompts arrive; None (every
    waiting prompt whole) when nothing decodes. Never under MIN_CHUNK, so prompts progress.

    `packed`: the chunks ride in the decode step's own forward (engine/packed.py), so they
    cost their tokens only, not the fixed cost of a forward of their own (the prefill
    model's `fixed`, a read of every weight: ~14 ms of the built-in model's ~15 ms decode
    step, which left a chunk the floor alone and let one short prompt join per step)."""
    if s.max_batch_tokens is not None:
        return max(MIN_CHUNK, s.max_batch_tokens - decoding)
    if not decoding:
        return None
    step = decode.predict(decoding)
    allowance = step if s.max_itl_ms is None else min(step, s.max_itl_ms / 1000.0 - step)
    per_token = prefill.params.per_token
    if per_token <= 0:
        return None
    overhead = 0.0 if packed else prefill.predict(1, 0)
    return max(MIN_CHUNK, int((allowance - overhead) / per_token))


def run_iteration(
    engine: SteppingEngine,
    removals: list[int],
    requests: list[PrefillRequest],
    decode: bool,
    chunking: Chunking | None = None,
    held: frozenset[int] = frozenset(),
) -> IterationResult:
    """Runs on the worker thread: everything the engine does in one iteration. With
    `chunking`, the new prompts are handed over first and the prefill comes after the
    decode step, a budgeted chunk of every waiting prompt (`ChunkingEngine.prefill`).
    `held`: running sequences the decode step leaves out (an engine that `holds_rows`)."""
    if removals:
        engine.remove(removals)
    if getattr(engine, "holds_rows", False):
        engine.held = held  # type: ignore[attr-defined]
    if chunking is not None and hasattr(engine, "step_ceiling"):
        engine.step_ceiling = chunking.ceiling
    if chunking is not None and isinstance(engine, ChunkingEngine):
        return _chunked_iteration(engine, requests, decode, chunking)
    t0 = time.perf_counter()
    outputs = list(engine.step()) if decode and engine.running else []
    rows, decoded_tokens = len(outputs), sum(len(o.token_ids) for o in outputs)
    t1 = time.perf_counter()
    cached: dict[int, int] = {}
    done, failed = _each_alone(engine.add, engine, requests)
    for request, result in done:
        outputs.append(result)
        if result.token_ids:  # prefilled (a prompt the engine refused has no token)
            cached[request.seq_id] = result.cached_tokens
    t2 = time.perf_counter() if requests else t1  # no prefill: the whole iteration was the decode step's
    work = PrefillWork()
    if requests:
        # What the prefill computed: each prompt less what the prefix cache served.
        computed = TokenCount.of([len(q.prompt_ids) - cached.get(q.seq_id, 0) for q in requests])
        queried = sum(len(q.prompt_ids) for q in requests if q.seq_id in cached)
        tokens = TokenCount.of([len(q.prompt_ids) for q in requests])
        work = PrefillWork(len(requests), tokens, computed, queried, sum(cached.values()))
    return IterationResult(outputs, failed, t2 - t1, t1 - t0, rows, cached, work, decoded_tokens=decoded_tokens)


EngineCall = Callable[[list[PrefillRequest]], Sequence[SequenceStep]]  # the engine's `add` or `enqueue`


def _each_alone(
    call: EngineCall, engine: SteppingEngine, requests: list[PrefillRequest]
) -> tuple[list[tuple[PrefillRequest, SequenceStep]], dict[int, Exception]]:
    """`call(requests)` (the engine's `add` or `enqueue`): each request's output, and the
    failures. A group that fails is retried by halves, so only the failing prompt fails; a
    failed call's sequences are removed first, whatever it left behind."""
    if not requests:
        return [], {}
    results = split_in_halves(call, requests, after_failure=lambda group: engine.remove([r.seq_id for r in group]))
    done: list[tuple[PrefillRequest, SequenceStep]] = []
    failed: dict[int, Exception] = {}
    for request, result in zip(requests, results, strict=True):
        if isinstance(result, Exception):
            failed[request.seq_id] = result
        else:
            done.append((request, result))
    return done, failed


def _chunked_iteration(
    engine: ChunkingEngine, requests: list[PrefillRequest], decode: bool, chunking: Chunking
) -> IterationResult:
    t0 = time.perf_counter()
    # Taking a prompt computes nothing; it fails only on what the engine refuses outright.
    taken, failed = _each_alone(engine.enqueue, engine, requests)
    outputs = [result for _, result in taken if result.finish_reason is not None]  # refused outright: ends now
    t1 = time.perf_counter()
    packed = False
    if decode and engine.running and packs(engine):
        # One forward for both: its time counts as the decode step's, shared out by `apportion`.
        stepped, done = engine.step_with_prefill(chunking.budget, chunking.first)
        decoded = list(stepped)
        t2 = t3 = time.perf_counter()
        packed = done.rows > 0  # timed as one: shared out by the cost models
    else:
        decoded = list(engine.step()) if decode and engine.running else []
        t2 = time.perf_counter()
        done = engine.prefill(chunking.budget, chunking.first)
        t3 = time.perf_counter()
    failed.update(done.failed)
    cached = {out.seq_id: out.cached_tokens for out in done.outputs}
    tokens = TokenCount(done.computed_tokens, done.padded_tokens)
    work = PrefillWork(done.rows, tokens, tokens, done.queried_tokens, done.cached_tokens)
    prefill_seconds = (t1 - t0) + (t3 - t2) if requests or done.rows else 0.0
    return IterationResult(
        decoded + outputs + list(done.outputs),
        failed,
        prefill_seconds,
        t2 - t1,
        len(decoded),
        cached,
        work,
        packed,
        sum(len(o.token_ids) for o in decoded),
    )


def profile(engine: SteppingEngine, make_request: MakeRequest, prompt: list[int]) -> list[tuple[str, int, int, float]]:
    """Runs on the worker thread: prefill groups of WARMUP_SIZES prompts, then three decode
    steps of each, as (phase, rows, tokens, seconds) for the cost models' seed."""
    obs = []
    next_id = -1
    for n in WARMUP_SIZES:
        ids = list(range(next_id, next_id - n, -1))
        next_id -= n
        # Every row a different rotation of the prompt: no row shares a prefix with another,
        # here or in an earlier group, so a prefix cache serves none and the seed is what
        # an uncached prompt costs.
        reqs = [make_request(i, _rotated(prompt, -i), None, 0) for i in ids]
        t0 = time.perf_counter()
        engine.add(reqs)
        obs.append(("prefill", n, n * len(prompt), time.perf_counter() - t0))
        for _ in range(3):
            t0 = time.perf_counter()
            engine.step()
            obs.append(("decode", n, 0, time.perf_counter() - t0))
        engine.remove(ids)
    return obs


def _rotated(prompt: list[int], k: int) -> list[int]:
    k %= len(prompt)
    return prompt[k:] + prompt[:k]
