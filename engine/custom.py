"""A batched model the user brings (docs/custom-models.md): the contract it follows, and the
engine Ferry wraps it in so that the batcher serves it like the built-in kinds.

The user's class declares its tensors and answers a batch, one output per input:

    from engine.custom import Tensor

    class Classifier:
        inputs = [Tensor("text", "BYTES")]                       # one row's tensors
        outputs = [Tensor("label", "BYTES"), Tensor("scores", "FP32", (-1,))]

        def __init__(self, labels: list[str]): ...             # `options:` of the config entry
        def load(self, device: str, dtype: str) -> None: ...    # weights, once, in the engine process
        def predict(self, batch: list[dict]) -> list[dict | Exception]: ...
        def cost(self, row: dict) -> int: ...                   # optional: relative work of one row
        thread_safe = True                                      # optional: predict may run on two threads

A row is a dict of input name to value: a numeric tensor as a numpy array of the row's shape,
a BYTES tensor as `str` (UTF-8; `bytes` when it is not) or, when the row's shape is not
scalar, a numpy object array of them. An output row is a dict of output name to anything
`numpy.asarray` takes (BYTES: `str`/`bytes` or lists of them). An Exception in place of an
output fails that input alone; raising out of `predict` fails the batch's inputs (and an
out-of-memory error is retried by halves).

Tensors travel between processes as `Packed` values, (datatype, shape, data): raw
little-endian bytes for numbers, a list of `str`/`bytes` for BYTES. No HTTP, no torch here.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The Open Inference Protocol's datatypes (KServe v2) to numpy's, little-endian; BYTES: None.
DATATYPES: dict[str, str | None] = {
    "BOOL": "?",
    "UINT8": "<u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "<i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
    "BYTES": None,
}
# Where the user's class lives: "package.module:ClassName".
SOURCE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")

Packed = tuple[str, list[int], Any]  # (datatype, shape, bytes or a list of str/bytes)


class CustomModelError(ValueError):
    """The user's class breaks the contract (no `predict`, a bad tensor declaration); the
    message says what to change."""


@dataclass(frozen=True)
class Tensor:
    """One declared tensor: its name, Open Inference Protocol datatype and one row's shape
    (without the batch dimension; -1: any length; () a scalar per row)."""

    name: str
    datatype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise CustomModelError(f"a tensor's name must be a non-empty string, got {self.name!r}")
        if self.datatype not in DATATYPES:
            raise CustomModelError(
                f"tensor {self.name!r}: datatype {self.datatype!r} is not one of {', '.join(DATATYPES)}"
            )
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in shape):
            raise CustomModelError(f"tensor {self.name!r}: shape {list(shape)} must be integers >= -1")
        object.__setattr__(self, "shape", shape)

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether a row of `shape` matches the declared one (-1 matches any length)."""
        return len(shape) == len(self.shape) and all(d in (-1, s) for d, s in zip(self.shape, shape, strict=True))

    def describe(self) -> dict[str, Any]:
        """Its Open Inference Protocol metadata: the shape with the batch dimension (-1) first."""
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.shape]}

    def to_list(self) -> list[Any]:
        return [self.name, self.datatype, list(self.shape)]

    @classmethod
    def of(cls, value: Any) -> Tensor:
        """A declaration as the user wrote it: a Tensor, a mapping or a (name, datatype, shape)."""
        if isinstance(value, Tensor):
            return value
        if isinstance(value, dict):
            return cls(value.get("name", ""), value.get("datatype", ""), tuple(value.get("shape", ())))
        if isinstance(value, (list, tuple)) and len(value) in (2, 3):
            return cls(value[0], value[1], tuple(value[2]) if len(value) == 3 else ())
        raise CustomModelError(f"a tensor is declared as Tensor(name, datatype, shape), got {value!r}")


@dataclass(slots=True)
class Row:
    """One work item: one row of each input tensor, packed."""

    tensors: dict[str, Packed]


@dataclass(slots=True)
class CustomResult:
    """One input's outputs, packed."""

    outputs: dict[str, Packed] = field(default_factory=dict)


def pack_value(datatype: str, value: Any) -> Packed:
    """A row's value (anything numpy.asarray takes; BYTES: str/bytes, lists of them) as it travels."""
    dtype = DATATYPES[datatype]
    if dtype is None:
        arr = np.asarray(value, dtype=object)
        # As bytes (UTF-8 for text): a str that cannot be encoded (a lone surrogate) fails here,
        # for its row alone, not later where it would cross a process or become JSON.
        flat = [_bytes_of(v) for v in arr.reshape(-1).tolist()]
        return datatype, list(arr.shape), flat
    arr = np.asarray(value)
    if arr.dtype == object or (arr.dtype.kind in "US"):
        raise ValueError(f"a {datatype} tensor holds numbers, got {arr.dtype} values")
    return datatype, list(arr.shape), np.ascontiguousarray(arr, dtype=dtype).tobytes()


def _bytes_of(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"a BYTES text is not encodable as UTF-8: {exc.reason}") from None
    raise ValueError(f"a BYTES tensor holds str or bytes, got {type(value).__name__}")


def unpack_value(packed: Packed) -> Any:
    """What the model sees: a numpy array of the row's shape (its own, writable); BYTES: str
    (bytes if not UTF-8), an object array of them when the row is not a scalar."""
    datatype, shape, data = packed
    dtype = DATATYPES[datatype]
    if dtype is None:
        items = [_text(v) for v in data]
        if not shape:
            return items[0]
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out.reshape(shape)
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return value


