"""Log probabilities in OpenAI's shapes: what a request asks for, and each generated token's
log probability (the engine's `TokenLogprob`: id, logprob, the most likely alternatives)
as chat's `choices[].logprobs.content[]` or the legacy completions `logprobs` object."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import APIError
from ..schemas import ChatCompletionRequest, CompletionRequest

Decode = Callable[[list[int]], str]  # one token id's text

# Each model's token texts, decoded once: every log probability entry names a token and its
# alternatives, so a stream with top_logprobs 5 decodes six tokens per generated one.
_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def token_texts(engine: Any) -> Decode:
    """`decode` for the entries: a token id's text as the model's tokenizer writes it
    (special tokens included), remembered per model."""
    texts = _TEXTS.setdefault(engine, {})

    def decode(ids: list[int]) -> str:
        if len(ids) != 1:
            return str(engine.decode(ids, skip_special_tokens=False))
        text = texts.get(ids[0])
        if text is None:
            text = texts[ids[0]] = str(engine.decode(ids, skip_special_tokens=False))
        return text

    return decode


def requested(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives each token's entry lists (0: the token's own only), or None
    when the request asks for no log probabilities. Chat: `logprobs: true` with
    `top_logprobs` (0-20; it needs `logprobs: true`). Completions: `logprobs: N` (0-20),
    with `echo` the prompt's tokens' too (GenerationWork.prompt_entries)."""
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs:
            return body.top_logprobs or 0
        if body.top_logprobs:
            raise APIError(
                422, "top_logprobs: needs logprobs set to true", code="logprobs_required", param="top_logprobs"
            )
        return None
    return body.logprobs


def _token(decode: Decode, token_id: int) -> tuple[str, list[int]]:
    text = decode([token_id])
    return text, list(text.encode("utf-8"))


def chat_logprobs(entries: Sequence[Any], decode: Decode) -> dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`."""
    content = []
    for token_id, logprob, top in entries:
        text, raw = _token(decode, token_id)
        alternatives = []
        for alt_id, alt_logprob in top:
            alt_text, alt_raw = _token(decode, alt_id)
            alternatives.append({"token": alt_text, "logprob": alt_logprob, "bytes": alt_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content}


def completion_logprobs(entries: Sequence[Any], decode: Decode, offset: int = 0) -> dict[str, Any]:
    """The legacy shape: `tokens`, `token_logprobs`, `top_logprobs` (token text to logprob,
    one object per token) and `text_offset` (each token's character offset in the completion,
    from `offset`). An echoed prompt's first token has null for both (logprob None)."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, logprob, top in entries:
        text, _ = _token(decode, token_id)
        tokens.append(text)
        logprobs.append(logprob)
        tops.append(None if logprob is None else {_token(decode, alt)[0]: value for alt, value in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
