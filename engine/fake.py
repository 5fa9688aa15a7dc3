"""Fake engines with a configurable cost model, for tests and benchmarks of the batcher
and gateway. Torch-free. Special inputs inject faults:

- text containing ``FAIL_ITEM``: that item fails alone (returned as an exception);
- ``FAIL_BATCH``: the whole engine call raises;
- ``OOM``: the call raises an out-of-memory error (the gateway splits and retries);
- ``HANG``: the call blocks for `hang_seconds`.

The fake embeddings are a function of the token ids, as a real model's are, and the fake
tokenizer is the same in every process: an engine core computes from the ids a front end
made exactly what the front end's own engine would. A word holding a fault marker becomes
a reserved id, so the fault crosses the process boundary with it.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from .base import ChatTemplateError, EmbeddingResult, GenerationEngine, PrefillStep, StepOutput
from .custom import Tensor
from .detokenize import FINISH_LENGTH, SequenceText


class _Clock(Protocol):
    """What the simulations need of a clock (batcher.clock.FakeClock in tests); the engine
    package does not import the batcher."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class FakeOOM(RuntimeError):
    def __init__(self) -> None:
        super().__init__("CUDA out of memory (simulated)")


FAULTS = ("FAIL_ITEM", "FAIL_BATCH", "OOM", "HANG")
_FAULT_IDS = 1 << 30  # word ids stay below; a word with markers is this plus their bits


@functools.lru_cache(maxsize=65536)  # a hash per word made the fake tokenizer far from zero-cost
def _word_id(word: str) -> int:
    bits = sum(1 << i for i, marker in enumerate(FAULTS) if marker in word)
    if bits:
        return _FAULT_IDS + bits
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % _FAULT_IDS


def fake_tokens(text: str, max_length: int = 512) -> list[int]:
    """The fake tokenizer: one id per word between [101] and [102], truncated."""
    return list(_fake_tokens(text, max_length))


@functools.lru_cache(maxsize=16384)  # the benchmark aid's tokenizer should cost next to nothing
def _fake_tokens(text: str, max_length: int) -> tuple[int, ...]:
    return tuple(([101] + [_word_id(w) for w in text.split()] + [102])[:max_length])


def _faults(ids: Sequence[int]) -> set[str]:
    bits = 0
    for i in ids:
        if i > _FAULT_IDS:
            bits |= i - _FAULT_IDS
    return {marker for i, marker in enumerate(FAULTS) if bits & (1 << i)}


def _vector_of(ids: Sequence[int], dim: int) -> np.ndarray:
    return _unit_vector(np.asarray(ids, dtype="<i8").tobytes(), dim)


@functools.lru_cache(maxsize=4096)
def _unit_vector(raw: bytes, dim: int) -> np.ndarray:
    """Remembered: a generator per item was the fake engine's whole cost (a seventh of an
    engine core's time under `wrk`), and the zero-cost engine is meant to cost nothing.
    Read-only, since every caller of the same ids shares it."""
    seed = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    v /= np.linalg.norm(v)
    v.flags.writeable = False
    return v


def fake_vector(text: str, dim: int, max_length: int = 512) -> np.ndarray:
    """The embedding the fake engine gives `text`."""
    return _vector_of(fake_tokens(text, max_length), dim)


