"""The front end's view of a batcher that runs in an engine core (gateway/cores/core.py):
the surface the gateway uses of a QueueingBatcher, over a ZMQ DEALER socket.

What differs from a local batcher, and why:
- `submit_many` is a coroutine: admission is the core's, so it answers when the core's
  `Admitted` or `Refused` arrives (a refusal raises the same BatchingError, still before
  any response byte). The items exist from the moment the core admitted them, so no
  `Result` can arrive for a request this side does not know yet.
- Cancelling is per request on the wire: `cancel(item)` withdraws every unfinished item of
  the item's request in the core and resolves them here at once (the gateway only ever
  cancels all of a request's items).
- Generation: the core sends token ids only (`NewTokens`); this side makes the text and
  applies the stop strings (gateway/cores/text.py, `TextAssembler`), and a stop string
  found here ends the item's sequence in the core at once (`Stop`).
- `update` and `describe` (the admin GET) are coroutines answered by the core; so is
  `scrape`, the core's metrics for the server's /metrics.
- Dispatches are not reported until an item ends, so `item in batcher.queue` holds for
  every unfinished item.
- When the core is lost (`lost`, called by whoever watches its process), every request in
  flight ends at once with `503 model_unavailable` and `failed` says why. While a new core
  starts (`restarting`) the 503s carry a Retry-After; `reconnect` then serves from it.

`CoreClient` holds the socket, the admin calls and the core's lifecycle; its `RequestTable`
(gateway/cores/inflight.py) holds the requests in flight and resolves them with what the
core sends of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import msgspec
import zmq
import zmq.asyncio

from batcher.errors import ModelUnavailable, ShuttingDown
from batcher.fairness import DEFAULT
from batcher.settings import BatchingSettings, SettingsError
from batcher.types import GenRequest, Priority, WorkItem
from engine.base import SamplingParams
from engine.custom import Row
from gateway.cores import wire

from .inflight import RequestTable
from .outbox import Outbox

log = logging.getLogger("ferry.gateway")

# Results a core sent just before it exited may still be on their way when its exit is
# seen; they get this long to arrive before the items still open fail.
LATE_RESULTS_S = 0.5
# An admin request the core does not answer in this time fails (a stuck core).
ANSWER_TIMEOUT_S = 10.0
# A /metrics scrape leaves out a core that does not answer in this time, well inside
# Prometheus' default scrape timeout (10 s), so one stuck core does not fail the scrape.
SCRAPE_TIMEOUT_S = 2.0


class CoreControl(Protocol):
    """What the batcher asks of the engine core behind it, beyond messages."""

    async def drain(self, timeout: float) -> None: ...  # finish accepted work, then exit

    async def stop(self) -> None: ...  # exit now


def sampling_of(p: SamplingParams) -> wire.Sampling:
    """The wire's copy of a prompt's sampling parameters: every field of `wire.Sampling`,
    named as in SamplingParams."""
    return wire.Sampling(**{name: getattr(p, name) for name in wire.Sampling.__struct_fields__})


class CoreClient:
    """A model's batcher as a front end sees it when the batcher runs in an engine core:
    the gateway's `ServedBatcher`, over ZMQ (see the module's docstring)."""

    def __init__(
        self,
        model: str,
        address: str,
        settings: BatchingSettings,
        *,
        core: CoreControl | None = None,
        ctx: zmq.asyncio.Context | None = None,
        tokenizer: Any = None,
        identity: bytes | None = None,
    ):
        """`tokenizer`: a generation model's, which detokenizes what its core generates
        (gateway/cores/text.py). `identity`: this side's socket identity (ZMQ's own if
        None); with `--api-workers N` the supervisor names each front end, so that it can
        tell the cores which one died (gateway/cores/supervisor.py)."""
        self.identity = identity
        self.model = model
        self.tokenizer = tokenizer
        self.address = address
        self.core = core
        self._settings = settings
        self.failed: str | None = None
        self.restarting = False  # `failed` until a new core serves (gateway/cores/process.py)
        self._closing = False
        self._leaving = False  # the server drains or stops: the core's exit is expected
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self._connect(address)
        self.outbox = Outbox(self._send_now)
        self.table = RequestTable(model, tokenizer, self._send)
        self.queue = self.table.queue
        self._receiver: asyncio.Task | None = None

    # -- the surface of a QueueingBatcher -------------------------------------------------
    @property
    def settings(self) -> BatchingSettings:
        """As of the core's last answer (start-up, or an admin GET or PATCH)."""
        return self._settings

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def in_flight(self) -> int:
        """Requests submitted through this side and not finished (awaiting admission or results)."""
        return len(self.table)

    @property
    def dropped(self) -> int:
        """Messages for requests this side no longer knows."""
        return self.table.dropped

    @property
    def shut_down_items(self) -> int:
        """Items ended with shutting_down, here or in the core (drain counts them)."""
        return self.table.shut_down_items

    def _connect(self, address: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.identity is not None:
            sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.connect(address)
        return sock

    async def start(self) -> None:
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive(), name=f"ferry-remote-{self.model}")

    async def _stop_receiving(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._receiver
            self._receiver = None

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
        """As QueueingBatcher.submit_many, once the core has answered. `one_shot`
        (work whose caller reads only the results): the items come back at once
        and the core sends no Admitted; a refusal fails every item with the error
        submit_many would have raised, so the client still hears it before any result.
        Under `wrk` the Admitted answers were most of the frames a core sent (one per turn
        of its loop that took a Submit, against one per batch for results)."""
        self._refuse_if_closed()
        now = time.monotonic()
        deadline = None if budget is None else now + budget  # one clock for every process on the host
        costs = list(costs) if costs is not None else [cost] * len(payloads)
        req = self.table.new_req()
        loop = asyncio.get_running_loop()
        items = [
            WorkItem(
                payload=p,
                arrival=now,
                deadline=deadline,
                priority=priority,
                cost=costs[i],
                request_id=request_id,
                prompt_index=i,
                on_delta=on_delta,
                itl_target=itl_target,
                tenant=tenant,
                on_infeasible=on_infeasible,
                future=loop.create_future(),
            )
            for i, p in enumerate(payloads)
        ]
        # Generation items (GenRequest) cross as their prompt's ids and sampling parameters.
        generation = bool(payloads) and isinstance(payloads[0], GenRequest)
        if generation and self.tokenizer is None:
            raise RuntimeError(f"no tokenizer to detokenize what the engine core of {self.model} generates")
        sampling = [sampling_of(g.params) for g in payloads] if generation else None
        prompts = [g.prompt_ids for g in payloads] if generation else payloads
        quiet = one_shot and not generation and on_delta is None
        rows = bool(payloads) and isinstance(payloads[0], Row)  # a custom model's
        submit = wire.Submit(
            req,
            self.model,
            wire.rows(payloads) if rows else [wire.ids(p) for p in prompts],
            costs,
            deadline,
            int(priority),
            request_id,
            on_delta is not None,
            sampling,
            count_rejection,
            itl_target,
            quiet,
            rows,
            tenant,
            on_infeasible,
        )
        if quiet:
            self.table.track(req, items)
            self._send(submit)
            return items
        answered = self.table.await_answer(req, items)
        try:
            self._send(submit)
            answer = await answered
        except asyncio.CancelledError:
            self.table.abandon(req, items)
            raise
        finally:
            self.table.pending.pop(req, None)
        if isinstance(answer, wire.Refused):
            raise wire.error_of(answer.code, answer.message, answer.retry_after)
        return items

    def cancel(self, item: WorkItem, *, by_client: bool = True) -> bool:
        """Idempotent: a finished or unknown item is skipped."""
        if item.finished:
            return False
        req = self.table.req_of.get(item.id)
        if req is None:
            return False
        self.table.withdraw(req, by_client)
        return True

    async def update(self, **changes: Any) -> BatchingSettings:
        """Apply new knobs in the core; raises SettingsError as a local batcher does."""
        await self._ask(changes)
        return self._settings

    async def describe(self) -> dict[str, Any]:
        """The admin GET: every setting and the fitted cost models, from the core."""
        answer = await self._ask({})
        return {**(answer.settings or {}), "cost_model": answer.cost_model}

    async def scrape(self) -> list[wire.MetricFamily]:
        """The core's metric families (gateway/metrics/merge.py merges them)."""
        answer: wire.MetricsAnswer = await self._request(wire.MetricsRequest, SCRAPE_TIMEOUT_S)
        return answer.families

    async def _ask(self, changes: dict[str, Any]) -> wire.SettingsAnswer:
        answer = await self._request(lambda seq: wire.SettingsChange(seq, self.model, changes))
        if answer.error is not None:
            raise SettingsError(answer.field or "", answer.error)
        self._settings = BatchingSettings(**answer.settings)
        return answer

    async def _request(self, message: Callable[[int], msgspec.Struct], timeout: float = ANSWER_TIMEOUT_S) -> Any:
        self._refuse_if_closed(draining_ok=True)
        seq, fut = self.table.await_reply()
        try:
            self._send(message(seq))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ModelUnavailable(f"the engine core of {self.model} did not answer in {timeout:g} s") from None
        finally:
            self.table.replies.pop(seq, None)

    # -- lifecycle ------------------------------------------------------------------------
    async def drain(self, timeout: float) -> int:
        """Stop admitting; the core finishes accepted work within `timeout` and exits.
        Returns how many items ended with an error for it."""
        self._closing = self._leaving = True
        before = self.shut_down_items
        if self.core is not None:
            await self.core.drain(timeout)
        self.table.fail(ShuttingDown("server shut down before this request could finish"))
        return self.shut_down_items - before

    async def stop(self) -> None:
        self._closing = self._leaving = True
        if self.core is not None:
            await self.core.stop()
        await self._stop_receiving()
        self.table.fail(ShuttingDown("server stopped"))
        self.sock.close(linger=0)

    async def lost(self, reason: str, *, clean: bool = False, restarting: bool = False) -> None:
        """The core exited: unless the server is draining, the model is unavailable from now
        on (until `reconnect`, when `restarting`). After a clean exit (a drain) the results
        it sent last are read first; then every request still open fails at once."""
        self._closing = True
        if not self._leaving:
            self.failed, self.restarting = reason, restarting
            log.error("engine core of %s lost: %s", self.model, reason)
        loop = asyncio.get_running_loop()
        end = loop.time() + (LATE_RESULTS_S if clean else 0.0)
        # A bounded wait for the last results of a clean exit; nothing signals "all read".
        while self.table and loop.time() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        self.outbox.clear()  # for the core that is gone
        if self._leaving:
            self.table.fail(ShuttingDown("server shut down before this request could finish"))
        else:
            self.table.fail(self._unavailable())

    async def reconnect(self, address: str) -> None:
        """Serve from a new core at `address` (a restarted one): the model is available again.
        A request still open was sent to the core that is gone (its loss not heard here):
        it fails now, as `lost` would have failed it, rather than wait for an answer."""
        self.table.fail(ModelUnavailable(f"the engine core of {self.model} restarted", retry_after=1))
        await self._stop_receiving()
        self.outbox.clear()
        self.sock.close(linger=0)
        self.address, self.sock = address, self._connect(address)
        self.failed, self.restarting, self._closing = None, False, self._leaving
        await self.start()

    def _unavailable(self) -> ModelUnavailable:
        return ModelUnavailable(
            f"model {self.model} is unavailable: {self.failed}", retry_after=1 if self.restarting else None
        )

    def _refuse_if_closed(self, draining_ok: bool = False) -> None:
        if self.failed is not None:
            raise self._unavailable()
        if self._closing and not (draining_ok and self._leaving):
            raise ShuttingDown("server is shutting down", retry_after=1)

    # -- messages -------------------------------------------------------------------------
    def _send(self, message: msgspec.Struct) -> None:
        """Sent at the end of this turn of the loop, with the turn's other messages."""
        self.outbox.put(None, message)

    def _send_now(self, _peer: None, messages: list[msgspec.Struct]) -> None:
        """Never queues in this process: when the core does not read (its high-water mark
        reached), each request among `messages` is answered at once with 503; a Cancel or
        Stop it could not take ends its items here all the same."""
        if self.sock.closed:
            return  # stopped: every request open here has failed already
        # done at once, sent or not (a NOBLOCK send on an asyncio socket returns a done future)
        sent = cast("asyncio.Future[Any]", self.sock.send(wire.pack(messages), flags=zmq.NOBLOCK))
        if sent.exception() is not None:
            unavailable = ModelUnavailable(f"the engine core of {self.model} is not reading ({sent.exception()})")
            self.table.unsent(messages, unavailable)

    async def _receive(self) -> None:
        while True:
            raw = await self.sock.recv()
            try:
                messages = wire.unpack_to_front_end(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("undecodable message from the engine core of %s dropped: %s", self.model, exc)
                continue
            for message in messages:
                self.table.handle(message)
