"""Continuous (iteration-level) batching over any Hugging Face causal LM.

Running sequences share preallocated per-slot KV buffers (`_RunningBatch`), one row each,
right-aligned at a shared write column and left-padded. `add()` prefills new prompts as
their own batch (a DynamicCache) and copies their rows into free slots; `step()` decodes
one token for every row, writing one cache column in place; finished or cancelled rows
leave at once and their slots are reused. Because rows are left-padded and joined at different times, every forward gets
an explicit 2D 0/1 attention mask and explicit position ids (real tokens before the
fed one); transformers' defaults ignore padding and give silently wrong tokens.
"""
from __future__ import annotations

import copy
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import jinja2
import torch
from transformers.cache_utils import DynamicLayer

from .base import ChatTemplateError, SamplingParams, SequenceRequest, StepOutput
from .device import configure_threads, resolve_device, resolve_dtype
from .sampling import SequenceSampler, sample_next_tokens

log = logging.getLogger("ferry.engine")

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

# Prompt tokens decoded ahead of the completion so that tokenizers which drop or add a
# leading space at the start of a decode (SentencePiece) render the first word right.
_DETOKENIZE_CONTEXT = 5
# A UTF-8 character is at most 4 bytes; past this many undecodable tokens the bytes are
# genuinely invalid and are released as U+FFFD rather than held forever.
_MAX_HELD_TOKENS = 6