class FakeEmbeddingEngine:
    """Implements `EmbeddingEngine`; latency = fixed + per_item * n (+ per_token * padded)."""

    def __init__(
        self,
        name: str = "fake-embed",
        dim: int = 8,
        fixed: float = 0.0,
        per_item: float = 0.0,
        per_token: float = 0.0,
        max_length: int = 512,
        hang_seconds: float = 30.0,
        vocab_size: int | None = None,
    ):
        self.name, self.dim, self.max_length = name, dim, max_length
        self.vocab_size = vocab_size or _FAULT_IDS  # ids a client may send (the fault markers lie above)
        self.fixed, self.per_item, self.per_token, self.hang_seconds = fixed, per_item, per_token, hang_seconds
        self.calls: list[int] = []  # batch sizes seen, in order
        self._texts: dict[tuple[int, ...], str] = {}  # what this instance tokenized, for logs

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        out = []
        for text in texts:
            ids = _fake_tokens(text, self.max_length)
            self._texts[ids] = text
            out.append(list(ids))
        return out

    def text_of(self, ids: Sequence[int]) -> str:
        """The text these ids came from, if this instance tokenized it, else the ids
        spelled out (an engine core sees only ids)."""
        return self._texts.get(tuple(ids)) or " ".join(map(str, ids))

    def cost(self, batch: Sequence[Sequence[int]]) -> float:
        longest = max((len(b) for b in batch), default=0)
        return self.fixed + self.per_item * len(batch) + self.per_token * longest * len(batch)

    def embed(self, batch: Sequence[Sequence[int]]) -> list[EmbeddingResult | Exception]:
        self.calls.append(len(batch))
        faults = [_faults(ids) for ids in batch]
        if any("HANG" in f for f in faults):
            time.sleep(self.hang_seconds)
        if any("FAIL_BATCH" in f for f in faults):
            raise RuntimeError("simulated engine failure")
        if any("OOM" in f for f in faults):
            raise FakeOOM()
        delay = self.cost(batch)
        if delay > 0:
            time.sleep(delay)
        return [
            ValueError("simulated failure of one input")
            if "FAIL_ITEM" in f
            else EmbeddingResult(_vector_of(ids, self.dim), len(ids))
            for f, ids in zip(faults, batch, strict=True)
        ]


class SimulatedExecutor:
    """An async `execute` for the batcher that spends simulated time on a clock.

    latency = fixed + per_item * n; `fail_items` fail alone, `fail_batches` (by call
    index) raise. Records every batch it ran, with the clock time it started.
    """

    def __init__(
        self,
        clock: _Clock,
        fixed: float = 0.010,
        per_item: float = 0.002,
        fail_items: set[Any] | None = None,
        fail_batches: set[int] | None = None,
    ):
        self.clock, self.fixed, self.per_item = clock, fixed, per_item
        self.fail_items = fail_items or set()
        self.fail_batches = fail_batches or set()
        self.runs: list[tuple[float, list[Any]]] = []

    async def __call__(self, payloads: list[Any]) -> list[Any]:
        index = len(self.runs)
        self.runs.append((self.clock.now(), list(payloads)))
        await self.clock.sleep(self.fixed + self.per_item * len(payloads))
        if index in self.fail_batches:
            raise RuntimeError(f"simulated failure of batch {index}")
        return [ValueError(f"bad item {p!r}") if p in self.fail_items else ("ok", p) for p in payloads]


class SimulatedEngineThread:
    """Stands in for the generation scheduler's engine thread in tests: each engine call costs
    fixed + per_row * running rows of simulated time on `clock`, then runs inline.

    `per_touched_row` (a FakeGenerationEngine): per_row for each row the call touched
    instead, decoded or prefilled (a prefill of one prompt costs one row, not every
    running one); the call then runs first and its result comes after the time it cost."""

    def __init__(
        self,
        clock: _Clock,
        engine: GenerationEngine,
        fixed: float = 0.010,
        per_row: float = 0.001,
        per_touched_row: bool = False,
    ):
        self.clock, self.engine, self.fixed, self.per_row = clock, engine, fixed, per_row
        self.per_touched_row = per_touched_row

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.per_touched_row:
            await self.clock.sleep(self.fixed + self.per_row * max(1, self.engine.running))
            return fn(*args)
        calls: list[tuple[str, list[int]]] = self.engine.calls  # type: ignore[attr-defined]
        before = len(calls)
        result = fn(*args)
        rows = sum(len(ids) for kind, ids in calls[before:] if kind != "remove")
        await self.clock.sleep(self.fixed + self.per_row * max(1, rows))
        return result


