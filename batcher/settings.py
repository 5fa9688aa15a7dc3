"""Batching knobs of one model, each declared once (see batcher/knobs.py for what the
declaration feeds). Validated at construction; the admin API changes the `live` ones."""

from __future__ import annotations

from typing import Any, Literal

from .knobs import MAX_MS, Knobs, SettingsError, knob

__all__ = ["BatchingSettings", "PolicyName", "SettingsError"]

# batcher/policy.py implements each name (POLICIES, GENERATION_POLICIES); a test keeps them equal.
PolicyName = Literal["fixed", "deadline", "adaptive"]
COUNT: dict[str, Any] = {"ge": 1, "le": 1_000_000}
# Padded tokens of one embeddings batch when `max_batch_tokens` is unset; measured on this
# machine's two cores (docs/benchmarks-history.md, "Batches of like lengths").
EMBED_BATCH_TOKENS = 2048
WAIT: dict[str, Any] = {"unit": "ms", "ge": 0, "lt": MAX_MS}
BUDGET: dict[str, Any] = {"unit": "ms", "gt": 0, "lt": MAX_MS}


class BatchingSettings(Knobs):
    max_batch_size: int = knob(
        32, "most items per embeddings batch / per chat admission", live=True, gauge=True, **COUNT
    )
    max_wait_ms: float = knob(
        5.0, "longest the oldest queued item waits for batch mates", live=True, gauge=True, **WAIT
    )
    max_queue: int = knob(1024, "queued items per model before `429 queue_full`", live=True, gauge=True, **COUNT)
    policy: PolicyName = knob(
        "adaptive",
        "dispatch policy: `fixed` (size cap or max wait), `deadline` (also dispatch early for the "
        "tightest budget), `adaptive` (wait only while waiting raises throughput and every budget holds)",
        live=True,
    )
    default_budget_ms: float | None = knob(
        10_000.0,
        "latency budget of requests that name none (body `latency_budget_ms` or header `X-Ferry-Latency-Budget-Ms`)",
        null="no deadline",
        live=True,
        gauge=True,
        **BUDGET,
    )
    # Set at start only: the deadline-aware policies and admission were measured with it.
    deadline_margin_ms: float = knob(
        10.0,
        "safety margin the deadline-aware policies keep between predicted finish and deadline: what the "
        "server's clock does not see (reading the request, writing the answer, the client's own queueing) and "
        "the noise of a shared CPU",
        **WAIT,
    )
    aging_ms: float = knob(
        2_000.0,
        "batch-class work waits at most this long behind interactive work before it "
        "is ordered as if it were interactive",
        live=True,
        **WAIT,
    )
    on_infeasible: Literal["reject", "serve"] = knob(
        "reject",
        "`reject` gives `429 deadline_infeasible` at once; `serve` serves best-effort (`X-Ferry-Best-Effort: true`)",
        live=True,
    )
    fairness: Literal["on", "off"] = knob(
        "on",
        "fair shares between tenants within each priority class (batcher/fairness.py): the tenant with the "
        "smallest virtual token counter first, so admission refuses the tenant over its share first; `off`: "
        "earliest deadline first whoever asks",
        live=True,
    )
    fair_input_weight: float = knob(
        1.0, "what one input token (prompt, embedded input) adds to its tenant's counter", live=True, ge=0, le=1000
    )
    fair_output_weight: float = knob(
        2.0, "what one generated token adds to its tenant's counter", live=True, ge=0, le=1000
    )
    fair_hold_margin: float = knob(
        64.0,
        "chat, KV in blocks: how far a tenant's counter may run ahead of the lowest among the tenants decoding "
        "in its priority class before its rows sit out decode steps (their KV kept) while the step's time "
        "follows its rows; 0: never",
        live=True,
        ge=0,
        le=1_000_000,
    )
    # On by default since admission counts on the measured drain (batcher/load.py): with it
    # off, interactive requests are refused under batch-class overload (docs/benchmarks.md).
    interactive_first: bool = knob(
        True,
        "while interactive requests arrive, batches are sized for their budgets and batch-class work "
        "waits, is refused or expires first; off (`--no-interactive-first`): every urgent request sizes "
        "batches, total throughput first",
        live=True,
    )
    # Measured: interactive first with the lane kept interactive requests on time and let
    # batch-class batches grow back to full size (docs/benchmarks-history.md, "The interactive lane").
    interactive_lane: bool = knob(
        True,
        "embeddings: a batch of interactive requests runs at once beside the batch in flight, on a second "
        "engine thread, instead of waiting for it; batch-class batches are then not cut for interactive "
        "budgets. Chat: interactive prompts are prefilled alone, ahead of the decode step, while batch-class "
        "work runs. With no interactive request for 10 s, batches of any class run two at a time, so bulk "
        "work uses both cores. Off (`--no-interactive-lane`): one batch at a time",
        live=True,
    )
    max_batch_tokens: int | None = knob(
        None,
        "most tokens one batch computes. Embeddings: padded tokens (rows x longest row) of one batch, "
        "one input always fits; unset, 2048. Generation: decode rows and prompt chunks of one engine step "
        "(vLLM's `max_num_batched_tokens`): a longer prompt is prefilled a chunk a step, so it never stalls "
        "the streams decoding; unset, each step's chunk is sized to take no longer than its decode step "
        "(inter-token latency within 2x steady, and within `max_itl_ms`), and prompts go whole while nothing decodes",
        null="auto",
        live=True,
        **COUNT,
    )
    group_by_length: bool = knob(
        True,
        "embeddings: a batch takes queued items of similar length, so little of it is padding; the "
        "most urgent item leads, and items whose deadline cannot wait for another batch always join",
        live=True,
    )
    # Generation only from here.
    budget_scope: Literal["ttft", "total"] = knob(
        "ttft",
        "what a generation request's budget covers: `ttft` (time to first token) or `total` (a sequence "
        "still running at its deadline is cut with a 504)",
    )
    max_itl_ms: float | None = knob(
        None,
        "inter-token latency target: new sequences wait rather than slow everyone",
        null="no inter-token target",
        live=True,
        **BUDGET,
    )
    # 128 since 2026-12-07: on the real default model 128 closed-loop clients got 1.19x vLLM's
    # tokens/s with every client running, where 64 refused half of them (docs/benchmarks.md,
    # "Chat on a real model"); a decode step grows with its rows: `max_itl_ms` bounds it.
    max_running: int = knob(128, "most sequences decoding at once", live=True, **COUNT)
    prefill_token_budget: int = knob(
        2048, "most prompt tokens admitted to prefill in one step (one prompt always fits)", **COUNT
    )
    mode: Literal["continuous", "static"] = knob(
        "continuous", "generation batching; `static` is the comparison baseline", option="batching"
    )

    @property
    def batch_tokens(self) -> int:
        """The padded tokens one one-shot (embeddings) batch may hold."""
        return self.max_batch_tokens if self.max_batch_tokens is not None else EMBED_BATCH_TOKENS

    @property
    def max_wait(self) -> float:
        return self.max_wait_ms / 1000.0

    @property
    def margin(self) -> float:
        return self.deadline_margin_ms / 1000.0

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def updated(self, **changes: Any) -> BatchingSettings:
        """A validated copy with `changes` (an unknown name is a SettingsError too)."""
        return BatchingSettings(**{**self.to_dict(), **changes})
