"""The messages between a front end and an engine core (docs/architecture.md, "Processes").

One module defines them and both sides import it. Each is a tagged `msgspec.Struct`
encoded as msgpack, as many to a ZMQ frame as one turn of the sender's loop made
(`pack`); token ids and vectors travel as raw little-endian arrays (`ids` / `floats`
below), never pickled. Deadlines are absolute `time.monotonic()` seconds: one
clock for every process on a host, so time in flight counts against the budget.

A request is keyed by `req`, a number its front end makes unique among its own requests;
the engine core tells front ends apart by their socket identity, so the pair is unique.
A message for a key the receiver no longer knows is dropped (see `docs/architecture.md`).
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from batcher import errors
from batcher.types import Outcome, Priority

_INT32, _FLOAT32 = "i", "f"


def ids(values: list[int]) -> bytes:
    """Token ids as raw int32."""
    return array(_INT32, values).tobytes()


def ids_of(raw: bytes) -> list[int]:
    a = array(_INT32)
    a.frombytes(raw)
    return a.tolist()


def floats(values: Any) -> bytes:
    """A vector (a list, an array or a numpy array) as raw float32."""
    tobytes = getattr(values, "astype", None)
    if tobytes is not None:  # numpy: no per-element Python objects
        return values.astype("<f4", copy=False).tobytes()
    return array(_FLOAT32, values).tobytes()


def floats_of(raw: bytes) -> array:
    a = array(_FLOAT32)
    a.frombytes(raw)
    return a


def rows(payloads: list[Any]) -> list[bytes]:
    """A custom model's rows (engine/custom.py `Row`) as msgpack: each tensor's datatype,
    shape and data (raw bytes for numbers, a list of byte strings for BYTES: the model
    sees UTF-8 text as `str` either way)."""
    return [_encoder.encode(_bytes_only(r.tensors)) for r in payloads]


def _bytes_only(tensors: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, (dt, shape, data) in tensors.items():
        if isinstance(data, list):
            data = [v.encode("utf-8") if isinstance(v, str) else v for v in data]
        out[k] = (dt, shape, data)
    return out


def rows_of(raw: list[bytes]) -> list[Any]:
    from engine.custom import Row

    return [Row(dict(_rows.decode(r))) for r in raw]


def outputs(result: Any) -> bytes:
    """A custom model's outputs for one row (engine/custom.py `CustomResult`), as msgpack."""
    return _encoder.encode(_bytes_only(result.outputs))


def outputs_of(raw: bytes) -> Any:
    from engine.custom import CustomResult

    return CustomResult(dict(_rows.decode(raw)))


class Sampling(msgspec.Struct, frozen=True, array_like=True):
    """Per-prompt generation parameters (engine-neutral)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    json_schema: str | None = None  # canonical JSON schema text the output must match
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None


class Submit(msgspec.Struct, tag="submit", array_like=True):
    """The items of one request, admitted all or none. `payloads[i]` is prompt i's token
    ids (`ids`); `sampling` is None for one-shot models."""

    req: int
    model: str
    payloads: list[bytes]
    costs: list[int]
    deadline: float | None
    priority: int = int(Priority.INTERACTIVE)
    request_id: str = ""
    stream: bool = False
    sampling: list[Sampling] | None = None
    count_rejection: bool = True
    itl_target: float | None = None  # seconds (x-llm-d-slo-tpot-ms)
    # No Admitted answer: the front end awaits only the results (one-shot work read by
    # nobody until it is done); a refusal still comes, as Refused.
    quiet: bool = False
    rows: bool = False  # `payloads` are a custom model's rows (`rows`), not token ids
    tenant: str = "default"  # whose work (batcher/fairness.py)
    on_infeasible: str | None = None  # the request's own "reject" / "serve"; None: the model's


class Admitted(msgspec.Struct, tag="admitted", array_like=True):
    req: int
    best_effort: bool = False


class Refused(msgspec.Struct, tag="refused", array_like=True):
    req: int
    code: str
    message: str
    retry_after: float | None = None


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    """Cancel every item of `req` not finished yet. Idempotent: unknown keys are skipped.
    `by_client=False`: withdrawn for the server's own reasons (a sibling failed)."""

    req: int
    by_client: bool = True


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """End item `index` of `req` now: the front end, which detokenizes, found a stop string
    in its text. The core frees the sequence before its next decode step and ends it with
    finish_reason "stop" (its usage: the tokens generated so far). Idempotent: an item
    finished already, or a key the core does not know, is skipped."""

    req: int
    index: int


class Timing(msgspec.Struct, frozen=True, array_like=True):
    """What the `X-Ferry-*` headers report about an item's way through the batcher."""

    arrival: float
    dispatched_at: float | None = None
    batch_size: int = 0
    reason: str | None = None
    best_effort: bool = False


