"""Continuous (iteration-level) batching for generation.

One iteration = apply cancellations, one decode step of every running sequence, then a
batched prefill of the prompts admitted now; every sequence gets exactly one token per
iteration, and a sequence leaves the moment it finishes without ending its peers.

The micro-batcher decides *admission*: waiting prompts join together when enough are
waiting (max_batch_size), when the oldest has waited max_wait_ms, when a deadline says so,
or at once when nothing is running. Static mode (the comparison baseline) admits a new
group only when the previous one has completely finished.

The loop is here; its parts are their own modules: the running set (batcher/running.py),
the slots admission reads (batcher/slots.py), what admission predicts of the scheduler
(batcher/gen_load.py), the engine's side of an iteration (batcher/iteration.py) and the
delivery of tokens to their items (batcher/delivery.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from . import admission
from .cost import Calibration, CostModel, LinearCost, PackedChunkCost
from .delivery import Delivery
from .errors import DeadlineExceeded, EngineError, ShuttingDown
from .fair_steps import fair_holds
from .gen_load import GenerationLoad
from .iteration import WARMUP_PROMPT, Chunking, IterationResult, chunk_budget, packs, profile, run_iteration
from .policy import GENERATION_POLICIES, Decision, Dispatch, WaitUntil, prompt_group
from .protocols import ChunkingEngine, EngineCaller, MakeRequest, PrefillRequest, SteppingEngine
from .queueing import seconds_until
from .running import RunningSet, _Seq
from .settings import BatchingSettings
from .slots import Slots
from .types import DispatchReason, Outcome, Priority, WorkItem

log = logging.getLogger("ferry.batcher")


class GenerationScheduler(GenerationLoad):
    phase = "decode"

    def __init__(
        self,
        model: str,
        engine: SteppingEngine,
        engine_thread: EngineCaller,
        settings: BatchingSettings,
        *,
        make_request: MakeRequest,
        **kw: Any,
    ) -> None:
        super().__init__(model, settings, **kw)
        self.metrics.init_phases(model, "prefill", "decode")
        self.metrics.init_prefix_cache(model)
        self.engine = engine
        self.engine_thread = engine_thread
        self.prefill_cost = CostModel(LinearCost(0.010, 0.002, 0.0002))
        self.decode_cost = CostModel(LinearCost(0.010, 0.0005, 0.0))
        self.cost = self.prefill_cost  # admission predicts time to first token from prefill
        # Passed in: the batcher does not import the engine (see batcher.protocols).
        self._make_request = make_request
        # Prompts prefilled a budgeted chunk a step (batcher/iteration.py), where the engine can.
        self._chunked = isinstance(engine, ChunkingEngine)
        self._running = RunningSet()
        self._slots = Slots(engine, self._running)
        self.first_tokens = {p: Calibration() for p in Priority}  # promised as nine in ten came, by class
        self.predict = admission.calibrated(admission.predicted_first_token, self.first_tokens)
        self._delivery = Delivery(model, self.metrics, self._running, self._finish, self._record_slo, self.first_tokens)
        self.iterations = 0
        self._iteration_ends: float | None = None  # when the iteration in flight is predicted to end
        self._preempted = 0  # the engine's preemption count at the last gauge update
        self._speculated: tuple[int, int, int] = (0, 0, 0)  # its speculation counts then (drafted, taken, steps)
        self.packed_chunk = PackedChunkCost()
        self._tokens_a_step = 1.0  # what the last decode step gave each row, on average (drafts taken: more)
        self.trace: list[tuple[int, list[int], list[int]]] = []  # (iteration, decoded ids, admitted ids)
        self._keep_trace = 1024

    # -- introspection ------------------------------------------------------------
    @property
    def cost_models(self) -> dict[str, CostModel]:
        return {"prefill": self.prefill_cost, "decode": self.decode_cost}

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def busy(self) -> bool:
        return len(self.queue) > 0 or bool(self._running)

    # -- load and admission (the predictions: batcher/gen_load.py) --------------------
    def submit_many(self, payloads: list[Any], **kw: Any) -> list[WorkItem]:
        cached = [self.engine.cached_prefix(p.prompt_ids) for p in payloads]
        costs = kw.get("costs") or [kw.pop("cost", 1)] * len(payloads)
        kw["costs"], taken = admission.uncached(costs, cached)
        items = super().submit_many(payloads, **kw)
        for item, k in zip(items, taken, strict=True):
            item.cached = k
        self._slots.submitted(items)
        return items

    def _admission(self, now: float) -> tuple[list[WorkItem], float | None]:
        """Items to admit now (in queue order) and, if none, when to look again. Admitted
        with reason `lane`: interactive prompts whose prefill is the whole iteration."""
        s = self.settings
        if not len(self.queue) or self._slots.free(s, self.decode_cost) == 0:
            return [], None
        admission.reprice(self.queue.peek(s.max_batch_size, now), self.engine.cached_prefix)
        load = self.load(now)
        if self._closing:
            group = prompt_group(self.queue, now, s, self.prefill_cost, load)
            decision: Decision = Dispatch(len(group), DispatchReason.DRAIN) if group else WaitUntil(None)
        else:
            decision = GENERATION_POLICIES[s.policy](self.queue, now, s, self.prefill_cost, load)
        if isinstance(decision, WaitUntil):
            return [], decision.t
        chosen = self._take(decision.size, now)
        for item in chosen:
            item.dispatched_at, item.batch_size, item.reason = now, len(chosen), decision.reason
        self.metrics.batches.labels(self.model, decision.reason.value).inc()
        return chosen, None

    # -- the loop -----------------------------------------------------------------
    async def _loop(self) -> None:
        # The previous iteration's outputs are delivered (streams woken, results set)
        # while the worker already runs the next one: slots it freed are known before,
        # so admission timing is the same as if delivery came first.
        pending: Callable[[], None] | None = None
        try:
            while True:
                now = self.clock.now()
                self._expire(now)
                self._expire_running(now)
                admitted, look_again = self._admission(now)
                if admitted or self._running or self._running.has_removals:
                    deliver, pending = pending, None  # _iteration runs it exactly once
                    alone = bool(admitted) and admitted[0].reason is DispatchReason.LANE
                    self._slots.skipped_decode = alone and bool(self._running)
                    pending = await self._iteration(admitted, deliver, decode=not alone)
                    continue
                if pending is not None:
                    last_delivery, pending = pending, None
                    last_delivery()
                    continue
                if not self.busy:
                    self._idle.set()
                self._slots.pause()
                wake_at = min(self.queue.min_deadline, look_again if look_again is not None else float("inf"))
                self._wake.clear()
                await self.clock.wait(self._wake, seconds_until(wake_at, now))
        finally:
            if pending is not None:
                pending()

    async def _iteration(
        self, admitted: list[WorkItem], pending: Callable[[], None] | None, decode: bool = True
    ) -> Callable[[], None] | None:
        """Run one iteration; returns the delivery of its outputs, for the caller to run.
        `decode=False`: the admitted prompts' prefill alone, the running sequences wait."""
        requests, removals, decoding, held = self._schedule(admitted, decode)
        started = self.clock.now()
        self._iteration_ends = started + self._predicted_iteration(admitted, len(decoding))
        try:
            call = self._start(
                run_iteration, self.engine, removals, requests, bool(decoding), self._chunking(decode), held
            )
        finally:
            if pending is not None:  # the last step's finished items live only in it
                pending()
        try:
            result: IterationResult = await call
        except asyncio.CancelledError:
            self._fail_running(ShuttingDown("server stopped while this request ran"))
            raise
        except Exception as exc:
            self._iteration_ends = None
            log.exception("engine failed a decode step", extra={"model": self.model})
            self.metrics.engine_errors.labels(self.model, "decode").inc()
            self._fail_running(EngineError(f"model execution failed: {type(exc).__name__}: {exc}"))
            return None
        now, self._iteration_ends = self.clock.now(), None
        result.apportion(now - started, self.cost_models, self.packed_chunk)
        result.record(requests, self.metrics, self.model, self.cost_models)
        if result.decoded_rows:  # (the next step's interval from this one is that many tokens')
            self._tokens_a_step = result.tokens_a_row
        finished = self._postprocess(result)
        return lambda: self._delivery.deliver_all(result.outputs, finished, now, self.settings.budget_scope == "ttft")

    def _schedule(
        self, admitted: list[WorkItem], decode: bool
    ) -> tuple[list[PrefillRequest], list[int], list[int], frozenset[int]]:
        """The admitted prompts join the running set. What the engine is handed: their
        prefill requests, the ids to drop, the ids a decode step runs (none without one),
        and the running ids it leaves out (batcher/fair_steps.py)."""
        self._running.join(admitted)
        requests = [self._make_request(i.id, i.payload.prompt_ids, i.payload.params, int(i.priority)) for i in admitted]
        removals = self._running.take_removals()
        decoding = self._running.decoding({r.seq_id for r in requests}) if decode else []
        held = frozenset[int]()
        if getattr(self.engine, "holds_rows", False):  # fair shares a step at a time
            held = fair_holds(self._running, decoding, self.tenants, self.settings, self.decode_cost, self.clock.now())
        if held:
            decoding = [i for i in decoding if i not in held]
            self.metrics.tenant_held_rows.labels(self.model).inc(len(held))
        self.iterations += 1
        if decoding:
            self._slots.decode_step(self.clock.now(), self._tokens_a_step)
        self.trace.append((self.iterations, decoding, [r.seq_id for r in requests]))
        if len(self.trace) > self._keep_trace:
            del self.trace[: -self._keep_trace]
        self._publish_gen()
        return requests, removals, decoding, held

    def _chunking(self, decode: bool) -> Chunking | None:
        """This iteration's prefill budget, interactive chunks first (None: whole prompts as they join)."""
        if not self._chunked:
            return None
        # The worker is idle here (the last iteration was awaited): the engine's own counts hold.
        decoding = self.engine.running - getattr(self.engine, "prefilling", 0)
        first = self.chunk_order()
        s = self.settings
        packed = decode and packs(self.engine)
        # What drafts may take a step to (engine/speculation.py): the rows' inter-token
        # targets, and the decode step's share of the interactive reserve.
        reserve = self.tracker.reserve(self.clock.now(), s, self.prefill_cost, 0.0)
        ceiling = self._slots.step_ceiling(s, reserve)
        return Chunking(chunk_budget(s, decoding, self.prefill_cost, self.decode_cost, packed), first, ceiling)

    def chunk_order(self) -> list[int]:
        """The prompts still prefilling in the order their chunks go: interactive ones
        first; with fair shares, within each class the tenant with the smallest counter
        first (each tenant's prompts in the order they joined), so a tenant over its share
        cannot hold a quiet one's first token behind its long prompts. Admission predicts
        by the same order (`admission.prefill_ahead`)."""
        waiting = self._running.prefilling()
        if not self.tenants.enabled:
            return [i.id for i in waiting if i.priority is Priority.INTERACTIVE]
        counters = {t: self.tenants.counter(t) for t in {i.tenant for i in waiting}}
        return [i.id for i in sorted(waiting, key=lambda i: (i.priority, counters[i.tenant]))]

    def _postprocess(self, result: IterationResult) -> dict[int, _Seq]:
        """Failed prefills end their items; prefilled sequences learn how much of their prompt
        the prefix cache served; each sequence's new tokens are charged to its tenant.
        Finished sequences leave the running set now, so the next
        admission sees their slots; returned, their last outputs still to deliver."""
        for seq_id, cached in result.cached.items():
            joined = self._running.get(seq_id)
            if joined is not None and not joined.tokens:  # its first prefill (not one resumed after preemption)
                joined.cached_tokens = cached
        for seq_id, error in result.failed.items():
            seq = self._running.leave(seq_id)
            if seq is not None:
                self.metrics.engine_errors.labels(self.model, "prefill").inc()
                self._finish(seq.item, Outcome.ERROR, EngineError(f"model execution failed for this prompt: {error}"))
        finished, now = {}, self.clock.now()
        for out in result.outputs:
            if out.token_ids and (running := self._running.get(out.seq_id)) is not None:
                self.serve_tokens(running.item.tenant, now, output_tokens=len(out.token_ids))
            seq = self._running.leave(out.seq_id) if out.finish_reason is not None else None
            if seq is not None:
                finished[out.seq_id] = seq
                self._slots.finished(seq.tokens + len(out.token_ids), seq.limit)
        self._publish_gen()
        return finished

    def _start(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """Start the engine call now if the engine thread can (EngineThread.start), else when awaited."""
        start = getattr(self.engine_thread, "start", None)
        return start(fn, *args) if start is not None else self.engine_thread(fn, *args)

    # -- sequences that end early -------------------------------------------------------
    def _expire_running(self, now: float) -> None:
        """With budget_scope=total, a sequence still running at its deadline is cut."""
        if self.settings.budget_scope != "total":
            return
        for seq in self._running.values():
            d = seq.item.deadline
            if d is not None and d <= now and not seq.item.best_effort:
                self._running.drop(seq.item.id)
                self.metrics.expired.labels(self.model, seq.item.priority.label).inc()
                self._finish(seq.item, Outcome.EXPIRED, DeadlineExceeded("latency budget exceeded while generating"))

    def _cancel_running(self, item: WorkItem) -> None:
        self._running.drop(item.id)

    def stop_sequence(self, item: WorkItem) -> bool:
        """End a running sequence now as finished by a stop string its caller found in the
        text (an engine core's front end detokenizes): it resolves with finish_reason
        "stop" and the tokens generated so far, and leaves the engine before its next step.
        A sequence not running (finished already) is skipped."""
        seq = self._running.drop(item.id)
        if seq is None:
            return False
        self._finish(item, Outcome.RESULT, seq.result("stop"))  # first: nothing below may leave it open
        self._slots.finished(seq.tokens, seq.limit)
        self._publish_gen()
        self._wake.set()
        return True

    def _fail_running(self, exc: Exception) -> int:
        failed = 0
        for seq in self._running.values():
            self._running.drop(seq.item.id)
            failed += self._finish(seq.item, Outcome.ERROR, exc)
        return failed

    # -- gauges and warm-up ---------------------------------------------------------------
    def _publish_gen(self) -> None:
        m = self.metrics
        m.running.labels(self.model).set(len(self._running))
        m.waiting.labels(self.model).set(len(self.queue))
        m.kv_tokens.labels(self.model).set(self.engine.kv_tokens)
        m.kv_usage.labels(self.model).set(self.kv_usage())
        m.set_first_token_slowdown(self.model, {p: c.factor for p, c in self.first_tokens.items()})
        last, self._preempted = self._preempted, getattr(self.engine, "preemptions", 0)
        m.preemptions.labels(self.model).inc(max(0, self._preempted - last))
        counts, self._speculated = self._speculated, getattr(self.engine, "speculated", (0, 0, 0))
        for counter, now, before in zip(
            (m.spec_draft_tokens, m.spec_accepted_tokens, m.spec_steps), self._speculated, counts, strict=True
        ):
            counter.labels(self.model).inc(max(0, now - before))

    def kv_usage(self) -> float:
        """The share of the KV cache this model may use that is in use, 0 to 1 (`Slots.kv_usage`)."""
        return self._slots.kv_usage(self.settings)

    async def warmup(self) -> None:
        """Profile prefill and decode on the real engine to seed both cost models."""
        prompt = self.engine.encode_prompt(WARMUP_PROMPT)
        obs = await self.engine_thread(profile, self.engine, self._make_request, prompt)
        self._preempted = getattr(self.engine, "preemptions", 0)  # the warm-up's are not traffic's
        self._speculated = getattr(self.engine, "speculated", (0, 0, 0))
        if (reserve := getattr(self.engine, "reserve", None)) is not None:  # KV rows for every slot, now
            await self.engine_thread(reserve, self._slots.engine_slots(self.settings))
        self.prefill_cost.seed([(n, tokens, secs) for phase, n, tokens, secs in obs if phase == "prefill"])
        self.decode_cost.seed([(n, tokens, secs) for phase, n, tokens, secs in obs if phase == "decode"])
