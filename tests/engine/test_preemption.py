"""KV memory bounded by a budget (engine/preemption.py): running sequences preempted when it
is full give the greedy tokens of an unbounded run, token for token, on the built-in tiny
chat model and on a grouped-query-attention Llama; the buffers never pass the budget;
batch-class rows yield first and no interactive row ever yields for a batch-class one; a
preempted sequence can be cancelled; a budget below one full context fails at load."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.base import SamplingParams, SequenceRequest
from engine.generation import HFGenerationEngine
from tests.engine.test_prefill import Run, turn

TEXTS = [
    "Ferry boats cross the river at dawn",
    "a long barge of coal and timber sails north past the mill",
    "tides",
    "the harbour master counts every hull that leaves the dock tonight",
    "gulls",
    "lanterns on the pier, and a bell for the last crossing of the day",
]


def request(seq_id: int, prompt: list[int], priority: int = 1, max_tokens: int = 24) -> SequenceRequest:
    return SequenceRequest(seq_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), priority)


@contextmanager
def budget(engine: HFGenerationEngine, cells: int) -> Iterator[HFGenerationEngine]:
    """The engine with a KV budget of `cells` (rows x columns) for the duration."""
    assert engine.running == 0
    saved = engine.kv_budget
    engine.kv_budget, engine._batch = cells, None  # type: ignore[assignment]
    engine._batch = engine._new_batch()
    try:
        yield engine
    finally:
        engine.remove(engine.running_ids)
        engine.kv_budget = saved
        engine._batch = engine._new_batch()


class Bounded:
    """An engine driven as the scheduler drives it (enqueue, then each iteration a decode
    step and a budgeted prefill), recording every preemption and the buffers' size."""

    def __init__(self, engine: HFGenerationEngine, packed: bool, chunk: int | None = 64) -> None:
        self.engine, self.packed, self.chunk = engine, packed, chunk
        self.tokens: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}
        self.parked: list[tuple[int, list[int]]] = []  # (victim's priority, priorities of the rows then)
        preemption = engine._preemption
        park = preemption.park

        def recording_park(batch, row):  # type: ignore[no-untyped-def]
            self.parked.append((batch.seqs[row].priority, [s.priority for s in batch.seqs]))
            park(batch, row)

        preemption.park = recording_park  # type: ignore[method-assign]
        self._restore = lambda: setattr(preemption, "park", park)

    def add(self, *requests: SequenceRequest) -> None:
        for out in self.engine.enqueue(list(requests)):
            self.tokens[out.seq_id] = []

    def step(self) -> None:
        e = self.engine
        if self.packed:
            decoded, done = e.step_with_prefill(self.chunk)
        else:
            decoded, done = e.step(), e.prefill(self.chunk)
        assert not done.failed
        for out in [*decoded, *done.outputs]:
            if not self.tokens[out.seq_id]:
                self.cached[out.seq_id] = out.cached_tokens
            elif out in done.outputs:
                assert out.cached_tokens == 0  # a resumed sequence reports its prompt's once
            self.tokens[out.seq_id] += out.token_ids
        assert e.kv_budget is not None and e._batch.cells <= e.kv_budget

    def drain(self) -> Bounded:
        for _ in range(2000):
            if not self.engine.running:
                self._restore()
                return self
            self.step()
        raise AssertionError("sequences did not finish")


def unbounded(engine: HFGenerationEngine, prompts: list[list[int]]) -> dict[int, list[int]]:
    run = Run(engine)
    run.add(*[request(i, p) for i, p in enumerate(prompts)])
    run.drain()
    return run.tokens


@pytest.mark.parametrize(
    ("packed", "cache"), [(False, True), (True, True), (False, False)], ids=["apart", "packed", "no-prefix-cache"]
)
def test_preempted_sequences_give_the_unbounded_greedy_tokens(pair, packed: bool, cache: bool) -> None:
    """Recomputed from the prefix cache, or wholly without one."""
    on, off = pair
    prompts = [turn(on, text) for text in TEXTS]
    want = unbounded(off, prompts)
    with budget(on if cache else off, 3 * 90) as engine:  # about three rows of the longest: six take turns
        before = engine.preemptions
        run = Bounded(engine, packed)
        run.add(*[request(i, p) for i, p in enumerate(prompts)])
        run.drain()
        assert engine.preemptions > before and run.parked
    assert run.tokens == want


def test_batch_class_rows_yield_first_and_never_for_a_batch_class_prompt(engine: HFGenerationEngine) -> None:
    prompts = [turn(engine, text) for text in TEXTS]
    with budget(engine, 3 * 90) as bounded:
        run = Bounded(bounded, packed=True)
        run.add(*[request(i, p, priority=1) for i, p in enumerate(prompts[:4])])
        for _ in range(6):
            run.step()
        run.add(*[request(10 + i, p, priority=0) for i, p in enumerate(prompts[4:])])  # interactive arrive
        run.drain()
    assert run.parked, "the budget should have made rows yield"
    for victim, rows in run.parked:
        assert victim == max(rows), "a row yielded while one of a higher priority number ran"
    assert any(victim == 1 and 0 in rows for victim, rows in run.parked), "interactive prompts should preempt"
    assert all(len(run.tokens[10 + i]) == 24 for i in range(2)) and all(len(run.tokens[i]) == 24 for i in range(4))


def test_a_preempted_sequence_can_be_cancelled(engine: HFGenerationEngine) -> None:
    prompts = [turn(engine, text) for text in TEXTS[:4]]
    with budget(engine, 2 * 90) as bounded:
        run = Bounded(bounded, packed=False)
        run.add(*[request(i, p) for i, p in enumerate(prompts)])
        while not run.parked:
            run.step()
        parked = [s for s in bounded.running_ids if s in bounded._pending]
        bounded.remove(parked[:1])
        del run.tokens[parked[0]]
        assert parked[0] not in bounded.running_ids
        run.drain()
    assert all(len(tokens) == 24 for tokens in run.tokens.values())


def test_a_budget_below_one_context_fails_at_load(tiny_chat_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_mb"):
        HFGenerationEngine(str(tiny_chat_dir), kv_cache_bytes=64 * 1024)
