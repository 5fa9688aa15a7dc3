"""The Open Inference Protocol (KServe v2) for custom models: its request and response
bodies (pydantic), a request's tensors checked against the model's declared inputs and cut
into rows (one work item each, `engine.custom.Row`), and the rows' outputs put back together
as the response's tensors.

Both of the protocol's encodings of a tensor are read and written: JSON `data` (flat or
nested, row-major) and the binary tensor data extension (Triton's and tritonclient's
default): the body is the JSON header, `Inference-Header-Content-Length` bytes long, then
each binary tensor's raw bytes in order (`parameters.binary_data_size`; BYTES elements as a
4-byte little-endian length and the bytes)."""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.custom import DATATYPES, CustomResult, Row, Tensor

from ..errors import APIError
from ..schemas import ON_INFEASIBLE

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES"
]
HEADER_LENGTH = "inference-header-content-length"
# A batch line's url for a custom model (gateway/jobs/validate.py), and the batch endpoint that says so.
INFER_URL = re.compile(r"^/v2/models/(?P<model>[^/].*)/infer$")
INFER_ENDPOINT = "/v2/models/{model}/infer"
BINARY_SIZE = "binary_data_size"
MAX_DIM = 2**31 - 1  # one dimension of a tensor's shape
MAX_SHAPE = 2**40  # the product of a shape's non-zero dimensions (numpy refuses far less than its int64)
MAX_BUDGET_MS = 3_600_000.0  # as X-Ferry-Latency-Budget-Ms and the OpenAI routes' field
Parameters = Annotated[dict[str, Any], Field(description="free-form; Ferry reads the names below")]


class RequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="a declared input of the model")
    shape: list[Annotated[int, Field(ge=0, le=MAX_DIM)]] = Field(
        min_length=1, max_length=32, description="rows first: [rows, *row shape]"
    )
    datatype: Datatype
    parameters: Parameters | None = None
    data: list[Any] | None = Field(
        None, description="row-major elements, flat or nested; absent when the tensor is binary (binary_data_size)"
    )


class RequestOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="a declared output of the model")
    parameters: Parameters | None = Field(None, description="`binary_data: true`: this output in binary")


class InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, description="echoed in the response")
    parameters: Parameters | None = Field(
        None,
        description="Ferry's `latency_budget_ms` (number), `priority` (interactive | batch) and `on_infeasible` "
        "(reject | serve), as the X-Ferry-Latency-Budget-Ms, X-Ferry-Priority and X-Ferry-On-Infeasible headers; "
        "`binary_data_output: true`: every output in binary",
    )
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = Field(None, description="the outputs to return (default: all)")


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(None, description="flat, row-major; absent when binary")


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class MetadataTensor(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int] = Field(description="-1: any length; the first dimension is the rows")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[MetadataTensor]
    outputs: list[MetadataTensor]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class OIPErrorBody(BaseModel):
    error: str


@dataclass
class Infer:
    """A checked infer request: its rows, Ferry's scheduling fields and what to answer."""

    id: str | None
    rows: list[Row]
    outputs: list[tuple[Tensor, bool]]  # (declared output, in binary?)
    latency_budget_ms: float | None  # read by submission.scheduling, as a body's field
    priority: str | None
    on_infeasible: str | None = None  # read by submission.on_infeasible, as a body's field


@dataclass
class CustomWork:
    """An infer request as work (translate/work.py's `Work`): its rows, their cost hints
    (ones where the front end has no class: the engine core computes them) and the
    response body, as a batch line's output records it."""

    model: str
    infer: Infer
    costs: list[int]

    @property
    def payloads(self) -> list[Row]:
        return self.infer.rows

    def response(self, results: list[Any]) -> dict[str, Any]:
        body, _ = encode_response(self.model, self.infer, results)
        return orjson.loads(body)


def custom_work(name: str, model: Any, body: dict[str, Any], max_rows: int) -> CustomWork:
    """A batch line's infer body (JSON tensors only: a line has no binary part) as work."""
    infer = parse_infer(orjson.dumps(body), None, model, max_rows)
    if any(binary for _, binary in infer.outputs):
        raise bad("a batch line's outputs are JSON: binary outputs are not available in batch jobs", "outputs")
    costs = model.costs(infer.rows) or [1] * len(infer.rows)
    return CustomWork(name, infer, costs)


def metadata(name: str, inputs: list[Tensor], outputs: list[Tensor]) -> dict[str, Any]:
    return {
        "name": name,
        "versions": ["1"],
        "platform": "ferry_custom",
        "inputs": [t.describe() for t in inputs],
        "outputs": [t.describe() for t in outputs],
    }


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, code="invalid_value", param=param)


