"""The front-end half of a chat engine whose model runs in an engine core (`ferry serve
--engine-cores`): its name, context and tokenizer with its chat template, never its
weights. The gateway's translation (gateway/translate/chat.py) needs no more than this.

It loads the tokenizer with transformers' AutoTokenizer, as the engine does, so the ids
and the template's output are the engine's own. transformers imports torch when it is
installed: the front end pays that import (not the weights) until the chat template is
rendered without transformers (docs/architecture.md, step 3).
"""

from __future__ import annotations

from typing import Any

import jinja2

from .base import ChatTemplateError
from .grammar import GrammarCache


def grammar_cache(tokenizer: Any, path: str, trust_remote_code: bool) -> GrammarCache:
    """A GrammarCache for the model at `path` (its vocabulary size from its config)."""
    import copy

    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).vocab_size)
    eos = tokenizer.eos_token_id
    return GrammarCache(copy.deepcopy(tokenizer), vocab, [eos] if isinstance(eos, int) else [])


def encode_chat(tokenizer: Any, name: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A conversation through the model's chat template, as token ids ready to generate from;
    `tools` (OpenAI function tools) go to the template, which decides how to show them."""
    if not tokenizer.chat_template:
        raise ChatTemplateError(f"model {name!r} has no chat template")
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or an undefined name it needs
        raise ChatTemplateError(exc.message or type(exc).__name__) from None
    return list(ids)


class ChatTokenizer:
    def __init__(self, path: str, *, name: str, max_context: int, trust_remote_code: bool = False):
        """`name` and `max_context` are what the core's engine reports of itself."""
        from transformers import AutoTokenizer

        self.name, self.max_context = name, max_context
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        # The front end compiles schemas too, so that one it cannot follow is a 422 here.
        self.grammars = grammar_cache(self.tokenizer, path, trust_remote_code)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return encode_chat(self.tokenizer, self.name, messages, tools)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))
