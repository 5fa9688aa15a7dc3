"""The front-end half of an embeddings engine whose model runs in an engine core
(`ferry serve --engine-cores`): its name, size and tokenizer, never its weights. The
gateway's translation (gateway/translate/embeddings.py) needs no more than this.

A model's `tokenizer.json` is read with the `tokenizers` library alone: transformers
imports torch, which a front end has no use for (seconds at start, hundreds of MB). A model
without one falls back to transformers' AutoTokenizer, as the engine itself loads it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class EmbeddingTokenizer:
    def __init__(self, path: str, *, name: str, dim: int, max_length: int, vocab_size: int | None = None):
        """`name`, `dim`, `max_length` and `vocab_size` are what the core's engine reports of
        itself (no `vocab_size`: inputs given as token ids are refused)."""
        self.name, self.dim, self.max_length, self.vocab_size = name, dim, max_length, vocab_size
        self._fast = None
        self._auto = None
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            from tokenizers import Tokenizer

            # The engine's call (HFEmbeddingEngine.tokenize) pads nothing and truncates to
            # max_length, whatever the file's own settings say.
            self._fast = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
            self._fast.no_padding()
            self._fast.enable_truncation(max_length)
        else:
            from transformers import AutoTokenizer

            self._auto = AutoTokenizer.from_pretrained(path)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=True)]
        assert self._auto is not None  # one of the two is set in __init__
        enc = self._auto(list(texts), truncation=True, max_length=self.max_length, add_special_tokens=True)
        return enc["input_ids"]