def parse_infer(raw: bytes, header_length: str | None, model: Any, max_rows: int) -> Infer:
    """The request `raw` (with `Inference-Header-Content-Length` when it has binary tensors)
    checked against `model`'s declared tensors, as rows; APIError 400 saying what is wrong."""
    body, binary = _split(raw, header_length)
    try:
        req = InferenceRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise bad(f"invalid inference request: {where}: {first['msg']}", where) from None
    declared = {t.name: t for t in model.inputs}
    given = {i.name: i for i in req.inputs}
    if len(given) != len(req.inputs):
        raise bad("two inputs share a name", "inputs")
    unknown = sorted(set(given) - set(declared))
    missing = sorted(set(declared) - set(given))
    if unknown or missing:
        raise bad(f"model {model.name} takes inputs {sorted(declared)}; unknown {unknown}, missing {missing}", "inputs")
    for i in req.inputs:  # a zero dimension makes no elements, but numpy still refuses a huge shape
        if math.prod(d for d in i.shape if d) > MAX_SHAPE:
            raise bad(f"input {i.name!r}: shape {i.shape} is too large", i.name)
    counts = {i.shape[0] for i in req.inputs}
    if len(counts) != 1:
        raise bad("every input has the same number of rows (the first dimension of its shape)", "inputs")
    n = counts.pop()
    if n < 1:
        raise bad("an inference request has at least one row", "inputs")
    if n > max_rows:
        raise APIError(
            422, f"{n} rows exceed the limit of {max_rows} per request", code="too_many_inputs", param="inputs"
        )
    offset = 0
    columns: dict[str, list[Any]] = {}
    for i in req.inputs:  # binary tensors lie in the order of the inputs
        spec = declared[i.name]
        if i.datatype != spec.datatype:
            raise bad(f"input {i.name!r} is {spec.datatype}, got {i.datatype}", i.name)
        if not spec.fits(i.shape[1:]):
            raise bad(f"input {i.name!r} has row shape {list(spec.shape)} (-1: any), got {i.shape[1:]}", i.name)
        size = (i.parameters or {}).get(BINARY_SIZE)
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise bad(f"input {i.name!r}: {BINARY_SIZE} {size!r} does not fit the binary data", i.name)
            columns[i.name] = _binary_rows(i, binary[offset : offset + size])
            offset += size
        elif i.data is None:
            raise bad(f"input {i.name!r} has no data", i.name)
        else:
            columns[i.name] = _json_rows(i)
    if offset != len(binary):
        raise bad(f"{len(binary) - offset} bytes of binary data belong to no input", "inputs")
    rows = [Row({name: col[r] for name, col in columns.items()}) for r in range(n)]
    outputs = _outputs(req, model)
    params = req.parameters or {}
    budget, priority = params.get("latency_budget_ms"), params.get("priority")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= MAX_BUDGET_MS
    ):  # NaN fails the range too
        raise bad(
            f"parameters.latency_budget_ms is a number of milliseconds in (0, {MAX_BUDGET_MS:.0f}], got {budget!r}",
            "latency_budget_ms",
        )
    if priority is not None and priority not in ("interactive", "batch"):
        raise bad(f"parameters.priority is 'interactive' or 'batch', got {priority!r}", "priority")
    choice = params.get("on_infeasible")
    if choice is not None and choice not in ON_INFEASIBLE:
        raise bad(f"parameters.on_infeasible is 'reject' or 'serve', got {choice!r}", "on_infeasible")
    return Infer(req.id, rows, outputs, None if budget is None else float(budget), priority, choice)


