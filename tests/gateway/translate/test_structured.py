"""Structures per prompt, forced calls read back as tool_calls, and a call's stream
split into OpenAI's delta.tool_calls fragments (no model needed)."""

from __future__ import annotations

import json

import pytest

from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.translate.structured import (
    FREE,
    Structure,
    ToolCallStream,
    chat_message,
    offered_tools,
    parse_call,
    structures,
)

CONV = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "move",
        "parameters": {"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]},
    },
}
STOP = {"type": "function", "function": {"name": "stop"}}
DOCK = {"type": "json_schema", "json_schema": {"name": "dock", "schema": {"type": "boolean"}}}


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": CONV, **body})


def test_scalars_apply_to_every_prompt_and_lists_per_prompt():
    body = chat(messages=[CONV, CONV, CONV], response_format=[DOCK, {"type": "json_object"}, None])
    a, b, c = structures(body, 3)
    assert json.loads(a.schema) == {"type": "boolean"} and not a.tool_call
    assert json.loads(b.schema) == {"type": "object"}
    assert c == FREE
    shared = structures(chat(messages=[CONV, CONV], response_format=DOCK), 2)
    assert shared[0] == shared[1] and shared[0].schema == '{"type":"boolean"}'
    completions = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "response_format": DOCK})
    assert [s.schema for s in structures(completions, 2)] == ['{"type":"boolean"}'] * 2


def test_forced_calls_are_call_schemas_and_auto_only_offers():
    named = structures(chat(tools=[TOOL, STOP], tool_choice={"type": "function", "function": {"name": "stop"}}), 1)[0]
    assert named.tool_call and named.tools == ("move", "stop")
    assert json.loads(named.schema)["properties"] == {
        "name": {"const": "stop"},
        "arguments": {"type": "object", "properties": {}, "additionalProperties": False},
    }
    required = structures(chat(tools=[TOOL, STOP], tool_choice="required"), 1)[0]
    assert [s["properties"]["name"]["const"] for s in json.loads(required.schema)["anyOf"]] == ["move", "stop"]
    auto = structures(chat(tools=[TOOL]), 1)[0]
    assert auto == Structure(tools=("move",))
    assert structures(chat(tools=[TOOL], tool_choice="none"), 1)[0] == FREE
    per_prompt = chat(messages=[CONV, CONV], tools=[[TOOL], None], tool_choice=["required", None])
    assert [s.tool_call for s in structures(per_prompt, 2)] == [True, False]
    assert offered_tools(per_prompt, 2) == [[TOOL], []]
    assert offered_tools(chat(tools=[TOOL], tool_choice="none"), 1) == [[]]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"tools": [TOOL, TOOL]}, "tools", "invalid_tools"),
        ({"messages": [CONV, CONV], "tools": [[TOOL], [STOP]], "tool_choice": "required"}, None, None),
        ({"messages": [CONV, CONV], "tool_choice": ["none", "required"], "tools": [TOOL, STOP]}, None, None),
        (
            {"messages": [CONV, CONV], "tool_choice": ["required"], "tools": [TOOL]},
            "tool_choice",
            "prompt_count_mismatch",
        ),
        ({"messages": [CONV, CONV], "parallel_tool_calls": [True]}, "parallel_tool_calls", "prompt_count_mismatch"),
        (
            {
                "messages": [CONV, CONV],
                "tools": [[TOOL], [STOP]],
                "tool_choice": {"type": "function", "function": {"name": "move"}},
            },
            "tool_choice",
            "invalid_tool_choice",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": "3"}}}},
            "response_format.json_schema.schema",
            "invalid_schema",
        ),
    ],
)
def test_what_structures_refuse(body, param, code):
    req = chat(**body)
    n = len(req.conversations)
    if param is None:
        structures(req, n)
        return
    with pytest.raises(APIError) as err:
        structures(req, n)
    assert (err.value.param, err.value.code, err.value.status) == (param, code, 422)


