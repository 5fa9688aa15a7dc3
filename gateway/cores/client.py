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
- Generation: the core sends token ids only (`NewTokens`, every item, streamed or not);
  this side detokenizes them and applies the stop strings with the engine's own code
  (engine/detokenize.py's `SequenceText`, over the model's `tokenizer`), so the text is
  what one process would make. Text that may start a stop string is held back; a stop
  string found here ends the item's sequence in the core at once (`Stop`). Streamed items
  get a `Delta` for each piece of text, in order, before the item's `Result` (with the
  core's timing) resolves it with a `GenResult` of the text made here.
- `update` and `describe` (the admin GET) are coroutines answered by the core; so is
  `scrape`, the core's metrics for the server's /metrics.
- Dispatches are not reported until an item ends, so `item in batcher.queue` holds for
  every unfinished item.
- When the core is lost (`lost`, called by whoever watches its process), every request in
  flight ends at once with `503 model_unavailable` and `failed` says why. While a new core
  starts (`restarting`) the 503s carry a Retry-After; `reconnect` then serves from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from batcher.errors import Cancelled, EngineError, ModelUnavailable, ShuttingDown
from batcher.settings import BatchingSettings, SettingsError
from batcher.types import Delta, DispatchReason, GenRequest, GenResult, Outcome, Priority, WorkItem
from engine.base import EmbeddingResult, SamplingParams
from engine.detokenize import SequenceText
from gateway.cores import wire

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


class _Unfinished:
    """`item in batcher.queue` for a remote batcher (see the module's docstring)."""

    def __init__(self, requests: dict[int, int]):
        self._req_of = requests

    def __contains__(self, item: WorkItem) -> bool:
        return not item.finished and item.id in self._req_of


class _Pending:
    """A submit waiting for the core's answer, with the items it will return."""

    __slots__ = ("answer", "items")

    def __init__(self, items: list[WorkItem], answer: asyncio.Future):
        self.items, self.answer = items, answer


class _Text:
    """A generation item's text, made here from the token ids its core sends."""

    __slots__ = ("finish_reason", "pieces", "sequence", "tokens", "undelivered")

    def __init__(self, tokenizer: Any, request: GenRequest):
        self.sequence = SequenceText(tokenizer, request.prompt_ids, request.params.stop)
        self.pieces: list[str] = []
        self.tokens = 0  # generated tokens that made the text (none after a stop string)
        self.undelivered = 0  # tokens whose text is held back, counted in the next delta
        self.finish_reason: str | None = None  # known here: the text is complete


def sampling_of(params: SamplingParams) -> wire.Sampling:
    return wire.Sampling(
        params.max_tokens, params.temperature, params.top_p, params.seed, list(params.stop), params.json_schema
    )


