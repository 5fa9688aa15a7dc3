"""Constrained decoding: JSON schemas compiled to token masks with llguidance.

A constraint travels as the canonical JSON text of a JSON schema (`canonical_schema`):
`response_format` json_schema and json_object and forced tool calls all reduce to one.
`GrammarCache` compiles each distinct text once (LRU) against the model's tokenizer;
callers compile ahead, off the decode loop (the gateway in a worker thread before it
submits, an engine core before it hands a prompt to its batcher), so the engine's
`add()` only copies a compiled matcher. Each running row owns its matcher; a decode step
fills one bitmask row per constrained row and applies it to that row's logits only, so
constrained and free rows share a batch and free rows' logits are untouched.

Output is compact JSON (no free whitespace: a model that may emit whitespace forever
could otherwise never finish), object properties in the schema's order.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Compact output, so the answer ends when the schema is satisfied (see module doc).
GUIDANCE_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
DEFAULT_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A schema that cannot be compiled: invalid JSON Schema or a keyword the grammar
    library does not support. `path` is a JSON pointer into the schema ("" = the root)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message, self.path = message, path


# A constraint that lets a thinking row reason first (gateway/translate/reasoning.py):
# `{AFTER_THINKING: "</think>", "schema": {...}}`, free text up to the marker, then the schema.
AFTER_THINKING = "x-ferry-after-thinking"


def after_thinking(schema_text: str, end: str = "</think>") -> str:
    """The constraint of `schema_text` applied to the answer after a thinking section."""
    return canonical_schema({AFTER_THINKING: end, "schema": json.loads(schema_text)})


def canonical_schema(schema: Any) -> str:
    """The one text of a schema: the cache key and what crosses to an engine core. Keys
    keep their order: the output writes properties in the schema's order."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def check_schema(schema: Any) -> None:
    """Raise GrammarError (with the path) if `schema` is not a valid JSON Schema document."""
    from jsonschema import Draft202012Validator, SchemaError  # type: ignore[import-untyped]

    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object or a boolean")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise GrammarError(exc.message, _pointer(exc.path)) from None
    except Exception as exc:  # a meta-schema it cannot even check against
        raise GrammarError(f"{type(exc).__name__}: {exc}") from None


def _pointer(parts: Sequence[Any]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _locate(schema: Any, message: str) -> str:
    """Best guess at where in `schema` llguidance's error points (its messages carry no
    path): the first node, depth first, holding a key or value the message quotes."""
    words = set(re.findall(r'"([^"]+)"', message)) | set(re.findall(r"'([^']+)'", message))
    words |= set(re.findall(r"(?:format|type): (\S+)", message))

    def walk(node: Any, path: list[Any]) -> list[Any] | None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in words or (isinstance(v, str) and (v in words or v.lstrip("#") in words)):
                    return path
            for k, v in node.items():
                found = walk(v, [*path, k])
                if found is not None:
                    return found
        elif isinstance(node, list):
            for i, v in enumerate(node):
                found = walk(v, [*path, i])
                if found is not None:
                    return found
        return None

    return _pointer(walk(schema, []) or [])


class GrammarCache:
    """Compiled schemas for one tokenizer, shared by every row. Thread-safe: the gateway
    compiles from worker threads while the engine thread takes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], size: int = DEFAULT_CACHE_SIZE):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._size = size
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.hits = self.misses = 0

    def compile(self, schema_text: str) -> Any:
        """The compiled matcher of a canonical schema text (from the cache when there).
        Raises GrammarError for a schema that cannot be compiled (errors are not cached)."""
        with self._lock:
            found = self._compiled.get(schema_text)
            if found is not None:
                self._compiled.move_to_end(schema_text)
                self.hits += 1
                return found
        compiled = self._compile(schema_text)
        with self._lock:
            self.misses += 1
            self._compiled[schema_text] = compiled
            while len(self._compiled) > self._size:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, schema_text: str) -> Any:
        """A fresh matcher for one row (a copy of the compiled one)."""
        return self.compile(schema_text).deep_copy()

    def __contains__(self, schema_text: str) -> bool:
        with self._lock:
            return schema_text in self._compiled

    def _compile(self, schema_text: str) -> Any:
        from llguidance import LLMatcher

        schema = json.loads(schema_text)
        end = None
        if isinstance(schema, dict) and AFTER_THINKING in schema:
            end, schema = schema[AFTER_THINKING], schema["schema"]
        check_schema(schema)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**GUIDANCE_OPTIONS, **schema.get("x-guidance", {})}}
        try:
            if end is None:
                grammar = LLMatcher.grammar_from_json_schema(schema)
            else:  # any text up to the end of the thinking section (lazily: its first end), then the schema
                grammar = LLMatcher.grammar_from_lark(
                    f"start: think /[ \\t\\r\\n]*/ answer\n"
                    f"think[lazy]: /(?s:.*)/ {json.dumps(end)}\n"
                    f"answer: %json {json.dumps(schema)}\n"
                )
        except Exception as exc:  # llguidance raises ValueError; anything else is its refusal too
            raise GrammarError(str(exc), _locate(schema, str(exc))) from None
        matcher = LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            message = matcher.get_error()
            raise GrammarError(message, _locate(schema, message))
        return matcher

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                # ~1 s for a real vocabulary: built on the first schema, not at load.
                if hasattr(self._tokenizer, "backend_tokenizer"):  # transformers' (the engine's)
                    import llguidance.hf

                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                    )
                else:  # a `tokenizers.Tokenizer` (a front end's, without transformers)
                    from llguidance import LLTokenizer

                    self._ll_tokenizer = LLTokenizer(
                        self._tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self._eos
                    )
            return self._ll_tokenizer


class RowMasks:
    """The decode step's token masks: one bitmask row per constrained row (32 tokens per
    int32, as llguidance writes them), applied to those rows' logits only. Written by
    hand rather than with llguidance.torch, which imports torch.compile's machinery."""

    def __init__(self, rows: int, vocab_size: int) -> None:
        import torch

        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._bitmask = torch.full((rows, self._words), -1, dtype=torch.int32)
        self._bits = torch.arange(32, dtype=torch.int32)

    def apply(self, logits: torch.Tensor, matchers: Sequence[Any]) -> None:
        """Mask `logits` ([rows, vocab]) in place where `matchers[i]` is not None."""
        import torch

        constrained = [i for i, m in enumerate(matchers) if m is not None]
        if not constrained:
            return
        if len(constrained) > self._bitmask.shape[0]:
            self._bitmask = torch.full((len(constrained), self._words), -1, dtype=torch.int32)
        nbytes = self._words * 4
        for j, i in enumerate(constrained):
            row = self._bitmask[j]
            matchers[i].unsafe_compute_mask_ptr(row.data_ptr(), nbytes)
        # The packed words cross to the logits' device (32x less than a bool mask) and are
        # unpacked there.
        device = logits.device
        words = self._bitmask[: len(constrained)].to(device)
        allowed = ((words.unsqueeze(2) >> self._bits.to(device)) & 1).reshape(len(constrained), -1).bool()
        vocab = logits.shape[1]
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer: the rest is never allowed
            allowed = torch.cat([allowed, allowed.new_zeros((len(constrained), vocab - allowed.shape[1]))], dim=1)
        rows = torch.tensor(constrained, device=device)
        sub = logits.index_select(0, rows)
        sub.masked_fill_(~allowed[:, :vocab], float("-inf"))
        logits[rows] = sub
