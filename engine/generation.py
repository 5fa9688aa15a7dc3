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

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import PrefillStep, SamplingParams, SequenceRequest, StepOutput, TokenLogprob
from .chat_tokenizer import encode_chat
from .chunks import Chunk, PendingPrefills
from .detokenize import FINISH_COMPLETE, FINISH_LENGTH, FINISH_STOP, SequenceText
from .device import configure_threads, resolve_device, resolve_dtype
from .forward import CausalForward
from .grammar import GrammarCache, RowMasks
from .kv import RunningBatch
from .logits import LogitRules, apply_rules
from .prefill import Prefilled, Prefiller
from .prefix_cache import DEFAULT_BLOCK, PrefixCache
from .prompt_logprobs import prompt_logprobs
from .sampling import SequenceSampler, sample_next_tokens, token_logprobs

log = logging.getLogger("ferry.engine")

DEFAULT_PREFIX_CACHE_BYTES = 256 * 1024 * 1024


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
        prefix_caching: bool = True,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        prefix_block: int = DEFAULT_BLOCK,
    ) -> None:
        """`device` and `dtype` accept "auto" (see engine.device); `max_context` defaults
        to the config's max_position_embeddings. With `prefix_caching`, the KV of full
        `prefix_block`-token blocks of prompts is kept (up to `prefix_cache_bytes`; 0 is
        off) and reused by later prompts that start with the same tokens."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # Before the model loads, so a bad setting fails at once, naming itself.
        prefix_cache = PrefixCache(prefix_cache_bytes, prefix_block) if prefix_caching else None
        if prefix_cache_bytes == 0:
            prefix_cache = None  # a cache that can hold nothing would only cost look-ups
        configure_threads(torch_threads)
        self.name = name or model_name_or_path
        self.device = torch.device(resolve_device(device))
        self.max_running = max_running
        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_name_or_path,
            dtype=resolve_dtype(dtype, self.device.type),
            trust_remote_code=trust_remote_code,
        )
        # transformers wraps `to` with functools.wraps(nn.Module.to), which types it as unbound.
        self.model.to(self.device).eval()  # type: ignore[arg-type]
        # Prompts are tokenized on the event loop while the worker thread detokenizes; a
        # Rust tokenizer borrowed from two threads raises "Already borrowed" as soon as one
        # side changes its settings, so the detokenizer gets its own copy.
        self._detok = copy.deepcopy(self.tokenizer)
        self.max_context = max_context or _max_context(self.model.config, self.tokenizer)
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self._eos = sorted(self.eos_token_ids)
        self._forward = CausalForward(self.model, self.name)
        vocab = int(self.model.config.vocab_size)
        # Its own tokenizer copy, for the same reason as the detokenizer's: compiled from
        # worker threads (engine/grammar.py).
        self.grammars = GrammarCache(copy.deepcopy(self.tokenizer), vocab, self.eos_token_ids)
        self._masks: RowMasks | None = None
        self._batch: RunningBatch[_Sequence] = RunningBatch(max_running)
        if not self._forward.check_cache_layout(self.device) and prefix_cache is not None:
            log.warning("prefix caching off for %s: its attention layers differ in KV shape", self.name)
            prefix_cache = None
        self._prefiller = Prefiller(self._forward, self.model.config, self.device, prefix_cache)
        self._pending: PendingPrefills[_Sequence] = PendingPrefills(self._prefiller)
        log.info(
            "loaded chat model %s on %s (max_context=%d, max_running=%d, prefix cache %s)",
            self.name,
            self.device,
            self.max_context,
            self.max_running,
            f"{prefix_cache.max_bytes} bytes in {prefix_cache.block}-token blocks" if prefix_cache else "off",
        )

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
    def kv_tokens(self) -> int:
        """Token slots the running rows attend over (rows x length, padding included), and
        the prompt tokens prefilling sequences hold."""
        return self._batch.rows * self._batch.width + self._pending.kv_tokens

    @property
    def running_ids(self) -> list[int]:
        return [seq.seq_id for seq in self._batch.seqs] + self._pending.ids

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens a prefill would serve from the prefix cache now; changes nothing
        (read from the event loop while the worker thread may store: an estimate)."""
        cache = self._prefiller.prefix_cache
        return 0 if cache is None else cache.cached_blocks(prompt_ids) * cache.block

    def prefix_cache_stats(self) -> dict[str, int]:
        """queries and hits (prompt tokens looked up, and served from the cache), used_bytes,
        max_bytes, blocks; all 0 with prefix caching off."""
        cache = self._prefiller.prefix_cache
        if cache is None:
            return {"queries": 0, "hits": 0, "used_bytes": 0, "max_bytes": 0, "blocks": 0}
        return cache.stats()

    def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        return encode_chat(self.tokenizer, self.name, messages, tools, template_kwargs)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @torch.inference_mode()
    def add(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        """Prefill `requests` together; each yields its first token (or finishes at once).

        A prompt that is empty or leaves no room in max_context finishes with "length" and
        no tokens: the protocol has no per-item error, and it must not fail its batch mates.
        """
        self._check_admission(requests)
        admitted = [r for r in requests if self._fits(r)]
        outputs = {r.seq_id: StepOutput(r.seq_id, [], "", FINISH_LENGTH) for r in requests if not self._fits(r)}
        if admitted:
            outputs.update((o.seq_id, o) for o in self._prefill(admitted))
        return [outputs[r.seq_id] for r in requests]

    def enqueue(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        """Take `requests` for token-budgeted prefill (`prefill`), computing nothing yet:
        one output each, with no token. A prompt that `add` would finish at once finishes
        here the same way; the others are prefilling until `prefill` gives their first token."""
        self._check_admission(requests)
        outputs = []
        for r in requests:
            if self._fits(r):
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
        try:
            chunks = self._pending.plan(budget, first, result)
            for group, done in self._pending.run_isolated(chunks, result):
                self._first_tokens(group, done, result)
        except BaseException:
            self._batch = RunningBatch(self.max_running)
            self._pending.clear()
            raise
        return result

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Decode one token for every running sequence.

        If this raises, every running sequence has failed and has been dropped (prefilling
        ones too): a forward that dies part-way leaves the per-layer caches at different lengths.
        """
        try:
            return self._decode_step()
        except BaseException:
            self._batch = RunningBatch(self.max_running)
            self._pending.clear()
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
        tokens = self._sample(logits, batch.seqs)
        outputs = [self._advance(seq, *token) for seq, token in zip(batch.seqs, tokens, strict=True)]
        finished = {i for i, out in enumerate(outputs) if out.finish_reason}
        if finished:
            batch.drop(finished)
        return outputs

    @torch.inference_mode()
    def remove(self, seq_ids: Sequence[int]) -> None:
        drop = set(seq_ids)
        self._pending.discard(drop)
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
                f"admitting {admitted} would exceed max_running={self.max_running} ({self.running} running)"
            )

    def _first_tokens(self, chunks: list[Chunk[_Sequence]], done: Prefilled, result: PrefillStep) -> None:
        """The prompts whose last chunk ran in `done` sample their first token and join the
        decoding rows (unless that token ends them)."""
        finished = [row for row, c in enumerate(chunks) if c.completes]
        if not finished:
            return
        seqs = [c.pending.seq for c in chunks]
        tokens = self._sample(done.logits[finished], [seqs[row] for row in finished])
        alive = []
        for row, token in zip(finished, tokens, strict=True):
            out = self._advance(seqs[row], *token)
            out.cached_tokens = chunks[row].pending.cached
            result.outputs.append(out)
            if out.finish_reason is None:
                alive.append(row)
        if alive:  # rows are right-aligned: the finished ones need their own columns only
            w = max(chunks[row].end for row in alive)
            self._batch.admit([(k[:, :, -w:], v[:, :, -w:]) for k, v in done.layers], done.mask[:, -w:], seqs, alive)

    def _prefill(self, requests: Sequence[SequenceRequest]) -> list[StepOutput]:
        done = self._prefiller.run([r.prompt_ids for r in requests])
        seqs = [self._new_sequence(r) for r in requests]
        tokens = self._sample(done.logits, seqs)
        outputs = [self._advance(seq, *token) for seq, token in zip(seqs, tokens, strict=True)]
        for out, cached in zip(outputs, done.cached, strict=True):
            out.cached_tokens = cached
        alive = [i for i, out in enumerate(outputs) if out.finish_reason is None]
        if alive:
            self._batch.admit(done.layers, done.mask, seqs, alive)
        return outputs

    def _new_sequence(self, request: SequenceRequest) -> _Sequence:
        return _Sequence.of(request, self._detok, self.grammars)

    def _sample(self, logits: torch.Tensor, seqs: Sequence[_Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        """Each row's next token, and its log probabilities where asked: the logit rules
        (bias, min_tokens, penalties: engine/logits.py), constrained rows masked to what
        their grammar allows, then each row sampled with its own sampler."""
        apply_rules(logits, [s.rules for s in seqs], [len(s.tokens) for s in seqs], self._eos)
        matchers = [s.matcher for s in seqs]
        if any(m is not None for m in matchers):
            if self._masks is None:
                self._masks = RowMasks(max(self.max_running, len(seqs)), self.grammars.vocab_size)
            self._masks.apply(logits, matchers)
        samplers = [s.sampler for s in seqs]
        tokens = sample_next_tokens(logits, samplers)
        logprobs = token_logprobs(logits, samplers, tokens, [s.params.logprobs for s in seqs])
        return list(zip(tokens, logprobs, strict=True))

    def _advance(self, seq: _Sequence, token: int, logprob: TokenLogprob | None = None) -> StepOutput:
        """Account one new token: release text, decide whether the sequence finishes."""
        seq.tokens.append(token)
        if seq.rules is not None:
            seq.rules.observe(token)
        end = None
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            end = FINISH_STOP
        else:
            if seq.matcher is not None:
                # A token the mask allowed is always accepted; once the grammar admits nothing
                # more (the JSON value is closed) the row ends with this token, its text kept.
                seq.matcher.consume_token(token)
                if seq.matcher.is_stopped() or seq.matcher.is_error():
                    end = FINISH_COMPLETE
            if end is None and (len(seq.tokens) >= seq.params.max_tokens or seq.total_tokens >= self.max_context):
                end = FINISH_LENGTH
        logprobs = None if logprob is None else [logprob]
        prompt = seq.score_prompt(self._forward) if len(seq.tokens) == 1 else None
        if seq.text is None:
            return StepOutput(seq.seq_id, [token], "", end, logprobs=logprobs, prompt_logprobs=prompt)
        text, reason = seq.text.advance(token, end)
        return StepOutput(seq.seq_id, [token], text, reason, logprobs=logprobs, prompt_logprobs=prompt)


@dataclass(slots=True)
class _Sequence:
    seq_id: int
    params: SamplingParams
    prompt_len: int
    sampler: SequenceSampler
    text: SequenceText | None
    matcher: Any = None  # llguidance matcher of a constrained row
    rules: LogitRules | None = None  # bias, min_tokens, penalties (engine/logits.py)
    tokens: list[int] = field(default_factory=list)
    scored: list[int] | None = None  # its prompt, kept where its params ask for the prompt's log probabilities

    @classmethod
    def of(cls, request: SequenceRequest, detok: Any, grammars: GrammarCache) -> _Sequence:
        params = request.params
        return cls(
            seq_id=request.seq_id,
            params=params,
            prompt_len=len(request.prompt_ids),
            sampler=SequenceSampler.create(params.temperature, params.top_p, params.seed, params.top_k, params.min_p),
            rules=LogitRules.of(params, request.prompt_ids),
            # None: the front end detokenizes (an engine core sends token ids only)
            text=SequenceText(detok, request.prompt_ids, params.stop) if params.detokenize else None,
            matcher=grammars.matcher(params.json_schema) if params.json_schema is not None else None,
            scored=list(request.prompt_ids) if params.prompt_logprobs is not None else None,
        )

    def score_prompt(self, forward: CausalForward) -> list[TokenLogprob | None] | None:
        """Its prompt's log probabilities where its params ask (a forward of their own)."""
        if self.scored is None:
            return None
        return prompt_logprobs(forward, self.scored, self.params.prompt_logprobs or 0)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion; the cache holds all but the last completion token."""
        return self.prompt_len + len(self.tokens)


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
