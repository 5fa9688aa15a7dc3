"""Prefill with prefix caching: greedy tokens identical with the cache on and off, on the
built-in tiny chat model and on a grouped-query-attention Llama, in every way a prompt can
meet the cache; the counters show the cache was used. The helpers on plain tensors first."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.base import SamplingParams, SequenceRequest
from engine.generation import HFGenerationEngine
from engine.prefill import prefill_inputs, right_align, shared_prefixes
from engine.prefix_cache import PrefixCache
from tests.engine.conftest import BLOCK

# -- helpers on plain tensors -------------------------------------------------------------


def test_inputs_feed_each_prompt_from_the_end_of_its_cached_prefix():
    kv = torch.arange(2.0).view(1, 1, 1, 2, 1).expand(1, 2, 1, 2, 1)  # [layers, k/v, heads, 2 tokens, dim]
    ids, positions, mask, past = prefill_inputs([[1, 2, 3], [4, 5, 6, 7, 8]], [(2, kv), (0, None)], torch.device("cpu"))
    assert ids.tolist() == [[0, 0, 0, 0, 3], [4, 5, 6, 7, 8]]
    assert mask.tolist() == [[1, 1, 0, 0, 0, 0, 1], [0, 0, 1, 1, 1, 1, 1]]  # [prefix][pads][suffix]
    assert positions[0, -1] == 2 and positions[1].tolist() == [0, 1, 2, 3, 4]
    assert past is not None and past.shape == (1, 2, 2, 1, 7, 1)  # fed columns left for the forward
    assert past[0, 0, 0, 0, :2, 0].tolist() == [0.0, 1.0]
    assert past[0, :, 1, :, :2].abs().sum() == 0  # padding is zeros, never garbage


def test_right_align_packs_each_rows_real_columns_in_order():
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    keys = torch.arange(15.0).view(3, 1, 5, 1)
    [(packed_keys, _)], packed_mask = right_align([(keys, -keys)], mask)
    assert packed_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1]]
    assert packed_keys[:, 0, :, 0][packed_mask.bool()].tolist() == [0, 1, 4, 7, 8, 9, 14]
    aligned = torch.tensor([[0, 1, 1], [1, 1, 1]])
    layers = [(torch.zeros(2, 1, 3, 1), torch.zeros(2, 1, 3, 1))]
    assert right_align(layers, aligned) == (layers, aligned)  # nothing to move: no copy


def test_shared_prefixes_are_the_longest_uncached_ones_once_each():
    cache = PrefixCache(1 << 20, block=4)
    a, b = list(range(100, 112)), list(range(200, 212))
    prompts = [
        [*a, 1, 2],  # a shares 3 blocks with the next, 1 block with the third
        [*a, 3, 4],
        [*a[:4], 9, 9, 9, 9, 9],
        [*b, 5],  # b is unique
        [7, 7, 7],  # shorter than a block
    ]
    assert shared_prefixes(prompts, cache) == [a]
    cache.store(a, [(torch.zeros(1, 12, 1), torch.zeros(1, 12, 1))])
    assert shared_prefixes(prompts, cache) == []  # cached already


# -- on a model: cache on vs off --------------------------------------------------------


def system_prompt(engine: HFGenerationEngine, tag: str, words: int = 60) -> list[int]:
    """A long prompt start of its own per test, so tests do not share cached blocks."""
    return engine.encode_prompt(" ".join(f"{tag}{i % 7} river boats" for i in range(words // 3)))


def turn(engine: HFGenerationEngine, text: str) -> list[int]:
    return engine.encode_prompt(text)[1:]  # without BOS


def greedy(seq_id: int, prompt: list[int], max_tokens: int = 12) -> SequenceRequest:
    return SequenceRequest(seq_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


class Run:
    """Tokens and reported cached tokens per sequence of one engine, one script."""

    def __init__(self, engine: HFGenerationEngine) -> None:
        self.engine = engine
        self.tokens: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}

    def add(self, *requests: SequenceRequest) -> None:
        for out in self.engine.add(list(requests)):
            self.tokens[out.seq_id] = list(out.token_ids)
            self.cached[out.seq_id] = out.cached_tokens

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for out in self.engine.step():
                self.tokens[out.seq_id] += out.token_ids

    def drain(self) -> Run:
        for _ in range(200):
            if not self.engine.running:
                return self
            self.step()
        raise AssertionError("sequences did not finish")


def on_and_off(pair, script: Callable[[Run], object]) -> tuple[Run, dict[str, int]]:
    """Run `script` on both engines; the tokens must agree. The cached run and how its
    counters moved."""
    on, off = pair
    before = on.prefix_cache_stats()
    cached_run, plain_run = Run(on), Run(off)
    for run in (cached_run, plain_run):
        script(run)
        run.drain()
    assert cached_run.tokens == plain_run.tokens
    after = on.prefix_cache_stats()
    assert after["used_bytes"] <= after["max_bytes"]
    delta = {k: after[k] - before[k] for k in ("queries", "hits")}
    return cached_run, delta


def aligned(n: int) -> int:
    return n // BLOCK * BLOCK


def test_many_prompts_sharing_a_long_prefix_in_one_add_compute_it_once(pair, monkeypatch):
    on, _ = pair
    system = system_prompt(on, "many")
    prompts = [system + turn(on, f" question {i} about ferries") for i in range(8)]
    fed: list[int] = []
    forward = on._prefiller.forward

    def counting(input_ids, positions, mask, cache):
        fed.append(int(mask[:, -input_ids.shape[1] :].sum()))
        return forward(input_ids, positions, mask, cache)

    monkeypatch.setattr(on._prefiller, "forward", counting)
    run, delta = on_and_off(pair, lambda r: r.add(*(greedy(i, p) for i, p in enumerate(prompts))))
    monkeypatch.undo()
    # The shared prefix once, then only each prompt's own tokens.
    assert len(fed) == 2 and set(run.cached.values()) == {fed[0]} and fed[0] >= aligned(len(system))
    assert fed[1] == sum(len(p) - fed[0] for p in prompts)
    assert delta == {"queries": sum(map(len, prompts)), "hits": 8 * fed[0]}


def test_a_later_request_reuses_an_earlier_prompts_prefix(pair):
    on, _ = pair
    system = system_prompt(on, "later")
    first, second = system + turn(on, " first question"), system + turn(on, " another question entirely")

    def script(r: Run) -> None:
        r.add(greedy(1, first))
        r.drain()
        r.add(greedy(2, second))

    run, delta = on_and_off(pair, script)
    assert run.cached[1] == 0 and run.cached[2] >= aligned(len(system))
    assert delta["hits"] == run.cached[2]


def test_a_second_turn_reuses_the_first_turns_prompt(pair):
    on, _ = pair
    first = on.encode_chat([{"role": "system", "content": "Answer briefly. " * 10}, {"role": "user", "content": "Hi"}])
    answer = Run(on)
    answer.add(greedy(1, first, max_tokens=6))
    answer.drain()
    follow_up = turn(on, "<|eos|>\n<|user|>\nAnd then?<|eos|>\n<|assistant|>\n")
    second = first + answer.tokens[1] + follow_up
    run, _ = on_and_off(pair, lambda r: r.add(greedy(2, second)))
    assert run.cached[2] == aligned(len(first))


def test_prompts_shorter_than_a_block_and_ones_cached_but_for_the_last_token(pair):
    on, _ = pair
    short = on.encode_prompt("1 2 3")
    assert len(short) < BLOCK
    exact = system_prompt(on, "exact")[: 3 * BLOCK + 1]

    def script(r: Run) -> None:
        r.add(greedy(1, short), greedy(2, exact))
        r.drain()
        r.add(greedy(3, short), greedy(4, exact), greedy(5, exact))

    run, delta = on_and_off(pair, script)
    assert [run.cached[i] for i in (1, 3)] == [0, 0]
    assert run.cached[2] == 0 and run.cached[4] == run.cached[5] == 3 * BLOCK  # one token fed
    assert delta["hits"] == 6 * BLOCK


def test_eviction_under_a_tiny_budget_still_gives_identical_tokens(pair, model_path):
    on, off = pair
    config = on.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * BLOCK * head_dim * 4  # float32
    small = HFGenerationEngine(str(model_path), max_running=16, prefix_block=BLOCK, prefix_cache_bytes=5 * block_bytes)
    prompts = [system_prompt(on, f"evict{i}", words=30 + 6 * i) for i in range(4)]

    def script(r: Run) -> None:
        for round_no in range(2):
            r.add(*(greedy(10 * round_no + i, p) for i, p in enumerate(prompts)))
            r.step(2)
            r.add(greedy(100 + round_no, prompts[-1] + turn(on, " again")))
            r.drain()

    on_and_off((small, off), script)
    stats = small.prefix_cache_stats()
    assert stats["blocks"] <= 5 and stats["used_bytes"] <= 5 * block_bytes
    assert stats["hits"] > 0 and stats["used_bytes"] > 0


def test_staggered_admissions_while_others_decode(pair):
    on, _ = pair
    system = system_prompt(on, "stagger")

    def script(r: Run) -> None:
        r.add(greedy(1, system + turn(on, " one"), max_tokens=20))
        r.step(3)
        r.add(greedy(2, system + turn(on, " two, a longer question")), greedy(3, turn(on, "plain")))
        r.step(2)
        r.add(greedy(4, system + turn(on, " three")), greedy(5, system[:40]))

    run, _ = on_and_off(pair, script)
    assert run.cached[1] == 0 and min(run.cached[i] for i in (2, 4)) >= aligned(len(system))
    assert run.cached[5] == aligned(39)


def test_sequences_removed_mid_run_leave_the_cache_intact(pair):
    on, _ = pair
    system = system_prompt(on, "remove")
    prompts = [system + turn(on, f" ask {i}") for i in range(4)]

    def script(r: Run) -> None:
        r.add(*(greedy(i, p, max_tokens=16) for i, p in enumerate(prompts)))
        r.step(2)
        r.engine.remove([1, 2])
        r.step(2)
        r.add(greedy(9, prompts[1]))  # removed rows' blocks still serve

    run, _ = on_and_off(pair, script)
    assert len(run.tokens[1]) == 3 and run.cached[9] >= aligned(len(system))


def test_a_failed_forward_stores_nothing_and_changes_nothing(pair, monkeypatch):
    on, _ = pair
    prompt = system_prompt(on, "fail")
    before = on.prefix_cache_stats()

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(on._prefiller, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        on.add([greedy(1, prompt), greedy(2, prompt)])
    monkeypatch.undo()
    after = on.prefix_cache_stats()
    assert (after["blocks"], after["used_bytes"], on.running) == (before["blocks"], before["used_bytes"], 0)
    on_and_off(pair, lambda r: r.add(greedy(3, prompt)))
