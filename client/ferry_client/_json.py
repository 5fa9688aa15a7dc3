"""JSON on the wire, with the standard library so the client needs nothing but httpx.

numpy values (arrays and scalars) in request parameters are written as plain numbers and
lists; NaN and infinities are refused, since the gateway would reject them as invalid JSON.
"""

from __future__ import annotations

import json
from typing import Any


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # a numpy array or scalar
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def dumps(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_plain).encode()


def loads(data: bytes | str) -> Any:
    return json.loads(data)
