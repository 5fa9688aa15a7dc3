"""The packed step of the generation engine (engine/generation.py): one forward over the
decode rows' next tokens and the prompt chunks of a step (engine/packed.py), and what it
yields: the rows' tokens, and each finished prompt's first token as it joins them."""

from __future__ import annotations

import torch

from .base import PrefillStep, StepOutput, TokenLogprob
from .chunks import Chunk, PendingPrefills
from .decode_attention import DecodeAttention
from .forward import CausalForward
from .kv import RunningBatch
from .packed import PrefixSharing, Sharing
from .sequence import NextTokens, RunningSequence

Chunks = list[Chunk[RunningSequence]]


class PackedSteps:
    """The engine's packed forwards and the accounting of their tokens (a mixin of
    `HFGenerationEngine`, whose state it reads)."""

    device: torch.device
    _batch: RunningBatch[RunningSequence]
    _pending: PendingPrefills[RunningSequence]
    _sharing: PrefixSharing
    _forward: CausalForward
    _decode_kernel: DecodeAttention | None
    _empty_kv: torch.Tensor
    _next: NextTokens

    def _decoded(self, tokens: list[tuple[int, TokenLogprob | None]]) -> list[StepOutput]:
        """The running rows' new tokens accounted; the rows that finish leave."""
        outputs = [self._next.advance(seq, *token) for seq, token in zip(self._batch.seqs, tokens, strict=True)]
        finished = {i for i, out in enumerate(outputs) if out.finish_reason}
        if finished:
            self._batch.drop(finished)
        return outputs

    def _packed_forward(self, chunks: Chunks, sharing: Sharing | None = None) -> torch.Tensor:
        """One forward over one token of every running row and every chunk: the logits of
        the rows, then of each chunk that ends its prompt; the batch advanced if it succeeds."""
        batch = self._batch
        if batch.seqs:
            batch.decode_mask()  # may move the columns: the plan reads them after
        sharing = sharing or self._sharing.plan(batch.seqs, batch.end, self.device)
        last = [(s.last_token, s.total_tokens - 1) for s in batch.seqs]
        input_ids, positions, plan, keep = self._pending.pack(batch, last, chunks, sharing, self.device, self._empty_kv)
        plan.kernel = self._decode_kernel
        logits = self._forward.packed(input_ids, positions, plan, keep)
        if batch.seqs:
            batch.advance()
        return logits

    def _packed_outputs(self, chunks: Chunks, logits: torch.Tensor, result: PrefillStep) -> list[StepOutput]:
        """The rows' tokens, then each finished prompt's first token (joining the rows)."""
        batch = self._batch
        completing = [c for c in chunks if c.completes]
        rows = batch.rows
        tokens = self._next.sample(logits, batch.seqs + [c.pending.seq for c in completing])
        self._pending.packed_done(chunks, result)
        decoded = self._decoded(tokens[:rows])
        for c, token in zip(completing, tokens[rows:], strict=True):
            out = self._next.advance(c.pending.seq, *token)
            out.cached_tokens = c.pending.cached
            result.outputs.append(out)
            if out.finish_reason is None:
                assert c.pending.buffer is not None
                batch.join(c.pending.buffer[:, :, :, : c.end], c.pending.seq)
        return decoded
