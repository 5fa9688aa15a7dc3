"""Token-budgeted prefill (engine/chunks.py): prompts fed a chunk at a time, beside decode
steps, give the greedy tokens of whole prompts prefilled without a cache, on the built-in
tiny chat model and on a grouped-query-attention Llama; no call computes more than its
budget; a prompt sharing a prefix with one prefilling ahead of it takes that prefix from
the cache; `first` goes first; a failing chunk fails only its prompt."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.base import SequenceRequest
from engine.detokenize import FINISH_LENGTH
from engine.generation import HFGenerationEngine
from tests.engine.conftest import BLOCK
from tests.engine.test_prefill import Run, greedy, system_prompt, turn

# The engine's buffers are allocated unzeroed: these tests run with them full of NaN.
pytestmark = pytest.mark.usefixtures("nan_empty")


class ChunkedRun:
    """One engine driven as the scheduler drives it with a budget: prompts taken by
    `enqueue`, then each iteration a decode step and a budgeted `prefill`."""

    def __init__(
        self, engine: HFGenerationEngine, budget: int | None, first: Sequence[int] = (), packed: bool = False
    ) -> None:
        """`packed`: each iteration's decode step and prefill as one call (`step_with_prefill`)."""
        self.engine, self.budget, self.first, self.packed = engine, budget, list(first), packed
        self.tokens: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}
        self.first_token_call: dict[int, int] = {}  # seq id -> which prefill call gave its first token
        self.computed: list[int] = []  # prompt tokens each prefill call fed

    def add(self, *requests: SequenceRequest) -> None:
        for out in self.engine.enqueue(list(requests)):
            assert not out.token_ids
            self.tokens[out.seq_id] = []

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            if self.packed:
                decoded, done = self.engine.step_with_prefill(self.budget, self.first)
            else:
                decoded, done = self.engine.step(), self.engine.prefill(self.budget, self.first)
            for out in decoded:
                self.tokens[out.seq_id] += out.token_ids
            assert not done.failed
            self.computed.append(done.computed_tokens)
            for out in done.outputs:
                self.tokens[out.seq_id] = list(out.token_ids)
                self.cached[out.seq_id] = out.cached_tokens
                self.first_token_call[out.seq_id] = len(self.computed)

    def drain(self) -> ChunkedRun:
        for _ in range(400):
            if not self.engine.running:
                return self
            self.step()
        raise AssertionError("sequences did not finish")


def prompts_of(engine: HFGenerationEngine, tag: str) -> list[list[int]]:
    system = system_prompt(engine, tag, words=150)
    return [
        system + turn(engine, " a first question"),
        turn(engine, "short"),
        system_prompt(engine, tag + "other", words=90),
        system + turn(engine, " a second, longer question about the harbour"),
    ]


@pytest.mark.parametrize("packed", [False, True], ids=["apart", "packed"])
@pytest.mark.parametrize("budget", [16, 45, None])
def test_chunked_prompts_give_the_tokens_of_whole_prompts_without_a_cache(pair, budget, packed):
    on, off = pair
    prompts = prompts_of(on, f"chunk{budget}{packed}")

    def script(r: Run | ChunkedRun) -> None:
        r.add(greedy(1, prompts[0], max_tokens=20), greedy(2, prompts[1]))
        r.step(3)
        r.add(greedy(3, prompts[2]), greedy(4, prompts[3]))
        r.drain()

    chunked, whole = ChunkedRun(on, budget, packed=packed), Run(off)
    script(chunked)
    script(whole)
    assert chunked.tokens == whole.tokens
    if budget is not None:
        assert max(chunked.computed) <= budget
        assert len(chunked.computed) > len(prompts[0]) // budget  # the long prompts took several steps
    assert on.running == 0 and on.kv_tokens == 0


@pytest.mark.parametrize("packed", [False, True], ids=["apart", "packed"])
def test_a_prompt_sharing_a_prefix_with_one_prefilling_waits_and_takes_it_from_the_cache(pair, packed):
    on, off = pair
    system = system_prompt(on, f"wait{packed}", words=120)
    a, b = system + turn(on, " one"), system + turn(on, " two")
    chunked = ChunkedRun(on, budget=48, packed=packed)
    beside = turn(on, "beside") if packed else []
    if packed:  # a row decoding, so the chunks run packed beside it
        chunked.add(greedy(9, beside, max_tokens=40))
        chunked.step()
    chunked.add(greedy(1, a), greedy(2, b))
    chunked.drain()
    whole = Run(off)
    if packed:
        whole.add(greedy(9, beside, max_tokens=40))
        whole.step()
    whole.add(greedy(1, a), greedy(2, b))
    whole.drain()
    assert chunked.tokens == whole.tokens
    assert chunked.cached[1] == 0 and chunked.cached[2] >= len(system) // BLOCK * BLOCK
    # The shared prefix was computed once: everything fed is a and the part of b past it.
    assert sum(chunked.computed) == len(beside) + len(a) + len(b) - chunked.cached[2]


