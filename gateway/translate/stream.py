"""The chunk objects of one streamed chat or completions response (OpenAI's shapes plus
`prompt_index`): text, tool-call fragments, reasoning deltas, log probabilities and the echoed
prompt, per item, as its deltas come (gateway/routes/chat.py frames them as SSE)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import APIError, error_body
from .chat import GenerationWork, response_id
from .reasoning import ReasoningStream
from .structured import Structure, ToolCallStream, chat_message, parse_call


class StreamChunks:
    """The chunk objects of one streamed response (OpenAI's shapes plus `prompt_index`);
    `k` is the item's index, the choice's `index`."""

    def __init__(self, work: GenerationWork, include_usage: bool = False):
        self.work = work
        # With stream_options.include_usage every chunk says `"usage": null` but the last
        # (OpenAI's contract: a client may read the key on every chunk).
        self.include_usage = include_usage
        self.id, self.created = response_id(work.chat), int(time.time())
        self.object = "chat.completion.chunk" if work.chat else "text_completion"
        self._started: set[int] = set()  # chat choices whose first delta (the role) went out
        self._calls: dict[int, ToolCallStream] = {}  # items whose output is a forced tool call
        self._held: dict[int, str] = {}  # "auto" items' text held back while it may be a call
        self._free: set[int] = set()  # "auto" items whose text cannot be a call: streamed as it comes
        self._entries: dict[int, list[Any]] = {}  # log probability entries not yet sent, by item
        self._offsets: dict[int, int] = {}  # completions: characters of each item's text sent
        self._echoed: set[int] = set()  # completions with echo: items whose prompt went out
        self._thoughts: dict[int, ReasoningStream] = {}  # chat on a thinking model: each item's split

    def delta(self, k: int, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk(k, text, finish_reason)

    def deltas(
        self,
        k: int,
        text: str | None,
        finish_reason: str | None,
        entries: Sequence[Any] | None = None,
        prompt_entries: Sequence[Any] | None = None,
    ) -> list[dict[str, Any]]:
        """`_deltas`, with the log probabilities of the delta's tokens (where the request
        asked) on its first chunk, or on the next chunk of the item when it has none. With
        `echo`, an item's first chunk begins with its prompt (and the prompt's entries)."""
        if self.work.echo is not None and k not in self._echoed:
            self._echoed.add(k)
            p = self.work.prompt_index[k]
            text = self.work.echo[p] + (text or "")
            if self.work.logprobs is not None:
                entries = self.work.prompt_entries(p, prompt_entries) + list(entries or [])
        if self.work.thinking is not None:
            chunks = self._thinking(k, text, finish_reason)
        else:
            chunks = self._deltas(k, text, finish_reason)
        if self.work.logprobs is None:
            return chunks
        waiting = self._entries.setdefault(k, [])
        waiting.extend(entries or [])
        if chunks:
            offset = self._offsets.get(k, 0)
            made = self.work.logprobs_of(waiting, offset)
            chunks[0]["choices"][0]["logprobs"] = made
            # Completions: the next token's offset follows the entries' texts, so offsets
            # never go back whatever the chunk's text held back or echoed.
            self._offsets[k] = offset + sum(len(t) for t in made["tokens"]) if made and "tokens" in made else offset
            self._entries[k] = []
        return chunks

    def _thinking(self, k: int, text: str | None, finish_reason: str | None) -> list[dict[str, Any]]:
        """On a thinking model: the delta's reasoning as its own chunk (`delta.reasoning_content`
        and `delta.reasoning`), then its answer as `_deltas` makes it (the whole delta, when
        it is all answer)."""
        thinking = self.work.thinking
        assert thinking is not None
        stream = self._thoughts.setdefault(k, ReasoningStream(thinking[self.work.prompt_index[k]]))
        reasoning, answer = stream.feed(text or "", final=finish_reason is not None)
        if not reasoning and answer == (text or ""):
            return self._deltas(k, text, finish_reason)
        chunks = []
        if reasoning:
            chunk = self._chunk(k, None, None)
            chunk["choices"][0]["delta"].update(reasoning_content=reasoning, reasoning=reasoning)
            chunks.append(chunk)
        if answer or finish_reason is not None:
            chunks += self._deltas(k, answer, finish_reason)
        return chunks

    def _deltas(self, k: int, text: str | None, finish_reason: str | None) -> list[dict[str, Any]]:
        """The chunks of one delta of item `k`: one, or for a forced tool call the
        `delta.tool_calls` fragments it completes (none while the call's head is incomplete),
        or for tools offered under "auto" what `_auto` lets out."""
        structure = self.work.structures[self.work.prompt_index[k]]
        if not (self.work.chat and structure.tools):
            return [self._chunk(k, text, finish_reason)]
        if not structure.tool_call:
            return self._auto(k, structure, text, finish_reason)
        stream = self._calls.setdefault(k, ToolCallStream())
        final = finish_reason is not None
        # A whole call, not one a stop string cut short (which ends as text would).
        complete = finish_reason == "stop" and parse_call(stream.buffer + (text or "")) is not None
        entries = stream.feed(text or "", final, complete)
        if final and not stream.started:  # cut short before a call took shape: its text as content
            return [self._chunk(k, stream.buffer, finish_reason)]
        chunks = [self._chunk(k, None, None, tool_calls=[entry]) for entry in entries]
        if final:
            reason = "tool_calls" if complete else finish_reason
            if chunks:
                chunks[-1]["choices"][0]["finish_reason"] = reason
            else:
                chunks.append(self._chunk(k, None, reason))
        return chunks

    def _auto(self, k: int, s: Structure, text: str | None, finish_reason: str | None) -> list[dict[str, Any]]:
        """Under tool_choice "auto" the answer is a call only if it is exactly one, which is
        known at its end. So its text is held back while it may still be a call (nothing
        but whitespace yet, or it begins with `{`): at the end it goes out as the whole
        answer would (`chat_message`), either as `delta.tool_calls` (a head fragment, then
        the arguments) with finish_reason "tool_calls", or as the held content. Text that
        cannot be a call streams as it comes."""
        if k in self._free:
            return [self._chunk(k, text, finish_reason)]
        buffer = self._held.get(k, "") + (text or "")
        start = buffer.lstrip()
        if start and not start.startswith("{"):
            self._held.pop(k, None)
            self._free.add(k)
            return [self._chunk(k, buffer, finish_reason)]
        if finish_reason is None:
            self._held[k] = buffer
            return []
        self._held.pop(k, None)
        message, reason = chat_message(s, buffer, finish_reason)
        if not message.get("tool_calls"):
            return [self._chunk(k, buffer, reason)]
        (call,) = message["tool_calls"]
        function = {"name": call["function"]["name"], "arguments": ""}
        head = {"index": 0, "id": call["id"], "type": "function", "function": function}
        arguments = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
        return [self._chunk(k, None, None, tool_calls=[head]), self._chunk(k, None, reason, tool_calls=[arguments])]

    def error(self, k: int, err: APIError) -> dict[str, Any]:
        """The error rides on the item's own final chunk: a separate top-level error event
        would make OpenAI clients abort the whole stream, and with it the other prompts'
        answers. Its finish_reason is the one value OpenAI's chat and completion chunk
        types both allow that does not claim a whole answer; the `error` field tells a
        failure from a real content filter."""
        detail = error_body(err.status, err.message, err.code)["error"]
        detail.update(status=err.status, prompt_index=self.work.prompt_index[k], index=k)
        # Text held back (under tool_choice "auto" it might have become a call; it might have
        # begun or ended a thinking section) goes out with it.
        held = self._held.pop(k, None) or ""
        thought = self._thoughts.pop(k, None)
        reasoning, answer = thought.feed("", final=True) if thought is not None else ("", "")
        chunk = self._chunk(k, answer + held or None, "content_filter", detail)
        if reasoning:
            chunk["choices"][0]["delta"].update(reasoning_content=reasoning, reasoning=reasoning)
        return chunk

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": self.work.usage(completion_tokens, cached_tokens)}

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.work.model}

    def _chunk(
        self,
        k: int,
        text: str | None,
        finish_reason: str | None,
        error: dict | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": k,
            "prompt_index": self.work.prompt_index[k],
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        if error is not None:
            choice["error"] = error
        if self.work.chat:
            delta: dict[str, Any] = {}
            if k not in self._started:
                delta["role"] = "assistant"
                self._started.add(k)
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = {**self._head(), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out
