"""Ferry gateway. `from gateway import Ferry, FerryClient` (imported lazily, so importing
the package stays cheap)."""
from __future__ import annotations

from typing import Any

_LAZY = {
    "Ferry": "gateway.embedded",
    "FerryClient": "gateway.client",
    "AsyncFerryClient": "gateway.client",
    "gather_stream": "gateway.client",
    "agather_stream": "gateway.client",
    "FerryError": "gateway.client",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gateway' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
