"""Constrained decoding on the tiny chat model: every answer validates, constrained and free
rows share a batch without changing each other's tokens, schemas compile once."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.base import SamplingParams, SequenceRequest
from engine.grammar import GrammarError, canonical_schema
from tests.engine.test_generation import Transcript, drain, prompts, req, run_alone

__all__ = ["prompts"]  # the module-scoped fixture, shared

pytestmark = pytest.mark.model

# Objects, arrays, enums, numbers and nested required fields, each bounded so that even a
# model with random weights closes every value well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["river", "lake", "sea"]},
        "depth": {"type": "integer", "minimum": -50, "maximum": 5000},
        "ratio": {"type": "number", "enum": [0.25, 0.5, 1.5]},
        "open": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "kind", "depth", "ratio", "open", "tags", "owner"],
    "additionalProperties": False,
}
TEXT = canonical_schema(SCHEMA)
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def prompt(_shared_engine) -> list[int]:
    return _shared_engine.encode_chat([{"role": "user", "content": "Describe a river as JSON."}])


def constrained(seq_id: int, prompt: list[int], seed: int, schema: str = TEXT, **params) -> SequenceRequest:
    params.setdefault("temperature", 1.0)
    return SequenceRequest(seq_id, prompt, SamplingParams(MAX_TOKENS, seed=seed, json_schema=schema, **params))


def test_every_seed_gives_an_answer_that_validates(engine, prompt):
    rows = engine.max_running
    transcript = Transcript()
    for first in range(0, 100, rows):
        seeds = range(first, min(first + rows, 100))
        transcript.take(engine.add([constrained(s + 1, prompt, s) for s in seeds]))
        drain(engine, transcript, max_steps=MAX_TOKENS + 1)
    assert len(transcript.finish) == 100
    for seq_id, text in transcript.text.items():
        assert transcript.finish[seq_id] == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(transcript.text.values())) > 50, "seeds should give different answers"


def test_constrained_and_free_rows_share_a_batch_unchanged(engine, prompt, prompts):
    free = {"temperature": 0.8, "top_p": 0.9, "seed": 3, "max_tokens": 24}
    solo_free = run_alone(engine, prompts["b"], **free).tokens[1]
    solo_greedy = run_alone(engine, prompts["a"], max_tokens=24, temperature=0).tokens[1]
    alone = Transcript()
    alone.take(engine.add([constrained(1, prompt, 11, top_p=0.9)]))
    solo_constrained = drain(engine, alone).tokens[1]

    mixed = Transcript()
    mixed.take(
        engine.add(
            [
                req(2, prompts["b"], **free),
                constrained(1, prompt, 11, top_p=0.9),
                req(3, prompts["a"], max_tokens=24, temperature=0),
                constrained(4, prompts["long"], 5, temperature=0.0),
            ]
        )
    )
    drain(engine, mixed)
    assert mixed.tokens[2] == solo_free
    assert mixed.tokens[3] == solo_greedy
    assert mixed.tokens[1] == solo_constrained
    jsonschema.validate(json.loads(mixed.text[4]), SCHEMA)

    staggered = Transcript()
    staggered.take(engine.add([req(2, prompts["b"], **free)]))
    staggered.take(engine.step())
    staggered.take(engine.add([constrained(1, prompt, 11, top_p=0.9)]))
    drain(engine, staggered)
    assert staggered.tokens[2] == solo_free
    assert staggered.tokens[1] == solo_constrained


def test_stop_strings_and_max_tokens_apply_to_constrained_rows(engine, prompt):
    full = Transcript()
    full.take(engine.add([constrained(1, prompt, 4)]))
    text = drain(engine, full).text[1]
    cut = text.index('"kind"')
    stopped = Transcript()
    stopped.take(engine.add([constrained(1, prompt, 4, stop=['"kind"'])]))
    drain(engine, stopped)
    assert stopped.text[1] == text[:cut]
    assert stopped.finish[1] == "stop"

    short = Transcript()
    short.take(engine.add([SequenceRequest(1, prompt, SamplingParams(5, seed=4, json_schema=TEXT))]))
    drain(engine, short)
    assert short.finish[1] == "length"
    assert len(short.tokens[1]) == 5
    assert text.startswith(short.text[1])


def test_each_schema_compiles_once(engine):
    schema = canonical_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    misses = engine.grammars.misses
    engine.grammars.compile(schema)
    engine.grammars.compile(schema)
    engine.grammars.matcher(schema)
    assert engine.grammars.misses == misses + 1
    assert schema in engine.grammars


@pytest.mark.parametrize(
    ("schema", "path", "words"),
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "/properties/a/type", "strin"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "/properties/a", "not"),
        ({"type": "array", "items": {"type": "string", "format": "weird"}}, "/items", "weird"),
        ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "/properties/a", "missing"),
    ],
)
def test_a_schema_that_cannot_compile_names_the_place(engine, schema, path, words):
    with pytest.raises(GrammarError) as err:
        engine.grammars.compile(canonical_schema(schema))
    assert err.value.path == path
    assert words in err.value.message


def test_masks_touch_only_constrained_rows_and_never_allow_padding_columns(engine):
    import torch

    from engine.grammar import RowMasks

    vocab = engine.grammars.vocab_size
    matcher = engine.grammars.matcher(canonical_schema({"enum": ["river"]}))
    logits = torch.zeros((3, vocab + 5))
    RowMasks(1, vocab).apply(logits, [None, matcher, None])
    assert bool((logits[0] == 0).all()) and bool((logits[2] == 0).all())
    allowed = (logits[1] == 0).nonzero().squeeze(1).tolist()
    assert allowed and all(t < vocab for t in allowed)
    assert all(engine.tokenizer.decode([t]).startswith('"') for t in allowed)
    assert bool(torch.isinf(logits[1, vocab:]).all())


def test_after_thinking_the_schema_binds_the_answer_only(engine):
    """A thinking row's constraint (`after_thinking`): any text up to `</think>`, then only
    what the schema allows, and the row ends when the answer is complete."""
    from engine.grammar import after_thinking

    wrapped = after_thinking(canonical_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))
    tokenizer = engine.tokenizer
    free = engine.grammars.matcher(wrapped)
    ids = tokenizer.encode('Twelve, I think.\n</think>\n\n{"a":12}', add_special_tokens=False)
    assert all(free.consume_token(t) for t in ids) and free.is_stopped()
    strict = engine.grammars.matcher(wrapped)
    ids = tokenizer.encode("x</think>hello", add_special_tokens=False)
    assert [strict.consume_token(t) for t in ids][-5:] != [True] * 5  # "hello" is no JSON
    with pytest.raises(GrammarError):
        engine.grammars.compile(after_thinking(canonical_schema({"type": "object", "if": {}})))