class HFGenerationEngine:
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
    ) -> None:
        """`device` and `dtype` accept "auto" (see engine.device); `max_context` defaults
        to the config's max_position_embeddings."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        configure_threads(torch_threads)
        self.name = name or model_name_or_path
        self.device = torch.device(resolve_device(device))
        self.max_running = max_running
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_name_or_path, trust_remote_code=trust_remote_code
        )
        self.model = AutoModelForCausalLM.from_pretrained(
            model_name_or_path,
            dtype=resolve_dtype(dtype, self.device.type),
            trust_remote_code=trust_remote_code,
        )
        self.model.to(self.device).eval()
        # Prompts are tokenized on the event loop while the worker thread detokenizes; a
        # Rust tokenizer borrowed from two threads raises "Already borrowed" as soon as one
        # side changes its settings, so the detokenizer gets its own copy.
        self._detok = copy.deepcopy(self.tokenizer)
        self.max_context = max_context or _max_context(self.model.config, self.tokenizer)
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self._cache_kwarg = _cache_kwarg(self.model)
        self._batch = _RunningBatch(max_running)
        self._check_cache_layout()
        log.info(
            "loaded chat model %s on %s (max_context=%d, max_running=%d)",
            self.name, self.device, self.max_context, self.max_running,
        )

    @classmethod
    def tiny_default(cls, cache_dir: str | None = None, **kwargs: Any) -> "HFGenerationEngine":
        """The built-in "ferry-tiny-chat" model, built on first use."""
        from .tiny_chat import MODEL_NAME, ensure_tiny_chat

        kwargs.setdefault("name", MODEL_NAME)
        return cls(ensure_tiny_chat(cache_dir), **kwargs)

    @property
    def running(self) -> int:
        return len(self._batch.seqs)

    @property
    def kv_tokens(self) -> int:
        """Token slots the running rows attend over: rows x length, padding included."""
        return self._batch.rows * self._batch.width

    @property
    def running_ids(self) -> list[int]:
        return [seq.seq_id for seq in self._batch.seqs]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ChatTemplateError(f"model {self.name!r} has no chat template")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or an undefined name it needs
            raise ChatTemplateError(exc.message or type(exc).__name__) from None
        return list(ids)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    @torch.inference_mode()
    def add(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        """Prefill `requests` together; each yields its first token (or finishes at once).

        A prompt that is empty or leaves no room in max_context finishes with "length" and
        no tokens: the protocol has no per-item error, and it must not fail its batch mates.
        """
        self._check_admission(requests)
        admitted = [r for r in requests if self._fits(r)]
        outputs = {
            r.seq_id: StepOutput(r.seq_id, [], "", FINISH_LENGTH)
            for r in requests
            if not self._fits(r)
        }
        if admitted:
            outputs.update((o.seq_id, o) for o in self._prefill(admitted))
        return [outputs[r.seq_id] for r in requests]

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Decode one token for every running sequence.

        If this raises, every running sequence has failed and has been dropped: a forward
        that dies part-way leaves the per-layer caches at different lengths.
        """
        try:
            return self._decode_step()
        except BaseException:
            self._batch = _RunningBatch(self.max_running)
            raise

    def _decode_step(self) -> list[StepOutput]:
        batch = self._batch
        if not batch.seqs:
            return []
        input_ids = torch.tensor([[s.last_token] for s in batch.seqs], device=self.device)
        positions = torch.tensor([[s.total_tokens - 1] for s in batch.seqs], device=self.device)
        mask = batch.decode_mask()
        logits, _ = self._forward(input_ids, positions, mask, batch.cache)
        batch.advance()
        tokens = sample_next_tokens(logits, [s.sampler for s in batch.seqs])
        outputs = [self._advance(seq, token) for seq, token in zip(batch.seqs, tokens)]
        finished = {i for i, out in enumerate(outputs) if out.finish_reason}
        if finished:
            batch.drop(finished)
        return outputs

    @torch.inference_mode()
    def remove(self, seq_ids: Sequence[int]) -> None:
        drop = set(seq_ids)
        leaving = {i for i, seq in enumerate(self._batch.seqs) if seq.seq_id in drop}
        if leaving:
            self._batch.drop(leaving)

    # -- internals -------------------------------------------------------------------

    def _fits(self, request: SequenceRequest) -> bool:
        n = len(request.prompt_ids)
        return 0 < n < self.max_context and request.params.max_tokens > 0

    def _check_admission(self, requests: Sequence[SequenceRequest]) -> None:
        """Caller bugs fail the whole call, before any state changes."""
        ids = [r.seq_id for r in requests]
        clash = set(ids) & set(self.running_ids)
        if clash or len(set(ids)) != len(ids):
            raise ValueError(f"duplicate seq_id(s): {sorted(clash) or ids}")
        admitted = sum(1 for r in requests if self._fits(r))
        if self.running + admitted > self.max_running:
            raise ValueError(
                f"admitting {admitted} would exceed max_running={self.max_running} "
                f"({self.running} running)"
            )

    def _prefill(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        input_ids, mask = _left_pad_prompts([r.prompt_ids for r in requests], self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp_(min=0)
        logits, cache = self._forward(input_ids, positions, mask, self._new_cache())
        seqs = [self._new_sequence(r) for r in requests]
        tokens = sample_next_tokens(logits, [s.sampler for s in seqs])
        outputs = [self._advance(seq, token) for seq, token in zip(seqs, tokens)]
        alive = [i for i, out in enumerate(outputs) if out.finish_reason is None]
        if alive:
            self._batch.admit(cache, mask, seqs, alive)
        return outputs

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
    ) -> tuple[torch.Tensor, Any]:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        cache = out.cache if self._cache_kwarg == "cache" else out.past_key_values
        return out.logits[:, -1, :], cache

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _new_sequence(self, request: SequenceRequest) -> "_Sequence":
        params = request.params
        return _Sequence(
            seq_id=request.seq_id,
            params=params,
            prompt_len=len(request.prompt_ids),
            sampler=SequenceSampler.create(params.temperature, params.top_p, params.seed),
            detokenizer=_IncrementalDetokenizer(
                self._detok, request.prompt_ids[-_DETOKENIZE_CONTEXT:]
            ),
            stops=_StopStringFilter(params.stop),
        )

    def _advance(self, seq: "_Sequence", token: int) -> StepOutput:
        """Account one new token: release text, decide whether the sequence finishes."""
        seq.tokens.append(token)
        if token in self.eos_token_ids:
            text, _ = seq.stops.feed(seq.detokenizer.flush(), final=True)
            return StepOutput(seq.seq_id, [token], text, FINISH_STOP)
        text, stopped = seq.stops.feed(seq.detokenizer.push(token))
        if stopped:
            return StepOutput(seq.seq_id, [token], text, FINISH_STOP)
        out_of_room = (
            len(seq.tokens) >= seq.params.max_tokens or seq.total_tokens >= self.max_context
        )
        if not out_of_room:
            return StepOutput(seq.seq_id, [token], text)
        tail, stopped = seq.stops.feed(seq.detokenizer.flush(), final=True)
        reason = FINISH_STOP if stopped else FINISH_LENGTH
        return StepOutput(seq.seq_id, [token], text + tail, reason)

    def _check_cache_layout(self) -> None:
        """Fail at load, not mid-traffic, if the merge recipe cannot apply to this model."""
        from transformers.cache_utils import DynamicLayer

        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            _, cache = self._forward(ids, torch.zeros_like(ids), mask, self._new_cache())
        unsupported = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
        if unsupported:
            raise NotImplementedError(
                f"model {self.name!r} uses cache layers {sorted(unsupported)}; only full-attention "
                "DynamicLayer caches can be merged across sequences"
            )


@dataclass(slots=True)
class _Sequence:
    seq_id: int
    params: SamplingParams
    prompt_len: int
    sampler: SequenceSampler
    detokenizer: "_IncrementalDetokenizer"
    stops: "_StopStringFilter"
    tokens: list[int] = field(default_factory=list)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion; the cache holds all but the last completion token."""
        return self.prompt_len + len(self.tokens)


class _SlotLayer(DynamicLayer):
    """One attention layer's keys and values in preallocated per-slot buffers.

    Buffers are [slots, kv_heads, capacity, head_dim]; running row i lives in slot i and
    all rows share one write column (`owner.end`), so a decode step writes one column in
    place and attends over a view of columns [start, end] instead of concatenating the
    whole cache, as DynamicLayer does every step.
    """

    def __init__(self, owner: "_RunningBatch", keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("slot buffers are allocated by the running batch")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        rows, width = key_states.shape[0], key_states.shape[-2]
        start, end = self.owner.start, self.owner.end
        self.keys[:rows, :, end : end + width] = key_states
        self.values[:rows, :, end : end + width] = value_states
        return self.keys[:rows, :, start : end + width], self.values[:rows, :, start : end + width]

    def get_seq_length(self) -> int:
        return self.owner.end - self.owner.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


class _RunningBatch:
    """Running sequences in preallocated KV slots.

    Row i of every buffer belongs to `seqs[i]`; rows are kept dense (a leaving row's slot
    is filled by the last row), so the forward sees rows [0, n). Columns [start, end) hold
    the cached tokens, rows right-aligned at `end` and left-padded with mask 0. Joining
    copies only the newcomers' prefill cache, leaving copies only the rows that move, and
    the buffers are compacted to the left (or grown) when the write column reaches the
    end: amortised, nothing is copied per step.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.seqs: list[_Sequence] = []
        self.start = self.end = 0
        self.mask: torch.Tensor | None = None  # [slots, capacity] int64, 1 = real token
        self.cache: Any = None  # transformers Cache over _SlotLayer views

    @property
    def rows(self) -> int:
        return len(self.seqs)

    @property
    def width(self) -> int:
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def decode_mask(self) -> torch.Tensor:
        """Open the next column for every row; the 2D mask for a one-token forward."""
        self._ensure_room(self.width + 1)
        self.mask[: self.rows, self.end] = 1
        return self.mask[: self.rows, self.start : self.end + 1]

    def advance(self) -> None:
        """The forward wrote column `end` of every row."""
        self.end += 1

    def admit(self, cache: Any, mask: torch.Tensor, seqs: list[_Sequence], alive: list[int]) -> None:
        """Copy the alive rows of a prefill (its own left-padded cache) into free slots."""
        if len(alive) < len(seqs):
            index = torch.tensor(alive, device=mask.device)
            mask = mask.index_select(0, index)
            layers = [(l.keys.index_select(0, index), l.values.index_select(0, index)) for l in cache.layers]
        else:
            layers = [(l.keys, l.values) for l in cache.layers]
        seqs = [seqs[i] for i in alive]
        width = mask.shape[1]
        if self.mask is None:
            self._allocate(layers, max(256, 2 * width), mask.dtype)
        if not self.seqs:
            self.start = self.end = 0
        # Newcomers end at column `end` like everyone else: the span after joining is the
        # wider of the two, plus one column for the next decode step.
        span = max(self.width, width)
        if span + 1 > self.capacity:
            self._grow(span + 1)
        if self.end < width or self.end + 1 > self.capacity:
            self._move_columns(span - self.width)
        lo, hi, first = self.end - width, self.end, self.rows
        last = first + len(seqs)
        self.mask[first:last].zero_()
        self.mask[first:last, lo:hi] = mask
        for layer, (keys, values) in zip(self.cache.layers, layers):
            layer.keys[first:last, :, lo:hi] = keys
            layer.values[first:last, :, lo:hi] = values
        self.start = min(self.start, lo) if self.seqs else lo
        self.seqs.extend(seqs)

    def drop(self, leaving: set[int]) -> None:
        """Remove the rows at indices `leaving`; later rows fill their slots."""
        keep = self.rows - len(leaving)
        holes = [i for i in sorted(leaving) if i < keep]
        movers = [i for i in range(keep, self.rows) if i not in leaving]
        if holes:
            dst = torch.tensor(holes, device=self.mask.device)
            src = torch.tensor(movers, device=self.mask.device)
            cols = slice(self.start, self.end)
            for layer in self.cache.layers:
                layer.keys[dst, :, cols] = layer.keys[src, :, cols]
                layer.values[dst, :, cols] = layer.values[src, :, cols]
            self.mask[dst, cols] = self.mask[src, cols]
            for hole, mover in zip(holes, movers):
                self.seqs[hole] = self.seqs[mover]
        del self.seqs[keep:]
        if not self.seqs:
            self.start = self.end = 0
            return
        # Padding columns nobody needs any more stop costing attention.
        used = self.mask[:keep, self.start : self.end].any(dim=0)
        self.start += int(used.int().argmax())

    # -- buffers ---------------------------------------------------------------------

    def _allocate(self, layers: list[tuple[torch.Tensor, torch.Tensor]], capacity: int, dtype: torch.dtype) -> None:
        from transformers.cache_utils import Cache

        slot_layers = [
            _SlotLayer(self, _slot_buffer(k, self.slots, capacity), _slot_buffer(v, self.slots, capacity))
            for k, v in layers
        ]
        self.mask = torch.zeros((self.slots, capacity), dtype=dtype, device=layers[0][0].device)
        self.cache = Cache(layers=slot_layers)

    def _ensure_room(self, needed: int) -> None:
        """Make columns [start, start + needed) fit: compact to the left, else grow.

        Compaction only when it frees at least a quarter of the buffer, so its copy is
        amortised over that many steps; otherwise double.
        """
        if self.start + needed <= self.capacity:
            return
        if needed <= self.capacity - self.capacity // 4:
            self._move_columns(0)
        else:
            self._grow(needed)

    def _grow(self, needed: int) -> None:
        capacity = max(2 * self.capacity, needed + needed // 2)
        width, cols = self.width, slice(self.start, self.end)
        grown_mask = self.mask.new_zeros((self.slots, capacity))
        grown_mask[:, :width] = self.mask[:, cols]

        def regrown(old: torch.Tensor) -> torch.Tensor:
            new = _slot_buffer(old, self.slots, capacity)
            new[:, :, :width] = old[:, :, cols]
            return new

        grown = [(regrown(layer.keys), regrown(layer.values)) for layer in self.cache.layers]
        # Allocated and copied first: an OOM above leaves the batch as it was.
        for layer, (keys, values) in zip(self.cache.layers, grown):
            layer.keys, layer.values = keys, values
        self.mask = grown_mask
        self.start, self.end = 0, width

    def _move_columns(self, new_start: int) -> None:
        """Shift the cached columns to begin at `new_start`, leaving one free column after."""
        width, rows = self.width, self.rows
        if new_start + width + 1 > self.capacity:
            raise AssertionError("caller must ensure capacity before moving columns")
        if new_start != self.start and rows:
            src, dst = slice(self.start, self.end), slice(new_start, new_start + width)
            # Every copy first (an OOM here changes nothing), then the writes, which do not
            # allocate: a half-moved cache would give running rows misaligned keys.
            moved = [(l.keys[:rows, :, src].clone(), l.values[:rows, :, src].clone()) for l in self.cache.layers]
            mask = self.mask[:rows, src].clone()
            for layer, (keys, values) in zip(self.cache.layers, moved):
                layer.keys[:rows, :, dst] = keys
                layer.values[:rows, :, dst] = values
            self.mask[:rows].zero_()
            self.mask[:rows, dst] = mask
        self.start, self.end = new_start, new_start + width


class _IncrementalDetokenizer:
    """Turns a token stream into text deltas, holding back incomplete UTF-8 characters.

    Decodes a short window (already-released context + new tokens) and emits the part
    beyond the context, so byte-level and SentencePiece tokenizers both render spaces and
    multi-byte characters split across tokens correctly.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(context)
        self._prefix = 0  # window start
        self._read = len(self._ids)  # end of text already released

    def push(self, token: int) -> str:
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        incomplete = len(text) <= len(prefix_text) or text.endswith("\ufffd")
        if incomplete and held < _MAX_HELD_TOKENS:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Everything not yet released, partial characters included."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )


class _StopStringFilter:
    """OpenAI stop semantics over a text stream: output ends before the first stop
    string, which is not included; text that may be the start of one is held back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(releasable text, whether a stop string was hit)."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        hold = 0 if final else self._partial_stop_suffix(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def _partial_stop_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def _left_pad_prompts(prompts: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    # The pad id is never attended to; 0 is merely a valid embedding index.
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def _slot_buffer(like: torch.Tensor, slots: int, capacity: int) -> torch.Tensor:
    """Zeroed [slots, kv_heads, capacity, head_dim] buffer shaped after `like` ([rows, kv_heads, seq, head_dim])."""
    return like.new_zeros((slots, like.shape[1], capacity, like.shape[3]))


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


def _cache_kwarg(model: Any) -> str:
    """transformers 5.x renamed `past_key_values` to `cache` (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
