"""Reasoning per prompt, for a model whose chat template has a thinking section
(`<think>...</think>`, as DeepSeek-R1, Qwen3 and the built-in ferry-tiny-chat write it).

The request side: `reasoning_effort` (OpenAI's) and `chat_template_kwargs` (vLLM's), each
one value for every prompt or a per-prompt list, become the keyword arguments each prompt's
chat template is rendered with: `enable_thinking` (what Qwen3-style templates read; effort
"none" switches thinking off, any other effort on) and `reasoning_effort` itself (what
gpt-oss-style templates read). The answer side: what the model writes up to `</think>` is
its reasoning, returned apart from the answer in the message's `reasoning_content` (and
`reasoning`, the newer name), streamed as its own deltas; structured output and tool calls
apply to the answer only (GenerationWork, engine/grammar.py's `after_thinking`).

A prompt "thinks" when its rendered text leaves a `<think>` open (the template wrote it into
the generation prompt) or when the model's answer begins with `<think>`; then everything
before `</think>` is reasoning, and an answer cut off before `</think>` is all reasoning.
"""

from __future__ import annotations

from typing import Any

from ..errors import APIError
from .per_prompt import per_prompt

START, END = "<think>", "</think>"
EFFORTS = ("none", "minimal", "low", "medium", "high")
# Names a request may not set: what the server gives the template (the conversation, the
# special tokens, its helper functions), and every other argument of transformers'
# `apply_chat_template` (the template itself, tokenization, truncation, the return shape).
RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "sep_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
        "tojson",
        "namespace",
        "range",
        "dict",
        "cycler",
        "joiner",
        "lipsum",
    }
)


def template_of(engine: Any) -> str | None:
    """A chat model's template: a front end's tokenizer holds it, an engine's tokenizer does."""
    template = getattr(engine, "chat_template", None) or getattr(
        getattr(engine, "tokenizer", None), "chat_template", None
    )
    return template if isinstance(template, str) else None


def thinks(template: str | None) -> bool:
    """Whether a chat template has a thinking section."""
    return bool(template) and (START in template or END in template)  # type: ignore[operator]


def template_kwargs(body: Any, n: int, thinking: bool, model: str) -> list[dict[str, Any]]:
    """Each prompt's extra chat-template arguments from `chat_template_kwargs` and
    `reasoning_effort` (the explicit kwargs win). An effort other than "none" on a model
    without a thinking section is refused by name: it would be silently ignored."""
    given = per_prompt("chat_template_kwargs", getattr(body, "chat_template_kwargs", None), n, None)
    efforts = per_prompt("reasoning_effort", getattr(body, "reasoning_effort", None), n, None)
    out = []
    for i, (kwargs, effort) in enumerate(zip(given, efforts, strict=True)):
        kwargs = dict(kwargs or {})
        clash = sorted(name for name in kwargs if name in RESERVED or not name.isidentifier() or name.startswith("_"))
        if clash:
            raise APIError(
                422,
                f"chat_template_kwargs of prompt {i}: {clash[0]!r} is set by the server, not the request",
                code="invalid_value",
                param="chat_template_kwargs",
            )
        if effort is not None:
            if effort != "none" and not thinking:
                raise APIError(
                    422,
                    f"reasoning_effort: the chat template of {model} has no thinking section",
                    code="unsupported_parameter",
                    param="reasoning_effort",
                )
            kwargs.setdefault("enable_thinking", effort != "none")
            kwargs.setdefault("reasoning_effort", effort)
        out.append(kwargs)
    return out


def left_open(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a thinking section."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


def split(text: str, open_: bool) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a whole output."""
    body = text.lstrip()
    if body.startswith(START):
        open_, text = True, body[len(START) :]
    if not open_:
        return None, text
    at = text.find(END)
    if at < 0:
        return text, ""  # cut off while thinking
    return text[:at], text[at + len(END) :].lstrip()


class ReasoningStream:
    """One item's streamed text split as `split` would split the whole: `feed` returns
    (reasoning, answer) pieces. Text that may still become `<think>` or `</think>` is held
    back until the next piece tells."""

    def __init__(self, open_: bool) -> None:
        self.state = "think" if open_ else "start"  # "start": may yet open with <think>
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.held += text
        reasoning = answer = ""
        if self.state == "start":
            body = self.held.lstrip()
            if body.startswith(START):
                self.state, self.held = "think", body[len(START) :]
            elif final or (body and not START.startswith(body[: len(START)])):
                self.state = "answer"
            else:
                return "", ""
        if self.state == "think":
            at = self.held.find(END)
            if at >= 0:
                reasoning, self.held = self.held[:at], self.held[at + len(END) :]
                self.state = "after"
            else:
                keep = 0 if final else _partial(self.held, END)
                reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return reasoning, ""
        if self.state == "after":  # the answer's leading whitespace goes, as `split` drops it
            self.held = self.held.lstrip()
            if self.held or final:
                self.state = "answer"
        if self.state == "answer":
            answer, self.held = self.held, ""
        return reasoning, answer


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
