"""Text assembly in a front end: from the token ids an engine core generates to each
generation item's text and its stop strings, apart from the transport (gateway/cores/client.py),
as vLLM v1 keeps its detokenizer apart from its engine-core client.

The core sends token ids only (`NewTokens`, every item, streamed or not); this side
detokenizes them and applies the stop strings with the engine's own code
(engine/detokenize.py's `SequenceText`, over the model's `tokenizer`), so the text is what
one process would make. Text that may start a stop string is held back; a stop string found
here ends the item's sequence in the core at once (the client sends `Stop`). Streamed items
get a `Delta` for each piece of text, in order, before the item's `Result` (with the core's
timing) resolves it with a `GenResult` of the text made here.
"""

from __future__ import annotations

from typing import Any

from batcher.types import Delta, GenRequest, GenResult, LogprobLedger, Outcome, WorkItem
from engine.detokenize import SequenceText


class _ItemText:
    """A generation item's text, made here from the token ids its core sends."""

    __slots__ = ("finish_reason", "logprobs", "pieces", "sequence", "tokens", "undelivered")

    def __init__(self, tokenizer: Any, request: GenRequest):
        self.sequence = SequenceText(tokenizer, request.prompt_ids, request.params.stop)
        self.pieces: list[str] = []
        self.tokens = 0  # generated tokens that made the text (none after a stop string)
        self.undelivered = 0  # tokens whose text is held back, counted in the next delta
        self.finish_reason: str | None = None  # known here: the text is complete
        self.logprobs = LogprobLedger()  # where the request asked


class TextAssembler:
    """The text of each generation item a front end has in an engine core, made from the
    token ids the core sends (see the module's docstring)."""

    def __init__(self, tokenizer: Any):
        """`tokenizer`: a generation model's (anything with transformers' `decode`;
        engine/chat_tokenizer.py's ChatTokenizer); None for a model that generates nothing."""
        self.tokenizer = tokenizer
        self._texts: dict[int, _ItemText] = {}  # WorkItem.id -> its text

    def track(self, item: WorkItem) -> None:
        """From now on the tokens of `item` make its text (a generation item; others are skipped)."""
        if isinstance(item.payload, GenRequest):
            self._texts[item.id] = _ItemText(self.tokenizer, item.payload)

    def forget(self, item: WorkItem) -> None:
        self._texts.pop(item.id, None)

    def takes(self, item: WorkItem) -> bool:
        """Whether tokens for `item` still make text: a generation item whose text is not
        complete here (tokens past a stop string found here are the core's, stopping)."""
        text = self._texts.get(item.id)
        return text is not None and text.finish_reason is None

    def add(
        self,
        item: WorkItem,
        ids: list[int],
        finish_reason: str | None,
        logprobs: list[Any] | None = None,
        prompt_logprobs: list[Any] | None = None,
    ) -> bool:
        """Detokenize `ids`, the next tokens of `item` (which `takes` them), and hand a
        streamed item its `Delta`. `finish_reason`: the core's, for the last of them (EOS or
        out of room). True when a stop string was found here: the core would go on
        generating, so its sequence is to be stopped there."""
        text = self._texts[item.id]
        pieces, used = [], 0
        for token in ids:
            used += 1
            piece, text.finish_reason = text.sequence.advance(token, finish_reason if used == len(ids) else None)
            pieces.append(piece)
            if text.finish_reason is not None:
                break
        if text.finish_reason is None:
            text.finish_reason = finish_reason  # a prompt the engine could not start: no tokens
        released = "".join(pieces)
        text.pieces.append(released)
        text.tokens += used
        text.undelivered += used
        text.logprobs.add(logprobs[:used] if logprobs else None, prompt_logprobs)
        if item.on_delta is not None and (released or text.finish_reason):
            lps, prompt = text.logprobs.take()
            item.on_delta(Delta(item, released, text.undelivered, text.finish_reason, ids[:used], lps, prompt))
            text.undelivered = 0
        return text.finish_reason is not None and finish_reason is None

    def result(
        self, item: WorkItem, outcome: Outcome, finish_reason: str | None, cached_tokens: int = 0
    ) -> GenResult | None:
        """The answer of a generation item whose text is complete here, whatever the core
        ended it with (`outcome`) after this side found a stop string (a Stop, or a deadline
        meanwhile); None for an item whose answer is the core's (an embedding, an error).
        `cached_tokens`: the core's count of its prompt tokens the prefix cache served."""
        text = self._texts.get(item.id)
        if text is None or (text.finish_reason is None and outcome is not Outcome.RESULT):
            return None
        prompt_tokens = len(item.payload.prompt_ids)
        finish = text.finish_reason or finish_reason or ""
        lp = text.logprobs
        return GenResult("".join(text.pieces), finish, prompt_tokens, text.tokens, cached_tokens, lp.tokens, lp.prompt)
