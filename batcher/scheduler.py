"""Continuous (iteration-level) batching for generation.

One iteration = apply cancellations, one decode step of every running sequence, then a
batched prefill of the prompts admitted now; every sequence gets exactly one token per
iteration, and a sequence leaves the moment it finishes without ending its peers.

The micro-batcher decides *admission*: waiting prompts join together when enough are
waiting (max_batch_size), when the oldest has waited max_wait_ms, when a deadline says so,
or at once when nothing is running. Static mode (the comparison baseline) admits a new
group only when the previous one has completely finished.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import admission
from .cost import CostModel, LinearCost
from .errors import DeadlineExceeded, DeadlineInfeasible, EngineError, ShuttingDown
from .isolation import split_in_halves
from .load import Load
from .policy import GENERATION_POLICIES, Decision, Dispatch, WaitUntil, prompt_group
from .protocols import EngineCaller, MakeRequest, PrefillRequest, SequenceStep, SteppingEngine
from .queueing import QueueingBatcher, seconds_until
from .settings import BatchingSettings
from .types import Delta, DispatchReason, GenResult, Outcome, Priority, TokenCount, WorkItem

log = logging.getLogger("ferry.batcher")

# The 99th percentile of a Poisson count with mean m is about m + 2.33 sqrt(m).
POISSON_Z99 = 2.33
SLOT_RATE_MEMORY = 30.0  # seconds over which the interactive slots' rate fades (_slot_rate)


@dataclass(slots=True)
class _Seq:
    item: WorkItem
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    last_token_at: float | None = None
    undelivered: int = 0  # tokens whose text is held back, counted in the next delta
    # A delta for every token, text or not: the engine makes no text for this sequence
    # (its params say detokenize=False), the caller decodes the ids (an engine core's front end).
    every_token: bool = False


@dataclass(slots=True)
class _IterationResult:
    outputs: list[SequenceStep]
    failed: dict[int, Exception]
    prefill_seconds: float
    decode_seconds: float
    decoded_rows: int


class GenerationScheduler(QueueingBatcher):
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
        # Children looked up once: these are touched for every generated token.
        self._ttft = self.metrics.ttft.labels(model)
        self._itl = self.metrics.itl.labels(model)
        self._generated = self.metrics.generated_tokens.labels(model)
        self.engine = engine
        self.engine_thread = engine_thread
        self.prefill_cost = CostModel(LinearCost(0.010, 0.002, 0.0002))
        self.decode_cost = CostModel(LinearCost(0.010, 0.0005, 0.0))
        self.cost = self.prefill_cost  # admission predicts time to first token from prefill
        # Passed in: the batcher does not import the engine (see batcher.protocols).
        self._make_request = make_request
        self._running: dict[int, _Seq] = {}
        self._removals: list[int] = []
        self._targeted: list[WorkItem] = []  # unfinished items with an inter-token target (few)
        self._typical_steps = 16.0  # moving average of max_tokens, for how long a slot is held
        self._interactive_steps = 16.0  # the same over interactive requests (the slots kept for them)
        self._skipped_decode = False  # the last iteration was interactive prompts' prefill alone
        # Seconds between two decode steps, measured (a moving average): what a running
        # sequence waits per token, prefill groups and prefill-only iterations included.
        self._token_interval = 0.0
        self._slow_rate, self._slot_rate_at = 0.0, 0.0  # see _slot_rate
        self._last_decode_at: float | None = None
        self.iterations = 0
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

    # -- load and admission ----------------------------------------------------------
    predict = staticmethod(admission.predicted_first_token)

    def busy_until(self, now: float) -> float:
        """The next iteration boundary: when a free slot can take a newcomer."""
        return now + self.decode_cost.predict(len(self._running)) if self._running else now

    def submit_many(self, payloads: list[Any], **kw: Any) -> list[WorkItem]:
        items = super().submit_many(payloads, **kw)
        for item in items:
            self._typical_steps += 0.05 * (_max_tokens(item) - self._typical_steps)
            if item.priority is Priority.INTERACTIVE:
                self._interactive_steps += 0.05 * (_max_tokens(item) - self._interactive_steps)
        if items[0].itl_target is not None:
            self._targeted.extend(items)
        return items

    def load(self, now: float) -> Load:
        """The tracker's snapshot plus what runs: free slots, when each running sequence's
        slot frees at its token limit, and how long a typical sequence holds one. Decode
        steps are predicted at the occupancy the queue will bring (at most every slot).
        A sequence's tokens come one a decode step, at least the predicted step apart and
        at least as far apart as measured lately (prefills share the iterations).
        Interactive first: batch-class prompts leave free the slots interactive ones need
        by Little's law (their arrival rate, `_slot_rate`, times a typical interactive
        sequence's time is the mean in use), with room for Poisson arrivals above the mean
        (their 99th percentile), plus one: one always, or the first interactive prompt
        after batch-class work filled every slot would wait for a whole sequence to end.

        The reserve bounds a whole iteration, which an interactive prompt may arrive just
        after: the decode step now takes its share, a prefill group the rest. With the
        interactive lane, interactive prompts then go first in a prefill of their own
        (`prefill_first`) while batch-class work runs or waits: their first token no
        longer waits for a decode step of everyone's, at most one such iteration between
        two decode steps (the running sequences wait for one prefill)."""
        s = self.settings
        base = self.tracker.snapshot(now, self.queue, s, self.prefill_cost, self.busy_until(now), shape=False)
        slots = self._slot_limit()
        step = self.decode_cost.predict(max(1, min(slots, len(self._running) + len(self.queue))))
        step = max(step, self._token_interval)
        frees = tuple(sorted(now + max(1, _max_tokens(q.item) - q.tokens) * step for q in self._running.values()))
        held = self._typical_steps * step
        reserved = 0
        if s.interactive_first:  # one slot even before the first interactive arrival is seen
            in_use = self._slot_rate(now, base.interactive_rate) * self._interactive_steps * step
            reserved = min(slots - 1, math.ceil(in_use + POISSON_Z99 * math.sqrt(in_use)) + 1)
        reserve = base.reserve
        if reserve is not None and self._running:
            reserve = max(reserve - self.decode_cost.predict(len(self._running)), 0.0)
        first = (
            s.mode == "continuous"  # static mode (the baseline) runs whole groups, whatever their class
            and s.interactive_first
            and s.interactive_lane
            and not self._skipped_decode
            and self._batch_class_present()
        )
        return replace(
            base,
            reserve=reserve,
            free_slots=self._capacity(),
            interactive_slots=reserved,
            slots_free_at=frees,
            sequence_seconds=held,
            prefill_first=first,
        )

    def _slot_rate(self, now: float, rate: float) -> float:
        """The interactive arrival rate the slots are kept for: the last 2 s's, or what it
        was lately, fading over SLOT_RATE_MEMORY. A slot is held for a whole sequence, and
        a lull of a few seconds in Poisson arrivals says little about the next second."""
        dt, self._slot_rate_at = max(0.0, now - self._slot_rate_at), now
        self._slow_rate = max(rate, self._slow_rate * math.exp(-dt / SLOT_RATE_MEMORY))
        return self._slow_rate

    def _time_decode_step(self) -> None:
        """A decode step starts now: the interval since the last one (back to back only)."""
        now = self.clock.now()
        last, self._last_decode_at = self._last_decode_at, now
        if last is None:
            return
        gap = now - last
        self._token_interval += 0.1 * (gap - self._token_interval) if self._token_interval else gap

    def _batch_class_present(self) -> bool:
        if self.queue.count(Priority.BATCH):
            return True
        return any(seq.item.priority is Priority.BATCH for seq in self._running.values())

    def _slot_limit(self) -> int:
        """Most sequences that may run at once: max_running, the engine's own slot count (it
        bounds a live PATCH of max_running), and what keeps a decode step under max_itl_ms
        and under the inter-token target of every queued or running sequence that has one."""
        s = self.settings
        cap = min(s.max_running, getattr(self.engine, "max_running", s.max_running))
        # Queued ones too: the batch shrinks to what their targets allow, so they can join
        # (and a group admitted with one of them respects it from its first step).
        if self._targeted:
            self._targeted = [i for i in self._targeted if not i.finished]
        targets = [i.itl_target for i in self._targeted if i.itl_target is not None]
        if s.max_itl_ms is not None:
            targets.append(s.max_itl_ms / 1000.0)
        if targets:
            limit = min(targets)
            while cap > 1 and self.decode_cost.predict(cap) > limit:
                cap -= 1
        return cap

    def check_itl(self, item: WorkItem, siblings: int) -> bool:
        """A request's inter-token target against the predicted decode step at the
        occupancy it would join: the running sequences and the queue ahead (at most every
        slot the targets allow), itself and its siblings included. Refused at once
        (`429 deadline_infeasible`) when that step is slower than the target; admitted, its
        target then bounds the running batch while it runs (`_slot_limit`)."""
        target = item.itl_target
        if target is None:
            return False
        occupancy = max(1, min(self._slot_limit(), len(self._running) + len(self.queue) + siblings + 1))
        step = self.decode_cost.predict(occupancy)
        if step <= target:
            return False
        if self.settings.on_infeasible == "serve":
            return True
        alone = self.decode_cost.predict(1)
        if alone > target:
            why = f"a decode step of this model alone is predicted at {alone * 1000.0:.1f} ms"
            retry = 60  # not a matter of load: this replica cannot meet it
        else:
            why = f"a decode step is predicted at {step * 1000.0:.1f} ms with {occupancy} sequences"
            retry = max(1, math.ceil(self.load(self.clock.now()).sequence_seconds))  # a typical sequence ends
        raise DeadlineInfeasible(
            f"inter-token target of {target * 1000.0:.0f} ms cannot be met: {why}", retry_after=retry
        )

    def _capacity(self) -> int:
        """Slots free now (none in static mode while a group runs)."""
        if self.settings.mode == "static" and self._running:
            return 0
        return max(0, self._slot_limit() - len(self._running))

    def _admission(self, now: float) -> tuple[list[WorkItem], float | None]:
        """Items to admit now (in queue order) and, if none, when to look again. Admitted
        with reason `lane`: interactive prompts whose prefill is the whole iteration."""
        s = self.settings
        if not len(self.queue) or self._capacity() == 0:
            return [], None
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
                if admitted or self._running or self._removals:
                    deliver, pending = pending, None  # _iteration runs it exactly once
                    alone = bool(admitted) and admitted[0].reason is DispatchReason.LANE
                    self._skipped_decode = alone and bool(self._running)
                    pending = await self._iteration(admitted, deliver, decode=not alone)
                    continue
                if pending is not None:
                    last_delivery, pending = pending, None
                    last_delivery()
                    continue
                if not self.busy:
                    self._idle.set()
                self._last_decode_at = None  # the loop waits: the next step's interval is not a token's
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
        for item in admitted:
            self._running[item.id] = _Seq(item, every_token=not getattr(item.payload.params, "detokenize", True))
        requests = [self._make_request(i.id, i.payload.prompt_ids, i.payload.params) for i in admitted]
        removals, self._removals = self._removals, []
        joining = {r.seq_id for r in requests}
        decoding = [i for i in self._running if i not in joining] if decode else []
        self.iterations += 1
        if decoding:
            self._time_decode_step()
        self.trace.append((self.iterations, decoding, [r.seq_id for r in requests]))
        if len(self.trace) > self._keep_trace:
            del self.trace[: -self._keep_trace]
        self._publish_gen()
        started = self.clock.now()
        try:
            call = self._start(self._run_engine, removals, requests, bool(decoding))
        finally:
            if pending is not None:  # the last step's finished items live only in it
                pending()
        try:
            result: _IterationResult = await call
        except asyncio.CancelledError:
            self._fail_running(ShuttingDown("server stopped while this request ran"))
            raise
        except Exception as exc:
            log.exception("engine failed a decode step", extra={"model": self.model})
            self.metrics.engine_errors.labels(self.model, "decode").inc()
            self._fail_running(EngineError(f"model execution failed: {type(exc).__name__}: {exc}"))
            return None
        now = self.clock.now()
        _apportion(result, now - started)
        self._observe(result, requests)
        for seq_id, error in result.failed.items():
            seq = self._running.pop(seq_id, None)
            if seq is not None:
                self.metrics.engine_errors.labels(self.model, "prefill").inc()
                self._finish(seq.item, Outcome.ERROR, EngineError(f"model execution failed for this prompt: {error}"))
        # Finished sequences leave the running set now, so the next admission sees their slots.
        finished = {}
        for out in result.outputs:
            if out.finish_reason is not None and out.seq_id in self._running:
                finished[out.seq_id] = self._running.pop(out.seq_id)
        self._publish_gen()
        return lambda: self._deliver_all(result.outputs, finished, now)

    def _start(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """Start the engine call now if the engine thread can (EngineThread.start), else when awaited."""
        start = getattr(self.engine_thread, "start", None)
        return start(fn, *args) if start is not None else self.engine_thread(fn, *args)

    def _run_engine(self, removals: list[int], requests: list[PrefillRequest], decode: bool) -> _IterationResult:
        """Runs on the worker thread: everything the engine does in one iteration."""
        engine = self.engine
        if removals:
            engine.remove(removals)
        t0 = time.perf_counter()
        outputs = list(engine.step()) if decode and engine.running else []
        rows = len(outputs)
        t1 = time.perf_counter()
        failed: dict[int, Exception] = {}
        if requests:
            # A group that fails is retried by halves, so only the failing prompt fails; a
            # failed call's sequences are removed first, whatever it left behind.
            results = split_in_halves(
                engine.add, requests, after_failure=lambda group: engine.remove([r.seq_id for r in group])
            )
            for request, result in zip(requests, results, strict=True):
                if isinstance(result, Exception):
                    failed[request.seq_id] = result
                else:
                    outputs.append(result)
        return _IterationResult(outputs, failed, time.perf_counter() - t1, t1 - t0, rows)

    def _observe(self, r: _IterationResult, requests: list[PrefillRequest]) -> None:
        m, model = self.metrics, self.model
        if r.decoded_rows:
            m.batch_size.labels(model, "decode").observe(r.decoded_rows)
            m.batch_seconds.labels(model, "decode").observe(r.decode_seconds)
            m.cost_error.labels(model, "decode").observe(self.decode_cost.observe(r.decoded_rows, 0, r.decode_seconds))
        if requests:
            tokens = TokenCount.of([len(q.prompt_ids) for q in requests])
            m.batch_size.labels(model, "prefill").observe(len(requests))
            m.batch_tokens.labels(model, "prefill").observe(tokens.real)
            m.padding.labels(model, "prefill").observe(tokens.padding_ratio)
            m.batch_seconds.labels(model, "prefill").observe(r.prefill_seconds)
            m.cost_error.labels(model, "prefill").observe(
                self.prefill_cost.observe(len(requests), tokens.padded, r.prefill_seconds)
            )
            m.slowdown.labels(model, "prefill").set(self.prefill_cost.slowdown)
            m.prompt_tokens.labels(model).inc(tokens.real)

    def _deliver_all(self, outputs: list[SequenceStep], finished: dict[int, _Seq], now: float) -> None:
        """Deliver one step's outputs. Finished sequences are no longer in the running set,
        so a failure here must still end each item: it fails only the item it hit."""
        for out in outputs:
            seq = finished.get(out.seq_id) or self._running.get(out.seq_id)
            if seq is None:  # cancelled while the step ran: its output is dropped
                continue
            try:
                self._deliver(seq, out, now)
            except Exception as exc:
                log.exception("delivering generated tokens failed", extra={"model": self.model})
                if self._running.pop(out.seq_id, None) is not None:
                    self._removals.append(out.seq_id)
                self._finish(seq.item, Outcome.ERROR, EngineError(f"delivering the output failed: {exc}"))

    def _deliver(self, seq: _Seq, out: SequenceStep, now: float) -> None:
        item = seq.item
        if item.finished:  # cancelled or expired after its last step ran
            return
        produced = len(out.token_ids)
        if produced:
            if seq.tokens == 0:
                self._ttft.observe(now - item.arrival)
                if self.settings.budget_scope == "ttft":
                    self._record_slo(item, True)  # the budget covered the first token
            elif seq.last_token_at is not None:
                self._itl.observe((now - seq.last_token_at) / produced)
            seq.last_token_at = now
            seq.tokens += produced
            self._generated.inc(produced)
        if out.text:
            seq.pieces.append(out.text)
        seq.undelivered += produced
        if item.on_delta is not None and (out.text or out.finish_reason or (produced and seq.every_token)):
            item.on_delta(Delta(item, out.text, seq.undelivered, out.finish_reason, out.token_ids))
            seq.undelivered = 0
        if out.finish_reason is not None:
            prompt_tokens = len(item.payload.prompt_ids)
            self._finish(
                item, Outcome.RESULT, GenResult("".join(seq.pieces), out.finish_reason, prompt_tokens, seq.tokens)
            )

    def _expire_running(self, now: float) -> None:
        """With budget_scope=total, a sequence still running at its deadline is cut."""
        if self.settings.budget_scope != "total":
            return
        for seq_id, seq in list(self._running.items()):
            d = seq.item.deadline
            if d is not None and d <= now and not seq.item.best_effort:
                del self._running[seq_id]
                self._removals.append(seq_id)
                self.metrics.expired.labels(self.model, seq.item.priority.label).inc()
                self._finish(seq.item, Outcome.EXPIRED, DeadlineExceeded("latency budget exceeded while generating"))

    def _cancel_running(self, item: WorkItem) -> None:
        if self._running.pop(item.id, None) is not None:
            self._removals.append(item.id)

    def stop_sequence(self, item: WorkItem) -> bool:
        """End a running sequence now as finished by a stop string its caller found in the
        text (an engine core's front end detokenizes): it resolves with finish_reason
        "stop" and the tokens generated so far, and leaves the engine before its next step.
        A sequence not running (finished already) is skipped."""
        seq = self._running.pop(item.id, None)
        if seq is None:
            return False
        self._removals.append(item.id)
        self._publish_gen()
        prompt_tokens = len(item.payload.prompt_ids)
        self._finish(item, Outcome.RESULT, GenResult("".join(seq.pieces), "stop", prompt_tokens, seq.tokens))
        self._wake.set()
        return True

    def _fail_running(self, exc: Exception) -> int:
        failed = 0
        for seq_id, seq in list(self._running.items()):
            del self._running[seq_id]
            self._removals.append(seq_id)
            failed += self._finish(seq.item, Outcome.ERROR, exc)
        return failed

    def _publish_gen(self) -> None:
        m = self.metrics
        m.running.labels(self.model).set(len(self._running))
        m.waiting.labels(self.model).set(len(self.queue))
        m.kv_tokens.labels(self.model).set(self.engine.kv_tokens)
        m.kv_usage.labels(self.model).set(self.kv_usage())

    def kv_usage(self) -> float:
        """The share of the KV cache this model may use that is in use, 0 to 1: the running
        rows' cache tokens over the capacity, one full context (`max_context`) for each
        sequence that may run (`max_running`, bounded by the engine's own slots). 0 for an
        engine that does not say its context."""
        s = self.settings
        context = getattr(self.engine, "max_context", None)
        if not context:
            return 0.0
        slots = min(s.max_running, getattr(self.engine, "max_running", s.max_running))
        return min(1.0, self.engine.kv_tokens / (slots * context))

    async def warmup(self) -> None:
        """Profile prefill and decode on the real engine to seed both cost models."""
        sizes = (1, 4, 8)
        prompt = self.engine.encode_prompt("Ferry warms up the engine with an ordinary prompt.")

        def profile() -> list[tuple[str, int, int, float]]:
            obs = []
            next_id = -1
            for n in sizes:
                ids = list(range(next_id, next_id - n, -1))
                next_id -= n
                reqs = [self._make_request(i, prompt, None) for i in ids]
                t0 = time.perf_counter()
                self.engine.add(reqs)
                obs.append(("prefill", n, n * len(prompt), time.perf_counter() - t0))
                for _ in range(3):
                    t0 = time.perf_counter()
                    self.engine.step()
                    obs.append(("decode", n, 0, time.perf_counter() - t0))
                self.engine.remove(ids)
            return obs

        obs = await self.engine_thread(profile)
        self.prefill_cost.seed([(n, tokens, secs) for phase, n, tokens, secs in obs if phase == "prefill"])
        self.decode_cost.seed([(n, tokens, secs) for phase, n, tokens, secs in obs if phase == "decode"])


def _max_tokens(item: WorkItem) -> int:
    return int(getattr(item.payload.params, "max_tokens", 1) or 1)


def _apportion(r: _IterationResult, total: float) -> None:
    """Charge the iteration's clock time (thread hop included) to its two phases, in the
    proportion the worker thread measured; the clock is the one the tests can drive."""
    measured = r.prefill_seconds + r.decode_seconds
    share = r.decode_seconds / measured if measured > 0 else (1.0 if r.decoded_rows else 0.0)
    if not r.decoded_rows:
        share = 0.0
    r.decode_seconds, r.prefill_seconds = total * share, total * (1.0 - share)
