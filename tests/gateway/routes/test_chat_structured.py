"""Structured output and tool calls through /v1/chat/completions on ferry-tiny-chat (real
uvicorn, real model): schemas per prompt, forced tool calls, streaming, the official
openai client, and the 422s for what cannot be followed."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from .test_chat import sse_events

pytestmark = pytest.mark.model

MODEL = "ferry-tiny-chat"
CONV = [{"role": "user", "content": "Describe a ferry as JSON."}]
SHIP = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["ferry", "barge", "tug"]},
        "decks": {"type": "integer", "minimum": 1, "maximum": 9},
        "speed": {"type": "number", "enum": [4.5, 12, 20.25]},
        "crew": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "role": {"enum": ["captain", "mate"]},
                    "age": {"type": "integer", "minimum": 16, "maximum": 99},
                },
                "required": ["role", "age"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    },
    "required": ["name", "kind", "decks", "speed", "crew"],
    "additionalProperties": False,
}
DOCK = {
    "type": "object",
    "properties": {"open": {"type": "boolean"}, "berths": {"type": "integer", "minimum": 0, "maximum": 40}},
    "required": ["open", "berths"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather at a port",
        "parameters": {
            "type": "object",
            "properties": {
                "port": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["port", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIDES = {
    "type": "function",
    "function": {
        "name": "tides",
        "parameters": {
            "type": "object",
            "properties": {"hours": {"type": "integer", "minimum": 1, "maximum": 48}},
            "required": ["hours"],
            "additionalProperties": False,
        },
    },
}
MAX_TOKENS = 160


def fmt(schema: dict, name: str = "ship") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat(server, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("messages", CONV)
    body.setdefault("max_tokens", MAX_TOKENS)
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


# -- answers that validate ---------------------------------------------------------------------------
# A hundred seeds are the engine's test (tests/engine/test_grammar.py); over HTTP, half as
# many each way: the schema through the request, the stream and the response.
def test_fifty_seeds_all_validate(real_server):
    # 48 prompts in 3 requests of 16, one seed each, every answer checked.
    seen = set()
    for first in range(0, 48, 16):
        seeds = list(range(first, first + 16))
        r = chat(real_server, messages=[CONV] * len(seeds), seed=seeds, temperature=1.0, response_format=fmt(SHIP))
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), SHIP)
            seen.add(choice["message"]["content"])
    assert len(seen) > 24


def test_fifty_seeds_all_validate_streaming(real_server):
    for first in range(100, 150, 25):
        seeds = list(range(first, first + 25))
        body = {"model": MODEL, "messages": [CONV] * 25, "seed": seeds, "temperature": 1.0, "stream": True}
        body.update(max_tokens=MAX_TOKENS, response_format=fmt(SHIP))
        with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            events = sse_events(r)
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for ev in events[:-1]:
            for c in ev["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
        assert set(finish.values()) == {"stop"} and len(finish) == 25
        for text in texts.values():
            jsonschema.validate(json.loads(text), SHIP)


def test_streamed_and_whole_answers_are_the_same_for_a_seed(real_server):
    whole = chat(real_server, seed=5, temperature=0.9, response_format=fmt(SHIP)).json()
    with httpx.stream(
        "POST",
        real_server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CONV, "seed": 5, "temperature": 0.9, "stream": True}
        | {"max_tokens": MAX_TOKENS, "response_format": fmt(SHIP)},
        timeout=300,
    ) as r:
        events = sse_events(r)
    text = "".join(c["delta"].get("content") or "" for ev in events[:-1] for c in ev["choices"])
    assert text == whole["choices"][0]["message"]["content"]


def test_json_object_and_text_and_free_rows_in_one_request(real_server):
    small = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = chat(
        real_server,
        messages=[CONV, CONV, CONV],
        temperature=0,
        max_tokens=[24, MAX_TOKENS, MAX_TOKENS],
        response_format=[{"type": "text"}, fmt(DOCK, "dock"), None],
    )
    assert r.status_code == 200, r.text
    free, dock, none = r.json()["choices"]
    jsonschema.validate(json.loads(dock["message"]["content"]), DOCK)
    alone = chat(real_server, temperature=0, max_tokens=24).json()["choices"][0]["message"]["content"]
    assert free["message"]["content"] == alone
    assert none["message"]["content"] == chat(real_server, temperature=0).json()["choices"][0]["message"]["content"]
    obj = chat(real_server, temperature=0, response_format=fmt(small, "small"))
    assert json.loads(obj.json()["choices"][0]["message"]["content"]) in ({"a": True}, {"a": False})
    # Any object: random weights rarely close one, so only its start is certain.
    any_object = chat(real_server, temperature=0, max_tokens=8, response_format={"type": "json_object"}).json()
    assert any_object["choices"][0]["message"]["content"].startswith("{")


# -- tool calls -----------------------------------------------------------------------------------------
def test_a_named_tool_is_called_with_valid_arguments(real_server):
    for seed in range(5):
        r = chat(
            real_server,
            seed=seed,
            tools=[WEATHER, TIDES],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_required_calls_one_of_the_tools_streaming_and_not(real_server):
    c = client(real_server)
    names = set()
    for seed in range(8):
        res = c.chat.completions.create(
            model=MODEL, messages=CONV, tools=[WEATHER, TIDES], tool_choice="required", seed=seed, max_tokens=MAX_TOKENS
        )
        choice = res.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        tool = {"get_weather": WEATHER, "tides": TIDES}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        names.add(call.function.name)

        stream = c.chat.completions.create(
            model=MODEL,
            messages=CONV,
            tools=[WEATHER, TIDES],
            tool_choice="required",
            seed=seed,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        chunks = [ch for ch in stream if ch.choices]
        calls = [ch.choices[0].delta.tool_calls[0] for ch in chunks if ch.choices[0].delta.tool_calls]
        first, rest = calls[0], calls[1:]
        assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
        assert first.function.name == call.function.name
        assert all(f.id is None and f.function.name is None for f in rest)
        assert "".join(f.function.arguments or "" for f in calls) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert all(ch.choices[0].model_extra["prompt_index"] == 0 for ch in chunks)
    assert names == {"get_weather", "tides"}, "required picks among the tools"


def test_openai_client_streams_a_named_call(real_server):
    stream = client(real_server).chat.completions.create(
        model=MODEL,
        messages=CONV,
        tools=[TIDES],
        tool_choice={"type": "function", "function": {"name": "tides"}},
        max_tokens=MAX_TOKENS,
        stream=True,
        seed=3,
    )
    arguments, ids = "", set()
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            arguments += tc.function.arguments or ""
            ids.add(tc.id)
    jsonschema.validate(json.loads(arguments), TIDES["function"]["parameters"])
    assert len(ids - {None}) == 1


# -- the openai client's structured output helpers ------------------------------------------------------
class Crew(pydantic.BaseModel):
    role: Literal["captain", "mate"]
    age: int = pydantic.Field(ge=18, le=70)


class Ship(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: Literal["ferry", "barge", "tug"]
    crew: list[Crew] = pydantic.Field(max_length=2)


def test_openai_parse_with_a_pydantic_model(real_server):
    parse = getattr(client(real_server).chat.completions, "parse", None)
    if parse is None:
        parse = client(real_server).beta.chat.completions.parse
    for seed in range(3):
        res = parse(model=MODEL, messages=CONV, response_format=Ship, seed=seed, max_tokens=MAX_TOKENS)
        ship = res.choices[0].message.parsed
        assert isinstance(ship, Ship)
        assert Ship.model_validate_json(res.choices[0].message.content) == ship


def test_two_prompts_with_different_schemas_through_the_openai_client(real_server):
    res = client(real_server).chat.completions.create(
        model=MODEL,
        messages=CONV,
        max_tokens=MAX_TOKENS,
        seed=1,
        extra_body={"messages": [CONV, CONV], "response_format": [fmt(SHIP), fmt(DOCK, "dock")]},
    )
    ship, dock = res.choices
    assert (ship.model_extra["prompt_index"], dock.model_extra["prompt_index"]) == (0, 1)
    jsonschema.validate(json.loads(ship.message.content), SHIP)
    jsonschema.validate(json.loads(dock.message.content), DOCK)


def test_per_prompt_tools_and_choices(real_server):
    r = chat(
        real_server,
        messages=[CONV, CONV, CONV],
        tools=[[WEATHER], [TIDES], None],
        tool_choice=["required", {"type": "function", "function": {"name": "tides"}}, None],
        response_format=[None, None, fmt(DOCK, "dock")],
        parallel_tool_calls=False,
    )
    assert r.status_code == 200, r.text
    a, b, c = r.json()["choices"]
    assert a["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert b["message"]["tool_calls"][0]["function"]["name"] == "tides"
    jsonschema.validate(json.loads(c["message"]["content"]), DOCK)


# -- what cannot be followed ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": fmt({"type": "object", "properties": {"a": {"type": "strin"}}})},
            "response_format.json_schema.schema",
            "/properties/a/type",
        ),
        (
            {"messages": [CONV, CONV], "response_format": [None, fmt({"properties": {"a": {"not": {}}}})]},
            "response_format.1.json_schema.schema",
            "prompt 1",
        ),
        (
            {"response_format": fmt({"type": "array", "uniqueItems": True})},
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
            "if",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"messages": [CONV, CONV], "response_format": [None]}, "response_format", "2 prompts"),
        ({"messages": [CONV, CONV], "tools": [[WEATHER]]}, "tools", "2 prompts"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "cannot honour"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "set by the server"),
        ({"logit_bias": {"99999999": 10}}, "logit_bias", "not in the vocabulary"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"echo": True}, "echo", "cannot honour"),
    ],
)
def test_what_cannot_be_followed_is_a_422(real_server, body, param, words):
    r = chat(real_server, **body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert words in err["message"]


def test_completions_accept_response_format(real_server):
    r = httpx.post(
        real_server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "A dock:", "max_tokens": 64, "response_format": fmt(DOCK, "dock")},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), DOCK)


def test_a_model_that_cannot_constrain_refuses_with_a_422(fake_server_factory):
    s = fake_server_factory()
    r = httpx.post(
        s.url + "/v1/chat/completions",
        json={"model": "fake-chat", "messages": CONV, "response_format": fmt(DOCK, "dock")},
        timeout=30,
    )
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "unsupported_parameter"
    ok = httpx.post(
        s.url + "/v1/chat/completions",
        json={"model": "fake-chat", "messages": CONV, "response_format": {"type": "text"}},
        timeout=30,
    )
    assert ok.status_code == 200


def test_auto_shows_the_tools_to_the_template_and_none_does_not(real_server):
    plain = chat(real_server, max_tokens=4, temperature=0).json()
    auto = chat(real_server, max_tokens=4, temperature=0, tools=[WEATHER]).json()
    none = chat(real_server, max_tokens=4, temperature=0, tools=[WEATHER], tool_choice="none").json()
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert none["choices"][0]["message"] == plain["choices"][0]["message"]
    # With random weights the template's call format is not followed: the answer is text.
    assert auto["choices"][0]["message"]["content"] and auto["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("max_tokens", [2, 26])
def test_a_forced_call_cut_short_reads_the_same_streamed_and_not(real_server, max_tokens):
    body = {"model": MODEL, "messages": CONV, "seed": 3, "max_tokens": max_tokens, "tools": [WEATHER]}
    body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    whole = httpx.post(real_server.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=300) as r:
        choices = [c for ev in sse_events(r)[:-1] for c in ev["choices"]]
    assert whole["finish_reason"] == choices[-1]["finish_reason"] == "length"
    calls = [t for c in choices for t in c["delta"].get("tool_calls") or []]
    if max_tokens == 2:  # cut inside `{"name":"get_weather","arguments":`: the text as content
        assert not calls and whole["message"]["content"].startswith('{"')
        assert "".join(c["delta"].get("content") or "" for c in choices) == whole["message"]["content"]
        return
    (call,) = whole["message"]["tool_calls"]  # cut in its arguments: the call as far as it got
    assert whole["message"]["content"] is None and call["function"]["name"] == "get_weather"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(t["function"]["arguments"] for t in calls) == call["function"]["arguments"]
    assert call["function"]["arguments"].startswith("{")


def test_an_auto_answer_streams_as_the_whole_answer_reads(real_server):
    body = {"model": MODEL, "messages": CONV, "max_tokens": 8, "temperature": 0, "tools": [WEATHER]}
    whole = chat(real_server, max_tokens=8, temperature=0, tools=[WEATHER]).json()["choices"][0]
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=300) as r:
        events = sse_events(r)
    choices = [c for ev in events[:-1] for c in ev["choices"]]
    assert all(c["prompt_index"] == 0 for c in choices)
    assert "".join(c["delta"].get("content") or "" for c in choices) == whole["message"]["content"]
    assert choices[-1]["finish_reason"] == whole["finish_reason"]


def test_an_earlier_call_goes_back_to_the_template(real_server):
    first = chat(real_server, seed=2, tools=[TIDES], tool_choice="required").json()["choices"][0]["message"]
    history = [*CONV, first, {"role": "user", "content": "And tomorrow?"}]
    again = chat(real_server, messages=history, max_tokens=4, tools=[TIDES])
    assert again.status_code == 200, again.text
    without_call = [*CONV, {"role": "assistant", "content": ""}, {"role": "user", "content": "And tomorrow?"}]
    plain = chat(real_server, messages=without_call, max_tokens=4, tools=[TIDES]).json()
    call_tokens = again.json()["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert call_tokens > 5, "the call is written into the assistant turn"
    # The tiny chat's template has no tool role: a tool result is the template's refusal.
    result = {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "3 m"}
    refused = chat(real_server, messages=[*CONV, first, result], tools=[TIDES])
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "chat_template_error"
