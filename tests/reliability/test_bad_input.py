"""A table of bad inputs over every route: each gets its documented status and error code,
nothing reaches an engine, and the server still serves the next good request."""

from __future__ import annotations

import httpx
import pytest

E, C = "/v1/embeddings", "/v1/chat/completions"
P = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # route, raw body, status, code, param
    (E, b"{oops", 400, "invalid_json", None),
    (C, b"{oops", 400, "invalid_json", None),
    (P, b"\xff\xfe\x00garbage", 400, "invalid_json", None),  # not UTF-8
    (C, b'"just a string"', 400, "invalid_json", None),
    (E, b'{"model": "fake-embed"}', 422, "invalid_value", "input"),
    (C, b'{"model": "fake-chat"}', 422, "invalid_value", "messages"),
    (P, b'{"model": "fake-chat"}', 422, "invalid_value", "prompt"),
    (E, b'{"model": 3, "input": "x"}', 422, "invalid_value", "model"),
    (C, b'{"model": "fake-chat", "messages": []}', 422, "invalid_value", "messages"),
    (C, b'{"model": "fake-chat", "messages": [[]]}', 422, "invalid_value", "messages.0"),
    (P, b'{"model": "fake-chat", "prompt": []}', 422, "invalid_value", "prompt"),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "robot", "content": "x"}]}',
        422,
        "invalid_value",
        "messages.0.role",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "temperature": -1}',
        422,
        "invalid_value",
        "temperature",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        "invalid_json",
        None,
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
        400,
        "invalid_json",
        None,
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e30}',
        422,
        "invalid_value",
        "max_tokens",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}',
        422,
        "invalid_value",
        "max_tokens",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "n": 1000}',
        422,
        "invalid_value",
        "n",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        422,
        "invalid_value",
        "stream",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}',
        422,
        "logprobs_required",
        "top_logprobs",
    ),
    (
        C,  # echo is the legacy completions' (served there); chat refuses it by name
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "echo": true}',
        422,
        "unsupported_parameter",
        "echo",
    ),
    (
        C,  # OpenAI refuses it too: options for a stream that is not sent
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}',
        422,
        "stream_options_without_stream",
        "stream_options",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "store": true}',
        422,
        "unsupported_parameter",
        "store",
    ),
    (P, b'{"model": "fake-chat", "prompt": "x", "best_of": 3}', 422, "unsupported_parameter", "best_of"),
    (P, b'{"model": "fake-chat", "prompt": "x", "suffix": "after"}', 422, "unsupported_parameter", "suffix"),
    (
        C,  # param names the path the client sent, not pydantic's branch ("tool_choice.NamedToolChoice...")
        (
            b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], '
            b'"tool_choice": {"type": "function", "function": {}}}'
        ),
        422,
        "invalid_value",
        "tool_choice.function.name",
    ),
    (
        C,  # nor the discriminator's value ("response_format.json_schema.json_schema.name")
        (
            b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], '
            b'"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}'
        ),
        422,
        "invalid_value",
        "response_format.json_schema.name",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3}',
        422,
        "invalid_value",
        "frequency_penalty",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}',
        422,
        "invalid_value",
        "logit_bias.x",
    ),
    (
        C,
        (
            b'{"model": "fake-chat", "messages": [[{"role": "user", "content": "a"}], '
            b'[{"role": "user", "content": "b"}]], "seed": [1]}'
        ),
        422,
        "prompt_count_mismatch",
        "seed",
    ),
    (
        P,
        b'{"model": "fake-chat", "prompt": ["a", "b"], "max_tokens": [1, 2, 3]}',
        422,
        "prompt_count_mismatch",
        "max_tokens",
    ),
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "stop": [""]}',
        422,
        "invalid_value",
        "stop",
    ),
    (E, b'{"model": "fake-embed", "input": "x", "latency_budget_ms": 0}', 422, "invalid_value", "latency_budget_ms"),
    (E, b'{"model": "fake-embed", "input": "x", "priority": "vip"}', 422, "invalid_value", "priority"),
    # The chat template refuses the role (issue 15: this was a 500 from inside make_plan).
    (
        C,
        b'{"model": "fake-chat", "messages": [{"role": "tool", "content": "x"}]}',
        422,
        "chat_template_error",
        "messages",
    ),
    (
        C,
        (
            b'{"model": "fake-chat", "messages": [[{"role": "user", "content": "x"}], '
            b'[{"role": "developer", "content": "x"}]]}'
        ),
        422,
        "chat_template_error",
        "messages.1",
    ),
    (E, b'{"model": "ghost", "input": "x"}', 404, "model_not_found", "model"),
    (C, b'{"model": "ghost", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found", "model"),
    (P, b'{"model": "fake-embed", "prompt": "x"}', 404, "model_not_found", "model"),
]


