"""The steps of the generation engine (engine/generation.py): a decode step (packed where
it can be), one forward over the decode rows' next tokens and the prompt chunks of a step
(engine/packed.py), and what they yield: the rows' tokens, and each finished prompt's first
token as it joins them."""

from __future__ import annotations

import functools
import logging
import time

import torch

from .base import PrefillStep, StepOutput, TokenLogprob
from .blocks import PagedBatch
from .chunks import Chunk, PendingPrefills
from .decode_attention import DecodeAttention, KernelError, PagedAttention, kernel_after
from .forward import CausalForward
from .kv import RunningBatch
from .preemption import Preemption
from .sequence import NextTokens, RunningSequence
from .sharing import PrefixSharing, Sharing
from .speculation import Speculator, virtual_groups

log = logging.getLogger("ferry.engine")

Chunks = list[Chunk[RunningSequence]]


class PackedSteps:
    """The engine's steps and the accounting of their tokens (a mixin of
    `HFGenerationEngine`, whose state it reads)."""

    name: str
    device: torch.device
    _preemption: Preemption
    _batch: RunningBatch[RunningSequence] | PagedBatch[RunningSequence]
    _pending: PendingPrefills[RunningSequence]
    _sharing: PrefixSharing
    _forward: CausalForward
    _decode_kernel: DecodeAttention | None
    _paged_kernel: PagedAttention | None
    _empty_kv: torch.Tensor
    _next: NextTokens
    _speculator: Speculator | None
    _step_drafts: list[list[int]] | None  # the drafts the last packed forward fed (engine/speculation.py)
    step_ceiling: float | None  # seconds drafts may take a step to, the scheduler's (None: no bound)
    max_context: int
    packs_steps: bool

    @property
    def speculated(self) -> tuple[int, int, int]:
        """(draft tokens verified, of those taken, steps that verified any) so far."""
        spec = self._speculator
        return (0, 0, 0) if spec is None else (spec.drafted, spec.accepted, spec.steps)

    def _decoded(self, tokens: list[tuple[int, TokenLogprob | None]]) -> list[StepOutput]:
        """The running rows' new tokens accounted; the rows that finish leave."""
        outputs = [self._next.advance(seq, *token) for seq, token in zip(self._batch.seqs, tokens, strict=True)]
        return self._leave_finished(outputs)

    def _leave_finished(self, outputs: list[StepOutput]) -> list[StepOutput]:
        finished = {i for i, out in enumerate(outputs) if out.finish_reason}
        if finished:
            self._batch.drop(finished)
        return outputs

    def _decoded_runs(self, runs: list[list[int]], firsts: list[tuple[int, TokenLogprob | None]]) -> list[StepOutput]:
        """The running rows' new tokens, several a row where drafts were taken (each run
        starts with the row's sampled token, `firsts`, its log probability kept): accounted
        one by one up to the one that finishes the row (the rest dropped, as tokens never
        produced), one output a row; the rows that finish leave."""
        outputs = []
        for seq, run, first in zip(self._batch.seqs, runs, firsts, strict=True):
            steps = [self._next.advance(seq, *first)]
            for token in run[1:]:
                if steps[-1].finish_reason:
                    break
                steps.append(self._next.advance(seq, token))
            out = steps[0]
            if len(steps) > 1:
                out = StepOutput(
                    seq.seq_id,
                    [t for o in steps for t in o.token_ids],
                    "".join(o.text for o in steps),
                    steps[-1].finish_reason,
                )
            outputs.append(out)
        return self._leave_finished(outputs)

    def _decode_step(self, packed: bool = True) -> list[StepOutput]:
        """One token of every row: packed where rows share a prefix (engine/packed.py)."""
        batch = self._batch
        self._preemption.room_for_step(batch)
        if not batch.seqs:
            return []
        mask = batch.decode_mask()  # may move the columns: all below reads them after
        # Packed where rows share a prefix (their slots do not hold it: only the packed
        # attention reads it), or where the decode attention kernel runs (only a packed
        # forward's attention knows the rows apart); else one plain forward.
        sharing = self._sharing.plan(batch.seqs, batch.column, self.device) if self.packs_steps else ([], None)
        if sharing[0] or batch.paged or (packed and self.packs_steps and self._decode_kernel is not None):
            try:
                logits = self._packed_forward([], sharing)
            except Exception as exc:  # nothing advanced: run it plain, where that can be
                if batch.paged and self._paged_kernel is not None and isinstance(exc, KernelError):
                    log.error("paged decode attention kernel failed for %s; rows gathered from now on", self.name)
                    self._paged_kernel = None
                    return self._decode_step(packed)
                if sharing[0] or batch.paged:  # (only a packed forward reads them)
                    raise
                log.exception("packed decode step of %s failed; running it plain", self.name)
                self._decode_kernel = kernel_after(exc, self._decode_kernel, self.name)
            else:
                return self._packed_outputs([], logits, PrefillStep())
        assert isinstance(batch, RunningBatch)
        input_ids = torch.tensor([[s.last_token] for s in batch.seqs], device=self.device)
        positions = torch.tensor([[s.total_tokens - 1] for s in batch.seqs], device=self.device)
        logits, _ = self._forward(input_ids, positions, mask, batch.cache)
        batch.advance()
        return self._decoded(self._next.sample(logits, batch.seqs))

    def _packed_forward(self, chunks: Chunks, sharing: Sharing | None = None) -> torch.Tensor:
        """One forward over one token of every running row (and its drafts, where it
        speculates: engine/speculation.py) and every chunk: the logits of the rows' queries,
        then of each chunk that ends its prompt. The batch is advanced if it succeeds, or
        with drafts, by `_packed_outputs` once they are verified (`_step_drafts`)."""
        batch = self._batch
        drafts = None
        if batch.seqs:
            drafts = self._plan_drafts(chunks)
            if drafts is not None:
                assert isinstance(batch, PagedBatch)
                batch.decode_mask([len(d) for d in drafts])
            else:
                batch.decode_mask()  # may move the columns: the plan reads them after
        sharing = sharing or self._sharing.plan(batch.seqs, batch.column, self.device)
        last = []
        for s, d in zip(batch.seqs, drafts or [[]] * batch.rows, strict=True):
            last.append((s.last_token, s.total_tokens - 1))
            last += [(t, s.total_tokens + j) for j, t in enumerate(d)]
        if drafts is not None and sharing[0]:
            assert isinstance(batch, PagedBatch)
            sharing = (virtual_groups(sharing[0], batch.query_rows()), sharing[1])
        input_ids, positions, plan, keep = self._pending.pack(batch, last, chunks, sharing, self.device, self._empty_kv)
        plan.kernel, plan.paged_kernel = self._decode_kernel, self._paged_kernel
        began = time.perf_counter()
        logits = self._forward.packed(input_ids, positions, plan, keep)
        if self._speculator is not None:
            self._speculator.pricing.observe(int(input_ids.shape[1]), time.perf_counter() - began)
        self._step_drafts = drafts
        if batch.seqs and drafts is None:
            batch.advance()
        return logits

    def _plan_drafts(self, chunks: Chunks) -> list[list[int]] | None:
        """The rows' drafts this step (None: none), where the engine speculates and they fit."""
        batch = self._batch
        if self._speculator is None or not isinstance(batch, PagedBatch):
            return None
        drafts = self._speculator.plan(batch.seqs, sum(c.tokens for c in chunks), self.max_context, self.step_ceiling)
        # Room for every draft taken and for the prompts joining after them (their room was
        # planned on the rows' next token alone).
        joining = [len(c.pending.prompt) for c in chunks if c.completes]
        if drafts is None or not batch.step_fits([len(d) for d in drafts], joining):
            return None
        return drafts

    def _packed_outputs(self, chunks: Chunks, logits: torch.Tensor, result: PrefillStep) -> list[StepOutput]:
        """The rows' tokens, then each finished prompt's first token (joining the rows)."""
        batch = self._batch
        completing = [c for c in chunks if c.completes]
        rows = batch.rows
        joining = [c.pending.seq for c in completing]
        drafts, self._step_drafts = self._step_drafts, None
        if drafts is None:
            tokens = self._next.sample(logits, batch.seqs + joining)
        else:  # each row's first query, then the chunks'
            queries = sum(1 + len(d) for d in drafts)
            starts = [0]
            for d in drafts[:-1]:
                starts.append(starts[-1] + 1 + len(d))
            index = torch.tensor(starts + list(range(queries, int(logits.shape[0]))), device=logits.device)
            tokens = self._next.sample(logits.index_select(0, index), batch.seqs + joining)
        self._pending.packed_done(chunks, result)
        if drafts is None:
            decoded = self._decoded(tokens[:rows])
        else:
            assert self._speculator is not None and isinstance(batch, PagedBatch)
            runs = self._speculator.verify(logits[:queries], [t for t, _ in tokens[:rows]], drafts, batch.seqs)
            batch.advance([len(r) - 1 for r in runs])
            decoded = self._decoded_runs(runs, tokens[:rows])
        others = [*batch.seqs, *(p.seq for p in self._pending.waiting()), *joining]
        for c, token in zip(completing, tokens[rows:], strict=True):
            out = self._next.first(c.pending.seq, *token, failed=result.failed)
            if out is None:  # failed alone (its prompt's log probabilities): dropped
                continue
            out.cached_tokens = c.pending.cached
            result.outputs.append(out)
            if out.finish_reason is None:
                buffer = c.pending.buffer
                assert buffer is not None
                # A prefix its row references is held once, not copied into its slot.
                take = functools.partial(_first_columns, buffer)
                taken = self._sharing.take(c.pending.seq, take, lambda: others, c.pending.held)
                batch.join(buffer[:, :, :, taken : c.end], c.pending.seq)
        return decoded

    def _take_prefixes(
        self,
        seqs: list[RunningSequence],
        alive: list[int],
        lengths: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Rows `alive` of a prefill (its KV right-aligned in `layers`, rows `lengths` long)
        about to join the batch: each takes a held prefix where one serves (engine/sharing.py).
        The layers and mask are returned as wide as the joining rows' own parts, the prefix
        columns left in that width masked out (the mask a copy, where any is), so attention
        reads a prefix from the one held copy only and the slots hold none of it."""
        if not self.packs_steps:
            return layers, mask
        width, copied, own = mask.shape[1], False, 0
        others = [*self._batch.seqs, *(p.seq for p in self._pending.waiting()), *(seqs[row] for row in alive)]
        for row in alive:
            lo = width - lengths[row]

            def prefix(n: int, row: int = row, lo: int = lo) -> torch.Tensor:
                return torch.stack([torch.stack((k[row, :, lo : lo + n], v[row, :, lo : lo + n])) for k, v in layers])

            if taken := self._sharing.take(seqs[row], prefix, lambda: others):
                mask, copied = (mask, True) if copied else (mask.clone(), True)
                mask[row, lo : lo + taken] = 0
            own = max(own, lengths[row] - taken)
        if own == width:
            return layers, mask
        return [(k[:, :, -own:], v[:, :, -own:]) for k, v in layers], mask[:, -own:]


def _first_columns(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """A copy of a prompt buffer's KV of its first `n` tokens."""
    return buffer[:, :, :, :n].clone()
