"""Speculative decoding by prompt lookup (engine/speculation.py): the drafts, their price,
and greedy rows giving exactly the tokens they give one step at a time, with the KV of the
drafts not taken freed."""

from __future__ import annotations

import pytest
import torch

from engine.base import SamplingParams, SequenceRequest
from engine.blocks import blocks_for
from engine.generation import HFGenerationEngine
from engine.speculation import NgramDrafter, Pricing, RowRate, SpeculationConfig
from tests.engine.test_prefill import system_prompt, turn


# -- drafts ---------------------------------------------------------------------------------
def test_the_longest_earlier_suffix_gives_what_followed_it_last():
    drafter = NgramDrafter(SpeculationConfig("ngram", tokens=3, ngram_max=3, ngram_min=1))
    assert drafter.draft([1, 2, 3, 9, 9, 1, 2, 3]) == [9, 9, 1]  # "1 2 3" was followed by 9 9 1
    assert drafter.draft([5, 1, 2, 7, 1, 2]) == [7, 1, 2]
    # The longest suffix wins over a later, shorter one: "3 4" -> 5, not "4" -> 8.
    assert drafter.draft([3, 4, 5, 6, 4, 8, 3, 4]) == [5, 6, 4]
    assert drafter.draft([1, 2, 1, 3, 1, 4, 1]) == [4, 1]  # the latest occurrence; what is left of it
    assert drafter.draft([1, 2, 3, 4]) == []  # nothing repeats
    assert drafter.draft([1, 2, 3, 9, 1, 2, 3], most=1) == [9]


def test_the_shortest_suffix_bound_holds():
    drafter = NgramDrafter(SpeculationConfig("ngram", tokens=2, ngram_max=4, ngram_min=2))
    assert drafter.draft([7, 8, 1, 7]) == []  # only a 1-gram repeats
    assert drafter.draft([7, 8, 1, 7, 8]) == [1, 7]


