"""gateway/translate/chat.py without HTTP: request bodies in, work items and response
bodies out, over the fake generation engine."""

from __future__ import annotations

from typing import Any

import pytest

from batcher.types import GenResult
from engine.fake import FakeGenerationEngine
from gateway.config import ServerConfig
from gateway.errors import APIError
from gateway.limits import request_models
from gateway.translate.chat import (
    COMPLETIONS_MAX_TOKENS,
    check_generation,
    generation_work,
    stops_per_prompt,
)
from gateway.translate.stream import StreamChunks

CFG = ServerConfig()
CONV_A = [{"role": "user", "content": "hi"}]
CONV_B = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "colors?"}]


def chat_body(**fields: Any):
    return request_models(CFG).chat.model_validate({"model": "fake-chat", **fields})


def completion_body(**fields: Any):
    return request_models(CFG).completions.model_validate({"model": "fake-chat", **fields})


def refusal(call: Any) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


def test_each_conversation_goes_through_the_chat_template():
    engine = FakeGenerationEngine()
    work = generation_work(chat_body(messages=[CONV_A, CONV_B]), engine, CFG)
    assert work.prompts == [engine.encode_chat(CONV_A), engine.encode_chat(CONV_B)]
    assert work.model == "fake-chat" and work.chat


def test_completion_prompts_are_encoded_as_they_are():
    engine = FakeGenerationEngine()
    work = generation_work(completion_body(prompt="abc"), engine, CFG)
    assert work.prompts == [engine.encode_prompt("abc")] and not work.chat


def test_a_completion_prompt_of_no_tokens_is_refused_before_the_engine():
    """ "" on a model whose tokenizer adds no start token (GPT-2, Qwen) tokenizes to nothing:
    a 422 naming the prompt, never a sequence with nothing to condition on."""

    class NoStartToken(FakeGenerationEngine):
        def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [] if not text else super().encode_prompt(text, add_special_tokens)

    engine = NoStartToken()
    err = refusal(lambda: generation_work(completion_body(prompt=["abc", ""]), engine, CFG))
    assert (err.status, err.code, err.param) == (422, "empty_prompt", "prompt") and "prompt 1" in err.message
    assert generation_work(completion_body(prompt="abc"), engine, CFG).prompts == [engine.encode_prompt("abc")]


def test_scalars_apply_to_every_prompt_and_lists_one_value_each():
    body = chat_body(messages=[CONV_A, CONV_B], temperature=0.5, top_p=[0.9, 0.8], seed=[1, 2], max_tokens=[3, 4])
    params = generation_work(body, FakeGenerationEngine(), CFG).params
    assert [(p.temperature, p.top_p, p.seed, p.max_tokens) for p in params] == [(0.5, 0.9, 1, 3), (0.5, 0.8, 2, 4)]


def test_defaults_when_the_request_says_nothing():
    work = generation_work(chat_body(messages=CONV_A), FakeGenerationEngine(max_context=512), CFG)
    (params,) = work.params
    assert (params.temperature, params.top_p, params.seed, params.stop) == (1.0, 1.0, None, [])
    assert params.max_tokens == 512 - len(work.prompts[0])  # the context leaves less than the server limit


def test_chat_runs_to_the_server_limit_and_completions_to_16_tokens_by_default():
    engine = FakeGenerationEngine(max_context=100_000)
    (chat_params,) = generation_work(chat_body(messages=CONV_A), engine, CFG).params
    (completion_params,) = generation_work(completion_body(prompt="a"), engine, CFG).params
    assert chat_params.max_tokens == CFG.max_completion_tokens
    assert completion_params.max_tokens == COMPLETIONS_MAX_TOKENS == 16


def test_max_tokens_never_exceed_what_the_context_leaves():
    engine = FakeGenerationEngine(max_context=20)
    (params,) = generation_work(completion_body(prompt="abcde", max_tokens=100), engine, CFG).params
    assert params.max_tokens == 20 - 5


