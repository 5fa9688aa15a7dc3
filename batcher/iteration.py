"""The engine's side of one generation iteration, run on the worker thread: drop the
sequences that left, one decode step of the running ones, then the batched prefill of the
prompts joining now (a failing group retried by halves). Also the warm-up's profile, and
what an iteration measured: its time split between its two phases, into the metrics and
the cost models."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .cost import CostModel
from .isolation import split_in_halves
from .metrics import Metrics
from .protocols import MakeRequest, PrefillRequest, SequenceStep, SteppingEngine
from .types import TokenCount

WARMUP_SIZES = (1, 4, 8)
WARMUP_PROMPT = "Ferry warms up the engine with an ordinary prompt."


@dataclass(slots=True)
class IterationResult:
    outputs: list[SequenceStep]
    failed: dict[int, Exception]
    prefill_seconds: float
    decode_seconds: float
    decoded_rows: int
    # Of each sequence prefilled now (its prefill succeeded): prompt tokens the prefix cache served.
    cached: dict[int, int] = field(default_factory=dict)

    def apportion(self, total: float) -> None:
        """Charge the iteration's clock time (thread hop included) to its two phases, in the
        proportion the worker thread measured; the clock is the one the tests can drive."""
        measured = self.prefill_seconds + self.decode_seconds
        share = self.decode_seconds / measured if measured > 0 else (1.0 if self.decoded_rows else 0.0)
        if not self.decoded_rows:
            share = 0.0
        self.decode_seconds, self.prefill_seconds = total * share, total * (1.0 - share)

    def record(self, requests: list[PrefillRequest], m: Metrics, model: str, costs: dict[str, CostModel]) -> None:
        """Each phase's batch metrics, and its measured time to its cost model."""
        if self.decoded_rows:
            m.batch_size.labels(model, "decode").observe(self.decoded_rows)
            m.batch_seconds.labels(model, "decode").observe(self.decode_seconds)
            m.cost_error.labels(model, "decode").observe(
                costs["decode"].observe(self.decoded_rows, 0, self.decode_seconds)
            )
        if requests:
            tokens = TokenCount.of([len(q.prompt_ids) for q in requests])
            # What the prefill computed: each prompt less what the prefix cache served.
            computed = TokenCount.of([len(q.prompt_ids) - self.cached.get(q.seq_id, 0) for q in requests])
            m.batch_size.labels(model, "prefill").observe(len(requests))
            m.batch_tokens.labels(model, "prefill").observe(tokens.real)
            m.padding.labels(model, "prefill").observe(tokens.padding_ratio)
            m.batch_seconds.labels(model, "prefill").observe(self.prefill_seconds)
            m.cost_error.labels(model, "prefill").observe(
                costs["prefill"].observe(len(requests), computed.padded, self.prefill_seconds)
            )
            m.slowdown.labels(model, "prefill").set(costs["prefill"].slowdown)
            m.prompt_tokens.labels(model).inc(tokens.real)
        if self.cached:  # the prefix cache: prompt tokens looked up, and served from it
            queried = sum(len(q.prompt_ids) for q in requests if q.seq_id in self.cached)
            m.prefix_cache_queries.labels(model).inc(queried)
            m.prefix_cache_hits.labels(model).inc(sum(self.cached.values()))


def run_iteration(
    engine: SteppingEngine, removals: list[int], requests: list[PrefillRequest], decode: bool
) -> IterationResult:
    """Runs on the worker thread: everything the engine does in one iteration."""
    if removals:
        engine.remove(removals)
    t0 = time.perf_counter()
    outputs = list(engine.step()) if decode and engine.running else []
    rows = len(outputs)
    t1 = time.perf_counter()
    failed: dict[int, Exception] = {}
    cached: dict[int, int] = {}
    if requests:
        # A group that fails is retried by halves, so only the failing prompt fails; a
        # failed call's sequences are removed first, whatever it left behind.
        results = split_in_halves(
            engine.add, requests, after_failure=lambda group: engine.remove([r.seq_id for r in group])
        )
        for request, result in zip(requests, results, strict=True):
            if isinstance(result, Exception):
                failed[request.seq_id] = result
            else:
                outputs.append(result)
                if result.token_ids:  # prefilled (a prompt the engine refused has no token)
                    cached[request.seq_id] = result.cached_tokens
    return IterationResult(outputs, failed, time.perf_counter() - t1, t1 - t0, rows, cached)


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
        reqs = [make_request(i, _rotated(prompt, -i), None) for i in ids]
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
