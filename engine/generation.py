"""Continuous (iteration-level) batching over any Hugging Face causal LM.

Running sequences share preallocated per-slot KV buffers (engine/kv.py), one row each,
right-aligned at a shared write column and left-padded. `add()` prefills new prompts as
their own batch (engine/prefill.py), feeding each from the end of the prefix whose KV the
prefix cache holds (engine/prefix_cache.py), and copies their rows into free slots;
`step()` decodes one token for every row, writing one cache column in place; finished or
cancelled rows leave at once and their slots are reused. Because rows are left-padded and
joined at different times, every forward gets an explicit 2D 0/1 attention mask and
explicit position ids (real tokens before the fed one); transformers' defaults ignore
padding and give silently wrong tokens. Token ids become text, stop strings included, in
engine/detokenize.py.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .base import PrefillStep, SequenceRequest, StepOutput
from .blocks import PagedBatch, holding
from .chat_tokenizer import encode_chat
from .chunks import Chunk, PendingPrefills
from .decode_attention import kernel_after, kernel_for, paged_attention_kernel
from .detokenize import FINISH_LENGTH
from .device import configure_threads, resolve_device, resolve_dtype
from .forward import CausalForward
from .grammar import GrammarCache
from .kv import RunningBatch
from .kv_events import KVEventsConfig, cache_events
from .onednn import PLAIN_BELOW, fuse_projections, prepack_linears, prepack_output_head
from .packed import install
from .packed_steps import PackedSteps
from .preemption import Preemption
from .prefill import Prefilled, Prefiller
from .prefix_cache import DEFAULT_BLOCK, PrefixCache
from .sequence import NextTokens, RunningSequence
from .sharing import PrefixSharing
from .speculation import SpeculationConfig, Speculator

log = logging.getLogger("ferry.engine")

DEFAULT_PREFIX_CACHE_BYTES = 256 * 1024 * 1024
KV_LAYOUTS = ("blocks", "rectangle")  # the running rows' KV: engine/blocks.py, engine/kv.py
DEFAULT_KV_CACHE_BYTES = 4096 * 1024 * 1024  # the running rows' KV, as vLLM's CPU backend's default
MIN_KV_TOKENS = 1024  # fewer cannot hold the warm-up's rows (batcher/iteration.py) beside anything else


class ChatTokens:
    """Text to token ids and back, with the engine's tokenizer (`tokenizer`) and name."""

    name: str
    tokenizer: Any

    def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        return encode_chat(self.tokenizer, self.name, messages, tools, template_kwargs)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


class KVMemory:
    """An engine's KV memory as the scheduler reads it: the running rows (`_batch`), the
    prompts prefilling (`_pending`), the budget in cells and the preemptions."""

    _batch: RunningBatch[RunningSequence] | PagedBatch[RunningSequence]
    _pending: PendingPrefills[RunningSequence]
    _preemption: Preemption
    _sharing: PrefixSharing
    kv_budget: int | None

    @property
    def kv_tokens(self) -> int:
        """Token slots the running rows attend over (rows x length, padding included), the
        shared prefixes held for them once (engine/sharing.py), and the prompt tokens
        prefilling sequences hold."""
        return self._batch.used_cells + self._sharing.tokens + self._pending.kv_tokens

    @property
    def kv_usage(self) -> float | None:
        """The running rows' share of the KV budget (None without one): cells of the
        rectangle, or blocks in use over the pool's (engine/blocks.py)."""
        return self._batch.usage

    def reserve(self, rows: int) -> None:
        """Buffers for `rows` running rows now (the warm-up's: traffic then never waits for them to grow)."""
        self._batch.reserve(rows)

    @property
    def preemptions(self) -> int:  # running sequences preempted for KV memory so far
        return self._preemption.count


