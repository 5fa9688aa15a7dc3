"""Reasoning per prompt (gateway/translate/reasoning.py): a thinking section split from the
answer, whole and streamed in any pieces alike; reasoning_effort and chat_template_kwargs as
each prompt's template arguments."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from gateway.errors import APIError
from gateway.translate.reasoning import ReasoningStream, left_open, split, template_kwargs, thinks

CASES = [
    ('I should say 12.\n</think>\n\n{"a":12}', True, ("I should say 12.\n", '{"a":12}')),
    ("<think>plan</think> answer", False, ("plan", "answer")),
    ("plain answer", False, (None, "plain answer")),
    ("still thinking when cut off", True, ("still thinking when cut off", "")),
    ("  <thi", False, (None, "  <thi")),
    ("<think>x</thi", False, ("x</thi", "")),
    ("a</think>", True, ("a", "")),
    ("", True, ("", "")),
    ("<", False, (None, "<")),
]


@pytest.mark.parametrize(("text", "open_", "want"), CASES)
def test_streamed_in_any_pieces_the_split_is_the_whole_ones(text, open_, want):
    assert split(text, open_) == want
    rng = random.Random(len(text))
    for _ in range(30):
        stream, reasoning, answer, i = ReasoningStream(open_), "", "", 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            r, a = stream.feed(text[i:j])
            reasoning, answer, i = reasoning + r, answer + a, j
        r, a = stream.feed("", final=True)
        assert (reasoning + r if want[0] is not None else None, answer + a) == want


def test_a_prompt_leaves_a_thinking_section_open_or_not():
    assert left_open("<|assistant|>\n<think>\n")
    assert not left_open("<|assistant|>\n<think>\n\n</think>\n\n")
    assert not left_open("<|assistant|>\n")
    assert thinks("{{ '<think>' }}") and not thinks("{{ messages }}") and not thinks(None)


def body(**fields):
    return SimpleNamespace(**{"chat_template_kwargs": None, "reasoning_effort": None, **fields})


def test_effort_and_template_kwargs_per_prompt():
    got = template_kwargs(body(reasoning_effort=["none", "high", None]), 3, True, "m")
    assert got == [
        {"enable_thinking": False, "reasoning_effort": "none"},
        {"enable_thinking": True, "reasoning_effort": "high"},
        {},
    ]
    explicit = body(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False, "lang": "fr"})
    assert template_kwargs(explicit, 1, True, "m") == [
        {"enable_thinking": False, "lang": "fr", "reasoning_effort": "low"}
    ]
    assert template_kwargs(body(reasoning_effort="none"), 2, False, "m")[0]["enable_thinking"] is False  # asks nothing


def test_what_a_template_cannot_honour_is_refused_by_name():
    with pytest.raises(APIError) as info:
        template_kwargs(body(reasoning_effort="high"), 1, False, "plain-model")
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "reasoning_effort")
    for name in ("messages", "chat_template", "tokenize", "return_dict", "pad_token", "raise_exception", "_x", "a-b"):
        with pytest.raises(APIError) as info:  # the server's names, and transformers' own arguments
            template_kwargs(body(chat_template_kwargs={name: 1}), 1, True, "m")
        assert (info.value.code, info.value.param) == ("invalid_value", "chat_template_kwargs")
    with pytest.raises(APIError) as info:
        template_kwargs(body(reasoning_effort=["high"]), 2, True, "m")
    assert info.value.code == "prompt_count_mismatch"
