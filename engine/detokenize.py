"""From generated token ids to the text a client may see: incremental detokenization
that never releases half a character, and OpenAI stop strings over the text stream.

Torch-free, so that both halves of a chat model use it: the engine in one process
(engine/generation.py), and the front end when the model runs in an engine core, which
then sends token ids only (gateway/cores/client.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded ahead of the completion so that tokenizers which drop or add a
# leading space at the start of a decode (SentencePiece) render the first word right.
DETOKENIZE_CONTEXT = 5
# A UTF-8 character is at most 4 bytes; past this many undecodable tokens the bytes are
# genuinely invalid and are released as U+FFFD rather than held forever.
MAX_HELD_TOKENS = 6

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# The sequence ends after this token, which is part of the answer (a constrained row whose
# grammar is complete: engine/grammar.py). Engine-internal, and on the wire from an engine
# core to its front end; clients see "stop".
FINISH_COMPLETE = "complete"


class IncrementalDetokenizer:
    """Turns a token stream into text deltas, holding back incomplete UTF-8 characters.

    Decodes a short window (already-released context + new tokens) and emits the part
    beyond the context, so byte-level and SentencePiece tokenizers both render spaces and
    multi-byte characters split across tokens correctly.
    """

    def __init__(self, tokenizer: Any, prompt: Sequence[int]) -> None:
        """`prompt`: the sequence's prompt ids, of which the last few are decoded as context."""
        self._tokenizer = tokenizer
        self._ids = list(prompt[len(prompt) - DETOKENIZE_CONTEXT :]) if prompt else []
        self._prefix = 0  # window start
        self._read = len(self._ids)  # end of text already released

    def push(self, token: int) -> str:
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        incomplete = len(text) <= len(prefix_text) or text.endswith("\ufffd")
        if incomplete and held < MAX_HELD_TOKENS:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Everything not yet released, partial characters included."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class StopStringFilter:
    """OpenAI stop semantics over a text stream: output ends before the first stop
    string, which is not included; text that may be the start of one is held back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(releasable text, whether a stop string was hit)."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        hold = 0 if final else self._partial_stop_suffix(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def _partial_stop_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class SequenceText:
    """One sequence's text as a client sees it: its tokens detokenized, cut at the first
    stop string, and the reason it finishes. The engine and a front end make the same text
    from the same ids by both calling `advance` once per generated token."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int], stops: Sequence[str]) -> None:
        """`tokenizer`: anything with transformers' `decode(ids, skip_special_tokens=...,
        clean_up_tokenization_spaces=...)`."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        self._stops = StopStringFilter(stops)

    def advance(self, token: int, end: str | None = None) -> tuple[str, str | None]:
        """Account one new token: (the text it releases, the finish reason if the sequence
        ends with it). `end` is why the engine ends the sequence here regardless of its
        text: FINISH_STOP for an end-of-sequence token (never decoded), FINISH_COMPLETE for
        a last token that is part of the answer (a grammar complete), FINISH_LENGTH when
        out of room; a stop string in the text ends it with FINISH_STOP either way."""
        if end == FINISH_STOP:
            text, _ = self._stops.feed(self._detokenizer.flush(), final=True)
            return text, FINISH_STOP
        text, stopped = self._stops.feed(self._detokenizer.push(token))
        if stopped:
            return text, FINISH_STOP
        if end is None:
            return text, None
        tail, stopped = self._stops.feed(self._detokenizer.flush(), final=True)
        return text + tail, FINISH_STOP if stopped or end == FINISH_COMPLETE else FINISH_LENGTH
