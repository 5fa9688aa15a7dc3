"""Open Inference Protocol tensors for `infer`: a custom model's inputs (named columns, rows
first) as the JSON of `POST /v2/models/{model}/infer`, typed from the model's metadata, and
the response's outputs back as nested lists (or numpy arrays). No numpy needed unless asked."""

from __future__ import annotations

from typing import Any

NUMPY_TYPES = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BYTES": "object",
}


def _plain(value: Any) -> Any:
    """Lists of Python values from numpy arrays and tuples (bytes as UTF-8 text: JSON has no bytes)."""
    if hasattr(value, "tolist") and hasattr(value, "ndim"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return value


def _shape(value: Any) -> list[int]:
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _flatten(value: Any) -> list[Any]:
    if not isinstance(value, list):
        return [value]
    out: list[Any] = []
    for v in value:
        out.extend(_flatten(v))
    return out


def infer_body(
    model: str, metadata: dict, inputs: dict[str, Any], outputs: list[str] | None, request_id: str | None, params: dict
) -> tuple[dict, bool]:
    """The request body, and whether the inputs were one row without its list (`single`)."""
    declared = {t["name"]: t for t in metadata["inputs"]}
    if set(inputs) != set(declared):
        raise ValueError(f"model {model} takes inputs {sorted(declared)}, got {sorted(inputs)}")
    columns = {name: _plain(value) for name, value in inputs.items()}
    single = all(len(_shape(v)) < len(declared[n]["shape"]) for n, v in columns.items())
    tensors = []
    for name, value in columns.items():
        value = [value] if single else value
        tensors.append(
            {"name": name, "shape": _shape(value), "datatype": declared[name]["datatype"], "data": _flatten(value)}
        )
    body: dict[str, Any] = {"inputs": tensors}
    if outputs is not None:
        body["outputs"] = [{"name": o} for o in outputs]
    if request_id is not None:
        body["id"] = request_id
    parameters = {k: v for k, v in params.items() if v is not None}
    if parameters:
        body["parameters"] = parameters
    return body, single


def _nest(flat: list[Any], shape: list[int]) -> Any:
    if len(shape) <= 1:
        return flat if shape else flat[0]
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def read_outputs(body: dict, single: bool, numpy: bool) -> dict[str, Any]:
    """Each output by name: nested lists rows first (or a numpy array); one row's without
    the row dimension when the inputs were given so."""
    out = {}
    for o in body["outputs"]:
        shape, data = list(o["shape"]), o.get("data") or []
        if numpy:
            import numpy as np

            value: Any = np.array(data, dtype=NUMPY_TYPES[o["datatype"]]).reshape(shape)
            out[o["name"]] = value[0] if single else value
        else:
            nested = _nest(data, shape)
            out[o["name"]] = nested[0] if single else nested
    return out
