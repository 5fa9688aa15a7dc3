"""The front end's half of a chat engine in an engine core (engine/chat_tokenizer.py): the
engine's own ids, template refusals and facts, without the weights."""

from __future__ import annotations

import pytest

from engine.base import ChatTemplateError
from engine.chat_tokenizer import ChatTokenizer


def test_the_front_tokenizer_makes_the_engines_ids(engine, tiny_chat_dir):
    front = ChatTokenizer(str(tiny_chat_dir), name=engine.name, max_context=engine.max_context)
    assert (front.name, front.max_context) == (engine.name, engine.max_context)
    conversations = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Two words, please: ünïcode and spaces  here."},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": ""},
        ],
    ]
    for messages in conversations:
        assert front.encode_chat(messages) == engine.encode_chat(messages)
    for text in ("hi", "", "  leading and trailing  ", "ünïcode, punctuation: fine!"):
        assert front.encode_prompt(text) == engine.encode_prompt(text)
    with pytest.raises(ChatTemplateError, match="Unsupported role: wizard"):
        front.encode_chat([{"role": "wizard", "content": "hi"}])
