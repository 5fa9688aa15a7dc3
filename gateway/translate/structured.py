"""Structured output and tool calls: `response_format`, `tools`, `tool_choice` and
`parallel_tool_calls` per prompt, as JSON schemas the engine constrains decoding to
(engine/grammar.py), and the constrained answers read back as OpenAI shapes.

Each prompt gets a `Structure`: free text, an answer matching a schema (json_object,
json_schema), or one forced tool call (`tool_choice` "required" or a named function).
A forced call is generated as the compact JSON `{"name":"<tool>","arguments":{...}}`,
constrained to the named tool (or any of the prompt's tools, for "required") and to its
parameters' schema; the answer turns it into `message.tool_calls` with finish_reason
"tool_calls", and a stream into `delta.tool_calls` fragments. A forced call is always
exactly one call, whatever `parallel_tool_calls` says (one call is a valid answer to both).

Schemas compile ahead of submission, in a worker thread (`compile_structures`); a schema
that cannot compile is a 422 naming the prompt and the place in the schema.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.grammar import GrammarError, canonical_schema, check_schema

from ..errors import APIError
from ..schemas import ChatCompletionRequest, FunctionTool, JsonObjectFormat, JsonSchemaFormat, NamedToolChoice
from .per_prompt import per_prompt

if TYPE_CHECKING:
    from ..schemas import CompletionRequest

# Arguments of a function that declares no parameters: an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_CALL_HEAD = re.compile(r'^\{"name":"([A-Za-z0-9_-]+)","arguments":')


@dataclass(frozen=True)
class Structure:
    """What one prompt's output must be and how its answer is read."""

    schema: str | None = None  # canonical JSON schema text; None: free text
    tool_call: bool = False  # the output is one forced call, `{"name":..., "arguments":...}`
    # Where the schema came from, for errors: (request param, the schema as given), per part.
    sources: tuple[tuple[str, Any], ...] = ()
    tools: tuple[str, ...] = ()  # names of the prompt's tools


FREE = Structure()


def call_schema(tool: FunctionTool) -> dict[str, Any]:
    fn = tool.function
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": fn.parameters or NO_PARAMETERS},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def structures(body: ChatCompletionRequest | CompletionRequest, n: int) -> list[Structure]:
    """Each prompt's Structure, checking what needs no tokenizer: list lengths, tool names,
    and that every schema is valid JSON Schema (a 422 naming the prompt and the path)."""
    formats = per_prompt("response_format", body.response_format, n, None)
    tools: list[list[FunctionTool]] = [[] for _ in range(n)]
    choices: list[Any] = [None] * n
    many = {"response_format": isinstance(body.response_format, list), "tools": False, "tool_choice": False}
    if isinstance(body, ChatCompletionRequest):
        tools = _tools_per_prompt(body.tools, n)
        choices = per_prompt("tool_choice", body.tool_choice, n, None)
        per_prompt("parallel_tool_calls", body.parallel_tool_calls, n, None)
        many.update(tools=_tools_listed(body.tools), tool_choice=isinstance(body.tool_choice, list))
    out = []
    for i in range(n):
        out.append(_structure(i, formats[i], tools[i] or [], choices[i], many))
    return out


def offered_tools(body: ChatCompletionRequest, n: int) -> list[list[dict[str, Any]]]:
    """Per prompt, the tools its chat template is given (none where tool_choice is "none")."""
    tools = _tools_per_prompt(body.tools, n)
    choices = per_prompt("tool_choice", body.tool_choice, n, None)
    return [
        [] if choice == "none" else [t.model_dump(exclude_none=True) for t in prompt_tools]
        for prompt_tools, choice in zip(tools, choices, strict=True)
    ]


def _tools_listed(tools: Any) -> bool:
    return isinstance(tools, list) and any(t is None or isinstance(t, list) for t in tools)


def _tools_per_prompt(tools: Any, n: int) -> list[list[FunctionTool]]:
    if tools is None:
        return [[] for _ in range(n)]
    if _tools_listed(tools):
        return [list(t or []) for t in per_prompt("tools", tools, n, None)]
    return [list(tools) for _ in range(n)]


def _param(name: str, i: int, many: bool, rest: str = "") -> str:
    return f"{name}.{i}{rest}" if many else f"{name}{rest}"


def _structure(i: int, fmt: Any, tools: list[FunctionTool], choice: Any, many: dict[str, bool]) -> Structure:
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(
            422, f"prompt {i}: tool names must be unique", code="invalid_tools", param=_param("tools", i, many["tools"])
        )
    for j, tool in enumerate(tools):
        if tool.function.parameters is not None:
            _check(i, _param("tools", i, many["tools"], f".{j}.function.parameters"), tool.function.parameters)
    choice_param = _param("tool_choice", i, many["tool_choice"])
    if choice is not None and choice != "none" and not tools:
        raise APIError(
            422,
            f"prompt {i}: tool_choice needs tools, and this prompt has none",
            code="invalid_tool_choice",
            param=choice_param,
        )
    forced: list[FunctionTool] = []
    if isinstance(choice, NamedToolChoice):
        forced = [t for t in tools if t.function.name == choice.function.name]
        if not forced:
            raise APIError(
                422,
                f"prompt {i}: tool_choice names the function {choice.function.name!r}, which is not among its tools "
                f"({', '.join(names)})",
                code="invalid_tool_choice",
                param=choice_param,
            )
    elif choice == "required":
        forced = tools
    offered = tuple(names) if choice != "none" else ()
    if forced:
        sources = tuple(
            (
                _param("tools", i, many["tools"], f".{names.index(t.function.name)}.function.parameters"),
                t.function.parameters,
            )
            for t in forced
        )
        schemas = [call_schema(t) for t in forced]
        call: Any = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return Structure(canonical_schema(call), tool_call=True, sources=sources, tools=offered)
    fmt_param = _param("response_format", i, many["response_format"])
    if isinstance(fmt, JsonObjectFormat):
        return Structure(canonical_schema({"type": "object"}), tools=offered)
    if isinstance(fmt, JsonSchemaFormat):
        schema: Any = fmt.json_schema.schema_
        if schema is None:
            schema = {"type": "object"}
        param = fmt_param + ".json_schema.schema"
        _check(i, param, schema)
        return Structure(canonical_schema(schema), sources=((param, schema),), tools=offered)
    return Structure(tools=offered)


