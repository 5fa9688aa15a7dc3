"""Token ids to released text: partial characters held back, stop strings cut."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.detokenize import (
    DETOKENIZE_CONTEXT,
    FINISH_COMPLETE,
    FINISH_LENGTH,
    FINISH_STOP,
    MAX_HELD_TOKENS,
    IncrementalDetokenizer,
    SequenceText,
    StopStringFilter,
)


class ByteTokenizer:
    """Token i is byte i, so one character may take up to four tokens. Records the
    windows it is asked to decode."""

    def __init__(self) -> None:
        self.windows: list[list[int]] = []

    def decode(self, ids: Sequence[int], **_: object) -> str:
        self.windows.append(list(ids))
        return bytes(ids).decode("utf-8", errors="replace")


def test_prompt_context_is_decoded_but_never_released():
    tok = ByteTokenizer()
    prompt = list(b"a prompt far longer than the decode window")
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(b) for b in " ok, é".encode()]
    assert "".join(pieces) + detok.flush() == " ok, é"
    assert max(len(w) for w in tok.windows) <= DETOKENIZE_CONTEXT + 2  # context + a 2-byte é
    assert IncrementalDetokenizer(ByteTokenizer(), []).push(ord("x")) == "x"


def test_multibyte_characters_are_released_whole():
    detok = IncrementalDetokenizer(ByteTokenizer(), [])
    pieces = [detok.push(b) for b in "東😀".encode()]
    assert pieces == ["", "", "東", "", "", "", "😀"]


def test_invalid_bytes_are_released_as_replacement_characters_after_a_bound():
    detok = IncrementalDetokenizer(ByteTokenizer(), [])
    pieces = [detok.push(0x80) for _ in range(MAX_HELD_TOKENS)]
    assert pieces[:-1] == [""] * (MAX_HELD_TOKENS - 1)
    assert pieces[-1] == "\ufffd" * MAX_HELD_TOKENS
    assert detok.flush() == ""


@pytest.mark.model
def test_detokenizer_never_emits_partial_characters(engine):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = engine.tokenizer
    byte_token = {b: tok.convert_tokens_to_ids(ch) for b, ch in bytes_to_unicode().items()}
    text = "é東京😀 ok"
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    pieces = [detok.push(byte_token[b]) for b in text.encode()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text

    invalid = IncrementalDetokenizer(tok, [])
    assert invalid.push(byte_token[0x80]) == ""
    assert invalid.flush() == "\ufffd"


def test_stop_filter_holds_back_possible_stop_prefixes():
    stops = StopStringFilter(["World!", "xyz"])
    assert stops.feed("Hello W") == ("Hello ", False)
    assert stops.feed("orld") == ("", False)
    assert stops.feed("?") == ("World?", False)
    assert stops.feed("x") == ("", False)
    assert stops.feed("y World!") == ("xy ", True)
    assert StopStringFilter([]).feed("abc") == ("abc", False)
    assert StopStringFilter(["bc"]).feed("ab", final=True) == ("ab", False)


def test_stop_filter_cuts_at_the_earliest_of_several_stops():
    stops = StopStringFilter(["", "it", "of"])  # an empty stop string never matches
    assert stops.feed("the end o") == ("the end ", False)
    assert stops.feed("f it") == ("", True)
    assert StopStringFilter(["it", "of"]).feed("end of it") == ("end ", True)


def run(text: SequenceText, tokens: bytes, end: str | None = None) -> list[tuple[str, str | None]]:
    """advance() per token, the engine's `end` on the last one, until a finish."""
    out = []
    for k, token in enumerate(tokens):
        out.append(text.advance(token, end if k == len(tokens) - 1 else None))
        if out[-1][1] is not None:
            break
    return out


def test_a_sequence_ends_at_a_stop_string_split_across_tokens():
    text = SequenceText(ByteTokenizer(), list(b"prompt"), ["lo w", "never"])
    out = run(text, b"hello world")
    assert len(out) == len("hello w")  # it ends with the token that completes the stop string
    assert "".join(piece for piece, _ in out) == "hel"
    assert [reason for _, reason in out] == [None] * 6 + [FINISH_STOP]
    assert out[4] == ("", None)  # "lo" may start "lo w": held back


def test_an_end_of_sequence_token_releases_what_was_held_and_is_never_decoded():
    text = SequenceText(ByteTokenizer(), [], ["ab"])
    assert run(text, b"xa") == [("x", None), ("", None)]
    # EOS: the engine's reason; the token itself (0xFF here) is not decoded
    assert text.advance(0xFF, FINISH_STOP) == ("a", FINISH_STOP)


def test_a_complete_grammar_keeps_its_last_token_and_says_stop():
    """A constrained row ends on the token that closes its JSON value: that token is part
    of the answer (unlike an end-of-sequence token), and the client sees "stop"."""
    text = SequenceText(ByteTokenizer(), [], [])
    assert run(text, b'{"a":1}', FINISH_COMPLETE)[-1] == ("}", FINISH_STOP)
    text = SequenceText(ByteTokenizer(), [], ["1}"])  # a stop string still wins
    assert run(text, b'{"a":1}', FINISH_COMPLETE)[-1] == ("", FINISH_STOP)


def test_out_of_room_flushes_and_a_stop_string_there_still_says_stop():
    text = SequenceText(ByteTokenizer(), [], ["b!"])
    assert run(text, b"ab", FINISH_LENGTH) == [("a", None), ("b", FINISH_LENGTH)]
    text = SequenceText(ByteTokenizer(), [], ["b!"])
    assert run(text, b"ab!", FINISH_LENGTH) == [("a", None), ("", None), ("", FINISH_STOP)]
    text = SequenceText(ByteTokenizer(), [], [])
    assert run(text, "é".encode(), FINISH_LENGTH) == [("", None), ("é", FINISH_LENGTH)]
