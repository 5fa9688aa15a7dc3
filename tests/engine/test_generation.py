"""HFGenerationEngine on the built-in tiny chat model: batch invariance, limits, stops.

The KV buffers and the detokenizer alone: test_kv.py, test_detokenize.py."""

from __future__ import annotations

import ast
import hashlib
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.base import ChatTemplateError, SamplingParams, SequenceRequest, StepOutput
from engine.blocks import blocks_for
from engine.kv import RunningBatch
from engine.sampling import SequenceSampler, make_generator, sample_next_tokens

pytestmark = pytest.mark.model

SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}


class Transcript:
    """Everything each sequence produced, checking nothing arrives after its finish."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.text: dict[int, str] = defaultdict(str)
        self.finish: dict[int, str] = {}

    def take(self, outputs: Sequence[StepOutput]) -> list[StepOutput]:
        for out in outputs:
            assert out.seq_id not in self.finish, f"output for finished sequence {out.seq_id}"
            self.tokens[out.seq_id] += out.token_ids
            self.text[out.seq_id] += out.text
            if out.finish_reason:
                self.finish[out.seq_id] = out.finish_reason
        return list(outputs)


def req(seq_id: int, prompt: list[int], **params) -> SequenceRequest:
    return SequenceRequest(seq_id, prompt, SamplingParams(**params))


def drain(engine, transcript: Transcript, max_steps: int = 200) -> Transcript:
    for _ in range(max_steps):
        if not engine.running:
            return transcript
        transcript.take(engine.step())
    raise AssertionError("sequences did not finish")


def run_alone(engine, prompt: list[int], **params) -> Transcript:
    transcript = Transcript()
    transcript.take(engine.add([req(1, prompt, **params)]))
    return drain(engine, transcript)


def assert_no_padding_only_columns(engine) -> None:
    """The span the running rows attend over is exactly the longest row: padding that
    nobody needs any more is not attended to."""
    batch = engine._batch
    rows = engine.running
    if batch.paged:  # in blocks: each row holds its own tokens' blocks, no more, the rest free
        assert batch.used_blocks == sum(blocks_for(n) for n in batch.lengths)
        assert batch.used_blocks + len(batch._free) == batch.pool_blocks
        assert engine.kv_tokens == batch.used_blocks * batch.block
        return
    attended = batch.mask[:rows, batch.start : batch.end]
    width = int(attended.sum(dim=1).max())
    assert batch.width == width
    assert int(batch.mask[:rows].sum()) == int(attended.sum())  # nothing outside the span
    assert engine.kv_tokens == width * rows


@pytest.fixture(scope="module")
def prompts(_shared_engine) -> dict[str, list[int]]:
    chat = _shared_engine.encode_chat
    return {
        "a": chat([{"role": "user", "content": "Hello there, how are you today?"}]),
        "b": chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about rivers and boats"}]
        ),
        "c": _shared_engine.encode_prompt("1 2 3"),
        "long": _shared_engine.encode_prompt("the ferry crosses the river " * 12),
    }


# -- batch invariance ------------------------------------------------------------------


def test_greedy_is_the_same_alone_batched_and_staggered(engine, prompts):
    a, b = prompts["a"], prompts["b"]
    solo_a = run_alone(engine, a, max_tokens=16, temperature=0).tokens[1]
    solo_b = run_alone(engine, b, max_tokens=16, temperature=0).tokens[1]
    assert len(set(solo_a)) > 4, "the tiny model should not loop on one token"

    together = Transcript()
    together.take(
        engine.add(
            [
                req(1, a, max_tokens=16, temperature=0),
                req(2, b, max_tokens=16, temperature=0),
                req(3, prompts["long"], max_tokens=16, temperature=0),
            ]
        )
    )
    drain(engine, together)
    assert together.tokens[1] == solo_a
    assert together.tokens[2] == solo_b

    staggered = Transcript()
    staggered.take(engine.add([req(1, a, max_tokens=16, temperature=0)]))
    for _ in range(3):
        staggered.take(engine.step())
    staggered.take(
        engine.add([req(2, b, max_tokens=16, temperature=0), req(3, prompts["long"], max_tokens=40, temperature=0)])
    )
    for _ in range(2):
        staggered.take(engine.step())
    engine.remove([3])
    assert_no_padding_only_columns(engine)
    drain(engine, staggered)
    assert staggered.tokens[1] == solo_a
    assert staggered.tokens[2] == solo_b


def test_held_rows_sit_out_steps_keep_their_kv_and_resume_with_the_same_tokens(engine, prompts):
    a, b, long = prompts["a"], prompts["b"], prompts["long"]
    solo = {i: run_alone(engine, p, max_tokens=12, temperature=0).tokens[1] for i, p in ((1, a), (2, b), (3, long))}
    assert engine.holds_rows  # KV in blocks, the default where steps pack
    t = Transcript()
    t.take(engine.add([req(1, a, max_tokens=12, temperature=0), req(2, b, max_tokens=12, temperature=0)]))
    try:
        engine.held = frozenset({1})
        for _ in range(3):
            assert [o.seq_id for o in t.take(engine.step())] == [2]
        # A prompt's chunks packed with the decode step of the rows not held.
        engine.enqueue([req(3, long, max_tokens=12, temperature=0)])
        decoded, prefilled = engine.step_with_prefill(budget=None)
        t.take(decoded), t.take(prefilled.outputs)
        assert [o.seq_id for o in decoded] == [2] and [o.seq_id for o in prefilled.outputs] == [3]
        assert len(t.tokens[1]) == 1 and len(t.tokens[2]) == 5 and len(t.tokens[3]) == 1
        engine.held = frozenset({1, 2, 3})  # never every row: a step of none is no step
        assert sorted(o.seq_id for o in t.take(engine.step())) == [1, 2, 3]
    finally:
        engine.held = frozenset()
    drain(engine, t)
    assert dict(t.tokens) == solo
    assert_no_padding_only_columns(engine)


def test_seeded_sampling_is_the_same_alone_and_batched(engine, prompts):
    a = prompts["a"]
    solo = run_alone(engine, a, max_tokens=12, **SEEDED).tokens[1]
    other_seed = run_alone(engine, a, max_tokens=12, temperature=0.8, top_p=0.9, seed=8).tokens[1]
    assert solo != other_seed

    batched = Transcript()
    batched.take(
        engine.add(
            [
                req(2, prompts["b"], max_tokens=20, temperature=1.0, seed=1),
                req(3, prompts["c"], max_tokens=20, temperature=0.7, top_p=0.5),
                req(4, prompts["long"], max_tokens=20, temperature=0),
            ]
        )
    )
    batched.take(engine.step())
    batched.take(engine.add([req(1, a, max_tokens=12, **SEEDED)]))
    batched.take(engine.step())
    engine.remove([2])
    drain(engine, batched)
    assert batched.tokens[1] == solo


# -- limits and finishing ---------------------------------------------------------------


def test_each_sequence_gets_exactly_its_max_tokens(engine, prompts):
    limits = {1: 1, 2: 2, 3: 5, 4: 8}
    transcript = Transcript()
    transcript.take(engine.add([req(i, prompts["a"], max_tokens=n, temperature=0) for i, n in limits.items()]))
    running = [engine.running]
    while engine.running:
        transcript.take(engine.step())
        running.append(engine.running)
    assert {i: len(transcript.tokens[i]) for i in limits} == limits
    assert set(transcript.finish.values()) == {"length"}
    assert running == [3, 2, 2, 2, 1, 1, 1, 0]


def test_stop_string_ends_output_and_is_not_included(engine, prompts):
    reference = run_alone(engine, prompts["a"], max_tokens=16, temperature=0)
    text, tokens = reference.text[1], reference.tokens[1]
    stop = text[8:12]
    expected = text[: text.index(stop)]

    stopped = run_alone(engine, prompts["a"], max_tokens=16, temperature=0, stop=["never-seen-xyz", stop])
    assert stopped.finish[1] == "stop"
    assert stopped.text[1] == expected
    assert stopped.tokens[1] == tokens[: len(stopped.tokens[1])]
    assert len(stopped.tokens[1]) < len(tokens)

    at_start = run_alone(engine, prompts["a"], max_tokens=16, temperature=0, stop=[text[:3]])
    assert (at_start.text[1], at_start.finish[1]) == ("", "stop")


def test_eos_finishes_with_stop(engine, prompts, monkeypatch):
    tokens = run_alone(engine, prompts["a"], max_tokens=16, temperature=0).tokens[1]
    end = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    monkeypatch.setattr(engine, "eos_token_ids", frozenset({tokens[end]}))
    ended = run_alone(engine, prompts["a"], max_tokens=16, temperature=0)
    assert ended.tokens[1] == tokens[: end + 1]
    assert ended.finish[1] == "stop"
    assert ended.text[1] == engine.tokenizer.decode(tokens[:end], skip_special_tokens=True)


def test_context_limit_finishes_with_length(engine, prompts, monkeypatch):
    prompt = prompts["a"]
    monkeypatch.setattr(engine, "max_context", len(prompt) + 3)
    transcript = Transcript()
    outputs = transcript.take(
        engine.add(
            [
                req(1, prompt, max_tokens=50, temperature=0),
                req(2, prompts["long"], max_tokens=50, temperature=0),
                req(3, [], max_tokens=50),
            ]
        )
    )
    assert outputs[1] == StepOutput(2, [], "", "length")
    assert outputs[2] == StepOutput(3, [], "", "length")
    drain(engine, transcript)
    assert len(transcript.tokens[1]) == 3
    assert transcript.finish[1] == "length"


# -- membership -------------------------------------------------------------------------


def test_remove_frees_the_row_and_others_continue(engine, prompts):
    solo_c = run_alone(engine, prompts["c"], max_tokens=10, temperature=0).tokens[1]
    transcript = Transcript()
    transcript.take(
        engine.add(
            [
                req(1, prompts["a"], max_tokens=10, temperature=0),
                req(2, prompts["b"], max_tokens=10, temperature=0),
                req(3, prompts["c"], max_tokens=10, temperature=0),
            ]
        )
    )
    transcript.take(engine.step())
    engine.remove([2, 12345])
    assert engine.running == 2
    assert [o.seq_id for o in transcript.take(engine.step())] == [1, 3]
    drain(engine, transcript)
    assert transcript.tokens[3] == solo_c
    assert 2 not in transcript.finish and len(transcript.tokens[2]) == 2

    engine.add([req(4, prompts["a"], max_tokens=10)])
    engine.remove([4])
    assert engine.running == 0
    assert engine.step() == []


def test_admission_errors_leave_state_unchanged(engine, prompts, monkeypatch):
    monkeypatch.setattr(engine, "max_running", 2)
    with pytest.raises(ValueError, match="max_running"):
        engine.add([req(i, prompts["a"], max_tokens=4) for i in range(3)])
    assert engine.running == 0
    engine.add([req(1, prompts["a"], max_tokens=4)])
    with pytest.raises(ValueError, match="duplicate"):
        engine.add([req(1, prompts["b"], max_tokens=4)])
    assert engine.running_ids == [1]


# -- text handling ----------------------------------------------------------------------


def test_chat_template_and_prompt_encoding(engine):
    tok = engine.tokenizer
    ids = engine.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids).endswith("<|assistant|>\n")
    assert engine.encode_prompt("hi")[0] == tok.bos_token_id
    with pytest.raises(ChatTemplateError, match="Unsupported role: wizard"):
        engine.encode_chat([{"role": "wizard", "content": "hi"}])


# -- sampling ---------------------------------------------------------------------------


def test_sampling_draws_one_number_per_step_and_respects_top_p():
    order = torch.randperm(1000, generator=make_generator(0))
    logits = torch.linspace(0.0, 1.0, 1000)[order].repeat(3, 1)
    samplers = [
        SequenceSampler.create(0.0, 1.0, None),
        SequenceSampler.create(1.0, 0.5, 11),
        SequenceSampler.create(1.0, 1.0, 12),
    ]
    tokens = sample_next_tokens(logits, samplers)
    assert tokens[0] == int(logits[0].argmax())

    reference = make_generator(11)
    torch.rand(1, generator=reference)
    assert torch.equal(torch.rand(1, generator=samplers[1].generator), torch.rand(1, generator=reference))

    probs = logits[0].softmax(-1)
    ordered = probs.argsort(descending=True)
    cumulative = probs[ordered].cumsum(0)
    # 0.5 spills past the topk prefilter on this flat distribution; 0.05 fits inside it.
    for top_p, more_than_prefilter in ((0.5, True), (0.05, False)):
        size = int((cumulative < top_p).sum()) + 1
        assert (size > 256) == more_than_prefilter
        nucleus = set(ordered[:size].tolist())
        picks = [sample_next_tokens(logits[:1], [SequenceSampler.create(1.0, top_p, seed)])[0] for seed in range(40)]
        assert set(picks) <= nucleus
        assert len(set(picks)) > 10


# -- build ------------------------------------------------------------------------------


def test_tiny_chat_build_is_deterministic_and_cached(tiny_chat_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    import engine.tiny_chat as tiny_chat

    def fingerprint(path: Path) -> tuple[str, list[int]]:
        weights = load_file(str(path / "model.safetensors"))
        digest = hashlib.sha256()
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            digest.update(weights[name].numpy().tobytes())
        ids = AutoTokenizer.from_pretrained(str(path)).encode("Ferry carries café 東京 batches 😀")
        return digest.hexdigest(), ids

    again = Path(tiny_chat.ensure_tiny_chat(tmp_path / "again"))
    assert fingerprint(again) == fingerprint(tiny_chat_dir)

    monkeypatch.setattr(tiny_chat, "build_tiny_chat", lambda out_dir: pytest.fail("rebuilt a cached model"))
    assert tiny_chat.ensure_tiny_chat(tiny_chat_dir) == str(tiny_chat_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["again"], "staging directory left behind"


def test_the_engine_is_what_the_batcher_asks_for(engine):
    from batcher.protocols import SteppingEngine

    assert isinstance(engine, SteppingEngine)


def test_engine_package_does_not_import_the_server_layers():
    forbidden = {"starlette", "uvicorn", "gateway", "batcher"}
    for path in (Path(__file__).parents[2] / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & forbidden, f"{path.name} imports {names}"


def test_churn_through_compaction_and_growth_keeps_every_row_exact(engine, prompts):
    """Hundreds of steps of staggered joins, finishes and cancellations move the shared
    write column past the buffer's end (compaction), and a prompt wider than the buffer
    forces it to grow; every sequence still gets exactly its solo greedy tokens."""
    import random

    rng = random.Random(3)
    wide = engine.encode_prompt("boats carry people across the wide river " * 40)
    pool = [prompts["a"], prompts["b"], prompts["c"], prompts["long"]]
    solo = {}

    def expected(prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        if key not in solo:
            solo[key] = run_alone(engine, prompt, max_tokens=48, temperature=0).tokens[1]
        return solo[key][:max_tokens]

    for prompt in [*pool, wide]:
        expected(prompt, 1)
    engine._batch = RunningBatch(engine.max_running)  # fresh buffers, sized by short prompts
    transcript, asked, cancelled = Transcript(), {}, set()
    capacities, starts, next_id = set(), set(), 1
    for step in range(420):
        if engine.running < 12 and rng.random() < 0.5:
            group = []
            # One wide prompt alone: two would share their prefix, held apart (engine/sharing.py),
            # and their slots would not need the width.
            for _ in range(1 if step == 300 else rng.randint(1, 3)):
                prompt = wide if step == 300 else rng.choice(pool)
                asked[next_id] = (prompt, rng.randint(1, 48))
                group.append(req(next_id, prompt, max_tokens=asked[next_id][1], temperature=0))
                next_id += 1
            transcript.take(engine.add(group))
        if engine.running and rng.random() < 0.03:
            victim = rng.choice(engine.running_ids)
            engine.remove([victim])
            cancelled.add(victim)
        transcript.take(engine.step())
        capacities.add(engine._batch.capacity)
        starts.add(engine._batch.start)
    drain(engine, transcript)
    assert len(capacities) > 1, "the wide prompt should have grown the buffers"
    assert max(starts) > 0 and min(starts) == 0, "the write column should have wrapped by compaction"
    finished = [i for i in asked if i not in cancelled]
    assert len(finished) > 100
    for seq_id in finished:
        prompt, max_tokens = asked[seq_id]
        assert transcript.tokens[seq_id] == expected(prompt, max_tokens), seq_id