def test_first_goes_ahead_of_prompts_that_joined_before_it(engine):
    long_a = system_prompt(engine, "firstA", words=150)
    long_b = system_prompt(engine, "firstB", words=150)
    run = ChunkedRun(engine, budget=64, first=[2])
    run.add(greedy(1, long_a), greedy(2, long_b))
    run.drain()
    assert run.first_token_call[2] < run.first_token_call[1]


def test_a_chunk_that_fails_alone_fails_only_its_prompt(pair, monkeypatch):
    on, _ = pair
    good, bad = system_prompt(on, "goodchunk", words=60), system_prompt(on, "badchunk", words=60)
    extend = on._prefiller.extend

    def failing(prompts, hits):
        if any(p[: len(bad) // 2] == bad[: len(bad) // 2] for p in prompts):
            raise RuntimeError("out of memory")
        return extend(prompts, hits)

    monkeypatch.setattr(on._prefiller, "extend", failing)
    monkeypatch.setattr(on._forward, "packed", _failing_packed)  # the packed prefill fails whole: run padded
    on.enqueue([greedy(1, good, max_tokens=3), greedy(2, bad, max_tokens=3)])
    done = on.prefill(None)
    assert list(done.failed) == [2] and "out of memory" in str(done.failed[2])
    assert [out.seq_id for out in done.outputs] == [1] and done.outputs[0].token_ids
    assert on.running_ids == [1]
    on.remove([1])


def _failing_packed(*args):
    raise RuntimeError("out of memory")


def test_prompts_with_no_rows_running_are_prefilled_packed(engine):
    """With no decode rows, the chunks still run as one packed forward: no padding to the
    longest prompt, no copy of the prompts' KV into a padded batch and out again."""
    short, long = turn(engine, "alone"), system_prompt(engine, "alone", words=60)
    engine.enqueue([greedy(1, short, max_tokens=3), greedy(2, long, max_tokens=3)])
    done = engine.prefill(None)
    assert sorted(out.seq_id for out in done.outputs) == [1, 2] and not done.failed
    assert done.computed_tokens == len(short) + len(long) == done.padded_tokens
    engine.remove([1, 2])


def test_removed_while_prefilling_and_refused_outright(engine):
    prompt = system_prompt(engine, "removed", words=150)
    outs = engine.enqueue([greedy(1, prompt), greedy(2, []), SequenceRequest(3, prompt, greedy(3, []).params)])
    assert [out.finish_reason for out in outs] == [None, FINISH_LENGTH, None]
    engine.prefill(32)
    assert engine.prefilling == 2 and engine.kv_tokens > 0
    engine.remove([1, 3])
    assert engine.running == 0 and engine.kv_tokens == 0
    assert not engine.prefill(32).outputs


def test_a_failed_decode_step_drops_the_prompts_prefilling_too(engine, monkeypatch):
    engine.add([greedy(1, turn(engine, "decoding"))])
    engine.enqueue([greedy(2, system_prompt(engine, "dropped", words=150))])
    engine.prefill(32)

    class Broken:  # every forward, packed or not
        def __call__(self, *args):
            raise RuntimeError("device lost")

        packed = __call__

    monkeypatch.setattr(engine, "_forward", Broken())
    with pytest.raises(RuntimeError):
        engine.step()
    assert engine.running == 0 and engine.kv_tokens == 0


def test_a_prompt_finishing_beside_a_long_chunk_joins_the_batch_at_its_own_width(engine):
    long_prompt, short = system_prompt(engine, "widthL", words=150), turn(engine, "hi")
    engine.enqueue([greedy(2, short), greedy(1, long_prompt)])
    done = engine.prefill(80)  # the short one whole, and a chunk of the long one, in one forward
    assert [out.seq_id for out in done.outputs] == [2]
    assert engine._batch.width == len(short)  # not the long prompt's chunk's width
    engine.remove([1, 2])


def test_a_failure_keeping_one_prompts_kv_fails_it_alone(pair, monkeypatch):
    import engine.chunks as chunks

    on, off = pair
    a, b = system_prompt(on, "keepA", words=12), system_prompt(on, "keepB", words=90)
    kept = chunks._kept

    def failing(c, row, layers, width):
        if c.pending.seq_id == 2:
            raise RuntimeError("out of memory")
        return kept(c, row, layers, width)

    monkeypatch.setattr(chunks, "_kept", failing)
    monkeypatch.setattr(on._forward, "packed", _failing_packed)  # the padded path keeps a chunk's KV
    run = ChunkedRun(on, budget=40)
    on.enqueue([greedy(1, a), greedy(2, b)])
    try:
        # a whole and a first chunk of b in one forward; b's KV cannot be kept: the forward
        # is retried by halves, a completes alone, b fails alone.
        done = on.prefill(len(a) + 20)
        assert list(done.failed) == [2] and [out.seq_id for out in done.outputs] == [1]
        monkeypatch.undo()
        run.tokens[1] = list(done.outputs[0].token_ids)
        run.drain()
    finally:
        on.remove([1, 2])
    whole = Run(off)
    whole.add(greedy(1, a))
    whole.drain()
    assert run.tokens[1] == whole.tokens[1] and on.running == 0


# -- packed steps: the decode rows and the chunks in one forward ---------------------------


def test_a_packed_step_is_one_forward_and_gives_the_tokens_of_two(pair, monkeypatch):
    on, off = pair
    long_prompt = system_prompt(on, "packedone", words=100)
    calls = []
    packed = on._forward.packed

    def count_packed(*args):
        calls.append("packed")
        return packed(*args)

    monkeypatch.setattr(on._forward, "packed", count_packed)
    run = ChunkedRun(on, budget=40, packed=True)
    run.add(greedy(1, turn(on, "decoding"), max_tokens=30))
    run.step()  # nothing decodes yet: a prefill alone, packed too
    assert calls == ["packed"]
    run.add(greedy(2, long_prompt))
    run.step()
    assert calls == ["packed"] * 2 and run.computed[-1] == 40  # the chunk rode in the decode step's forward
    run.drain()
    assert on.running == 0
    whole = Run(off)
    whole.add(greedy(1, turn(on, "decoding"), max_tokens=30))
    whole.step()
    whole.add(greedy(2, long_prompt))
    whole.drain()
    assert run.tokens == whole.tokens


def test_a_packed_forward_that_fails_runs_apart_and_fails_only_the_bad_prompt(pair, monkeypatch):
    on, off = pair
    good, bad = system_prompt(on, "packgood", words=40), system_prompt(on, "packbad", words=40)
    extend, packed = on._prefiller.extend, on._forward.packed

    def failing_packed(input_ids, positions, plan, keep):
        # Packed with chunks fails; the running rows alone still run (rows in blocks are read
        # by packed forwards only, engine/blocks.py).
        if plan.segments:
            raise RuntimeError("out of memory")
        return packed(input_ids, positions, plan, keep)

    def failing_extend(prompts, hits):
        if any(p[:20] == bad[:20] for p in prompts):
            raise RuntimeError("out of memory")
        return extend(prompts, hits)

    on.add([greedy(1, turn(on, "running"), max_tokens=12)])
    on.enqueue([greedy(2, good, max_tokens=4), greedy(3, bad, max_tokens=4)])
    monkeypatch.setattr(on._forward, "packed", failing_packed)
    monkeypatch.setattr(on._prefiller, "extend", failing_extend)
    decoded, done = on.step_with_prefill(None)
    assert [out.seq_id for out in decoded] == [1] and decoded[0].token_ids
    assert list(done.failed) == [3] and [out.seq_id for out in done.outputs] == [2]
    assert sorted(on.running_ids) == [1, 2]
    monkeypatch.undo()
    run = ChunkedRun(on, budget=None, packed=True)
    run.tokens = {1: [], 2: list(done.outputs[0].token_ids)}
    run.drain()
    whole = Run(off)
    whole.add(greedy(2, good, max_tokens=4))
    whole.drain()
    assert run.tokens[2] == whole.tokens[2] and on.running == 0


def test_removed_while_prefilling_in_packed_steps(engine):
    engine.add([greedy(1, turn(engine, "staying"), max_tokens=20)])
    engine.enqueue([greedy(2, system_prompt(engine, "packremoved", words=150))])
    engine.step_with_prefill(32)
    assert engine.prefilling == 1 and engine.kv_tokens > 0
    engine.remove([2])
    decoded, done = engine.step_with_prefill(32)
    assert [out.seq_id for out in decoded] == [1] and not done.rows and not done.outputs
    engine.remove([1])
    assert engine.running == 0 and engine.kv_tokens == 0


def test_packed_steps_off_runs_two_forwards(tiny_chat_dir, monkeypatch):
    apart = HFGenerationEngine(str(tiny_chat_dir), max_running=4, packed_steps=False)

    def never(*args):
        raise AssertionError("packed steps are off")

    monkeypatch.setattr(apart._forward, "packed", never)
    apart.add([greedy(1, turn(apart, "one"), max_tokens=5)])
    apart.enqueue([greedy(2, turn(apart, "two"), max_tokens=5)])
    decoded, done = apart.step_with_prefill(None)
    assert [out.seq_id for out in decoded] == [1] and [out.seq_id for out in done.outputs] == [2]