class CoreClient:
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
        (anything with transformers' `decode`; engine/chat_tokenizer.py's ChatTokenizer).
        `identity`: this side's socket identity (ZMQ's own if None); with `--api-workers N`
        the supervisor names each front end, so that it can tell the cores which one died
        (gateway/cores/supervisor.py)."""
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
        self._reqs = itertools.count(1)
        self._seqs = itertools.count(1)
        self._pending: dict[int, _Pending] = {}  # req -> submit awaiting Admitted/Refused
        self._requests: dict[int, list[WorkItem]] = {}  # req -> admitted items, until all finish
        self._req_of: dict[int, int] = {}  # WorkItem.id -> req
        self._texts: dict[int, _Text] = {}  # WorkItem.id -> its text, for generation items
        self._answers: dict[int, asyncio.Future] = {}  # seq -> SettingsAnswer or MetricsAnswer
        self.queue = _Unfinished(self._req_of)
        self.dropped = 0  # messages for requests this side no longer knows
        self.shut_down_items = 0  # items ended with shutting_down, here or in the core (drain counts them)
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
        return len(self._requests) + len(self._pending)

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
        req = next(self._reqs)
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
        submit = wire.Submit(
            req,
            self.model,
            [wire.ids(p) for p in prompts],
            costs,
            deadline,
            int(priority),
            request_id,
            on_delta is not None,
            sampling,
            count_rejection,
            itl_target,
            quiet,
        )
        if quiet:
            self._track(req, items)
            self._send(submit)
            return items
        pending = self._pending[req] = _Pending(items, loop.create_future())
        try:
            self._send(submit)
            answer = await pending.answer
        except asyncio.CancelledError:
            # Gone before the answer: whatever the core decides, withdraw it.
            if self._pending.pop(req, None) is None:
                self._withdraw(req, by_client=True)
                for item in items:  # nobody holds these items: their errors are nobody's to read
                    if item.result_future.done():
                        item.result_future.exception()
            else:
                self._send(wire.Cancel(req))
            raise
        finally:
            self._pending.pop(req, None)
        if isinstance(answer, wire.Refused):
            raise wire.error_of(answer.code, answer.message, answer.retry_after)
        return items

    def cancel(self, item: WorkItem, *, by_client: bool = True) -> bool:
        """Idempotent: a finished or unknown item is skipped."""
        if item.finished:
            return False
        req = self._req_of.get(item.id)
        if req is None:
            return False
        self._withdraw(req, by_client)
        return True

    def _withdraw(self, req: int, by_client: bool) -> None:
        self._send(wire.Cancel(req, by_client))
        for item in self._forget(req):
            item.finish(Outcome.CANCELLED, Cancelled("request cancelled by the client"))

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
        seq = next(self._seqs)
        fut = self._answers[seq] = asyncio.get_running_loop().create_future()
        try:
            self._send(message(seq))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ModelUnavailable(f"the engine core of {self.model} did not answer in {timeout:g} s") from None
        finally:
            self._answers.pop(seq, None)

    # -- lifecycle ------------------------------------------------------------------------
    async def drain(self, timeout: float) -> int:
        """Stop admitting; the core finishes accepted work within `timeout` and exits.
        Returns how many items ended with an error for it."""
        self._closing = self._leaving = True
        before = self.shut_down_items
        if self.core is not None:
            await self.core.drain(timeout)
        self._fail_all(ShuttingDown("server shut down before this request could finish"))
        return self.shut_down_items - before

    async def stop(self) -> None:
        self._closing = self._leaving = True
        if self.core is not None:
            await self.core.stop()
        await self._stop_receiving()
        self._fail_all(ShuttingDown("server stopped"))
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
        while (self._requests or self._pending) and loop.time() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        self.outbox.clear()  # for the core that is gone
        if self._leaving:
            self._fail_all(ShuttingDown("server shut down before this request could finish"))
        else:
            self._fail_all(self._unavailable())

    async def reconnect(self, address: str) -> None:
        """Serve from a new core at `address` (a restarted one): the model is available again."""
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

    def _fail_all(self, exc: Exception) -> int:
        failed = 0
        for pending in list(self._pending.values()):
            if not pending.answer.done():
                pending.answer.set_exception(exc)
        for fut in self._answers.values():
            if not fut.done():
                fut.set_exception(exc)
        for req in list(self._requests):
            for item in self._forget(req):
                failed += item.finish(Outcome.ERROR, exc)
        if isinstance(exc, ShuttingDown):
            self.shut_down_items += failed
        return failed

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
            self._unsent(messages, unavailable)

    def _unsent(self, messages: list[msgspec.Struct], exc: Exception) -> None:
        for m in messages:
            if isinstance(m, wire.Submit) and m.quiet:
                for item in self._forget(m.req):
                    item.finish(Outcome.ERROR, exc)
            elif isinstance(m, wire.Submit):
                pending = self._pending.get(m.req)
                if pending is not None and not pending.answer.done():
                    pending.answer.set_exception(exc)
            elif isinstance(m, (wire.SettingsChange, wire.MetricsRequest)):
                fut = self._answers.get(m.seq)
                if fut is not None and not fut.done():
                    fut.set_exception(exc)

    def _forget(self, req: int) -> list[WorkItem]:
        items = self._requests.pop(req, [])
        for item in items:
            self._req_of.pop(item.id, None)
            self._texts.pop(item.id, None)
        return [i for i in items if not i.finished]

    async def _receive(self) -> None:
        while True:
            raw = await self.sock.recv()
            try:
                messages = wire.unpack_to_front_end(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("undecodable message from the engine core of %s dropped: %s", self.model, exc)
                continue
            for message in messages:
                self._handle(message)

    def _handle(self, message: wire.ToFrontEnd) -> None:
        if isinstance(message, wire.Result):
            self._result(message)
        elif isinstance(message, (wire.Admitted, wire.Refused)):
            self._answer(message)
        elif isinstance(message, wire.NewTokens):
            try:
                self._new_tokens(message)
            except Exception as exc:  # a bug detokenizing fails its item, never this loop
                log.exception("detokenizing the output of %s failed", self.model)
                self._failed_tokens(message, exc)
        else:
            fut = self._answers.get(message.seq)
            if fut is not None and not fut.done():
                fut.set_result(message)

    def _new_tokens(self, m: wire.NewTokens) -> None:
        items = self._requests.get(m.req)
        item = items[m.index] if items is not None and 0 <= m.index < len(items) else None
        text = self._texts.get(item.id) if item is not None and not item.finished else None
        if item is None or text is None or text.finish_reason is not None:
            # cancelled here already, or past its end (tokens the core made before it heard
            # of the stop string found here): its sequence is stopping in the core
            self.dropped += 1
            return
        ids = wire.ids_of(m.token_ids)
        pieces, used = [], 0
        for token in ids:
            used += 1
            # The core's finish reason belongs to the last token (EOS or out of room).
            piece, text.finish_reason = text.sequence.advance(token, m.finish_reason if used == len(ids) else None)
            pieces.append(piece)
            if text.finish_reason is not None:
                break
        if text.finish_reason is None:
            text.finish_reason = m.finish_reason  # a prompt the engine could not start: no tokens
        released = "".join(pieces)
        text.pieces.append(released)
        text.tokens += used
        text.undelivered += used
        if item.on_delta is not None and (released or text.finish_reason):
            item.on_delta(Delta(item, released, text.undelivered, text.finish_reason, ids[:used]))
            text.undelivered = 0
        if text.finish_reason is not None and m.finish_reason is None:
            # A stop string found here: the core would go on generating; its Result follows.
            self._send(wire.Stop(m.req, m.index))

    def _failed_tokens(self, m: wire.NewTokens, exc: Exception) -> None:
        items = self._requests.get(m.req) or []
        if 0 <= m.index < len(items) and not items[m.index].finished:
            self._send(wire.Stop(m.req, m.index))
            items[m.index].finish(Outcome.ERROR, EngineError(f"detokenizing the output failed: {exc}"))
            if all(i.finished for i in items):
                self._forget(m.req)

    def _track(self, req: int, items: list[WorkItem]) -> None:
        """From now on results and cancellations for `req` concern `items`."""
        self._requests[req] = items
        for item in items:
            self._req_of[item.id] = req
            if isinstance(item.payload, GenRequest):
                self._texts[item.id] = _Text(self.tokenizer, item.payload)

    def _answer(self, m: wire.Admitted | wire.Refused) -> None:
        pending = self._pending.pop(m.req, None)
        if pending is None and isinstance(m, wire.Refused) and m.req in self._requests:
            # Submitted quietly (one_shot): its items carry the refusal.
            refusal = wire.error_of(m.code, m.message, m.retry_after)
            for item in self._forget(m.req):
                item.finish(Outcome.ERROR, refusal)
            return
        if pending is None or pending.answer.done():
            self.dropped += 1
            if isinstance(m, wire.Admitted):  # its submitter left; nobody will take the results
                self._send(wire.Cancel(m.req))
            return
        if isinstance(m, wire.Admitted):
            for item in pending.items:
                item.best_effort = m.best_effort
            self._track(m.req, pending.items)
        pending.answer.set_result(m)

    def _result(self, m: wire.Result) -> None:
        items = self._requests.get(m.req)
        if items is None or not 0 <= m.index < len(items):
            self.dropped += 1
            return
        item = items[m.index]
        t = m.timing
        item.arrival, item.dispatched_at, item.batch_size = t.arrival, t.dispatched_at, t.batch_size
        item.reason = DispatchReason(t.reason) if t.reason else None
        item.best_effort = t.best_effort
        outcome = Outcome(m.outcome)
        text = self._texts.get(item.id)
        if text is not None and (text.finish_reason is not None or outcome is Outcome.RESULT):
            # A generation whose text is complete here: its answer, whatever the core ended
            # it with after this side found a stop string (a Stop, or a deadline meanwhile).
            answer = GenResult(
                "".join(text.pieces),
                text.finish_reason or m.finish_reason or "",
                len(item.payload.prompt_ids),
                text.tokens,
            )
            item.finish(Outcome.RESULT, answer)
        elif outcome is Outcome.RESULT:
            item.finish(outcome, EmbeddingResult(np.frombuffer(m.vector or b"", dtype="<f4"), m.prompt_tokens))
        else:
            if m.code == ShuttingDown.code:
                self.shut_down_items += 1
            item.finish(outcome, wire.error_of(m.code, m.message, m.retry_after))
        if all(i.finished for i in items):
            self._forget(m.req)