def _check(i: int, param: str, schema: Any) -> None:
    try:
        check_schema(schema)
    except GrammarError as exc:
        raise schema_error(i, param, exc) from None


def schema_error(i: int, param: str, exc: GrammarError) -> APIError:
    where = exc.path or "/"
    return APIError(
        422,
        f"prompt {i}: {param} is not a schema this server can follow (at {where}): {exc.message}",
        code="invalid_schema",
        param=param,
    )


async def compile_structures(structures: list[Structure], engine: Any) -> None:
    """Compile every distinct schema (cached by the engine) in a worker thread, before the
    prompts are queued: the decode loop never compiles. A model without constrained
    decoding refuses constraints with a 422."""
    wanted = {s.schema: (i, s) for i, s in reversed(list(enumerate(structures))) if s.schema is not None}
    if not wanted:
        return
    grammars = getattr(engine, "grammars", None)
    if grammars is None:
        raise APIError(
            422,
            f"model {engine.name!r} cannot constrain its output: response_format json_object/json_schema and "
            "forced tool calls are not available for it",
            code="unsupported_parameter",
            param="response_format",
        )
    for text, (i, s) in wanted.items():
        try:
            await asyncio.to_thread(grammars.compile, text)
        except GrammarError as exc:
            raise _located(i, s, exc) from None


def _located(i: int, s: Structure, exc: GrammarError) -> APIError:
    """The error of a combined schema (a forced call over several tools) blamed on the part
    it comes from, with the path inside that part."""
    if s.tool_call:
        for param, part in s.sources:
            try:
                check_schema(part or NO_PARAMETERS)
            except GrammarError as inner:
                return schema_error(i, param, inner)
        path, param = exc.path, s.sources[0][0] if s.sources else "tools"
        m = re.match(r"^(?:/anyOf/(\d+))?/properties/arguments(.*)$", path)
        if m:
            k = int(m.group(1) or 0)
            param = s.sources[k][0] if k < len(s.sources) else param
            path = m.group(2)
        return schema_error(i, param, GrammarError(exc.message, path))
    param = s.sources[0][0] if s.sources else "response_format"
    return schema_error(i, param, exc)


# -- answers -----------------------------------------------------------------------------------
def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of an answer that is exactly one call, or None.

    The answer is parsed as JSON, so any spacing counts (a forced call is compact; a
    template like ferry-tiny-chat's teaches `{"name": "...", "arguments": {...}}`). It must
    be an object of exactly `name` (a string) and `arguments` (an object); the arguments
    come back re-dumped as compact JSON text."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def chat_message(s: Structure, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """The chat answer's message and finish_reason. A forced call becomes `tool_calls` once
    its head `{"name":"<tool>","arguments":` was generated, exactly as its stream would
    (`ToolCallStream`): finish_reason "tool_calls" when it completed, else the reason it
    was cut (`length`, or `stop` for a stop string) with the arguments as far as they got,
    as OpenAI answers; cut before its head, it is content. With tools offered ("auto"), an
    answer that is exactly a call becomes `tool_calls`."""
    if s.tool_call:
        stream = ToolCallStream()
        complete = finish_reason == "stop" and parse_call(text) is not None
        entries = stream.feed(text, True, complete)
        if stream.started:
            head = entries[0]
            head["function"]["arguments"] = "".join(e["function"]["arguments"] for e in entries[1:])
            head.pop("index")
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [head],
            }, "tool_calls" if complete else finish_reason
    elif s.tools:
        call = parse_call(text)
        if call is not None and call[0] in s.tools:
            name, arguments = call
            tool_call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            return {"role": "assistant", "content": None, "tool_calls": [tool_call]}, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason


@dataclass
class ToolCallStream:
    """A forced call's text deltas as `delta.tool_calls` fragments: once the head
    `{"name":"<tool>","arguments":` has arrived, one fragment with the call's index, id,
    type and function name; then the arguments as they come, less the call object's
    closing brace (held back until the end)."""

    buffer: str = ""
    started: bool = False
    sent: int = 0  # characters of the arguments already sent
    head: int = 0
    id: str = field(default_factory=call_id)

    def feed(self, text: str, final: bool, complete: bool) -> list[dict[str, Any]]:
        """Tool-call delta entries for this text (final: nothing follows; complete: and the
        call ended as its grammar requires, so its last character is the object's brace)."""
        self.buffer += text
        out: list[dict[str, Any]] = []
        if not self.started:
            m = _CALL_HEAD.match(self.buffer)
            if m is None:
                return out
            self.started, self.head = True, m.end()
            out.append(
                {"index": 0, "id": self.id, "type": "function", "function": {"name": m.group(1), "arguments": ""}}
            )
        arguments = self.buffer[self.head :]
        if final:
            end = len(arguments) - 1 if complete and arguments.endswith("}") else len(arguments)
        else:
            end = max(self.sent, len(arguments) - 1)
        if end > self.sent:
            out.append({"index": 0, "function": {"arguments": arguments[self.sent : end]}})
            self.sent = end
        return out
