"""Logit rules and the further sampling fields (engine/logits.py, engine/sampling.py): the
penalties by their published formulas (OpenAI's presence and frequency penalties, Hugging
Face's repetition penalty checked against transformers' own processor), the bias,
min_tokens and ignore_eos, top_k and min_p; then on the built-in model through the engine."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.base import SamplingParams, SequenceRequest
from engine.detokenize import FINISH_LENGTH, FINISH_STOP
from engine.logits import LogitRules, apply_rules
from engine.sampling import LOGPROB_FLOOR, SequenceSampler, greedy_tokens, sample_next_tokens, token_logprobs

VOCAB = 12


def rules(prompt=(1, 2), **params) -> LogitRules:
    made = LogitRules.of(SamplingParams(**params), list(prompt))
    assert made is not None
    return made


def test_values_that_ask_for_nothing_make_no_rules():
    nothing = SamplingParams(presence_penalty=0, frequency_penalty=0, repetition_penalty=1.0, logit_bias={})
    assert LogitRules.of(nothing, [1, 2]) is None


def test_presence_and_frequency_penalties_follow_openais_formula():
    r = rules(presence_penalty=0.5, frequency_penalty=0.25)
    logits = torch.zeros(1, VOCAB)
    apply_rules(logits, [r], [0], [])
    assert torch.equal(logits, torch.zeros(1, VOCAB))  # nothing generated yet
    for token in (3, 3, 5):
        r.observe(token)
    logits = torch.zeros(1, VOCAB)
    apply_rules(logits, [r], [3], [])
    want = torch.zeros(VOCAB)
    want[3] = -(2 * 0.25 + 0.5)  # mu[j] - c[j] * frequency - (c[j] > 0) * presence
    want[5] = -(1 * 0.25 + 0.5)
    assert torch.allclose(logits[0], want)


def test_repetition_penalty_is_hugging_faces_over_prompt_and_output():
    r = rules(prompt=(1, 2), repetition_penalty=1.7)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    plain_row = logits[1].clone()
    apply_rules(logits[:1], [r], [0], [])  # prompt tokens only so far
    r.observe(7)
    mine = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    theirs = mine.clone()
    apply_rules(mine, [r], [1], [])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 2, 7]]), theirs)
    assert torch.allclose(mine, expected)
    assert torch.equal(logits[1], plain_row)  # a row without rules is untouched


def test_bias_and_min_tokens_and_rows_mixed_in_one_batch():
    eos = 11
    biased, early, free = rules(logit_bias={4: 5.0, 6: -100.0}), rules(min_tokens=2), None
    logits = torch.zeros(3, VOCAB)
    apply_rules(logits, [biased, early, free], [0, 1, 0], [eos])
    assert logits[0, 4] == 5.0 and logits[0, 6] == -100.0 and logits[0].abs().sum() == 105.0
    assert logits[1, eos] == float("-inf") and logits[1, :eos].abs().sum() == 0
    assert logits[2].abs().sum() == 0
    logits = torch.zeros(1, VOCAB)
    apply_rules(logits, [early], [2], [eos])  # two tokens generated: EOS allowed again
    assert logits[0, eos] == 0


def test_top_k_and_min_p_keep_only_their_tokens():
    logits = torch.log(torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05]] * 2))
    top2 = SequenceSampler.create(1.0, 1.0, seed=0, top_k=2)
    floor = SequenceSampler.create(1.0, 1.0, seed=1, min_p=0.3)  # keeps p >= 0.12: tokens 0, 1, 2
    seen: list[set[int]] = [set(), set()]
    for _ in range(300):
        a, b = sample_next_tokens(logits.clone(), [top2, floor])
        seen[0].add(a)
        seen[1].add(b)
    assert seen == [{0, 1}, {0, 1, 2}]
    # After top-k the rest is renormalised before top-p measures its nucleus: of 0.4 and 0.3
    # (0.57 and 0.43 once renormalised), top_p 0.5 keeps the first alone.
    both = SequenceSampler.create(1.0, 0.5, seed=2, top_k=2)
    assert {sample_next_tokens(logits[:1].clone(), [both])[0] for _ in range(100)} == {0}


def test_greedy_tokens_are_torchs_argmax_with_ties_nans_and_masked_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen)
    logits[1, 7] = logits[1, 250] = 99.0  # a tie: the first wins
    logits[2, 40] = float("nan")  # a NaN wins, as in torch
    logits[3, 12] = float("inf")
    logits[4] = float("-inf")  # every token masked (a grammar's dead end): index 0
    logits[5, 299] = 50.0
    for rows in (logits, logits[:, ::2], logits.double(), logits.clone().requires_grad_()):  # strided, float64, grad
        got = greedy_tokens(rows)
        assert got.dtype == torch.long and got.tolist() == rows.argmax(dim=-1).tolist()
    assert greedy_tokens(logits).tolist()[:4] == [int(logits[0].argmax()), 7, 40, 12]
    greedy = SequenceSampler(0.0, 1.0, torch.Generator())
    assert sample_next_tokens(logits.clone(), [greedy] * 6) == logits.argmax(dim=-1).tolist()


def test_a_token_that_cannot_be_drawn_reports_a_finite_floor():
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    (entry,) = token_logprobs(logits, [SequenceSampler.create(0.0, 1.0, seed=0)], [2], [3])
    assert entry is not None and entry[2][-1] == (1, LOGPROB_FLOOR)


def greedy(seq_id: int, prompt: list[int], **params) -> SequenceRequest:
    return SequenceRequest(seq_id, prompt, SamplingParams(max_tokens=6, temperature=0.0, **params))


def run_alone(engine, request: SequenceRequest) -> tuple[list[int], str | None]:
    out = engine.add([request])[0]
    tokens, reason = list(out.token_ids), out.finish_reason
    while reason is None:
        (out,) = engine.step()
        tokens += out.token_ids
        reason = out.finish_reason
    return tokens, reason


def test_on_the_model_bias_min_tokens_and_ignore_eos(engine):
    prompt = engine.encode_prompt("Ferries cross the harbour at dawn.")
    eos = min(engine.eos_token_ids)
    forced, reason = run_alone(engine, greedy(1, prompt, logit_bias={42: 100.0}))
    assert forced == [42] * 6 and reason == FINISH_LENGTH
    tokens, reason = run_alone(engine, greedy(2, prompt, logit_bias={eos: 100.0}, min_tokens=3))
    assert eos not in tokens[:3] and tokens[3] == eos and reason == FINISH_STOP and len(tokens) == 4
    tokens, reason = run_alone(engine, greedy(3, prompt, logit_bias={eos: 100.0}, ignore_eos=True))
    assert tokens == [eos] * 6 and reason == FINISH_LENGTH


def test_on_the_model_a_repetition_penalty_changes_a_repetitive_greedy_output(engine):
    prompt = engine.encode_prompt("one one one one one one")
    plain, _ = run_alone(engine, greedy(1, prompt))
    penalized, _ = run_alone(engine, greedy(2, prompt, repetition_penalty=50.0))
    assert len(set(plain)) < len(plain)  # the random model repeats itself
    assert len(set(penalized)) == len(penalized)  # a seen token must beat a 50x handicap: none did


def reference_logprobs(engine, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The model's own log-softmax at each generated position, one plain forward."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def test_log_probabilities_agree_with_the_models_own_forward(engine):
    prompt = engine.encode_prompt("The ferry leaves the harbour at")
    for temperature, seed in ((0.0, None), (0.7, 5)):
        request = SequenceRequest(
            1, prompt, SamplingParams(max_tokens=5, temperature=temperature, seed=seed, logprobs=3)
        )
        outputs = [engine.add([request])[0]]
        while outputs[-1].finish_reason is None:
            outputs += engine.step()
        entries = [entry for out in outputs for entry in out.logprobs]
        tokens = [t for out in outputs for t in out.token_ids]
        assert [e[0] for e in entries] == tokens
        want = reference_logprobs(engine, prompt, tokens, temperature)
        for row, (token, logprob, top) in enumerate(entries):
            assert abs(logprob - float(want[row, token])) < 1e-4
            values, ids = want[row].topk(3)
            assert [i for i, _ in top] == ids.tolist()
            assert max(abs(v - w) for (_, v), w in zip(top, values.tolist(), strict=True)) < 1e-4
    plain = engine.add([SequenceRequest(2, prompt, SamplingParams(max_tokens=1, temperature=0.0))])[0]
    assert plain.logprobs is None  # none asked, none computed


def test_prompt_log_probabilities_score_what_decoding_generated(engine):
    """Echo's prompt log probabilities (one full forward) give each token what the running
    batch's decode steps gave it when it was generated (greedy: temperature 1), and agree
    with the model's own forward; the first token has none."""
    prompt = engine.encode_prompt("Every evening the ferry")
    request = SequenceRequest(1, prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=2))
    outputs = [engine.add([request])[0]]
    while outputs[-1].finish_reason is None:
        outputs += engine.step()
    generated = [entry for out in outputs for entry in out.logprobs]
    tokens = [e[0] for e in generated]
    scored = SequenceRequest(2, prompt + tokens, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    first = engine.add([scored])[0]
    engine.remove([2])
    entries = first.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) + len(tokens) and entries[0] is None
    for (token, logprob, top), (want_token, want, want_top) in zip(entries[len(prompt) :], generated, strict=True):
        assert token == want_token and abs(logprob - want) < 1e-4
        assert [i for i, _ in top] == [i for i, _ in want_top]
    want = reference_logprobs(engine, prompt[:1], prompt[1:] + tokens, 0.0)
    for row, (token, logprob, _) in enumerate(entries[1:]):
        assert abs(logprob - float(want[row, token])) < 1e-4
    assert first.logprobs is None  # the completion's own were not asked


