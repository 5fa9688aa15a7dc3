"""Chat and completions requests: prompts and their sampling parameters in, response
bodies and stream chunks out.

Several prompts may share one request (`messages` as a list of conversations, `prompt`
as a list of strings); every sampling field is a scalar or a per-prompt list. Each
(prompt, candidate) pair is its own work item, so prompts of one request batch with
prompts of others; choices come back in prompt order and stream chunks carry
`prompt_index`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from batcher.types import GenRequest
from engine.base import ChatTemplateError, GenerationEngine, SamplingParams
from engine.grammar import after_thinking

from ..errors import APIError, check_vocabulary
from ..schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, stop_lists
from . import logprobs as lp
from .per_prompt import per_prompt
from .reasoning import left_open, split, template_kwargs, template_of, thinks
from .structured import FREE, Structure, chat_message, offered_tools, structures

if TYPE_CHECKING:
    from ..config import ServerConfig

GenerationBody = ChatCompletionRequest | CompletionRequest

# A rendered prompt's last tokens, enough to hold the generation prompt's `<think>`.
THINK_TAIL = 32

# OpenAI's legacy completions stop after 16 tokens unless told otherwise; chat runs to
# the server's --max-completion-tokens.
COMPLETIONS_MAX_TOKENS = 16


@dataclass(frozen=True)
class PromptParams:
    """One prompt's sampling parameters as the request gives them. `max_tokens` is None
    when not given: the default depends on the route and the prompt's length. `extra`: the
    further sampling fields (SamplingParams' names), only those given."""

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


# The further sampling fields: each a scalar for every prompt or a per-prompt list, None
# (absent) leaving SamplingParams' default, which asks for nothing.
EXTRA_FIELDS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
)


@dataclass
class GenerationWork:
    """A chat or completions request as work: one item per (prompt, candidate), prompt-major."""

    model: str
    chat: bool  # chat.completion shapes, else text_completion
    prompts: list[list[int]]  # token ids, in prompt order
    params: list[SamplingParams]  # one per prompt
    n: list[int]  # candidates of each prompt
    structures: list[Structure] = field(default_factory=list)  # per prompt; none given: free text
    logprobs: int | None = None  # alternatives per token's log probability entry; None: none asked
    decode: lp.Decode | None = None  # a token id's text (the entries' `token`)
    echo: list[str] | None = None  # completions with `echo`: each prompt's text, before its completion
    # Chat on a model whose template has a thinking section: per prompt, whether its prompt
    # leaves one open (translate/reasoning.py); None: no reasoning fields.
    thinking: list[bool] | None = None
    payloads: list[GenRequest] = field(init=False, repr=False)
    prompt_index: list[int] = field(init=False, repr=False)  # of each item
    first_item: list[int] = field(init=False, repr=False)  # of each prompt: its first candidate's item

    def __post_init__(self) -> None:
        self.payloads, self.prompt_index, self.first_item = [], [], []
        if not self.structures:
            self.structures = [FREE] * len(self.prompts)
        for p, (ids, sp, n) in enumerate(zip(self.prompts, self.params, self.n, strict=True)):
            self.first_item.append(len(self.payloads))
            for j in range(n):
                # Candidates of one seeded prompt differ from each other, reproducibly.
                seed = None if sp.seed is None else sp.seed + j
                self.payloads.append(
                    GenRequest(ids, replace(sp, seed=seed, stop=list(sp.stop), json_schema=self.structures[p].schema))
                )
                self.prompt_index.append(p)

    @property
    def costs(self) -> list[int]:
        return [len(g.prompt_ids) for g in self.payloads]

    def response(self, results: list[Any]) -> dict[str, Any]:
        """The non-streaming body: one choice per item, in item order."""
        choices = []
        for k, (prompt_index, r) in enumerate(zip(self.prompt_index, results, strict=True)):
            choice: dict[str, Any] = {"index": k, "prompt_index": prompt_index}
            finish_reason = r.finish_reason
            if self.chat:
                reasoning, answer = (
                    (None, r.text) if self.thinking is None else split(r.text, self.thinking[prompt_index])
                )
                message, finish_reason = chat_message(self.structures[prompt_index], answer, finish_reason)
                if self.thinking is not None:
                    message.update(reasoning_content=reasoning, reasoning=reasoning)
                choice["message"] = message
            else:
                choice["text"] = r.text if self.echo is None else self.echo[prompt_index] + r.text
            entries = getattr(r, "logprobs", None)
            if self.echo is not None and self.logprobs is not None:
                entries = self.prompt_entries(prompt_index, getattr(r, "prompt_logprobs", None)) + (entries or [])
            choice.update(finish_reason=finish_reason, logprobs=self.logprobs_of(entries))
            choices.append(choice)
        return {
            "id": response_id(self.chat),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": self.usage(sum(r.completion_tokens for r in results), self.cached_tokens(results)),
        }

    def logprobs_of(self, entries: Any, offset: int = 0) -> dict[str, Any] | None:
        """A choice's (or a chunk's) `logprobs`: None unless the request asked for them."""
        if self.logprobs is None or self.decode is None:
            return None
        if self.chat:
            return lp.chat_logprobs(entries or [], self.decode)
        return lp.completion_logprobs(entries or [], self.decode, offset)

    def prompt_entries(self, prompt_index: int, computed: Sequence[Any] | None) -> list[Any]:
        """The echoed prompt's log probability entries: the engine's, the first token's
        (which nothing predicts) as (id, None, None)."""
        ids = self.prompts[prompt_index]
        entries = list(computed or [])
        if len(entries) != len(ids):  # an engine that cannot score its prompt: every value null
            entries = [(token, None, None) for token in ids]
        return [(ids[0], None, None), *entries[1:]] if ids else []

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: of the prompt tokens, those
        whose KV the engine's prefix cache served (`cached_tokens`)."""
        prompt = sum(len(ids) for ids in self.prompts)  # once per prompt, whatever n is
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def cached_tokens(self, results: Sequence[Any]) -> int:
        """The prompt tokens the prefix cache served, counted as prompt_tokens is: once per
        prompt, its first candidate's count (an item that failed counts 0)."""
        return sum(getattr(results[k], "cached_tokens", 0) for k in self.first_item)


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