def _split(raw: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return raw, b""
    if not (header_length.isascii() and header_length.isdigit()) or int(header_length) > len(raw):
        raise bad(f"{HEADER_LENGTH} {header_length!r} is not a length within the body", HEADER_LENGTH)
    cut = int(header_length)
    return raw[:cut], raw[cut:]


def _flag(parameters: dict[str, Any] | None, name: str, default: bool) -> bool:
    value = (parameters or {}).get(name, default)
    if not isinstance(value, bool):
        raise bad(f"parameters.{name} is true or false, got {value!r}", name)
    return value


def _outputs(req: InferenceRequest, model: Any) -> list[tuple[Tensor, bool]]:
    """The outputs to answer, each in binary or not: an output's own `binary_data` wins over
    the request's `binary_data_output` (Triton's rule)."""
    declared = {t.name: t for t in model.outputs}
    everything = _flag(req.parameters, "binary_data_output", False)
    if req.outputs is None:
        return [(t, everything) for t in model.outputs]
    chosen = []
    for o in req.outputs:
        if o.name not in declared:
            raise bad(f"model {model.name} has outputs {sorted(declared)}, not {o.name!r}", "outputs")
        if "classification" in (o.parameters or {}):
            raise bad(f"output {o.name!r}: the classification extension is not served", "outputs")
        chosen.append((declared[o.name], _flag(o.parameters, "binary_data", everything)))
    return chosen


def _flat(data: list[Any]) -> list[Any]:
    if not any(isinstance(v, list) for v in data):
        return data
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def _json_rows(i: RequestInput) -> list[Any]:
    flat = _flat(i.data or [])
    total = math.prod(i.shape)
    if len(flat) != total:
        raise bad(f"input {i.name!r}: shape {i.shape} holds {total} elements, data has {len(flat)}", i.name)
    row_shape = i.shape[1:]
    per = math.prod(row_shape)
    if i.datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise bad(f"input {i.name!r}: BYTES data are strings", i.name)
        return [("BYTES", row_shape, flat[r * per : (r + 1) * per]) for r in range(i.shape[0])]
    arr = _numbers(i, flat)
    step = per * arr.itemsize
    data = arr.tobytes()
    return [(i.datatype, row_shape, data[r * step : (r + 1) * step]) for r in range(i.shape[0])]


def _numbers(i: RequestInput, flat: list[Any]) -> np.ndarray:
    dtype = np.dtype(DATATYPES[i.datatype])
    if i.datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise bad(f"input {i.name!r}: BOOL data are true or false", i.name)
        return np.asarray(flat, dtype=dtype)
    if dtype.kind in "iu":
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise bad(f"input {i.name!r}: {i.datatype} data are integers", i.name)
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise bad(f"input {i.name!r}: a value lies outside {i.datatype}'s [{info.min}, {info.max}]", i.name)
        return np.asarray(flat, dtype=dtype)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        raise bad(f"input {i.name!r}: {i.datatype} data are numbers", i.name)
    top = float(np.finfo(dtype).max)
    if flat and max(abs(v) for v in flat) > top:
        raise bad(f"input {i.name!r}: a value lies outside {i.datatype}'s range", i.name)
    return np.asarray(flat, dtype=dtype)


def _binary_rows(i: RequestInput, raw: bytes) -> list[Any]:
    row_shape = i.shape[1:]
    per = math.prod(row_shape)
    if i.datatype == "BYTES":
        items = _unlength(raw, i.name)
        if len(items) != math.prod(i.shape):
            raise bad(f"input {i.name!r}: shape {i.shape} and {len(items)} binary BYTES elements", i.name)
        return [("BYTES", row_shape, items[r * per : (r + 1) * per]) for r in range(i.shape[0])]
    itemsize = np.dtype(DATATYPES[i.datatype]).itemsize
    if len(raw) != math.prod(i.shape) * itemsize:
        raise bad(f"input {i.name!r}: shape {i.shape} of {i.datatype} is not {len(raw)} bytes", i.name)
    if i.datatype == "BOOL" and raw.strip(b"\x00\x01"):
        raise bad(f"input {i.name!r}: BOOL bytes are 0 or 1", i.name)
    step = per * itemsize
    return [(i.datatype, row_shape, raw[r * step : (r + 1) * step]) for r in range(i.shape[0])]


def _unlength(raw: bytes, name: str) -> list[bytes]:
    items, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise bad(f"input {name!r}: binary BYTES end inside an element's length", name)
        (size,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + size > len(raw):
            raise bad(f"input {name!r}: a binary BYTES element runs past the data", name)
        items.append(raw[at : at + size])
        at += size
    return items


def encode_response(name: str, infer: Infer, results: list[CustomResult]) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers: JSON, or the JSON header and the binary outputs."""
    outputs, binary = [], []
    for spec, as_binary in infer.outputs:
        parts = [r.outputs[spec.name] for r in results]
        shapes = {tuple(p[1]) for p in parts}
        if len(shapes) != 1:
            # A model's bug (its own rows disagree): the request fails, its batch mates do not.
            raise APIError(
                500,
                f"model {name}: output {spec.name!r} has rows of different shapes {sorted(shapes)}",
                code="engine_error",
            )
        shape = [len(parts), *parts[0][1]]
        entry: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype, "shape": shape}
        if as_binary:
            chunk = _binary_of(spec.datatype, parts)
            entry["parameters"] = {BINARY_SIZE: len(chunk)}
            binary.append(chunk)
        else:
            entry["data"] = _json_of(name, spec, parts)
        outputs.append(entry)
    body: dict[str, Any] = {"model_name": name, "model_version": "1", "outputs": outputs}
    if infer.id is not None:
        body["id"] = infer.id
    head = orjson.dumps(body)
    if not binary:
        return head, {"content-type": "application/json"}
    return head + b"".join(binary), {
        "content-type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }


def _binary_of(datatype: str, parts: list[Any]) -> bytes:
    if datatype != "BYTES":
        return b"".join(p[2] for p in parts)
    out = bytearray()
    for p in parts:
        for v in p[2]:
            b = v.encode("utf-8") if isinstance(v, str) else v
            out += struct.pack("<I", len(b)) + b
    return bytes(out)


def _json_of(name: str, spec: Tensor, parts: list[Any]) -> list[Any]:
    if spec.datatype == "BYTES":
        out = []
        for p in parts:
            for v in p[2]:
                if isinstance(v, bytes):
                    try:
                        v = v.decode("utf-8")
                    except UnicodeDecodeError:
                        raise APIError(
                            500,
                            f"model {name}: output {spec.name!r} is not UTF-8 text: ask for it in binary "
                            "(parameters.binary_data)",
                            code="engine_error",
                        ) from None
                out.append(v)
        return out
    dtype = np.dtype(DATATYPES[spec.datatype])
    return np.frombuffer(b"".join(p[2] for p in parts), dtype=dtype).tolist()
