"""prometheus-client's metric types with their children cached by label values.

`labels(...)` in prometheus-client checks the values, turns each into a string and takes a
lock on every call: on a busy front end that was several calls per request for children
that, once made, never change. These subclasses look the child up in a plain dict first;
`remove` and `clear` forget it too, so a removed series is made afresh next time.
"""

from __future__ import annotations

from typing import Any, TypeVar

import prometheus_client

_T = TypeVar("_T")


class _CachedLabels:
    def labels(self: _T, *values: Any, **by_name: Any) -> _T:
        if by_name:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        try:
            return self.__dict__["_children"][values]
        except KeyError:
            child = super().labels(*values)  # type: ignore[misc]
            self.__dict__.setdefault("_children", {})[values] = child
            return child

    def remove(self, *values: Any) -> None:
        self.__dict__.pop("_children", None)
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self.__dict__.pop("_children", None)
        super().clear()  # type: ignore[misc]


class Counter(_CachedLabels, prometheus_client.Counter):
    pass


class Gauge(_CachedLabels, prometheus_client.Gauge):
    pass


class Histogram(_CachedLabels, prometheus_client.Histogram):
    pass