def test_max_completion_tokens_wins_over_max_tokens_and_names_the_field():
    (params,) = generation_work(
        chat_body(messages=CONV_A, max_tokens=9, max_completion_tokens=3), FakeGenerationEngine(), CFG
    ).params
    assert params.max_tokens == 3
    err = refusal(lambda: check_generation(chat_body(messages=[CONV_A, CONV_B], max_completion_tokens=[1])))
    assert (err.status, err.code, err.param) == (422, "prompt_count_mismatch", "max_completion_tokens")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", [0.1, 0.2, 0.3]),
        ("max_tokens", [4]),
        ("seed", [1, 2, 3]),
        ("stop", [["a"], ["b"], ["c"]]),
        ("top_p", [0.5]),
    ],
)
def test_a_per_prompt_list_of_the_wrong_length_is_refused_naming_the_field(field, value):
    body = chat_body(messages=[CONV_A, CONV_B], **{field: value})
    err = refusal(lambda: check_generation(body))
    assert (err.status, err.code, err.param) == (422, "prompt_count_mismatch", field)
    assert err.message == (
        f"{field} is a list of {len(value)} values but the request has 2 prompts; "
        "give one value per prompt or a single value for all"
    )
    # The same check, once, whether a batch file is validated or a request translated.
    assert refusal(lambda: generation_work(body, FakeGenerationEngine(), CFG)).message == err.message


@pytest.mark.parametrize(
    "stop, expected",
    [
        (None, [[], []]),
        ("x", [["x"], ["x"]]),
        (["x", "y"], [["x", "y"], ["x", "y"]]),  # a list of strings is for every prompt (OpenAI)
        ([["x"], None], [["x"], []]),
        (["x", ["y", "z"]], [["x"], ["y", "z"]]),
    ],
)
def test_stop_strings_per_prompt(stop, expected):
    assert stops_per_prompt(stop, 2) == expected


def test_a_prompt_longer_than_the_context_is_refused_naming_it():
    engine = FakeGenerationEngine(max_context=64)
    body = chat_body(messages=[CONV_A, [{"role": "user", "content": "x" * 500}]])
    err = refusal(lambda: generation_work(body, engine, CFG))
    assert (err.status, err.code, err.param) == (422, "context_length_exceeded", "messages")
    assert err.message.startswith("prompt 1 has ") and err.message.endswith("at most 63 prompt tokens (context 64)")
    check_generation(body)  # needs the tokenizer: not a batch-file check


def test_max_prompt_tokens_lowers_the_prompt_limit():
    cfg = ServerConfig(max_prompt_tokens=3)
    err = refusal(lambda: generation_work(completion_body(prompt="abcd"), FakeGenerationEngine(), cfg))
    assert (err.code, err.param) == ("context_length_exceeded", "prompt")
    assert "at most 3 prompt tokens" in err.message


@pytest.mark.parametrize(
    "messages, param",
    [([{"role": "tool", "content": "x"}], "messages"), ([CONV_A, [{"role": "tool", "content": "x"}]], "messages.1")],
)
def test_a_conversation_the_template_refuses_names_the_prompt(messages, param):
    err = refusal(lambda: generation_work(chat_body(messages=messages), FakeGenerationEngine(), CFG))
    assert (err.status, err.code, err.param) == (422, "chat_template_error", param)
    index = param.rpartition(".")[2] if "." in param else "0"
    assert err.message == (
        f"prompt {index}: the chat template of fake-chat refuses this conversation: Unsupported role: tool"
    )


def test_one_item_per_prompt_and_candidate_prompt_major_with_distinct_seeds():
    work = generation_work(completion_body(prompt=["ab", "cde"], n=2, seed=[10, 20]), FakeGenerationEngine(), CFG)
    assert work.prompt_index == [0, 0, 1, 1]
    assert [g.params.seed for g in work.payloads] == [10, 11, 20, 21]
    assert work.costs == [2, 2, 3, 3]
    assert work.payloads[0].params is not work.payloads[1].params


def _result(text: str, finish: str, tokens: int, cached: int = 0) -> GenResult:
    return GenResult(text, finish, 0, tokens, cached)


