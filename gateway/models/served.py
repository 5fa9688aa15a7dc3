"""The one face every served batcher shows the gateway, wherever the batcher runs.

A model's batcher runs in this process (`--no-engine-cores`, `Ferry(specs=...)`, the tests'
fake engines: `LocalBatcher` around the batcher itself) or in the model's engine core
(`--engine-cores`, the default: gateway/cores/client.py, `CoreClient`, which speaks to it
over ZMQ). Which one a model has is decided once, when it starts (gateway/state.py); routes,
submission, admin, the live page, /metrics and batch jobs hold a `ServedBatcher` and never
ask which kind it is (as vLLM v1's `EngineCoreClient.make_client` hands out one interface
for its in-process and multiprocess clients)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from batcher.cost import cost_report
from batcher.fairness import DEFAULT
from batcher.queueing import QueueingBatcher
from batcher.settings import BatchingSettings
from batcher.types import Priority, WorkItem


class Holds(Protocol):
    def __contains__(self, item: WorkItem, /) -> bool: ...


class ServedBatcher(Protocol):
    """submit, cancel, update, describe, scrape, drain, stop; `failed` and `restarting`."""

    @property
    def failed(self) -> str | None:
        """Why the model cannot serve now (its core lost, its loop crashed); None: it can."""
        ...

    @property
    def restarting(self) -> bool:
        """Lost, and a restart is under way: a 503 then carries Retry-After."""
        ...

    @property
    def settings(self) -> BatchingSettings: ...

    @property
    def closing(self) -> bool: ...

    @property
    def queue(self) -> Holds:
        """Items not yet started, as far as this process can tell (an engine core's client
        counts every unfinished item)."""
        ...

    async def start(self) -> None: ...

    async def submit_many(
        self,
        payloads: list[Any],
        *,
        costs: list[int] | None = None,
        cost: int = 1,
        budget: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
        request_id: str = "",
        on_delta: Callable[[Any], None] | None = None,
        count_rejection: bool = True,
        itl_target: float | None = None,
        one_shot: bool = False,
        tenant: str = DEFAULT,
        on_infeasible: str | None = None,
    ) -> list[WorkItem]:
        """Queue one request's items, all or none, or raise a BatchingError at once.
        `one_shot`: the caller only waits for the results (embeddings), so a refusal may
        arrive as the items' error instead of being raised here (an engine core then
        answers without a round trip before the results)."""
        ...

    def cancel(self, item: WorkItem, *, by_client: bool = True) -> bool: ...

    async def update(self, **changes: Any) -> BatchingSettings:
        """Apply new knobs (SettingsError names a bad one); returns the settings now."""
        ...

    async def describe(self) -> dict[str, Any]:
        """Every setting and the fitted cost models (`cost_model`): the admin GET's body."""
        ...

    async def scrape(self) -> list[Any] | None:
        """The metric families of the process the batcher runs in, for /metrics to merge;
        None when that process is this one (its registry is read directly)."""
        ...

    async def drain(self, timeout: float) -> int:
        """Finish accepted work within `timeout`; returns how many items had to fail."""
        ...

    async def stop(self) -> None: ...


class LocalBatcher:
    """A batcher running in this process, behind the served face; `inner` is the batcher
    itself (the engine core serves its own through this too)."""

    restarting = False  # nothing restarts it: its loop crashing leaves the model failed

    def __init__(self, inner: QueueingBatcher):
        self.inner = inner

    @property
    def failed(self) -> str | None:
        return self.inner.failed

    @property
    def settings(self) -> BatchingSettings:
        return self.inner.settings

    @property
    def closing(self) -> bool:
        return self.inner.closing

    @property
    def queue(self) -> Holds:
        return self.inner.queue

    async def start(self) -> None:
        await self.inner.start()

    async def submit_many(
        self,
        payloads: list[Any],
        *,
        costs: list[int] | None = None,
        cost: int = 1,
        budget: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
        request_id: str = "",
        on_delta: Callable[[Any], None] | None = None,
        count_rejection: bool = True,
        itl_target: float | None = None,
        one_shot: bool = False,
        tenant: str = DEFAULT,
        on_infeasible: str | None = None,
    ) -> list[WorkItem]:
        return self.inner.submit_many(
            payloads,
            costs=costs,
            cost=cost,
            budget=budget,
            priority=priority,
            request_id=request_id,
            on_delta=on_delta,
            count_rejection=count_rejection,
            itl_target=itl_target,
            tenant=tenant,
            on_infeasible=on_infeasible,
        )

    def cancel(self, item: WorkItem, *, by_client: bool = True) -> bool:
        return self.inner.cancel(item, by_client=by_client)

    async def update(self, **changes: Any) -> BatchingSettings:
        return self.inner.update(**changes)

    async def describe(self) -> dict[str, Any]:
        return {**self.inner.settings.to_dict(), "cost_model": cost_report(self.inner.cost_models)}

    async def scrape(self) -> None:
        return None

    async def drain(self, timeout: float) -> int:
        return await self.inner.drain(timeout)

    async def stop(self) -> None:
        await self.inner.stop()