# -- from request to work --------------------------------------------------------------------
def generation_work(body: GenerationBody, engine: GenerationEngine, cfg: ServerConfig) -> GenerationWork:
    """Tokenize the prompts and settle each one's parameters. Every refusal
    (chat_template_error, prompt_count_mismatch, context_length_exceeded) comes before
    anything is queued."""
    chat = isinstance(body, ChatCompletionRequest)
    thinking_model = chat and thinks(template_of(engine))
    prompts = encode_prompts(body, engine, thinking_model)
    shapes = structures(body, len(prompts))
    params = sampling_params(body, prompts, engine, cfg)
    asked = lp.requested(body)
    echo = None
    if isinstance(body, CompletionRequest) and body.echo:
        echo = [t if isinstance(t, str) else engine.decode(t, skip_special_tokens=False) for t in body.prompts]
    if asked is not None:
        prompt_asked = asked if echo is not None else None
        params = [replace(p, logprobs=asked, prompt_logprobs=prompt_asked) for p in params]
    n = per_prompt("n", body.n, len(prompts), 1)
    decode = lp.token_texts(engine) if asked is not None else None
    thinking = None
    if thinking_model:
        thinking = [left_open(engine.decode(ids[-THINK_TAIL:], skip_special_tokens=False)) for ids in prompts]
        # Structured output and forced calls constrain the answer: a thinking prompt reasons first.
        shapes = [
            replace(s, schema=after_thinking(s.schema)) if s.schema is not None and open_ else s
            for s, open_ in zip(shapes, thinking, strict=True)
        ]
    return GenerationWork(engine.name, chat, prompts, params, n, shapes, asked, decode, echo, thinking)


def check_generation(body: GenerationBody) -> None:
    """What `generation_work` checks without the tokenizer (batch files are validated
    with it): every per-prompt list against the number of prompts. The request model has
    checked counts, limits and stop strings."""
    n = len(body.conversations if isinstance(body, ChatCompletionRequest) else body.prompts)
    prompt_params(body, n)
    structures(body, n)
    per_prompt("n", body.n, n, 1)


def template_messages(conversation: list[ChatMessage]) -> list[dict[str, Any]]:
    """A conversation as the chat template takes it (and as `--log-prompts` records it):
    role and text, and where given an assistant turn's `tool_calls` (arguments as the
    object they encode, as Hugging Face templates expect) and a tool turn's `tool_call_id`."""
    out = []
    for m in conversation:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None or m.reasoning is not None:
            message["reasoning_content"] = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        out.append(message)
    return out


