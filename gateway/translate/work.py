"""What a translated request is, whatever its route."""

from __future__ import annotations

from typing import Any, Protocol


class Work(Protocol):
    """A request as work items: one payload and one cost (prompt tokens) per item, for
    `QueueingBatcher.submit_many`, and how the items' results, in item order, become the
    response body a client gets."""

    @property
    def payloads(self) -> list[Any]: ...

    @property
    def costs(self) -> list[int]: ...

    def response(self, results: list[Any]) -> dict[str, Any]: ...
