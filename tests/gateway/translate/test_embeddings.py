"""gateway/translate/embeddings.py without HTTP, over the fake embedding engine."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from engine.fake import FakeEmbeddingEngine
from gateway.config import ServerConfig
from gateway.errors import APIError
from gateway.limits import request_models
from gateway.translate.embeddings import check_embeddings, embedding_work

CFG = ServerConfig()


def body(**fields: Any):
    return request_models(CFG).embeddings.model_validate({"model": "fake-embed", **fields})


def refusal(call: Any) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


@pytest.mark.parametrize("given, inputs", [([101, 7, 102], [[101, 7, 102]]), ([[101, 102], [5]], [[101, 102], [5]])])
def test_token_ids_are_taken_as_given_one_item_per_input(given, inputs):
    engine = FakeEmbeddingEngine()
    work = embedding_work(body(input=given), engine, CFG)
    assert work.payloads == inputs and work.costs == [len(ids) for ids in inputs]


def test_token_ids_outside_the_vocabulary_or_the_length_or_for_a_text_only_model_are_refused():
    engine = FakeEmbeddingEngine(max_length=4)
    err = refusal(lambda: embedding_work(body(input=[[1, 2], [3, engine.vocab_size]]), engine, CFG))
    assert (err.status, err.code, err.param) == (422, "invalid_token_id", "input") and "input[1]" in err.message
    err = refusal(lambda: embedding_work(body(input=[1, 2, 3, 4, 5]), engine, CFG))
    assert (err.code, err.param) == ("context_length_exceeded", "input")  # ids are not cut: the end token would go
    err = refusal(lambda: check_embeddings(body(input=[1, 2]), engine_without_vocab()))
    assert (err.code, err.param) == ("unsupported_parameter", "input")
    with pytest.raises(ValidationError, match="too_many_inputs"):  # token-id lists counted as inputs
        body(input=[[1]] * (CFG.max_inputs + 1))
    assert len(body(input=list(range(CFG.max_inputs + 5))).inputs) == 1  # one input of many ids


def engine_without_vocab() -> FakeEmbeddingEngine:
    engine = FakeEmbeddingEngine()
    del engine.vocab_size
    return engine


@pytest.mark.parametrize("given, inputs", [("one two", ["one two"]), (["a", "b c"], ["a", "b c"])])
def test_one_string_or_a_list_is_one_item_per_input(given, inputs):
    engine = FakeEmbeddingEngine()
    b = body(input=given)
    assert b.inputs == inputs
    work = embedding_work(b, engine, CFG)
    assert work.payloads == engine.tokenize(inputs)
    assert work.costs == [len(ids) for ids in work.payloads]
    assert work.model == "fake-embed"


def test_dimensions_other_than_the_model_s_are_refused():
    engine = FakeEmbeddingEngine(dim=8)
    check_embeddings(body(input="a", dimensions=8), engine)
    err = refusal(lambda: check_embeddings(body(input="a", dimensions=4), engine))
    assert (err.status, err.code, err.param) == (422, "invalid_value", "dimensions")
    assert err.message == "dimensions: fake-embed produces 8-dimensional embeddings; other sizes are not supported"
    assert refusal(lambda: embedding_work(body(input="a", dimensions=4), engine, CFG)).message == err.message


def test_an_input_over_max_prompt_tokens_is_refused_naming_it():
    cfg = ServerConfig(max_prompt_tokens=3)
    err = refusal(lambda: embedding_work(body(input=["a", "a b c"]), FakeEmbeddingEngine(), cfg))
    assert (err.status, err.code, err.param) == (422, "too_many_tokens", "input")
    assert err.message == "input[1] has 5 tokens; the limit is 3"


def test_response_body_as_floats_and_as_base64():
    engine = FakeEmbeddingEngine(dim=4)
    work = embedding_work(body(input=["a", "b"]), engine, CFG)
    results = engine.embed(work.payloads)
    out = work.response(results)
    assert list(out) == ["object", "data", "model", "usage"]
    assert out["object"] == "list" and out["model"] == "fake-embed"
    assert [(d["object"], d["index"]) for d in out["data"]] == [("embedding", 0), ("embedding", 1)]
    assert np.allclose(out["data"][0]["embedding"], results[0].vector)
    tokens = sum(r.tokens for r in results)
    assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    packed = embedding_work(body(input=["a", "b"], encoding_format="base64"), engine, CFG).response(results)
    decoded = np.frombuffer(base64.b64decode(packed["data"][1]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, results[1].vector)