class FakeGenerationEngine:
    """Implements `GenerationEngine` without a model: sequence `s` emits the words
    "w<k>" for k = 0, 1, ... (token id k + 1, one word a token) until its max_tokens or a
    stop string, released as a real engine releases text (engine/detokenize.py).

    `calls` records every engine call as (kind, [seq_ids]) so tests can count steps and
    the rows active in each. `fail_prompts` (first prompt token) make `add` raise when
    such a prompt is in the group; `step_delay` makes each call block (wall clock).
    As the front end of a model in an engine core it is also the tokenizer (`decode`).

    `held`: the sequences the next steps leave out (as a real engine's KV in blocks holds
    them: they keep their place and emit nothing), never all of them.

    Its prefix cache is a count only: a prompt's `cached_tokens` are its leading whole
    blocks of `prefix_block` tokens (0: none) that an earlier `add` prefilled, never its
    last token, as engine/prefix_cache.py would serve them with room for everything.
    """

    def __init__(
        self,
        name: str = "fake-chat",
        max_context: int = 512,
        step_delay: float = 0.0,
        fail_prompts: set[int] | None = None,
        roles: Sequence[str] = ("system", "user", "assistant"),
        prefix_block: int = 16,
    ):
        self.name, self.max_context, self.step_delay = name, max_context, step_delay
        self.roles = frozenset(roles)
        self.fail_prompts = fail_prompts or set()
        self.prefix_block = prefix_block
        self.calls: list[tuple[str, list[int]]] = []
        self.held: frozenset[int] = frozenset()
        self._seqs: dict[int, dict] = {}
        self._blocks: set[int] = set()  # chained keys of the prompt blocks prefilled so far

    @property
    def running(self) -> int:
        return len(self._seqs)

    @property
    def kv_tokens(self) -> int:
        longest = max((len(s["prompt"]) + s["n"] for s in self._seqs.values()), default=0)
        return longest * len(self._seqs)

    def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        # The same refusal as the built-in tiny model's template, so tests over fake engines
        # meet what a real template does to roles it does not know.
        for m in messages:
            if m["role"] not in self.roles:
                raise ChatTemplateError(f"Unsupported role: {m['role']}")
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages) + "<assistant>"
        return self.encode_prompt(text)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text] or [0]  # no special tokens either way

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        """The generated words of token ids (a prompt id decodes to some word as well)."""
        return "".join(f"w{i - 1} " for i in ids)

    def add(self, requests) -> list:
        self.calls.append(("add", [r.seq_id for r in requests]))
        if any(r.prompt_ids and r.prompt_ids[0] in self.fail_prompts for r in requests):
            raise RuntimeError("simulated prefill failure")
        self._sleep()
        cached = [self._cached(r.prompt_ids) for r in requests]
        for r in requests:
            p = r.params
            text = SequenceText(self, r.prompt_ids, p.stop) if getattr(p, "detokenize", True) else None
            self._seqs[r.seq_id] = {"prompt": r.prompt_ids, "params": p, "n": 0, "text": text}
            self._remember(r.prompt_ids)
        outputs = [self._emit(r.seq_id) for r in requests]
        for out, n in zip(outputs, cached, strict=True):
            out.cached_tokens = n
        return outputs

    holds_rows = True

    def _stepping(self) -> list[int]:
        """The sequences a step runs: all but those held (all, were every one held)."""
        return [i for i in self._seqs if i not in self.held] or list(self._seqs)

    def step(self) -> list:
        ids = self._stepping()
        self.calls.append(("step", ids))
        self._sleep()
        return [self._emit(i) for i in ids]

    def remove(self, seq_ids) -> None:
        for i in seq_ids:
            self._seqs.pop(i, None)

    def _chain(self, prompt: Sequence[int], blocks: int) -> list[int]:
        b, key, keys = self.prefix_block, 0, []
        for i in range(blocks):
            key = hash((key, tuple(prompt[i * b : (i + 1) * b])))  # ints and tuples: the same in every process
            keys.append(key)
        return keys

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        return self._cached(prompt_ids)

    def _cached(self, prompt: Sequence[int]) -> int:
        if self.prefix_block < 1:
            return 0
        usable = self._chain(prompt, max(len(prompt) - 1, 0) // self.prefix_block)
        hit = next((i for i, key in enumerate(usable) if key not in self._blocks), len(usable))
        return hit * self.prefix_block

    def _remember(self, prompt: Sequence[int]) -> None:
        if self.prefix_block < 1:
            return
        if len(self._blocks) > 65536:  # bounded, as a real cache is; a fake need not be LRU
            self._blocks.clear()
        self._blocks.update(self._chain(prompt, len(prompt) // self.prefix_block))

    def _sleep(self) -> None:
        if self.step_delay > 0:
            time.sleep(self.step_delay)

    def _emit(self, seq_id: int) -> StepOutput:
        s = self._seqs[seq_id]
        s["n"] += 1
        token = s["n"]
        full = s["n"] >= s["params"].max_tokens or len(s["prompt"]) + s["n"] >= self.max_context
        end = FINISH_LENGTH if full else None
        text, finish = ("", end) if s["text"] is None else s["text"].advance(token, end)
        if finish is not None:
            del self._seqs[seq_id]
        return StepOutput(seq_id, [token], text, finish)


class FakeChunkingEngine(FakeGenerationEngine):
    """A FakeGenerationEngine that also prefills a budgeted chunk at a time, as
    engine/chunks.py does (a `ChunkingEngine`): `enqueue` takes prompts, `prefill(budget,
    first)` feeds at most `budget` of their tokens, `first` ahead, and a prompt fed whole
    gives its first token. `calls` records ("enqueue", ids) and ("prefill", ids fed), and
    `fed` the tokens each prefill call fed. A prompt starting with a `fail_prompts` token
    fails alone in `prefill` (its chunk), not in `enqueue`."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._waiting: dict[int, list] = {}  # seq id -> [request, tokens fed]
        self.fed: list[int] = []

    @property
    def running(self) -> int:
        return len(self._seqs) + len(self._waiting)

    @property
    def prefilling(self) -> int:
        return len(self._waiting)

    @property
    def prefill_backlog(self) -> int:
        return sum(len(r.prompt_ids) - fed for r, fed in self._waiting.values())

    def enqueue(self, requests) -> list:
        self.calls.append(("enqueue", [r.seq_id for r in requests]))
        outputs = []
        for r in requests:
            if not r.prompt_ids or r.params.max_tokens < 1:
                outputs.append(StepOutput(r.seq_id, [], "", FINISH_LENGTH))
            else:
                self._waiting[r.seq_id] = [r, 0]
                outputs.append(StepOutput(r.seq_id, [], ""))
        return outputs

    def prefill(self, budget: int | None = None, first: Sequence[int] = ()) -> PrefillStep:
        order = [i for i in dict.fromkeys(first) if i in self._waiting]
        order += [i for i in self._waiting if i not in order]
        left = budget if budget is not None else sum(len(w[0].prompt_ids) for w in self._waiting.values())
        done, fed = PrefillStep(), []
        for seq_id in order:
            if left <= 0:
                break
            request, so_far = self._waiting[seq_id]
            n = min(len(request.prompt_ids) - so_far, left)
            left -= n
            fed.append(seq_id)
            done.rows, done.computed_tokens = done.rows + 1, done.computed_tokens + n
            if request.prompt_ids[0] in self.fail_prompts:
                del self._waiting[seq_id]
                done.failed[seq_id] = RuntimeError("simulated prefill failure")
                continue
            self._waiting[seq_id][1] = so_far + n
            if so_far + n == len(request.prompt_ids):
                del self._waiting[seq_id]
                p = request.params
                text = SequenceText(self, request.prompt_ids, p.stop) if getattr(p, "detokenize", True) else None
                self._seqs[seq_id] = {"prompt": request.prompt_ids, "params": p, "n": 0, "text": text}
                done.outputs.append(self._emit(seq_id))
        done.padded_tokens = done.computed_tokens
        self.calls.append(("prefill", fed))
        self.fed.append(done.computed_tokens)
        self._sleep()
        return done

    def remove(self, seq_ids) -> None:
        super().remove(seq_ids)
        for i in seq_ids:
            self._waiting.pop(i, None)


class FakePackingEngine(FakeChunkingEngine):
    """A FakeChunkingEngine that also runs a decode step and a budgeted prefill as one call,
    as engine/packed.py does (a `PackingEngine`): `step_with_prefill` records ("packed",
    ids decoding) and then the step's and the prefill's own calls. `ceilings`: the
    `step_ceiling` the scheduler had set at each packed call (a speculating engine's bound
    on its drafts)."""

    packs_steps = True

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.step_ceiling: float | None = None
        self.ceilings: list[float | None] = []

    def step_with_prefill(self, budget: int | None = None, first: Sequence[int] = ()) -> tuple[list, PrefillStep]:
        self.calls.append(("packed", self._stepping()))
        self.ceilings.append(self.step_ceiling)
        return self.step(), self.prefill(budget, first)


class FakeCustomModel:
    """A custom model (engine/custom.py's contract) for tests, fuzzing and benchmarks, torch-free:
    a text and a vector in, the text's length, the vector's sum and the text upper-cased
    out. The markers above work on the text: FAIL_ITEM fails its row alone, FAIL_BATCH raises
    out of `predict`, OOM raises out-of-memory, HANG sleeps `hang_seconds`. `delay`: seconds
    each batch takes; `per_row`: and each row."""

    inputs: ClassVar = [Tensor("text", "BYTES"), Tensor("vector", "FP32", (-1,))]
    outputs: ClassVar = [Tensor("length", "INT64"), Tensor("sum", "FP32"), Tensor("upper", "BYTES")]

    def __init__(self, delay: float = 0.0, per_row: float = 0.0, hang_seconds: float = 0.0):
        self.delay, self.per_row, self.hang_seconds = delay, per_row, hang_seconds
        self.batches: list[int] = []  # the size of each batch it computed
        self.started: list[list[str]] = []  # the texts of each call, as it starts
        self.finished: list[list[str]] = []  # and as it ends
        self.loaded_on: tuple[str, str] | None = None

    def load(self, device: str, dtype: str) -> None:
        self.loaded_on = (device, dtype)

    def predict(self, batch: list[dict[str, Any]]) -> list[dict[str, Any] | Exception]:
        texts = [row["text"] if isinstance(row["text"], str) else "" for row in batch]
        self.started.append(texts)
        if any("FAIL_BATCH" in t for t in texts):
            raise RuntimeError("simulated model failure")
        if any("OOM" in t for t in texts) and len(batch) > 1:
            raise FakeOOM()
        if any("HANG" in t for t in texts):
            time.sleep(self.hang_seconds)
        self.batches.append(len(batch))
        if self.delay or self.per_row:
            time.sleep(self.delay + self.per_row * len(batch))
        out: list[dict[str, Any] | Exception] = []
        for text, row in zip(texts, batch, strict=True):
            if "FAIL_ITEM" in text or "OOM" in text:
                out.append(ValueError(f"simulated failure of {text!r}"))
                continue
            out.append({"length": len(text), "sum": float(np.sum(row["vector"])), "upper": text.upper()})
        self.finished.append(texts)
        return out

    def cost(self, row: dict[str, Any]) -> int:
        return 1 + len(row["text"]) // 8 if isinstance(row["text"], str) else 1