def test_a_completed_call_becomes_tool_calls():
    forced = Structure('{"type":"object"}', tool_call=True, tools=("move",))
    text = '{"name":"move","arguments":{"to":"dock"}}'
    message, reason = chat_message(forced, text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {"name": "move", "arguments": '{"to":"dock"}'}
    # Cut at the token limit after the head: the call as far as it got, finish_reason "length"
    # (as OpenAI answers, and as the stream sends it); cut before the head: the text as content.
    message, reason = chat_message(forced, text[:-3], "length")
    assert reason == "length" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "move", "arguments": '{"to":"dock'}
    assert chat_message(forced, text[:12], "length") == ({"role": "assistant", "content": text[:12]}, "length")
    # tool_choice auto: an answer that is exactly a call to an offered tool is one; anything else is content.
    auto = Structure(tools=("move",))
    assert chat_message(auto, text, "stop")[1] == "tool_calls"
    assert chat_message(auto, text.replace("move", "fly"), "stop")[1] == "stop"
    assert chat_message(FREE, text, "stop") == ({"role": "assistant", "content": text}, "stop")
    assert parse_call('{"name":"move","arguments":3}') is None


@pytest.mark.parametrize(
    "text",
    [
        '{"name":"move","arguments":{"to":"dock"}}',
        '{"name": "move", "arguments": {"to": "dock"}}',  # the tiny chat's template's own spacing
        '\n  {"arguments" : { "to" : "dock" } ,\n "name" : "move"}  \n',
    ],
)
def test_an_auto_answer_that_is_exactly_a_call_in_any_spacing_is_a_call(text):
    message, reason = chat_message(Structure(tools=("move",)), text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "move", "arguments": '{"to":"dock"}'}


@pytest.mark.parametrize(
    "text",
    [
        'I will call {"name": "move", "arguments": {"to": "dock"}}',
        '{"name": "move", "arguments": {"to": "dock"}} done',
        '{"name": "move", "arguments": {"to": "dock"}, "why": "tide"}',
        '{"name": "move", "arguments": "{\\"to\\": \\"dock\\"}"}',
        '{"name": "move", "arguments": {"to": "dock"}',
        '[{"name": "move", "arguments": {}}]',
    ],
)
def test_an_auto_answer_that_is_not_exactly_a_call_stays_content(text):
    assert parse_call(text) is None
    assert chat_message(Structure(tools=("move",)), text, "stop") == ({"role": "assistant", "content": text}, "stop")


@pytest.mark.parametrize("cuts", [[1], [3, 9, 20, 24, 30], list(range(1, 41))])
def test_a_call_streams_as_a_head_then_argument_fragments(cuts):
    text = '{"name":"move","arguments":{"to":"d}o{ck"}}'
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True) if text[a:b]]
    stream = ToolCallStream()
    entries = []
    for k, piece in enumerate(pieces):
        final = k == len(pieces) - 1
        entries += stream.feed(piece, final, complete=final)
    head, rest = entries[0], entries[1:]
    assert head == {"index": 0, "id": stream.id, "type": "function", "function": {"name": "move", "arguments": ""}}
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in rest)
    assert "".join(e["function"]["arguments"] for e in rest) == '{"to":"d}o{ck"}'


def streamed(s: Structure, pieces: list[str], finish_reason: str) -> tuple[dict, str]:
    """The message and finish_reason a client rebuilds from the chunks of one streamed choice."""
    from engine.base import SamplingParams
    from gateway.translate.chat import GenerationWork
    from gateway.translate.stream import StreamChunks

    chunks = StreamChunks(GenerationWork("m", True, [[1]], [SamplingParams()], [1], [s]))
    out = []
    for k, piece in enumerate(pieces):
        out += chunks.deltas(0, piece, finish_reason if k == len(pieces) - 1 else None)
    choices = [c["choices"][0] for c in out]
    assert all(c["prompt_index"] == 0 for c in choices)
    assert [c["finish_reason"] is not None for c in choices] == [False] * (len(choices) - 1) + [True]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    calls = [t for c in choices for t in c["delta"].get("tool_calls") or []]
    if not calls:
        return {"role": "assistant", "content": content}, choices[-1]["finish_reason"]
    assert not content and all(t["index"] == 0 for t in calls)
    head = calls[0]
    arguments = "".join(t["function"]["arguments"] for t in calls)
    call = {
        "id": head["id"],
        "type": head["type"],
        "function": {"name": head["function"]["name"], "arguments": arguments},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}, choices[-1]["finish_reason"]