class CustomEngine:
    """The user's model behind the engine contract the batcher runs (engine/base.py's one-shot
    kind): `predict` over packed rows, results packed, each output checked against its
    declaration so that a wrong one fails that input alone."""

    def __init__(self, model: Any, name: str, inputs: list[Tensor], outputs: list[Tensor]):
        self.model = model
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        cost = getattr(model, "cost", None)
        self._cost = cost if callable(cost) else None
        # The class may be called from two threads at once: the interactive lane runs beside
        # the batch in flight (gateway/models/start.py). Off unless the class says so.
        self.thread_safe = getattr(model, "thread_safe", False) is True

    def predict(self, rows: Sequence[Row]) -> list[CustomResult | Exception]:
        out: list[CustomResult | Exception] = [CustomModelError("no output")] * len(rows)  # each set below
        batch, at = [], []
        for i, row in enumerate(rows):
            try:  # a row that cannot be unpacked fails alone
                batch.append(_values(row))
                at.append(i)
            except Exception as exc:
                out[i] = CustomModelError(f"{self.name}: input row cannot be read: {exc}")
        if batch:
            answers = self.model.predict(batch)
            if not isinstance(answers, (list, tuple)) or len(answers) != len(batch):
                got = f"{len(answers)} outputs" if isinstance(answers, (list, tuple)) else type(answers).__name__
                raise CustomModelError(f"{self.name}: predict took {len(batch)} inputs and returned {got}")
            for i, answer in zip(at, answers, strict=True):
                out[i] = answer if isinstance(answer, Exception) else self._result(answer)
        return out

    def _result(self, answer: Any) -> CustomResult | Exception:
        try:
            return self._checked(answer)
        except Exception as exc:  # whatever an output holds, a bad one fails its input alone
            return CustomModelError(f"{self.name}: an output cannot be read: {type(exc).__name__}: {exc}")

    def _checked(self, answer: Any) -> CustomResult | Exception:
        if not isinstance(answer, dict):
            return CustomModelError(
                f"{self.name}: an output is a dict of output name to value, got {type(answer).__name__}"
            )
        missing = [t.name for t in self.outputs if t.name not in answer]
        extra = sorted(set(answer) - {t.name for t in self.outputs})
        if missing or extra:
            return CustomModelError(
                f"{self.name}: an output lacks {missing} or has undeclared {extra} (declared: "
                f"{[t.name for t in self.outputs]})"
            )
        out: dict[str, Packed] = {}
        for t in self.outputs:
            try:
                packed = pack_value(t.datatype, answer[t.name])
            except (ValueError, TypeError, OverflowError) as exc:
                return CustomModelError(f"{self.name}: output {t.name!r}: {exc}")
            if not t.fits(packed[1]):
                return CustomModelError(
                    f"{self.name}: output {t.name!r} has shape {packed[1]}, declared {list(t.shape)}"
                )
            out[t.name] = packed
        return CustomResult(out)

    def costs(self, rows: Sequence[Row]) -> list[int] | None:
        """Each row's cost hint (the class's `cost`), at least 1; None without one."""
        cost = self._cost
        if cost is None:
            return None
        return [max(1, int(cost(_values(r)))) for r in rows]

    def facts(self) -> dict[str, Any]:
        """What a front end needs of it (CustomFront), reported by its engine core."""
        return {
            "name": self.name,
            "inputs": [t.to_list() for t in self.inputs],
            "outputs": [t.to_list() for t in self.outputs],
        }


def _values(row: Row) -> dict[str, Any]:
    """A row as the class sees it: input name to value."""
    return {k: unpack_value(v) for k, v in row.tensors.items()}


class CustomFront:
    """A custom model as a front end sees it when the model runs in an engine core: its name
    and tensors, no weights (the core computes the cost hints)."""

    def __init__(self, name: str, inputs: list[list[Any]], outputs: list[list[Any]]):
        self.name = name
        self.inputs = [Tensor.of(t) for t in inputs]
        self.outputs = [Tensor.of(t) for t in outputs]

    def costs(self, rows: Sequence[Row]) -> None:
        return None


def find_class(source: str) -> type:
    """The class `source` ("package.module:ClassName") names, imported."""
    if not SOURCE.match(source):
        raise CustomModelError(f"source {source!r} is not of the form package.module:ClassName")
    module_name, _, qualname = source.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # As uvicorn finds an app: the directory the server runs in, when the environment lacks it.
        if exc.name != module_name.split(".")[0] or os.getcwd() in sys.path:
            raise
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise CustomModelError(f"module {module_name!r} has no {qualname!r}")
    if not isinstance(target, type):
        raise CustomModelError(f"{source} is not a class")
    return target


def load_custom(
    source: str, name: str, *, device: str = "cpu", dtype: str = "auto", options: dict[str, Any] | None = None
) -> CustomEngine:
    """Import the class, make it with `options`, check its declarations and load it."""
    cls = find_class(source)
    if not callable(getattr(cls, "predict", None)):
        raise CustomModelError(f"{source} has no predict(batch) method")
    model = cls(**(options or {}))
    declared: dict[str, list[Tensor]] = {}
    for side in ("inputs", "outputs"):
        raw = getattr(model, side, None)
        if not isinstance(raw, (list, tuple)) or not raw:
            raise CustomModelError(f"{source} declares no {side} (a list of engine.custom.Tensor)")
        tensors = [Tensor.of(t) for t in raw]
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise CustomModelError(f"{source}: two {side} share a name ({names})")
        declared[side] = tensors
    load = getattr(model, "load", None)
    if callable(load):
        load(device=device, dtype=dtype)
    return CustomEngine(model, name, declared["inputs"], declared["outputs"])


def custom_device(device: str | None) -> str:
    """`auto` as the built-in kinds read it (cuda when torch sees one), without importing torch
    for a model that does not use it unless `auto` asks."""
    if device in (None, "", "auto"):
        try:
            import torch
        except ImportError:
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