class Result(msgspec.Struct, tag="result", array_like=True):
    """The one terminal outcome of item `index` of `req`: a vector (`floats`) for one-shot
    models, the finish reason and token counts for generation (whose text the front end
    made from the `NewTokens` before it; `cached_tokens`: its prompt tokens the prefix cache
    served); `code`/`message`/`retry_after` describe an error."""

    req: int
    index: int
    outcome: int
    timing: Timing
    vector: bytes | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    code: str | None = None
    message: str | None = None
    retry_after: float | None = None
    cached_tokens: int = 0
    output: bytes | None = None  # a custom model's outputs (`outputs`)


class NewTokens(msgspec.Struct, tag="delta", array_like=True):
    """New output of item `index` of `req`, in order: the new token ids (`ids`), sent for
    every generation item, streamed or not. The core makes no text: the front end
    detokenizes and applies stop strings (gateway/cores/client.py). `finish_reason`: the
    core ended the sequence with these tokens ("stop": an end-of-sequence token, never
    decoded; "complete": the last token is part of the answer, a constrained row's grammar
    is complete; "length")."""

    req: int
    index: int
    token_ids: bytes
    finish_reason: str | None = None
    # Where the request asked: per token (id, logprob, [(id, logprob) of the most likely]).
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # On an item's first tokens, where the request asked: each prompt token's (None for the first).
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]] | None] | None = None


class SettingsChange(msgspec.Struct, tag="settings", array_like=True):
    """Admin PATCH (empty `changes`: the GET). Answered by `SettingsAnswer` with the same
    `seq`."""

    seq: int
    model: str
    changes: dict[str, Any] = {}


class SettingsAnswer(msgspec.Struct, tag="settings_answer", array_like=True):
    seq: int
    settings: dict[str, Any] | None = None
    cost_model: dict[str, Any] | None = None
    field: str | None = None  # the setting an error names
    error: str | None = None


class MetricsRequest(msgspec.Struct, tag="metrics", array_like=True):
    """A /metrics scrape of the server asks each core for its own series; answered by
    `MetricsAnswer` with the same `seq` (docs/architecture.md, step 6)."""

    seq: int


class MetricFamily(msgspec.Struct, array_like=True):
    """One family of a core's registry as `registry.collect()` yields it (a counter's
    `_created` in its family): decoded by msgspec, not parsed from text, since parsing the
    OpenMetrics text of a core took most of a /metrics scrape (docs/benchmarks.md)."""

    name: str
    help: str
    type: str
    unit: str
    samples: list[tuple[str, dict[str, str], float]]  # (sample name, labels, value)


class MetricsAnswer(msgspec.Struct, tag="metrics_answer", array_like=True):
    seq: int
    families: list[MetricFamily]  # the core's registry


ToCore = Submit | Cancel | Stop | SettingsChange | MetricsRequest
ToFrontEnd = Admitted | Refused | Result | NewTokens | SettingsAnswer | MetricsAnswer

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(list[ToCore])
_to_front_end = msgspec.msgpack.Decoder(list[ToFrontEnd])
_rows = msgspec.msgpack.Decoder(dict[str, tuple[str, list[int], bytes | list[bytes]]])


# -- a frame between a front end and a core is a packet: the messages of one turn, in order --
def pack(messages: list[msgspec.Struct]) -> bytes:
    """One frame of messages (gateway/cores/outbox.py sends what one turn of the loop made)."""
    return _encoder.encode(messages)


def unpack_to_core(raw: bytes) -> list[ToCore]:
    """Raises msgspec.DecodeError (or ValidationError) unless every message is one of ToCore."""
    return _to_core.decode(raw)


def unpack_to_front_end(raw: bytes) -> list[ToFrontEnd]:
    return _to_front_end.decode(raw)


# -- errors cross as (code, message, retry_after) and come back as the same class ----------
_ERRORS: dict[str, type[errors.BatchingError]] = {
    cls.code: cls
    for cls in (
        errors.QueueFull,
        errors.DeadlineInfeasible,
        errors.TenantQuota,
        errors.RequestTooLarge,
        errors.DeadlineExceeded,
        errors.Cancelled,
        errors.EngineError,
        errors.ShuttingDown,
        errors.ModelUnavailable,
    )
}


def error_of(code: str | None, message: str | None, retry_after: float | None = None) -> errors.BatchingError:
    """The batcher error a `Refused` or an erroneous `Result` stands for; an unknown code
    is an EngineError that keeps its message (a newer core may know more codes)."""
    cls = _ERRORS.get(code or "", errors.EngineError)
    return cls(message or code or "unknown error", retry_after=retry_after)


def refusal(req: int, exc: Exception) -> Refused:
    return Refused(
        req,
        getattr(exc, "code", "internal_error"),
        getattr(exc, "message", str(exc)),
        getattr(exc, "retry_after", None),
    )


def outcome_of(result: Result) -> Outcome:
    return Outcome(result.outcome)
