"""vLLM's tokenizer routes for a chat model: `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info`. Evaluation harnesses use them to count and cut prompts with the
server's own tokenizer (lm-evaluation-harness's `local-completions` finds them on its own and
needs no tokenizer files of its own then). Nothing is queued: the front end's tokenizer answers.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request
from starlette.responses import Response

from ..endpoint import Ctx
from ..errors import APIError
from ..models.kinds import CHAT
from ..request_body import parse
from ..responses import json_response
from ..schemas import Conversation, Strict, TokenId
from ..state import gateway_state
from ..translate.chat import template_messages, token_prompt
from ..translate.reasoning import template_of


class TokenizeRequest(Strict):
    """vLLM's `/tokenize`: a text (`prompt`) or a conversation (`messages`, through the chat template)."""

    # Exactly one of the two, not null (what the route checks).
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    model: str | None = Field(None, min_length=1, max_length=256, description="A chat model; the only one if omitted.")
    prompt: str | None = None
    messages: Conversation | None = None
    add_special_tokens: StrictBool = Field(True, description="With `prompt`: the tokenizer's special tokens too.")


class DetokenizeRequest(Strict):
    model: str | None = Field(None, min_length=1, max_length=256, description="A chat model; the only one if omitted.")
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    model: str
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


def _served(request: Request, name: str | None):
    """The chat model named, or the only one when none is named."""
    ferry = gateway_state(request)
    if name is None:
        chats = [m.name for m in ferry.models.values() if m.kind == CHAT]
        if len(chats) != 1:
            raise APIError(422, f"model: name one of the chat models {chats}", code="invalid_value", param="model")
        name = chats[0]
    return ferry.model(name, CHAT)


async def tokenize(request: Request, ctx: Ctx) -> Response:
    ferry = gateway_state(request)
    body = await parse(request, TokenizeRequest, ferry.config.max_body_bytes)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(422, "give either prompt or messages", code="invalid_value", param="prompt")
    served = _served(request, body.model)
    ctx.model = served.name
    engine = served.engine
    if body.prompt is not None:
        ids = engine.encode_prompt(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        from engine.base import ChatTemplateError

        try:
            ids = engine.encode_chat(template_messages(body.messages or []))
        except ChatTemplateError as exc:
            raise APIError(
                422, f"the chat template refuses this conversation: {exc}", code="chat_template_error"
            ) from None
    return json_response({"count": len(ids), "max_model_len": engine.max_context, "tokens": list(ids)})


async def detokenize(request: Request, ctx: Ctx) -> Response:
    ferry = gateway_state(request)
    body = await parse(request, DetokenizeRequest, ferry.config.max_body_bytes)
    served = _served(request, body.model)
    ctx.model = served.name
    ids = token_prompt(body.tokens, 0, served.engine) if body.tokens else []
    return json_response({"prompt": served.engine.decode(ids, skip_special_tokens=False) if ids else ""})


async def tokenizer_info(request: Request, ctx: Ctx) -> Response:
    served = _served(request, request.query_params.get("model"))
    ctx.model = served.name
    engine = served.engine
    tokenizer = getattr(engine, "tokenizer", None) or getattr(engine, "_auto", None)
    return json_response(
        {
            "model": served.name,
            "tokenizer_class": type(tokenizer or engine).__name__,
            "bos_token": _special(engine, tokenizer, "bos_token"),
            "eos_token": _special(engine, tokenizer, "eos_token"),
            "pad_token": _special(engine, tokenizer, "pad_token"),
            "chat_template": template_of(engine),
            "model_max_length": engine.max_context,
        }
    )


def _special(engine: Any, tokenizer: Any, name: str) -> str | None:
    table = getattr(engine, "special_tokens", None)
    if isinstance(table, dict) and isinstance(table.get(name), str):
        return table[name]
    value = getattr(tokenizer, name, None)
    return value if isinstance(value, str) else None
