"""Ferry gateway. `from gateway import Ferry, FerryClient` (imported lazily, so importing
the package stays cheap). The client itself lives in `ferry_client` (client/), which also
installs on its own; it is re-exported here so one import gives both."""

from __future__ import annotations

from typing import Any

_LAZY = {
    "Ferry": "gateway.embedded",
    "FerryClient": "ferry_client",
    "AsyncFerryClient": "ferry_client",
    "gather_stream": "ferry_client",
    "agather_stream": "ferry_client",
    "FerryError": "ferry_client",
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