class HFGenerationEngine(ChatTokens, KVMemory, PackedSteps):
    """GenerationEngine for a local path or hub id loadable by AutoModelForCausalLM.

    Not thread-safe: the batcher calls it from one worker thread.
    """

    def __init__(
        self,
        model_name_or_path: str,
        device: str | None = "cpu",
        dtype: str | None = "float32",
        max_running: int = 32,
        *,
        name: str | None = None,
        max_context: int | None = None,
        torch_threads: int | None = None,
        trust_remote_code: bool = False,
        prefix_caching: bool = True,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        prefix_block: int = DEFAULT_BLOCK,
        packed_steps: bool = True,
        kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES,
        prepacked_linears: bool = True,
        native_attention: bool = True,
        fused_projections: bool = True,
        kv_events: KVEventsConfig | dict[str, Any] | str | None = None,
        kv_layout: str = "blocks",
        speculation: SpeculationConfig | None = None,
    ) -> None:
        """`device` and `dtype` accept "auto" (see engine.device); `max_context` defaults
        to the config's max_position_embeddings. With `prefix_caching`, the KV of full
        `prefix_block`-token blocks of prompts is kept (up to `prefix_cache_bytes`; 0 is
        off) and reused by later prompts that start with the same tokens. The running
        rows' KV buffers take at most `kv_cache_bytes` (None: no bound): past it, running
        sequences are preempted (engine/preemption.py). `kv_events`: vLLM's
        `--kv-events-config`, the prefix cache's blocks published (engine/kv_events.py).
        `kv_layout`: "blocks" keeps each running row's KV in blocks of one pool
        (engine/blocks.py; where steps are packed), "rectangle" in rows x the longest row
        (engine/kv.py). `speculation`: drafts verified in the steps (engine/speculation.py;
        with blocks only)."""
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
        # Before the model loads, so a bad setting fails at once, naming itself; a cache
        # that can hold nothing would only cost look-ups.
        prefix_cache = PrefixCache(prefix_cache_bytes, prefix_block) if prefix_caching and prefix_cache_bytes else None
        configure_threads(torch_threads)
        self.name = name or model_name_or_path
        self.device = torch.device(resolve_device(device))
        self.max_running = max_running
        self.tokenizer, self.model = _load(model_name_or_path, self.device, dtype, trust_remote_code)
        # Through oneDNN with weights prepacked once (engine/onednn.py): each block's products
        # of one input as one product, then every other linear layer (the output head among them).
        self.fused = fuse_projections(self.model) if prepacked_linears and fused_projections else 0
        self.head_prepacked = prepacked_linears and prepack_output_head(self.model, PLAIN_BELOW)
        self.prepacked = prepack_linears(self.model, PLAIN_BELOW) if self.fused else 0
        # Prompts are tokenized on the event loop while the worker thread detokenizes; a
        # Rust tokenizer borrowed from two threads raises "Already borrowed" as soon as one
        # side changes its settings, so the detokenizer gets its own copy.
        self._detok = copy.deepcopy(self.tokenizer)
        self.max_context = max_context or _max_context(self.model.config, self.tokenizer)
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self._forward = CausalForward(self.model, self.name)
        # Its own tokenizer copy, for the same reason as the detokenizer's: compiled from
        # worker threads (engine/grammar.py).
        vocab, tokenizer = int(self.model.config.vocab_size), copy.deepcopy(self.tokenizer)
        self.grammars = GrammarCache(tokenizer, vocab, self.eos_token_ids)
        self._next = NextTokens(self, self._forward, self.grammars, max_running)
        uniform, token_bytes, self._empty_kv = self._forward.check_cache_layout(self.device)
        # Cells (rows x columns) the running rows' KV may take; the context capped to fit it.
        self.kv_budget, self.max_context = _kv_budget(kv_cache_bytes, token_bytes, self.max_context, self.name)
        if not uniform and prefix_cache is not None:
            log.warning("prefix caching off for %s: its attention layers differ in KV shape", self.name)
            prefix_cache = None
        self.kv_events = cache_events(kv_events, prefix_cache, self.device.type == "cuda", self.name)
        # Packed steps keep a chunk's KV in one buffer across layers, as the prefix cache
        # does, and need the model's attention to be SDPA (engine/packed.py).
        self.packs_steps = packed_steps and uniform and install(self.model) and self._forward.packed_works(self.device)
        # Decode steps' attention through engine/decode_attention.py's kernel (packed steps
        # only); None keeps SDPA.
        self._decode_kernel = kernel_for(self.model, native_attention and self.packs_steps)
        # Running rows' KV in blocks where steps are packed (only packed forwards read blocks).
        self.kv_layout = kv_layout if self.packs_steps else "rectangle"
        self.holds_rows = self.kv_layout == "blocks"  # `held` rows sit out steps (engine/blocks.py `holding`)
        self._paged_kernel = paged_attention_kernel() if self._decode_kernel is not None else None
        self._speculator = _speculator(speculation, self.kv_layout, self.name)
        self._step_drafts = None
        # The longest a step with drafts may take (Pricing.choose), set by the scheduler before
        # each iteration: its rows' inter-token targets and what an interactive prompt may
        # wait out (batcher/scheduler.py `_chunking`). None: no bound.
        self.step_ceiling: float | None = None
        self.held: frozenset[int] = frozenset()  # what steps leave out, KV kept (batcher/fair_steps.py)
        self._batch = self._new_batch()
        self._prefiller = Prefiller(self._forward, self.model.config, self.device, prefix_cache)
        self._sharing = PrefixSharing()  # prefixes running rows share, held once (engine/sharing.py)
        self._pending: PendingPrefills[RunningSequence] = PendingPrefills(self._prefiller, self._sharing)
        self._preemption = Preemption(self._pending, self._prefiller.prefix_cache, self._sharing)
        _log_loaded(self, prefix_cache)

    @classmethod
    def tiny_default(cls, cache_dir: str | None = None, **kwargs: Any) -> HFGenerationEngine:
        """The built-in "ferry-tiny-chat" model, built on first use."""
        from .tiny_chat import MODEL_NAME, ensure_tiny_chat

        kwargs.setdefault("name", MODEL_NAME)
        return cls(ensure_tiny_chat(cache_dir), **kwargs)

    @property
    def running(self) -> int:
        """Sequences the engine holds: decoding, and taken but still prefilling (`enqueue`)."""
        return len(self._batch.seqs) + len(self._pending)

    @property
    def prefilling(self) -> int:
        return len(self._pending)

    @property
    def prefill_backlog(self) -> int:  # prompt tokens taken, not yet prefilled (admission reads it)
        return self._pending.backlog

    @property
    def running_ids(self) -> list[int]:
        return [seq.seq_id for seq in self._batch.seqs] + self._pending.ids

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        return self._prefiller.cached_prefix(prompt_ids)

    def prefix_cache_stats(self) -> dict[str, int]:
        return self._prefiller.cache_stats()

    @torch.inference_mode()
    def add(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        """Prefill `requests` together; each yields its first token (or finishes at once).

        A prompt that is empty or leaves no room in max_context finishes with "length" and
        no tokens: the protocol has no per-item error, and it must not fail its batch mates.
        """
        fits = _admissible(requests, self.running_ids, self.max_running, self.max_context)
        admitted = [r for r, ok in zip(requests, fits, strict=True) if ok]
        refused = [r for r, ok in zip(requests, fits, strict=True) if not ok]
        outputs = {r.seq_id: StepOutput(r.seq_id, [], "", FINISH_LENGTH) for r in refused}
        if admitted:
            outputs.update((o.seq_id, o) for o in self._prefill(admitted))
        return [outputs[r.seq_id] for r in requests]

    def enqueue(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        """Take `requests` for token-budgeted prefill (`prefill`), computing nothing yet:
        one output each, with no token. A prompt that `add` would finish at once finishes
        here the same way; the others are prefilling until `prefill` gives their first token."""
        fits = _admissible(requests, self.running_ids, self.max_running, self.max_context)
        outputs = []
        for r, ok in zip(requests, fits, strict=True):
            if ok:
                self._pending.add(r.seq_id, r.prompt_ids, self._new_sequence(r))
                outputs.append(StepOutput(r.seq_id, [], ""))
            else:
                outputs.append(StepOutput(r.seq_id, [], "", FINISH_LENGTH))
        return outputs

    @torch.inference_mode()
    def prefill(self, budget: int | None = None, first: Sequence[int] = ()) -> PrefillStep:
        """Prefill chunks of the prompts taken by `enqueue`: at most `budget` prompt tokens
        in all (None: every one whole), the ids in `first` ahead of the rest. A prompt whose
        last chunk runs now yields its first token and joins the decoding rows.

        A forward that fails is retried on each half of its chunks, so only a prompt that
        fails alone fails (in `failed`, and dropped). If this raises, every sequence the
        engine held has failed and has been dropped.
        """
        result = PrefillStep()
        with self._all_fail_on_error():
            chunks = self._preemption.plan(self._batch, budget, first, result)
            self._run_chunks(chunks, result)
        return result

    @torch.inference_mode()
    def step_with_prefill(
        self, budget: int | None = None, first: Sequence[int] = ()
    ) -> tuple[list[StepOutput], PrefillStep]:
        """`step()` then `prefill(budget, first)`, their outputs, in one forward where the model
        allows (engine/packed.py); one that raises runs again as the two, isolating failures
        as they do. If this raises, every sequence the engine held has failed and is dropped."""
        if not self.packs_steps or not self._batch.seqs or not len(self._pending):
            return self.step(), self.prefill(budget, first)
        result = PrefillStep()
        with self._all_fail_on_error(), holding(self._batch, self.held):
            self._preemption.room_for_step(self._batch)
            chunks = self._preemption.plan(self._batch, budget, first, result)
            if not chunks or not self._batch.seqs:  # (every row may have yielded to the chunks)
                decoded = self._decode_step()
                self._run_chunks(chunks, result)
                return decoded, result
            try:
                logits = self._packed_forward(chunks)
            except Exception as exc:  # nothing advanced: run the two apart
                log.exception("packed step of %s failed; running its decode rows and chunks apart", self.name)
                self._decode_kernel = kernel_after(exc, self._decode_kernel, self.name)
                decoded = self._decode_step(packed=False)
                self._run_chunks(chunks, result)
                return decoded, result
            return self._packed_outputs(chunks, logits, result), result

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Decode one token for every running sequence.

        If this raises, every running sequence has failed and has been dropped (prefilling
        ones too): a forward that dies part-way leaves the per-layer caches at different lengths.
        """
        with self._all_fail_on_error(), holding(self._batch, self.held):
            return self._decode_step()

    @contextlib.contextmanager
    def _all_fail_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._batch = self._new_batch()
            self._pending.clear()
            self._sharing.clear()
            raise
        # Only at the end of the call: the room its joining prompts were given (and any
        # fallback's) counted on the prefixes held when its chunks were planned.
        self._sharing.let_go(self._batch.seqs)

    def _run_chunks(self, chunks: list[Chunk[RunningSequence]], result: PrefillStep) -> None:
        """Packed where no row decodes (no padding to the longest prompt, no copies into a
        padded batch and out); else, or if that raises, padded with failures isolated."""
        if chunks and self.packs_steps and not self._batch.seqs:
            try:
                logits = self._packed_forward(chunks)
            except Exception:  # nothing advanced
                log.exception("packed prefill of %s failed; running its chunks padded", self.name)
            else:
                self._packed_outputs(chunks, logits, result)
                return
        for group, done in self._pending.run_isolated(chunks, result):
            self._first_tokens(group, done, result)

    @torch.inference_mode()
    def remove(self, seq_ids: Sequence[int]) -> None:
        drop = set(seq_ids)
        self._pending.discard(drop)
        leaving = {i for i, seq in enumerate(self._batch.seqs) if seq.seq_id in drop}
        if leaving:
            self._batch.drop(leaving)
            self._sharing.let_go(self._batch.seqs)

    # -- internals -------------------------------------------------------------------

    def _first_tokens(self, chunks: list[Chunk[RunningSequence]], done: Prefilled, result: PrefillStep) -> None:
        """The prompts whose last chunk ran in `done` sample their first token and join the
        decoding rows (unless that token ends them)."""
        if not (finished := [row for row, c in enumerate(chunks) if c.completes]):
            return
        seqs = [c.pending.seq for c in chunks]
        tokens = self._next.sample(done.logits[finished], [seqs[row] for row in finished])
        alive = []
        for row, token in zip(finished, tokens, strict=True):
            out = self._next.first(seqs[row], *token, failed=result.failed)
            if out is None:  # failed alone (its prompt's log probabilities): dropped
                continue
            out.cached_tokens = chunks[row].pending.cached
            result.outputs.append(out)
            if out.finish_reason is None:
                alive.append(row)
        if alive:  # rows are right-aligned: the finished ones need their own columns only
            w = max(chunks[row].end for row in alive)
            layers = [(k[:, :, -w:], v[:, :, -w:]) for k, v in done.layers]
            layers, mask = self._take_prefixes(seqs, alive, [c.end for c in chunks], layers, done.mask[:, -w:])
            self._batch.admit(layers, mask, seqs, alive)

    def _prefill(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        done = self._prefiller.run([r.prompt_ids for r in requests])
        seqs = [self._new_sequence(r) for r in requests]
        tokens = self._next.sample(done.logits, seqs)
        outputs = []
        for seq, token in zip(seqs, tokens, strict=True):
            out = self._next.first(seq, *token)
            assert out is not None  # without `failed`, a failure raises (and `add` runs again apart)
            outputs.append(out)
        for out, cached in zip(outputs, done.cached, strict=True):
            out.cached_tokens = cached
        alive = [i for i, out in enumerate(outputs) if out.finish_reason is None]
        if alive:
            lengths = [len(r.prompt_ids) for r in requests]
            layers, mask = self._take_prefixes(seqs, alive, lengths, done.layers, done.mask)
            self._batch.admit(layers, mask, seqs, alive)
        return outputs

    def _new_batch(self) -> RunningBatch[RunningSequence] | PagedBatch[RunningSequence]:
        if self.kv_layout == "blocks":
            return PagedBatch(self.max_running, self.kv_budget)
        return RunningBatch(self.max_running, self.kv_budget)

    def _new_sequence(self, request: SequenceRequest) -> RunningSequence:
        return RunningSequence.of(request, self._detok, self.grammars)


def _log_loaded(engine: HFGenerationEngine, prefix_cache: PrefixCache | None) -> None:
    log.info(
        "loaded chat model %s on %s (max_context=%d, max_running=%d, KV %s, prefix cache %s, packed steps %s, "
        "output head %s, %d blocks' products fused)",
        engine.name,
        engine.device,
        engine.max_context,
        engine.max_running,
        f"at most {engine.kv_budget} tokens" if engine.kv_budget else "unbounded",
        f"{prefix_cache.max_bytes} bytes in {prefix_cache.block}-token blocks" if prefix_cache is not None else "off",
        "on" if engine.packs_steps else "off",
        "prepacked for oneDNN" if engine.head_prepacked else "as loaded",
        engine.fused,
    )


def _kv_budget(max_bytes: int | None, token_bytes: int, max_context: int, name: str) -> tuple[int | None, int]:
    """(token cells `max_bytes` of KV hold, None: no bound; the context, capped to one
    sequence of them, as vLLM caps its `max_model_len` to its KV cache)."""
    if not max_bytes:
        return None, max_context
    cells = max_bytes // token_bytes
    if cells < MIN_KV_TOKENS:
        raise ValueError(f"kv_cache_mb: {max_bytes / 2**20:g} MiB holds {cells} tokens of {name}: too few to run")
    if cells < max_context:
        log.warning(
            "kv_cache_mb: %g MiB holds %d tokens of %s (%d bytes each), less than its context (%d): "
            "sequences are capped at %d tokens; raise --kv-cache-mb for longer ones",
            max_bytes / 2**20,
            cells,
            name,
            token_bytes,
            max_context,
            cells,
        )
    return cells, min(cells, max_context)


def _admissible(
    requests: Sequence[SequenceRequest], running: list[int], max_running: int, max_context: int
) -> list[bool]:
    """Whether each request can run (a prompt that is empty or leaves no room in
    `max_context`, or asks no tokens, cannot: it finishes at once); caller bugs (a seq_id
    running or repeated, more than `max_running`) fail the whole call, before any state changes."""
    ids = [r.seq_id for r in requests]
    clash = set(ids) & set(running)
    if clash or len(set(ids)) != len(ids):
        raise ValueError(f"duplicate seq_id(s): {sorted(clash) or ids}")
    fits = [0 < len(r.prompt_ids) < max_context and r.params.max_tokens > 0 for r in requests]
    if len(running) + sum(fits) > max_running:
        raise ValueError(f"admitting {sum(fits)} would exceed max_running={max_running} ({len(running)} running)")
    return fits


def _load(path: str, device: torch.device, dtype: str | None, trust_remote_code: bool) -> tuple[Any, Any]:
    """(tokenizer, model) of a local path or hub id, the model on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype, device.type), trust_remote_code=trust_remote_code
    )
    model.to(device).eval()
    return tokenizer, model


def _max_context(config: Any, tokenizer: Any) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    # Tokenizers without a limit report a huge sentinel (int(1e30)).
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 1_000_000:
        return limit
    raise ValueError("cannot tell the model's context length; pass max_context=")


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _speculator(config: SpeculationConfig | None, kv_layout: str, name: str) -> Speculator | None:
    """Speculation where asked for; drafts are verified through blocks only (a rectangle
    row has one column a step)."""
    if config is None or not config.on:
        return None
    if kv_layout != "blocks":
        log.warning("speculation off for %s: it needs --kv-layout blocks and packed steps", name)
        return None
    return Speculator(config)
