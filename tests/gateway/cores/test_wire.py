"""The front end / engine core messages: every one survives encoding unchanged, arrays
travel as raw bytes, each side decodes only its own messages, errors keep their class."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher import errors
from batcher.types import Outcome, Priority
from gateway.cores import wire

token_ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
sampling = st.builds(
    wire.Sampling,
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(max_size=8), max_size=4),
)


def to_core(message: msgspec.Struct) -> wire.ToCore:
    """One message through a frame to the core, alone."""
    [back] = wire.unpack_to_core(wire.pack([message]))
    return back


def to_front_end(message: msgspec.Struct) -> wire.ToFrontEnd:
    [back] = wire.unpack_to_front_end(wire.pack([message]))
    return back


@given(token_ids)
def test_token_ids_round_trip_as_raw_int32(values):
    raw = wire.ids(values)
    assert len(raw) == 4 * len(values)
    assert wire.ids_of(raw) == values


@given(st.lists(finite, max_size=64))
def test_vectors_round_trip_as_raw_float32_from_lists_and_numpy(values):
    assert wire.floats_of(wire.floats(values)).tolist() == values
    assert wire.floats(np.array(values, dtype=np.float64)) == wire.floats(values)


@given(
    st.integers(0, 2**62),
    st.lists(token_ids, min_size=1, max_size=4),
    st.none() | st.floats(0, 1e9),
    st.sampled_from(list(Priority)),
    st.booleans(),
    st.none() | st.lists(sampling, min_size=1, max_size=4),
)
def test_submit_round_trips(req, prompts, deadline, priority, stream, params):
    m = wire.Submit(
        req,
        "m",
        [wire.ids(p) for p in prompts],
        [len(p) for p in prompts],
        deadline,
        int(priority),
        "req-1",
        stream,
        params,
    )
    back = to_core(m)
    assert back == m
    assert [wire.ids_of(p) for p in back.payloads] == prompts


@given(
    st.integers(0, 2**62),
    st.integers(0, 63),
    st.sampled_from([o for o in Outcome if o is not Outcome.PENDING]),
    st.none() | st.binary(max_size=64),
    st.none() | st.sampled_from(["stop", "length"]),
)
def test_results_and_deltas_round_trip(req, index, outcome, vector, finish):
    timing = wire.Timing(12.5, 12.6, 8, "full", False)
    r = wire.Result(req, index, int(outcome), timing, vector, finish, 3, 4, None, None, None)
    assert to_front_end(r) == r
    assert wire.outcome_of(r) is outcome
    d = wire.NewTokens(req, index, wire.ids([1, 2, 3]), finish)
    assert to_front_end(d) == d
    assert wire.ids_of(d.token_ids) == [1, 2, 3]
    stop = wire.Stop(req, index)  # the front end found a stop string: the core ends the sequence
    assert to_core(stop) == stop


def test_each_side_decodes_only_its_own_messages():
    core_frame = wire.pack([wire.Cancel(7)])
    front_frame = wire.pack([wire.Admitted(7)])
    assert wire.unpack_to_core(core_frame) == [wire.Cancel(7, True)]
    with pytest.raises(msgspec.ValidationError):
        wire.unpack_to_front_end(core_frame)
    with pytest.raises(msgspec.ValidationError):
        wire.unpack_to_core(front_frame)
    with pytest.raises(msgspec.DecodeError):
        wire.unpack_to_core(b"\xc1 not msgpack")


def test_a_packet_keeps_its_messages_in_order_and_each_side_reads_only_its_own():
    """A frame between a front end and a core holds the messages of one turn of the
    sender's loop (gateway/cores/outbox.py): in order, each decoded whole."""
    for_core = [wire.Cancel(1), wire.Stop(2, 0), wire.MetricsRequest(3), wire.Cancel(4, False)]
    assert wire.unpack_to_core(wire.pack(for_core)) == for_core
    timing = wire.Timing(1.0, 1.1, 2, "full", False)
    for_front = [wire.Admitted(1), wire.NewTokens(1, 0, wire.ids([5]), None), wire.Result(1, 0, 1, timing)]
    assert wire.unpack_to_front_end(wire.pack(for_front)) == for_front
    with pytest.raises(msgspec.ValidationError):  # one message of the wrong side fails the frame
        wire.unpack_to_core(wire.pack([wire.Cancel(1), wire.Admitted(1)]))


def test_settings_round_trip_with_nulls():
    m = wire.SettingsChange(3, "m", {"max_wait_ms": 2.5, "default_budget_ms": None})
    assert to_core(m) == m
    a = wire.SettingsAnswer(3, None, None, "max_wait_ms", "must be at least 0")
    assert to_front_end(a) == a


@pytest.mark.parametrize(
    "cls",
    [
        errors.QueueFull,
        errors.DeadlineInfeasible,
        errors.RequestTooLarge,
        errors.DeadlineExceeded,
        errors.Cancelled,
        errors.EngineError,
        errors.ShuttingDown,
        errors.ModelUnavailable,
    ],
)
def test_errors_cross_as_code_message_retry_after_and_keep_their_class(cls):
    refused = to_front_end(wire.refusal(5, cls("no room", retry_after=2)))
    exc = wire.error_of(refused.code, refused.message, refused.retry_after)
    assert type(exc) is cls and exc.message == "no room" and exc.retry_after == 2


def test_an_unknown_error_code_is_an_engine_error_that_keeps_its_message():
    exc = wire.error_of("brand_new_code", "the core knows more than this front end")
    assert isinstance(exc, errors.EngineError) and "knows more" in exc.message
    assert math.isclose(wire.floats_of(wire.floats([0.5]))[0], 0.5)


def test_metrics_requests_and_answers_round_trip_each_to_its_side():
    m = wire.MetricsRequest(4)
    assert to_core(m) == m
    family = wire.MetricFamily("ferry_queue_depth", "Depth.", "gauge", "", [("ferry_queue_depth", {"model": "m"}, 2.0)])
    a = wire.MetricsAnswer(4, [family])
    assert to_front_end(a) == a
    with pytest.raises(msgspec.ValidationError):
        to_front_end(m)


def test_sampling_parameters_cross_the_wire_and_back_whole():
    from dataclasses import asdict

    from engine.base import SamplingParams
    from gateway.cores.client import sampling_of
    from gateway.cores.core import payloads

    sent = SamplingParams(
        max_tokens=7,
        temperature=0.3,
        top_p=0.9,
        seed=4,
        stop=["x"],
        json_schema='{"type":"string"}',
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={3: -2.0},
        min_tokens=2,
        ignore_eos=True,
        logprobs=3,
    )
    submit = wire.Submit(1, "m", [wire.ids([1, 2])], [2], None, sampling=[sampling_of(sent)])
    (arrived,) = wire.unpack_to_core(wire.pack([submit]))
    (got,) = payloads(arrived)
    # Everything but the stop strings (the front end's) and the text (the front end makes it).
    assert asdict(got.params) == {**asdict(sent), "stop": [], "detokenize": False}
