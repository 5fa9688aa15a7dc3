"""What a front end awaits from its engine core (gateway/cores/client.py's `CoreClient`
holds one `RequestTable`): each submit awaiting the core's answer, then its items until all
of them end, and each admin request awaiting its reply. What the core sends (answers,
token ids, results, replies) resolves them here; a generation item's text is made by the
table's `TextAssembler` (gateway/cores/text.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from batcher.errors import Cancelled, EngineError, ShuttingDown
from batcher.types import DispatchReason, Outcome, WorkItem
from engine.base import EmbeddingResult
from gateway.cores import wire

from .text import TextAssembler

log = logging.getLogger("ferry.gateway")


class _Unfinished:
    """`item in batcher.queue` for a remote batcher: every unfinished item, since the core
    reports no dispatch until an item ends (gateway/cores/client.py)."""

    def __init__(self, requests: dict[int, int]):
        self._req_of = requests

    def __contains__(self, item: WorkItem) -> bool:
        return not item.finished and item.id in self._req_of


class _Pending:
    """A submit waiting for the core's answer, with the items it will return."""

    __slots__ = ("answer", "items")

    def __init__(self, items: list[WorkItem], answer: asyncio.Future):
        self.items, self.answer = items, answer


class RequestTable:
    """The requests a front end has in its engine core: submits and their items by request
    number, admin requests by sequence number (see the module's docstring)."""

    def __init__(self, model: str, tokenizer: Any, send: Callable[[msgspec.Struct], None]):
        """`send`: how a Cancel or a Stop reaches the core (with this turn's other messages)."""
        self.model = model
        self.texts = TextAssembler(tokenizer)
        self._send = send
        self._reqs = itertools.count(1)
        self.pending: dict[int, _Pending] = {}  # req -> submit awaiting Admitted/Refused
        self.requests: dict[int, list[WorkItem]] = {}  # req -> admitted items, until all finish
        self.req_of: dict[int, int] = {}  # WorkItem.id -> req
        self._seqs = itertools.count(1)
        self.replies: dict[int, asyncio.Future] = {}  # seq -> SettingsAnswer or MetricsAnswer
        self.queue = _Unfinished(self.req_of)
        self.dropped = 0  # messages for requests this side no longer knows
        self.shut_down_items = 0  # items ended with shutting_down, here or in the core (drain counts them)

    def __len__(self) -> int:
        """Submits not finished (awaiting admission or results)."""
        return len(self.requests) + len(self.pending)

    def new_req(self) -> int:
        return next(self._reqs)

    def await_answer(self, req: int, items: list[WorkItem]) -> asyncio.Future:
        """The future of the core's answer to the submit `req`, whose items are `items`."""
        pending = self.pending[req] = _Pending(items, asyncio.get_running_loop().create_future())
        return pending.answer

    def await_reply(self) -> tuple[int, asyncio.Future]:
        """A sequence number for an admin request, and the future of the core's reply to it
        (the caller pops it from `replies` once done)."""
        seq = next(self._seqs)
        reply = self.replies[seq] = asyncio.get_running_loop().create_future()
        return seq, reply

    def abandon(self, req: int, items: list[WorkItem]) -> None:
        """The submitter of `req` left before the core's answer: whatever the core decides,
        withdraw it."""
        if self.pending.pop(req, None) is None:
            self.withdraw(req, by_client=True)
            for item in items:  # nobody holds these items: their errors are nobody's to read
                if item.result_future.done():
                    item.result_future.exception()
        else:
            self._send(wire.Cancel(req))

    def track(self, req: int, items: list[WorkItem]) -> None:
        """From now on results and cancellations for `req` concern `items`."""
        self.requests[req] = items
        for item in items:
            self.req_of[item.id] = req
            self.texts.track(item)

    def forget(self, req: int) -> list[WorkItem]:
        """Drop `req`; returns its items still unfinished."""
        items = self.requests.pop(req, [])
        for item in items:
            self.req_of.pop(item.id, None)
            self.texts.forget(item)
        return [i for i in items if not i.finished]

    def withdraw(self, req: int, by_client: bool) -> None:
        self._send(wire.Cancel(req, by_client))
        for item in self.forget(req):
            item.finish(Outcome.CANCELLED, Cancelled("request cancelled by the client"))

    def fail(self, exc: Exception) -> int:
        """Everything awaited ends with `exc`: submits awaiting an answer raise it, and so do
        admin requests; admitted items still open end with it. Returns how many items did."""
        for pending in list(self.pending.values()):
            if not pending.answer.done():
                pending.answer.set_exception(exc)
        for fut in self.replies.values():
            if not fut.done():
                fut.set_exception(exc)
        failed = 0
        for req in list(self.requests):
            for item in self.forget(req):
                failed += item.finish(Outcome.ERROR, exc)
        if isinstance(exc, ShuttingDown):
            self.shut_down_items += failed
        return failed

    def unsent(self, messages: list[msgspec.Struct], exc: Exception) -> None:
        """The core did not take `messages`: whoever awaits an answer to one gets `exc` (the
        items of a quiet submit, its submitter otherwise, or the admin request's caller)."""
        for m in messages:
            if isinstance(m, wire.Submit) and m.quiet:
                for item in self.forget(m.req):
                    item.finish(Outcome.ERROR, exc)
            elif isinstance(m, wire.Submit):
                pending = self.pending.get(m.req)
                if pending is not None and not pending.answer.done():
                    pending.answer.set_exception(exc)
            elif isinstance(m, (wire.SettingsChange, wire.MetricsRequest)):
                fut = self.replies.get(m.seq)
                if fut is not None and not fut.done():
                    fut.set_exception(exc)

    # -- what the core sends --------------------------------------------------------------
    def handle(self, message: wire.ToFrontEnd) -> None:
        if isinstance(message, wire.Result):
            self.result(message)
        elif isinstance(message, (wire.Admitted, wire.Refused)):
            self.answer(message)
        elif isinstance(message, wire.NewTokens):
            try:
                self.new_tokens(message)
            except Exception as exc:  # a bug detokenizing fails its item, never the receiving loop
                log.exception("detokenizing the output of %s failed", self.model)
                self._failed_tokens(message, exc)
        else:
            fut = self.replies.get(message.seq)
            if fut is not None and not fut.done():
                fut.set_result(message)

    def answer(self, m: wire.Admitted | wire.Refused) -> None:
        pending = self.pending.pop(m.req, None)
        if pending is None and isinstance(m, wire.Refused) and m.req in self.requests:
            # Submitted quietly (one_shot): its items carry the refusal.
            refusal = wire.error_of(m.code, m.message, m.retry_after)
            for item in self.forget(m.req):
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
            self.track(m.req, pending.items)
        pending.answer.set_result(m)

    def new_tokens(self, m: wire.NewTokens) -> None:
        items = self.requests.get(m.req)
        item = items[m.index] if items is not None and 0 <= m.index < len(items) else None
        if item is None or item.finished or not self.texts.takes(item):
            # cancelled here already, or past its end (tokens the core made before it heard
            # of the stop string found here): its sequence is stopping in the core
            self.dropped += 1
            return
        if self.texts.add(item, wire.ids_of(m.token_ids), m.finish_reason, m.logprobs, m.prompt_logprobs):
            # A stop string found here: the core would go on generating; its Result follows.
            self._send(wire.Stop(m.req, m.index))

    def _failed_tokens(self, m: wire.NewTokens, exc: Exception) -> None:
        items = self.requests.get(m.req) or []
        if 0 <= m.index < len(items) and not items[m.index].finished:
            self._send(wire.Stop(m.req, m.index))
            items[m.index].finish(Outcome.ERROR, EngineError(f"detokenizing the output failed: {exc}"))
            if all(i.finished for i in items):
                self.forget(m.req)

    def result(self, m: wire.Result) -> None:
        items = self.requests.get(m.req)
        if items is None or not 0 <= m.index < len(items):
            self.dropped += 1
            return
        item = items[m.index]
        t = m.timing
        item.arrival, item.dispatched_at, item.batch_size = t.arrival, t.dispatched_at, t.batch_size
        item.reason = DispatchReason(t.reason) if t.reason else None
        item.best_effort = t.best_effort
        outcome = Outcome(m.outcome)
        text = self.texts.result(item, outcome, m.finish_reason, m.cached_tokens)
        if text is not None:
            item.finish(Outcome.RESULT, text)
        elif outcome is Outcome.RESULT and m.output is not None:
            item.finish(outcome, wire.outputs_of(m.output))
        elif outcome is Outcome.RESULT:
            item.finish(outcome, EmbeddingResult(np.frombuffer(m.vector or b"", dtype="<f4"), m.prompt_tokens))
        else:
            if m.code == ShuttingDown.code:
                self.shut_down_items += 1
            item.finish(outcome, wire.error_of(m.code, m.message, m.retry_after))
        if all(i.finished for i in items):
            self.forget(m.req)