def _arguments(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def encode_prompts(body: GenerationBody, engine: GenerationEngine, thinking_model: bool = False) -> list[list[int]]:
    """Token ids per prompt: conversations through the model's chat template (with each
    prompt's template arguments; `thinking_model`: the template has a thinking section),
    completion prompts as they are. A conversation the template refuses is the client's
    error (422 naming the prompt and quoting the template)."""
    if not isinstance(body, ChatCompletionRequest):
        given: list[Any] = list(body.prompts)  # texts, or token ids
        prompts = [
            engine.encode_prompt(t) if isinstance(t, str) else token_prompt(t, i, engine) for i, t in enumerate(given)
        ]
        for i, ids in enumerate(prompts):
            if not ids:  # "" on a model that adds no BOS: nothing to condition on (vLLM refuses it too)
                raise APIError(
                    422,
                    f"prompt {i} is empty: {engine.name} adds no start token, so there is nothing to continue",
                    code="empty_prompt",
                    param="prompt",
                )
        return prompts
    conversations = body.conversations
    nested = conversations is body.messages  # a list of conversations, not one
    tools = offered_tools(body, len(conversations))
    extra = template_kwargs(body, len(conversations), thinking_model, engine.name)
    prompts = []
    for i, conv in enumerate(conversations):
        try:
            prompts.append(engine.encode_chat(template_messages(conv), tools[i] or None, extra[i] or None))
        except ChatTemplateError as exc:
            raise APIError(
                422,
                f"prompt {i}: the chat template of {engine.name} refuses this conversation: {exc}",
                code="chat_template_error",
                param=f"messages.{i}" if nested else "messages",
            ) from None
    return prompts


def token_prompt(ids: list[int], i: int, engine: GenerationEngine) -> list[int]:
    """A prompt given as token ids, each in the model's vocabulary."""
    vocab = getattr(getattr(engine, "grammars", None), "vocab_size", None)
    check_vocabulary(ids, vocab, f"prompt {i}", engine.name, "prompt")
    return list(ids)


def sampling_params(
    body: GenerationBody, prompts: list[list[int]], engine: GenerationEngine, cfg: ServerConfig
) -> list[SamplingParams]:
    """Each prompt checked against the context, and its max tokens settled: the request's,
    else the route's default, never more than the context leaves."""
    requested = prompt_params(body, len(prompts))
    chat = isinstance(body, ChatCompletionRequest)
    default_max = cfg.max_completion_tokens if chat else COMPLETIONS_MAX_TOKENS
    context = engine.max_context
    limit_prompt = min(context - 1, cfg.max_prompt_tokens or context)
    params = []
    vocab = getattr(getattr(engine, "grammars", None), "vocab_size", None)
    for i, (ids, req) in enumerate(zip(prompts, requested, strict=True)):
        check_vocabulary(req.extra.get("logit_bias", {}), vocab, f"logit_bias of prompt {i}", engine.name, "logit_bias")
        if len(ids) > limit_prompt:
            raise APIError(
                422,
                f"prompt {i} has {len(ids)} tokens; this model accepts at most {limit_prompt} prompt tokens "
                f"(context {context})",
                code="context_length_exceeded",
                param="messages" if chat else "prompt",
            )
        max_tokens = min(req.max_tokens if req.max_tokens is not None else default_max, context - len(ids))
        params.append(
            SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=req.seed,
                stop=req.stop,
                **req.extra,
            )
        )
    return params


def prompt_params(body: GenerationBody, n: int) -> list[PromptParams]:
    """Each sampling field, a scalar or a per-prompt list, spread over the `n` prompts."""
    max_tokens = getattr(body, "max_completion_tokens", None)
    max_name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = body.max_tokens
    lp.requested(body)  # its refusals, before anything else is queued
    columns = (
        per_prompt(max_name, max_tokens, n, None),
        per_prompt("temperature", body.temperature, n, 1.0),
        per_prompt("top_p", body.top_p, n, 1.0),
        per_prompt("seed", body.seed, n, None),
        stops_per_prompt(body.stop, n),
    )
    extras = [extra_params(body, name, n) for name in EXTRA_FIELDS]
    rows = []
    for i, row in enumerate(zip(*columns, strict=True)):
        extra = {name: values[i] for name, values in zip(EXTRA_FIELDS, extras, strict=True) if values[i] is not None}
        rows.append(PromptParams(*row, extra=extra))
    return rows


def extra_params(body: GenerationBody, name: str, n: int) -> list[Any]:
    """One further sampling field per prompt (None: not given); logit_bias's keys as ints."""
    values = per_prompt(name, getattr(body, name), n, None)
    if name == "logit_bias":
        values = [None if v is None else {int(k): float(b) for k, b in v.items()} for v in values]
    return values


def stops_per_prompt(stop: Any, n: int) -> list[list[str]]:
    shared, lists = stop_lists(stop)
    if shared:
        return [list(lists[0]) for _ in range(n)]
    return per_prompt("stop", lists, n, None)