def test_settings_are_checked():
    with pytest.raises(ValueError):
        SpeculationConfig("medusa")
    with pytest.raises(ValueError):
        SpeculationConfig("ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError):
        SpeculationConfig("ngram", tokens=0)


# -- the price ------------------------------------------------------------------------------
def fitted(fixed: float, per_token: float) -> Pricing:
    pricing = Pricing()
    for tokens in (1, 4, 16, 64, 2, 33):
        pricing.observe(tokens, fixed + per_token * tokens)
    return pricing


def test_alone_a_row_speculates_and_at_saturation_speculation_turns_itself_off():
    """A forward mostly the weights' read (fixed 50 ms, 1 ms a token): one row's drafts pay;
    64 rows' step costs their arithmetic and only near-certain drafts would pay."""
    pricing = fitted(0.050, 0.001)
    params = pricing.params
    assert params is not None and params[0] == pytest.approx(0.050) and params[1] == pytest.approx(0.001)
    assert pricing.choose(1, 1, [(0.7, 4)]) == [4]
    assert pricing.choose(64, 64, [(0.5, 4)] * 64) == [0] * 64
    # Beside one row, a compute-bound forward (1 ms fixed, 10 ms a token) takes no draft either.
    assert fitted(0.001, 0.010).choose(1, 1, [(0.7, 4)]) == [0]


def test_draft_tokens_go_best_first_and_a_row_that_is_never_right_stops_drafting():
    pricing = fitted(0.050, 0.004)
    keep = pricing.choose(8, 8, [(0.9, 4), (0.3, 4)])
    assert keep[0] >= keep[1] and keep[0] > 0
    wrong = RowRate(drafted=40, accepted=0)
    assert pricing.choose(1, 1, [(wrong.rate, 4)]) == [0]


def test_drafts_stay_within_the_steps_ceiling():
    """A row alone whose drafts would pay: only as many as keep the forward within the
    ceiling (the rows' inter-token targets, the interactive reserve's share), and none where
    the step without drafts is already past it, the look-ups not even made."""
    pricing = fitted(0.050, 0.001)  # one row: 51 ms, each draft token 1 ms more
    assert pricing.choose(1, 1, [(0.7, 4)], ceiling=None) == [4]
    assert pricing.choose(1, 1, [(0.7, 4)], ceiling=0.0535) == [2]
    assert pricing.choose(1, 1, [(0.7, 4)], ceiling=0.051) == [0]
    assert pricing.pays(1, 1, 0.7, ceiling=0.0535) and not pricing.pays(1, 1, 0.7, ceiling=0.051)


def test_unknown_costs_take_every_draft():
    pricing = Pricing()
    pricing.observe(5, 0.02)
    assert pricing.params is None
    assert pricing.choose(5, 5, [(0.1, 3), (0.0, 0)]) == [3, 0]


# -- greedy identity ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def speculating(model_path) -> HFGenerationEngine:
    engine = HFGenerationEngine(str(model_path), max_running=16, speculation=SpeculationConfig("ngram", tokens=4))
    assert engine._speculator is not None
    return engine


def run(engine: HFGenerationEngine, requests: list[SequenceRequest], check=None) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for out in engine.add(requests[:3]):
        tokens[out.seq_id] = list(out.token_ids)
    for step in range(300):
        if not engine.running:
            break
        if step == 3:
            for out in engine.add(requests[3:]):
                tokens[out.seq_id] = list(out.token_ids)
        for out in engine.step():
            tokens[out.seq_id] += out.token_ids
        if check is not None:
            check(engine)
    assert engine.running == 0
    return tokens


def oracle(reference: dict[tuple[int, ...], list[int]], vocab: int):
    """A drafter that knows each prompt's reference answer and is wrong at every fifth
    token of it: drafts taken whole, cut at a wrong token, and past the answer's end."""

    def draft(history, most=None):
        for prompt, answer in reference.items():
            if tuple(history[: len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                out = answer[done : done + (most or 4)]
                return [(t + 1) % vocab if (done + j) % 5 == 3 else t for j, t in enumerate(out)]
        return []

    return draft


def test_greedy_rows_give_the_tokens_of_one_step_at_a_time_and_free_the_drafts_kv(pair, speculating, monkeypatch):
    """Seven greedy rows of different lengths (two of them holding one system prompt once),
    some joining later, drafts that are right, cut or past the end, verified with the other
    rows in each packed forward: every row's tokens are those of the plain engine, every
    row holds blocks for its own tokens only after each step, and every block is back in
    the pool at the end. A seeded sampled row drafts too and gives its tokens without
    speculation (one draw a token, in order); a row asking for log probabilities runs beside
    them, never drafting, unchanged."""
    _, plain = pair
    prompts = [system_prompt(plain, f"spec{i}", words=12 + 9 * i) for i in range(5)]
    shared = system_prompt(plain, "specshared", words=60)  # two rows holding one prefix once
    prompts += [shared + turn(plain, "first question"), shared + turn(plain, "another one")]
    greedy = [
        SequenceRequest(i, p, SamplingParams(max_tokens=24 + 5 * i, temperature=0)) for i, p in enumerate(prompts)
    ]
    others = [
        SequenceRequest(10, prompts[0], SamplingParams(max_tokens=20, temperature=0.9, seed=3)),
        SequenceRequest(11, prompts[1], SamplingParams(max_tokens=20, temperature=0, logprobs=2)),
    ]
    # Three at first, the rest three steps later (`run`): the two sharing a prompt join together.
    requests = greedy[:2] + others[:1] + greedy[5:] + greedy[2:5] + others[1:]
    want = run(plain, requests)
    drafting = [*greedy[:5], others[0]]  # (the shared prompt's two rows: their prompts alike)
    reference = {tuple(r.prompt_ids): want[r.seq_id] for r in drafting}
    spec = speculating._speculator
    assert spec is not None
    monkeypatch.setattr(spec.drafter, "draft", oracle(reference, int(speculating.model.config.vocab_size)))
    monkeypatch.setattr(Pricing, "params", property(lambda self: None))  # every draft taken
    before = spec.drafted, spec.accepted

    held: list[int] = []

    def own_blocks_only(engine: HFGenerationEngine) -> None:
        held.append(engine._sharing.tokens)
        batch = engine._batch
        for table, n in zip(batch._tables, batch.lengths, strict=True):
            assert len(table) == blocks_for(n, batch.block)
        assert (batch._lengths[: batch.rows] == torch.tensor(batch.lengths)).all()

    got = run(speculating, requests, own_blocks_only)
    assert got == want
    drafted, accepted = spec.drafted - before[0], spec.accepted - before[1]
    assert accepted > 0 and drafted > accepted  # drafts taken and drafts cut
    assert speculating._batch.used_blocks == 0
    assert max(held) > 0  # the shared prompt was held once while its rows drafted


def test_a_sampled_rows_draft_is_taken_with_its_probability_and_the_rest_keep_theirs():
    """Rejection sampling for a draft proposed with certainty, on a toy vocabulary: the
    first token is the row's own draw; where it is the draft (token 1), the next is drawn
    from the next query's distribution. 20,000 runs with a fixed seed: the tokens' shares
    are the distributions' within 0.015."""
    from engine.sampling import SequenceSampler, sample_next_tokens
    from engine.speculation import Speculator

    class Row:
        params = SamplingParams(max_tokens=8, temperature=1.0)
        rules = matcher = None

        def __init__(self) -> None:
            self.sampler = SequenceSampler.create(1.0, 1.0, seed=7)
            self.spec = RowRate()

    p0, p1 = torch.tensor([0.1, 0.5, 0.3, 0.1]), torch.tensor([0.6, 0.1, 0.1, 0.2])
    logits = torch.stack([p0.log(), p1.log()])
    spec, row = Speculator(SpeculationConfig("ngram")), Row()
    firsts, seconds = torch.zeros(4), torch.zeros(4)
    n = 20_000
    for _ in range(n):
        first = sample_next_tokens(logits[:1].clone(), [row.sampler])[0]
        (run,) = spec.verify(logits, [first], [[1]], [row])
        firsts[run[0]] += 1
        if run[0] == 1:
            assert len(run) == 2
            seconds[run[1]] += 1
        else:
            assert run == [first]
    assert torch.allclose(firsts / n, p0, atol=0.015)
    assert torch.allclose(seconds / seconds.sum(), p1, atol=0.015)
    assert spec.accepted == firsts[1] and spec.drafted == n
