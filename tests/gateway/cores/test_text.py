"""gateway/cores/text.py: the text a front end makes of the token ids its engine core sends,
with the stop strings applied here."""

from __future__ import annotations

from typing import Any

from batcher.types import Delta, GenRequest, GenResult, Outcome, WorkItem
from engine.base import SamplingParams
from engine.fake import FakeGenerationEngine
from gateway.cores.text import TextAssembler

ENGINE = FakeGenerationEngine()  # token id i decodes to "w{i-1} "


def generation(stop: list[str] | None = None, on_delta: Any = None) -> WorkItem:
    request = GenRequest(ENGINE.encode_prompt("ab"), SamplingParams(max_tokens=9, stop=stop or []))
    return WorkItem(payload=request, arrival=0.0, on_delta=on_delta)


def test_tokens_make_the_text_streamed_as_deltas_in_order() -> None:
    deltas: list[Delta] = []
    item = generation(on_delta=deltas.append)
    texts = TextAssembler(ENGINE)
    texts.track(item)
    assert texts.takes(item)
    assert texts.add(item, [1, 2], None) is False
    assert texts.add(item, [3], "length") is False  # the core ended it: nothing to stop there
    assert not texts.takes(item)  # complete here: later tokens are dropped
    assert [(d.text, d.tokens, d.finish_reason, list(d.token_ids)) for d in deltas] == [
        ("w0 w1 ", 2, None, [1, 2]),
        ("w2 ", 1, "length", [3]),
    ]
    assert texts.result(item, Outcome.RESULT, "length") == GenResult("w0 w1 w2 ", "length", 2, 3)


def test_a_stop_string_found_here_asks_to_stop_the_core_and_its_text_is_the_answer() -> None:
    item = generation(stop=[" w3"])
    texts = TextAssembler(ENGINE)
    texts.track(item)
    assert texts.add(item, [1, 2, 3], None) is False
    assert texts.add(item, [4, 5], None) is True  # the core would go on: stop it there
    assert not texts.takes(item)
    # whatever the core ended it with after the Stop, the text made here answers
    assert texts.result(item, Outcome.CANCELLED, None) == GenResult("w0 w1 w2", "stop", 2, 4)


def test_an_item_that_makes_no_text_is_the_core_s_to_answer() -> None:
    texts = TextAssembler(None)
    embedding = WorkItem(payload=[1, 2], arrival=0.0)
    texts.track(embedding)
    assert not texts.takes(embedding)
    assert texts.result(embedding, Outcome.RESULT, None) is None
    item = generation()
    texts = TextAssembler(ENGINE)
    texts.track(item)
    assert texts.result(item, Outcome.ERROR, None) is None  # failed in the core before its text was complete
    texts.forget(item)
    assert not texts.takes(item)