def without_ids(answer: tuple[dict, str]) -> tuple[dict, str]:
    message, reason = answer
    return {**message, "tool_calls": [{**c, "id": "-"} for c in message.get("tool_calls") or []]}, reason


CALL = '{"name":"move","arguments":{"to":"dock"}}'


@pytest.mark.parametrize(
    ("text", "finish_reason"),
    [
        (CALL, "stop"),
        (CALL[:-3], "length"),  # cut by max_tokens after the head
        (CALL[:-3], "stop"),  # cut by a stop string
        (CALL[:20], "length"),  # cut inside the head
        (CALL[:28], "length"),  # right after the head
    ],
)
@pytest.mark.parametrize("size", [1, 4, 100])
def test_a_forced_call_streams_as_it_is_answered(text, finish_reason, size):
    forced = Structure('{"type":"object"}', tool_call=True, tools=("move",))
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    assert without_ids(streamed(forced, pieces, finish_reason)) == without_ids(
        chat_message(forced, text, finish_reason)
    )


@pytest.mark.parametrize(
    ("text", "finish_reason"),
    [
        (CALL, "stop"),
        ('  {"name": "move", "arguments": {"to": "dock"}}\n', "stop"),  # the template's spacing
        ('{"name": "fly", "arguments": {}}', "stop"),  # not an offered tool
        ('{"name": "move", "arguments": {"to": "do', "length"),  # cut short: not exactly a call
        ('{"name": "move", "arguments": {}} and then', "stop"),
        ("  \n ", "stop"),
        ("", "length"),
        ("the dock, then {} and more", "stop"),
        ("\n\nsail {", "length"),
    ],
)
@pytest.mark.parametrize("size", [1, 3, 100])
def test_an_auto_stream_agrees_with_the_whole_answer(text, finish_reason, size):
    auto = Structure(tools=("move",))
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    assert without_ids(streamed(auto, pieces, finish_reason)) == without_ids(chat_message(auto, text, finish_reason))


def test_an_auto_stream_holds_back_only_what_may_be_a_call():
    from engine.base import SamplingParams
    from gateway.errors import APIError
    from gateway.translate.chat import GenerationWork
    from gateway.translate.stream import StreamChunks

    auto = Structure(tools=("move",))
    chunks = StreamChunks(
        GenerationWork("m", True, [[1], [1], [1]], [SamplingParams()] * 3, [1, 1, 1], [auto, auto, FREE])
    )
    assert chunks.deltas(0, " ", None) == []  # whitespace: may still be a call
    (first,) = chunks.deltas(0, " sail", None)  # cannot be one: out at once, with what was held
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "  sail"}
    assert chunks.deltas(0, " on", None)[0]["choices"][0]["delta"] == {"content": " on"}
    assert chunks.deltas(1, '{"na', None) == []
    # The item fails while its text is held: the text rides on the error chunk.
    failed = chunks.error(1, APIError(500, "engine lost"))["choices"][0]
    assert failed["delta"]["content"] == '{"na' and failed["finish_reason"] == "content_filter"
    # Without tools nothing is held.
    assert chunks.deltas(2, "{", None)[0]["choices"][0]["delta"]["content"] == "{"


def test_earlier_calls_reach_the_template_with_their_arguments_decoded():
    from gateway.translate.chat import template_messages

    call = {"id": "call_1", "type": "function", "function": {"name": "move", "arguments": '{"to":"dock"}'}}
    body = chat(
        messages=[
            *CONV,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "moved"},
        ]
    )
    assert template_messages(body.conversations[0]) == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "move", "arguments": {"to": "dock"}}}
            ],
        },
        {"role": "tool", "content": "moved", "tool_call_id": "call_1"},
    ]