@pytest.fixture(scope="module")
def server():
    from ..conftest import fake_app
    from ..live import live

    with live(
        fake_app(
            max_body_bytes=10_000,
            max_prompts=4,
            max_inputs=4,
            max_completion_tokens=100,
            max_stop_strings=2,
            max_prompt_tokens=50,
        )
    ) as s:
        yield s


@pytest.mark.parametrize("route, raw, status, code, param", CASES)
def test_bad_input_gets_its_documented_error(server, route, raw, status, code, param):
    calls = [len(m.engine.calls) for m in server.ferry.models.values()]
    r = httpx.post(server.url + route, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    assert err["message"] and err["type"]
    assert [len(m.engine.calls) for m in server.ferry.models.values()] == calls  # nothing reached an engine
    good = httpx.post(server.url + C, json={"model": "fake-chat", "messages": MSG, "max_tokens": 2})
    assert good.status_code == 200


def test_openai_fields_that_change_nothing_here_are_served(server):
    """Values Ferry honours by doing nothing (no completion stored, one generation per
    choice, no suffix) and metadata such as `user` are served, not refused."""
    chat = {
        "model": "fake-chat",
        "messages": MSG,
        "max_tokens": 2,
        "store": False,
        "metadata": {"team": "search"},
        "prompt_cache_key": "tenant-7",
        "safety_identifier": "user-1234",
    }
    r = httpx.post(server.url + C, json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    done = {"model": "fake-chat", "prompt": "x", "max_tokens": 2, "best_of": 1, "suffix": ""}
    r = httpx.post(server.url + P, json=done)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


LIMITS = [
    (E, {"model": "fake-embed", "input": "x" * 20_000}, 413, "body_too_large"),
    (E, {"model": "fake-embed", "input": ["a"] * 5}, 422, "too_many_inputs"),
    (E, {"model": "fake-embed", "input": " ".join(["w"] * 60)}, 422, "too_many_tokens"),
    (C, {"model": "fake-chat", "messages": [MSG] * 5}, 422, "too_many_prompts"),
    (P, {"model": "fake-chat", "prompt": ["a"] * 5}, 422, "too_many_prompts"),
    (C, {"model": "fake-chat", "messages": MSG, "max_tokens": 101}, 422, "invalid_value"),
    (C, {"model": "fake-chat", "messages": MSG, "stop": ["a", "b", "c"]}, 422, "too_many_stop_strings"),
    (C, {"model": "fake-chat", "messages": [{"role": "user", "content": "x" * 80}]}, 422, "context_length_exceeded"),
]


@pytest.mark.parametrize("route, body, status, code", LIMITS)
def test_each_limit_has_its_own_clear_error(server, route, body, status, code):
    r = httpx.post(server.url + route, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["message"]


def test_a_refused_conversation_names_its_prompt_and_the_templates_words(server):
    convs = [[{"role": "user", "content": "a"}], [{"role": "tool", "content": "b"}]]
    r = httpx.post(server.url + C, json={"model": "fake-chat", "messages": convs, "stream": True})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"] == (
        "prompt 1: the chat template of fake-chat refuses this conversation: Unsupported role: tool"
    )


def test_unknown_route_and_method_answer_in_the_same_shape(server):
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.delete(server.url + "/v1/embeddings")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v2/models/i%0A/versions/x", 404),  # schemathesis' control character: no route matches
        ("GET", "/v2/nope", 404),
        ("DELETE", "/v2/health/live", 405),
        ("PUT", "/v2", 405),
    ],
)
def test_the_routers_own_answers_under_v2_keep_the_protocols_shape(server, method, path, status):
    """Under /v2 the Open Inference Protocol's `{"error": message}` holds, even where no
    route runs (the router's 404 and 405)."""
    r = httpx.request(method, server.url + path)
    assert r.status_code == status and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]


@pytest.mark.parametrize(
    "path, allow",
    [
        ("/v1/batches", {"GET", "HEAD", "POST"}),
        ("/admin/models/fake-chat/batching", {"GET", "HEAD", "PATCH"}),
        ("/v1/embeddings", {"POST"}),
    ],
)
def test_405_allow_lists_every_method_of_the_path(server, path, allow):
    r = httpx.request("OPTIONS", server.url + path)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert {m.strip() for m in r.headers["allow"].split(",")} == allow
