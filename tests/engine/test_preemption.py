"""KV memory bounded by a budget (engine/preemption.py): running sequences preempted when it
is full give the greedy tokens of an unbounded run, token for token, on the built-in tiny
chat model and on a grouped-query-attention Llama; the buffers never pass the budget;
batch-class rows yield first, only when that makes room, and no interactive row ever yields
for a batch-class one; what could not join computes nothing; a preempted sequence goes
ahead of new ones of its class and can be cancelled; a budget below the model's context
caps it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.base import SamplingParams, SequenceRequest
from engine.chunks import PendingPrefills
from engine.generation import HFGenerationEngine
from engine.preemption import Preemption
from engine.sharing import SHARE_BLOCK
from tests.engine.test_prefill import Run, system_prompt, turn

# The engine's buffers are allocated unzeroed: these tests run with them full of NaN.
pytestmark = pytest.mark.usefixtures("nan_empty")

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
        self.first: list[int] = []  # the ids the scheduler would put first (interactive prompts)
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
            decoded, done = e.step_with_prefill(self.chunk, self.first)
        else:
            decoded, done = e.step(), e.prefill(self.chunk, self.first)
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


@pytest.mark.parametrize("packed", [False, True], ids=["apart", "packed"])
def test_preempted_rows_of_a_shared_prefix_held_apart_give_the_unbounded_greedy_tokens(pair, packed: bool) -> None:
    """Rows that hold a shared system prompt apart (engine/sharing.py) keep only their own
    columns: parked, their whole KV (the held prefix, then their own) goes to the prefix
    cache, and they resume where they were."""
    on, off = pair
    system = system_prompt(on, "preemptheld", words=40)
    prompts = [system + turn(on, text) for text in TEXTS]
    want = unbounded(off, prompts)
    stored = []
    store = on._prefiller.prefix_cache.store

    def spy(prompt, kv, known=()):  # type: ignore[no-untyped-def]
        stored.append((len(prompt), kv[0][0].shape[1]))
        return store(prompt, kv, known)

    on._prefiller.prefix_cache.store = spy  # type: ignore[method-assign]
    try:
        with budget(on, 3 * 60) as engine:  # three rows of their own parts: six take turns
            before = engine.preemptions
            run = Bounded(engine, packed)
            run.add(*[request(i, p) for i, p in enumerate(prompts)])
            held = []
            take = engine._sharing.take

            def taking(seq, prefix, others, read=None):  # type: ignore[no-untyped-def]
                held.append(take(seq, prefix, others, read))
                return held[-1]

            engine._sharing.take = taking  # type: ignore[method-assign]
            try:
                run.drain()
            finally:
                del engine._sharing.take
    finally:
        del on._prefiller.prefix_cache.store
    assert run.tokens == want
    assert engine.preemptions > before and max(held) >= 2 * SHARE_BLOCK
    assert all(tokens == columns for tokens, columns in stored)  # every store had the whole KV


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


def test_a_sequence_that_could_not_join_computes_nothing(engine: HFGenerationEngine) -> None:
    """While two rows fill the budget, neither a new prompt nor a parked sequence starts its
    prefill: its KV would sit outside the budget."""
    prompts = [turn(engine, text * 3)[:70] for text in TEXTS[:3]]
    with budget(engine, 160) as bounded:  # two rows of 70 to 79 tokens
        run = Bounded(bounded, packed=True)
        run.add(*[request(i, p) for i, p in enumerate(prompts)])
        computing_beside_two = 0
        while bounded.running:
            run.step()
            if bounded._batch.rows == 2:
                computing_beside_two += sum(p.started for p in bounded._pending.waiting())
        run._restore()
    assert run.parked and computing_beside_two == 0
    assert all(len(tokens) == 24 for tokens in run.tokens.values())


def test_an_interactive_prompt_that_cannot_fit_parks_nobody_for_nothing(engine: HFGenerationEngine) -> None:
    """A batch-class row would yield to an interactive prompt only if that made room: with an
    interactive row running that leaves too little, the prompt waits and nobody is parked."""
    ids = turn(engine, " ".join(TEXTS) * 6)
    assert len(ids) >= 360
    with budget(engine, 300) as bounded:
        run = Bounded(bounded, packed=True)
        run.add(request(1, ids[:70], priority=0, max_tokens=40), request(2, ids[100:120], priority=1, max_tokens=60))
        for _ in range(6):
            run.step()
        run.add(request(3, ids[200:360], priority=0, max_tokens=4))  # 2 x 161 > 300 beside row 1
        while 1 in bounded.running_ids:
            run.step()
            assert not run.parked, "a batch-class row yielded without making room"
        run.drain()
    assert [len(run.tokens[i]) for i in (1, 2, 3)] == [40, 60, 4]


@pytest.mark.parametrize(
    ("packed", "cache"), [(False, True), (True, True), (False, False)], ids=["apart", "packed", "no-prefix-cache"]
)
def test_a_started_prompt_that_finds_no_room_lets_go_of_its_kv(pair, packed: bool, cache: bool) -> None:
    """A batch-class prompt half prefilled when an interactive one takes the room: at its
    last chunk it cannot join, lets go of its KV (its blocks are in the prefix cache) and
    starts again once there is room, giving the tokens it gives alone, its first look-up's
    cached count kept. Without a prefix cache it keeps its KV and waits instead."""
    on, off = pair
    tag = " packed" if packed else (" apart" if cache else " plain")
    ids = turn(on, " ".join(reversed(TEXTS)) * 6 + tag)[::-1]  # cached nowhere
    alone = unbounded(off, [ids[:200]])[0]
    with budget(on if cache else off, 300) as bounded:
        run = Bounded(bounded, packed=packed)
        run.add(request(1, ids[:200], priority=1, max_tokens=12))
        run.step()  # 64 of its 200 tokens
        run.add(request(2, ids[300:450], priority=0, max_tokens=4))
        run.first = [2]
        held = waited = False
        for _ in range(2000):
            if not bounded.running:
                break
            run.step()
            pending = {p.seq_id: p for p in bounded._pending.waiting()}
            if 1 in pending and pending[1].held_back and not pending[1].started:
                held = True
                assert pending[1].buffer is None and pending[1].kv is None
            waited |= 1 in pending and pending[1].left == 1 and 2 in bounded.running_ids
        run._restore()
    assert not bounded.running, "sequences did not finish"
    assert held == cache, "held back where (and only where) the prefix cache holds its work"
    assert waited or cache, "without a cache it should have waited with its KV, one token short"
    assert run.tokens[1] == alone[:12] and len(run.tokens[2]) == 4
    assert run.cached[1] == 0  # what its first look-up found, not its own blocks


def test_a_preempted_sequence_goes_ahead_of_new_prompts_of_its_class() -> None:
    pending: PendingPrefills = PendingPrefills(SimpleNamespace(prefix_cache=None))  # type: ignore[arg-type]
    preemption = Preemption(pending, None)
    pending.add(1, [5, 6], SimpleNamespace(priority=0))  # a new interactive prompt
    pending.add(2, [5, 6], SimpleNamespace(priority=1), resumed=True)
    assert preemption.first([1]) == [1, 2]  # a batch-class one resumed: after new interactive ones
    pending.add(3, [5, 6], SimpleNamespace(priority=0), resumed=True)
    assert preemption.first([1]) == [3, 1, 2]
    # The caller's order for every class (tenants' fair order): each class's resumed ones
    # ahead of its new ones, whatever order the caller gave those.
    pending.add(4, [5, 6], SimpleNamespace(priority=1))
    assert preemption.first([4, 1]) == [3, 1, 2, 4]


def test_a_budget_below_the_context_caps_it_and_one_too_small_fails_at_load(tiny_chat_dir: Path) -> None:
    capped = HFGenerationEngine(str(tiny_chat_dir), kv_cache_bytes=1024 * 8192)  # 1,024 tokens of 8 KiB
    assert capped.kv_budget == capped.max_context == 1024
    [out] = capped.add([request(1, [7] * 1100)])
    assert out.finish_reason == "length" and not out.token_ids  # longer than the context: refused
    with pytest.raises(ValueError, match="kv_cache_mb"):
        HFGenerationEngine(str(tiny_chat_dir), kv_cache_bytes=8 * 8192)