@pytest.mark.parametrize("beside_a_running_row", [False, True])
def test_a_prompt_whose_log_probabilities_fail_fails_alone(engine, monkeypatch, beside_a_running_row):
    """Echo's prompt forward is the prompt's own (a long prompt's logits take length x
    vocabulary floats): one that fails fails that prompt alone, in `failed`, while its batch
    mates get their first token and decode on (packed, and padded beside a running row)."""
    import engine.sequence as sequence

    scored = sequence.prompt_logprobs
    doomed = engine.encode_prompt("a prompt far too long to score")

    def fails_for_one(forward, prompt, top):
        if list(prompt) == doomed:
            raise torch.OutOfMemoryError("prompt logits of 150k x 32k floats")
        return scored(forward, prompt, top)

    monkeypatch.setattr(sequence, "prompt_logprobs", fails_for_one)
    if beside_a_running_row:
        engine.enqueue([SequenceRequest(9, engine.encode_prompt("already decoding"), SamplingParams(max_tokens=8))])
        assert engine.prefill().outputs[0].finish_reason is None
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)
    mate = engine.encode_prompt("Every evening the ferry")
    engine.enqueue([SequenceRequest(1, doomed, params), SequenceRequest(2, mate, params)])
    step = engine.prefill()
    assert list(step.failed) == [1] and isinstance(step.failed[1], torch.OutOfMemoryError)
    [out] = step.outputs
    assert out.seq_id == 2 and out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(mate)
    assert 1 not in engine.running_ids and 2 in engine.running_ids
    outputs = engine.step()
    assert {o.seq_id for o in outputs} == ({2, 9} if beside_a_running_row else {2})
