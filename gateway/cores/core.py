"""The engine core: one model's batcher served to front ends over ZMQ (docs/architecture.md,
"Processes"), its logic apart from its process (gateway/cores/proc.py), as vLLM v1 keeps
`EngineCore` apart from `EngineCoreProc`: a test serves one in its own event loop. No HTTP
here (nothing imports starlette).

Served on a ROUTER socket, in the core's event loop: `Submit` is admitted or refused at
once (`Admitted` / `Refused`), then each item's `Result` follows when its future resolves
(for generation, after its `NewTokens`: token ids only, one message per decode step,
streamed or not, since the front end detokenizes and applies stop strings);
`Cancel` withdraws a request's unfinished items; `Stop` ends one sequence the front end
found a stop string in; `SettingsChange` updates the batcher (or
only reads it) and is answered by `SettingsAnswer`; `MetricsRequest` is answered by
`MetricsAnswer`, the core's metric families as msgpack (the server merges them into its
/metrics). A message for an unknown key is dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from batcher.cost import cost_report
from batcher.queueing import QueueingBatcher
from batcher.settings import SettingsError
from batcher.types import Delta, GenRequest, GenResult, Outcome, Priority, WorkItem
from engine.base import SamplingParams
from engine.custom import CustomResult
from gateway.cores import wire

from ..metrics.merge import metric_families
from .outbox import Outbox

TENANTS_FILE = "tenants.json"  # beside the settings file: the tenants' weights and quotas in force

log = logging.getLogger("ferry.core")

# Results still unsent when the core exits are given this long to reach the front end.
LINGER_MS = 2000


class EngineCore:
    """One model's batcher served on a ROUTER socket bound to `address`; `serve()` until cancelled."""

    def __init__(
        self,
        batcher: QueueingBatcher,
        address: str,
        ctx: zmq.asyncio.Context | None = None,
        registry: CollectorRegistry | None = None,
        grammars: Any = None,
        settings_path: str | None = None,
        cost_of: Any = None,
    ):
        """`grammars`: the chat engine's GrammarCache (engine/grammar.py), where schemas
        are compiled before their prompts reach the batcher. `settings_path`: where the
        batching settings it acknowledges are recorded (`record_settings`), if anywhere.
        `cost_of`: a custom model's cost hints of its rows (CustomEngine.costs), computed here
        where the class is."""
        self.batcher = batcher
        self.settings_path = settings_path
        self.grammars = grammars
        self.cost_of = cost_of
        # Submits whose schemas are compiling -> whether a Cancel came meanwhile.
        self.compiling: dict[tuple[bytes, int], bool] = {}
        self._tasks: set[asyncio.Task] = set()
        self.registry = registry  # the batcher's metrics, for MetricsRequest
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.bind(address)
        self.outbox = Outbox(self._send_now)
        self.address = address
        self.requests: dict[tuple[bytes, int], list[WorkItem]] = {}  # (front end, req) -> items
        self.dropped = 0  # messages for keys this core does not know
        self.gone: set[bytes] = set()  # front ends their supervisor reported dead

    async def serve(self) -> None:
        while True:
            peer, raw = await self.sock.recv_multipart()
            if peer in self.gone:  # sent before it died, read after: nobody waits for it
                self.dropped += 1
                continue
            try:
                messages = wire.unpack_to_core(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("undecodable message dropped: %s", exc)
                continue
            for message in messages:
                self.handle(peer, message)

    def handle(self, peer: bytes, message: wire.ToCore) -> None:
        if isinstance(message, wire.Submit):
            self.submit(peer, message)
        elif isinstance(message, wire.Cancel):
            self.cancel(peer, message)
        elif isinstance(message, wire.Stop):
            self.stop_sequence(peer, message)
        elif isinstance(message, wire.MetricsRequest):
            families = metric_families(self.registry) if self.registry is not None else []
            self._send(peer, wire.MetricsAnswer(message.seq, families))
        else:
            self.settings(peer, message)

    def _send(self, peer: bytes, message: msgspec.Struct) -> None:
        self.outbox.put(peer, message)  # with the rest of this turn's messages to that front end

    def _send_now(self, peer: bytes, messages: list[msgspec.Struct]) -> None:
        # A ROUTER never blocks: a message to a front end past its high-water mark, or gone,
        # is dropped by ZMQ, and that front end's clients are gone with it. Non-blocking
        # sends finish at once, so the future is done here.
        if self.sock.closed or peer in self.gone:
            return  # stopping, or a dead front end's: nobody waits for this any more
        sent = cast("asyncio.Future[Any]", self.sock.send_multipart([peer, wire.pack(messages)], flags=zmq.NOBLOCK))
        if sent.exception() is not None:
            log.warning("%d messages to a front end not sent: %s", len(messages), sent.exception())

    def submit(self, peer: bytes, m: wire.Submit) -> None:
        key = (peer, m.req)
        if key in self.requests or key in self.compiling:
            self.dropped += 1  # a repeat; the first one holds the key
            return
        schemas = {s.json_schema for s in m.sampling or () if s.json_schema is not None}
        pending = [s for s in schemas if self.grammars is not None and s not in self.grammars]
        if pending:  # compiled in a worker thread: the decode loop never compiles
            self.compiling[key] = False
            task = asyncio.get_running_loop().create_task(self._compile_then_submit(peer, m, pending))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._submit(peer, m)

    async def _compile_then_submit(self, peer: bytes, m: wire.Submit, schemas: list[str]) -> None:
        key = (peer, m.req)
        try:
            for text in schemas:
                await asyncio.to_thread(self.grammars.compile, text)
        except Exception as exc:  # the front end compiled it first, so this is rare
            self.compiling.pop(key, None)
            self._send(peer, wire.Refused(m.req, "invalid_schema", f"the schema cannot be compiled: {exc}"))
            return
        cancelled = self.compiling.pop(key, False)
        self._submit(peer, m)
        if cancelled:
            self.cancel(peer, wire.Cancel(m.req))

    def _submit(self, peer: bytes, m: wire.Submit) -> None:
        key = (peer, m.req)
        if peer in self.gone:  # died while its schemas compiled
            self.dropped += 1
            return
        budget = None if m.deadline is None else m.deadline - self.batcher.clock.now()
        try:
            work = payloads(m)
            costs = list(m.costs)
            if m.rows and self.cost_of is not None:
                costs = self.cost_of(work) or costs
            items = self.batcher.submit_many(
                work,
                costs=costs,
                budget=budget,
                priority=Priority(m.priority),
                request_id=m.request_id,
                # Generation: the front end reads every token, to detokenize it.
                on_delta=functools.partial(self._delta, key) if m.stream or m.sampling is not None else None,
                count_rejection=m.count_rejection,
                itl_target=m.itl_target,
                tenant=m.tenant,
                on_infeasible=m.on_infeasible,
            )
        except Exception as exc:  # BatchingError or a bug: either way refused, at once
            self._send(peer, wire.refusal(m.req, exc))
            return
        if not m.quiet:
            self._send(peer, wire.Admitted(m.req, items[0].best_effort))
        self.requests[key] = items
        for item in items:
            item.result_future.add_done_callback(functools.partial(self._finished, key, item))

    def _delta(self, key: tuple[bytes, int], d: Delta) -> None:
        # Called by the scheduler before the item's future resolves, so on this one socket
        # an item's deltas always precede its Result.
        peer, req = key
        lps = None if d.logprobs is None else list(d.logprobs)
        prompt = None if d.prompt_logprobs is None else list(d.prompt_logprobs)
        ids = wire.ids(list(d.token_ids))
        self._send(peer, wire.NewTokens(req, d.item.prompt_index, ids, d.finish_reason, lps, prompt))

    def _finished(self, key: tuple[bytes, int], item: WorkItem, fut: asyncio.Future) -> None:
        peer, req = key
        try:
            message = result(req, item, fut)
        except Exception as exc:  # a result that cannot cross the wire still ends its item, as an error
            log.exception("result of item %d of a request cannot be sent", item.prompt_index)
            message = wire.Result(
                req,
                item.prompt_index,
                int(Outcome.ERROR),
                wire.Timing(item.arrival, item.dispatched_at, item.batch_size),
                code="engine_error",
                message=f"the result cannot be sent: {type(exc).__name__}: {exc}",
            )
        self._send(peer, message)
        items = self.requests.get(key)
        if items is not None and all(i.finished for i in items):
            del self.requests[key]

    def cancel(self, peer: bytes, m: wire.Cancel) -> None:
        items = self.requests.get((peer, m.req))
        if items is None and (peer, m.req) in self.compiling:
            self.compiling[(peer, m.req)] = True  # cancelled once submitted
            return
        if items is None:
            self.dropped += 1  # finished already, or never admitted
            return
        for item in items:
            self.batcher.cancel(item, by_client=m.by_client)  # idempotent per item

    def forget_peer(self, peer: bytes) -> int:
        """The front end whose sockets are named `peer` died (its supervisor says so): every
        unfinished item of it is cancelled (queued ones withdrawn, running sequences stopped
        and their KV freed; counted in ferry_cancellations_total, as its clients left), and
        its results and later messages are dropped. Returns how many items it cancelled."""
        self.gone.add(peer)
        for key in self.compiling:
            if key[0] == peer:
                self.compiling[key] = True  # cancelled once submitted (and _submit drops it)
        cancelled = 0
        for key in [k for k in self.requests if k[0] == peer]:
            for item in list(self.requests.get(key, [])):
                cancelled += self.batcher.cancel(item)
        if cancelled:
            log.warning("a front end died: %d of its items cancelled", cancelled)
        return cancelled

    def stop_sequence(self, peer: bytes, m: wire.Stop) -> None:
        items = self.requests.get((peer, m.req))
        if items is None or not 0 <= m.index < len(items):
            self.dropped += 1  # finished already
            return
        self.batcher.stop_sequence(items[m.index])  # skipped if it finished meanwhile

    def settings(self, peer: bytes, m: wire.SettingsChange) -> None:
        b = self.batcher
        try:
            if m.changes:
                b.update(**m.changes)
                self.record_settings()
        except SettingsError as exc:
            self._send(peer, wire.SettingsAnswer(m.seq, field=exc.field, error=exc.message))
            return
        costs = cost_report(b.cost_models)
        self._send(peer, wire.SettingsAnswer(m.seq, b.settings.to_dict(), costs))

    def record_settings(self) -> None:
        """Write the batching settings to `settings_path`, and the tenants' weights and
        quotas beside it (`tenants.json`), for a restart to start from."""
        path = self.settings_path
        if path is None:
            return
        tenants = getattr(self.batcher, "tenants", None)
        policies = {} if tenants is None else {n: dataclasses.asdict(p) for n, p in tenants.policies.items()}
        beside = os.path.join(os.path.dirname(path), TENANTS_FILE)
        for where, what in ((path, self.batcher.settings.model_dump(mode="json")), (beside, policies)):
            try:  # written whole, then renamed: a reader never sees half of it
                with open(where + ".tmp", "w", encoding="utf-8") as f:
                    json.dump(what, f)
                os.replace(where + ".tmp", where)
            except OSError as exc:
                log.warning("cannot record the batching settings in %s: %s", where, exc)

    async def close(self) -> None:
        await asyncio.sleep(0)  # items failed just now send their results first (done-callbacks)
        self.outbox.flush()
        self.sock.close(linger=LINGER_MS)


def payloads(m: wire.Submit) -> list[Any]:
    """What the core's batcher takes: token ids for one-shot models; for generation, the
    GenRequest the in-process route builds (gateway/translate/chat.py), except that the
    engine makes no text (`detokenize=False`): stop strings are the front end's."""
    if m.rows:
        return wire.rows_of(m.payloads)
    prompts = [wire.ids_of(p) for p in m.payloads]
    if m.sampling is None:
        return prompts
    return [
        GenRequest(
            ids,
            SamplingParams(**{**msgspec.structs.asdict(s), "stop": [], "detokenize": False}),
        )
        for ids, s in zip(prompts, m.sampling, strict=True)
    ]


def result(req: int, item: WorkItem, fut: asyncio.Future) -> wire.Result:
    """The `Result` message of a resolved item (an embedding, a generation or an error)."""
    timing = wire.Timing(
        item.arrival,
        item.dispatched_at,
        item.batch_size,
        item.reason.value if item.reason is not None else None,
        item.best_effort,
    )
    if item.outcome is Outcome.RESULT:
        value = fut.result()
        if isinstance(value, GenResult):
            return wire.Result(
                req,
                item.prompt_index,
                int(Outcome.RESULT),
                timing,
                finish_reason=value.finish_reason,
                prompt_tokens=value.prompt_tokens,
                completion_tokens=value.completion_tokens,
                cached_tokens=value.cached_tokens,
            )
        if isinstance(value, CustomResult):
            return wire.Result(req, item.prompt_index, int(Outcome.RESULT), timing, output=wire.outputs(value))
        return wire.Result(
            req,
            item.prompt_index,
            int(Outcome.RESULT),
            timing,
            vector=wire.floats(value.vector),
            prompt_tokens=value.tokens,
        )
    exc: Any = None if fut.cancelled() else fut.exception()
    return wire.Result(
        req,
        item.prompt_index,
        int(item.outcome),
        timing,
        code=getattr(exc, "code", "internal_error"),
        message=getattr(exc, "message", str(exc)),
        retry_after=getattr(exc, "retry_after", None),
    )