NO_CACHE = {"prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_response_body():
    work = generation_work(chat_body(messages=[CONV_A, CONV_B]), FakeGenerationEngine(), CFG)
    body = work.response([_result("w0 ", "length", 1), _result("w0 w1 ", "stop", 2)])
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["object"] == "chat.completion" and body["model"] == "fake-chat"
    assert body["choices"] == [
        {
            "index": 0,
            "prompt_index": 0,
            "message": {"role": "assistant", "content": "w0 "},
            "finish_reason": "length",
            "logprobs": None,
        },
        {
            "index": 1,
            "prompt_index": 1,
            "message": {"role": "assistant", "content": "w0 w1 "},
            "finish_reason": "stop",
            "logprobs": None,
        },
    ]
    prompt = len(work.prompts[0]) + len(work.prompts[1])
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3, **NO_CACHE}


def test_completions_response_counts_each_prompt_once_whatever_n():
    work = generation_work(completion_body(prompt="abc", n=2, max_tokens=1), FakeGenerationEngine(), CFG)
    body = work.response([_result("a", "length", 1), _result("b", "length", 1)])
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert [list(c) for c in body["choices"]] == [["index", "prompt_index", "text", "finish_reason", "logprobs"]] * 2
    assert [c["text"] for c in body["choices"]] == ["a", "b"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, **NO_CACHE}


def test_cached_tokens_count_once_per_prompt_as_prompt_tokens_do():
    """Each prompt's first candidate's count: its candidates share its prompt, which
    prompt_tokens counts once too."""
    work = generation_work(completion_body(prompt=["a" * 40, "b" * 20], n=2, max_tokens=1), FakeGenerationEngine(), CFG)
    results = [_result("x", "length", 1, cached) for cached in (32, 32, 16, 0)]
    assert work.response(results)["usage"] == {
        "prompt_tokens": 60,
        "completion_tokens": 4,
        "total_tokens": 64,
        "prompt_tokens_details": {"cached_tokens": 32 + 16},
    }
    assert work.cached_tokens([None, None, _result("x", "length", 1, 16), None]) == 16  # failed items: 0


def test_chat_stream_chunks_carry_the_role_once_then_content():
    work = generation_work(chat_body(messages=[CONV_A, CONV_B]), FakeGenerationEngine(), CFG)
    chunks = StreamChunks(work)
    first, second, last = chunks.delta(1, "w0 ", None), chunks.delta(1, "w1 ", None), chunks.delta(1, "", "length")
    assert first["id"].startswith("chatcmpl-") and first["object"] == "chat.completion.chunk"
    assert {c["id"] for c in (first, second, last)} == {chunks.id}
    assert first["choices"] == [
        {
            "index": 1,
            "prompt_index": 1,
            "finish_reason": None,
            "logprobs": None,
            "delta": {"role": "assistant", "content": "w0 "},
        }
    ]
    assert second["choices"][0]["delta"] == {"content": "w1 "}
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"


def test_completion_stream_chunks_always_have_text():
    chunks = StreamChunks(generation_work(completion_body(prompt=["a", "b"]), FakeGenerationEngine(), CFG))
    chunk = chunks.delta(0, None, "stop")
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "prompt_index": 0, "finish_reason": "stop", "logprobs": None, "text": ""}]


def test_an_error_rides_on_the_item_s_own_final_chunk():
    work = generation_work(completion_body(prompt=["a", "b"], n=2), FakeGenerationEngine(), CFG)
    chunk = StreamChunks(work).error(3, APIError(504, "too late", code="deadline_exceeded"))
    (choice,) = chunk["choices"]
    assert (choice["index"], choice["prompt_index"], choice["finish_reason"]) == (3, 1, "content_filter")
    assert choice["error"] == {
        "message": "too late",
        "type": "timeout_error",
        "param": None,
        "code": "deadline_exceeded",
        "status": 504,
        "prompt_index": 1,
        "index": 3,
    }


def test_usage_chunk_has_no_choices():
    chunks = StreamChunks(generation_work(chat_body(messages=CONV_A), FakeGenerationEngine(), CFG))
    prompt = len(chunks.work.prompts[0])
    assert chunks.usage(5) == {
        "id": chunks.id,
        "object": "chat.completion.chunk",
        "created": chunks.created,
        "model": "fake-chat",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5, **NO_CACHE},
    }
    assert chunks.usage(5, 16)["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
