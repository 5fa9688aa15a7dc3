"""Generated tokens to their items: each iteration's outputs become text pieces and token
counts on their sequences, a `Delta` for the caller's stream, and the result at the last
token; time to first token and inter-token latency are observed here, once a token."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .cost import Calibration
from .errors import EngineError
from .metrics import Metrics
from .protocols import SequenceStep
from .running import RunningSet, _Seq
from .types import Delta, Outcome, Priority, WorkItem

log = logging.getLogger("ferry.batcher")

Finish = Callable[[WorkItem, Outcome, Any], bool]  # QueueingBatcher._finish: resolve once, counted


class Delivery:
    def __init__(
        self,
        model: str,
        metrics: Metrics,
        running: RunningSet,
        finish: Finish,
        record_slo: Callable[[WorkItem, bool], None],
        first_tokens: Mapping[Priority, Calibration] | None = None,
    ) -> None:
        self.model = model
        self._first_tokens = first_tokens  # admission's first-token promises, calibrated here
        self._running = running
        self._finish, self._record_slo = finish, record_slo
        # Children looked up once: these are touched for every generated token.
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)
        self._generated = metrics.generated_tokens.labels(model)

    def deliver_all(
        self, outputs: list[SequenceStep], finished: dict[int, _Seq], now: float, ttft_budget: bool
    ) -> None:
        """Deliver one step's outputs. Finished sequences are no longer in the running set,
        so a failure here must still end each item: it fails only the item it hit.
        `ttft_budget`: the latency budget covers the first token (budget_scope=ttft)."""
        for out in outputs:
            seq = finished.get(out.seq_id) or self._running.get(out.seq_id)
            if seq is None:  # cancelled while the step ran: its output is dropped
                continue
            try:
                self._deliver(seq, out, now, ttft_budget)
            except Exception as exc:
                log.exception("delivering generated tokens failed", extra={"model": self.model})
                self._running.drop(out.seq_id)
                self._finish(seq.item, Outcome.ERROR, EngineError(f"delivering the output failed: {exc}"))

    def _deliver(self, seq: _Seq, out: SequenceStep, now: float, ttft_budget: bool) -> None:
        item = seq.item
        if item.finished:  # cancelled or expired after its last step ran
            return
        produced = len(out.token_ids)
        if produced:
            if seq.tokens == 0:
                self._ttft.observe(now - item.arrival)
                if self._first_tokens and item.predicted_wait is not None:
                    self._first_tokens[item.priority].observe(item.predicted_wait, now - item.arrival)
                    item.predicted_wait = None  # judged once (an expiry later is no first token's)
                if ttft_budget:
                    self._record_slo(item, True)  # the budget covered the first token
            elif seq.last_token_at is not None:
                self._itl.observe((now - seq.last_token_at) / produced)
            seq.last_token_at = now
            seq.tokens += produced
            self._generated.inc(produced)
        if out.text:
            seq.pieces.append(out.text)
        seq.undelivered += produced
        # An engine that reports them, where asked.
        seq.logprobs.add(getattr(out, "logprobs", None), getattr(out, "prompt_logprobs", None))
        if item.on_delta is not None and (out.text or out.finish_reason or (produced and seq.every_token)):
            lps, prompt = seq.logprobs.take()
            item.on_delta(Delta(item, out.text, seq.undelivered, out.finish_reason, out.token_ids, lps, prompt))
            seq.undelivered = 0
        if out.finish_reason is not None:
            self._finish(item, Outcome.RESULT, seq.result(out.finish_reason))
