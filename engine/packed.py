"""One forward for a whole engine step: the decode rows and the prompt chunks of the step
packed into one sequence of tokens (vLLM's mixed batches), so a step reads the model's
weights once, not once for the decode rows and again for the chunks.

Only attention needs to know where one sequence ends and the next begins; every other
layer works token by token. The tokens go in as one row, [decode rows' last tokens][chunk
1][chunk 2]..., each with its own position id; the attention layers' cache is a
`PackedCache`, which writes each token's keys and values where its sequence keeps them (a
decode row's slot column in the running batch, a chunk's columns in its prompt's own
buffer), and the attention function `packed_attention` attends per segment: the decode
rows together as in a decode step, each chunk causally over its prompt so far, both
through transformers' own SDPA attention function, so grouped-query attention and scaling
are the model's. The function is registered as the attention implementation "ferry" and
behaves exactly as "sdpa" in every other forward (`install`); the segments travel to it
as the forward's `ferry_plan` keyword, which transformers passes down to attention.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .blocks import PagedBatch, gathered
from .decode_attention import DecodeAttention, KernelError, PagedAttention

log = logging.getLogger("ferry.engine")
IMPLEMENTATION = "ferry"  # the attention implementation name models are switched to


@dataclass(slots=True)
class Segment:
    """A prompt chunk in a packed forward: tokens [offset, offset + tokens) of the packed
    row feed prompt positions [start, start + tokens); `kv` is the prompt's buffer
    [layers, 2, kv_heads, >= start + tokens, head_dim], its first `start` columns known."""

    offset: int
    start: int
    tokens: int
    kv: torch.Tensor
    mask: torch.Tensor | None = None  # its attention mask, built by the first layer for all
    # A prefix held once for running rows (engine/sharing.py) that gives the prompt's first
    # tokens, [layers, 2, kv_heads, tokens, head_dim]: `kv` has none of those columns filled.
    held: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.tokens


@dataclass(slots=True)
class SharedPrefix:
    """Decode rows `rows` (indices) start with the same prefix, whose keys and values `kv`
    [layers, 2, kv_heads, tokens, head_dim] are held once (engine/sharing.py), not in the
    rows' slots: each row's slot holds only the columns after it."""

    rows: torch.Tensor
    kv: torch.Tensor


@dataclass(slots=True)
class PackedPlan:
    """Where each token of a packed forward belongs: the first `rows` tokens are one token
    of each running row (written at column `column` of the running batch's `slots`, rows
    attending over columns [lo, column] under `decode_mask` [rows, 1, 1, width], True =
    real), then the chunks."""

    rows: int
    slots: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, the running batch's keys and values buffers
    lo: int
    column: int
    decode_mask: torch.Tensor | None
    segments: list[Segment]
    # Shared-prefix attention (`shared_prefix_attention`): the groups, and each decode row's
    # first column of its own part (after its group's prefix, or its first token).
    shared: list[SharedPrefix] = field(default_factory=list)
    own_start: torch.Tensor | None = None
    # The decode rows through engine/decode_attention.py's kernel where the engine has it:
    # it reads `row_mask` [rows, width] (the running batch's int64 mask over [lo, column]).
    kernel: DecodeAttention | None = None
    row_mask: torch.Tensor | None = None
    held_chunks: list[HeldChunks] | None = None  # built by the first layer (`held_chunks`)
    own_bias: torch.Tensor | None = None  # the decode rows' own parts' mask, built by the first layer
    # The decode rows' KV in blocks (engine/blocks.py) instead of `slots`: written through
    # it, read through each row's block table (`paged_rows_attention`).
    paged: PagedBatch | None = None
    paged_kernel: PagedAttention | None = None

    @property
    def layers(self) -> int:
        if self.paged is not None and self.paged.pool is not None:
            return int(self.paged.pool.shape[0])
        return len(self.slots) if self.slots else int(self.segments[0].kv.shape[0])

    def chunk_mask(self, s: Segment, device: torch.device) -> torch.Tensor:
        """[1, 1, tokens, end] True where a chunk's token may attend: its prompt up to itself
        (built once per forward, not once per layer)."""
        if s.mask is None:
            query = torch.arange(s.start, s.end, device=device).unsqueeze(1)
            s.mask = (torch.arange(s.end, device=device).unsqueeze(0) <= query)[None, None]
        return s.mask


@dataclass(slots=True, eq=False)
class HeldChunks:
    """Chunks whose prompts start with one held prefix `kv` [layers, 2, kv_heads, tokens,
    head_dim]: their tokens (`index`, their places in the packed row, in segment order)
    meet the prefix's keys in one product, and their own columns (each prompt's after the
    prefix, its chunks' included) under `mask` [tokens, own columns], True where a token
    may attend: its own prompt's, up to itself."""

    kv: torch.Tensor
    segments: list[Segment]
    index: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor | None = None  # the mask as the scores' bias, once per query head of a KV head


def held_chunks(plan: PackedPlan, device: torch.device) -> list[HeldChunks]:
    """The plan's chunks over held prefixes, grouped by prefix (built once per forward)."""
    if plan.held_chunks is None:
        groups: dict[int, list[Segment]] = {}
        for s in plan.segments:
            if s.held is not None:
                groups.setdefault(id(s.held), []).append(s)
        plan.held_chunks = []
        for segments in groups.values():
            held = segments[0].held
            assert held is not None
            first = int(held.shape[3])
            index = torch.cat([torch.arange(s.offset, s.offset + s.tokens, device=device) for s in segments])
            own = [s.end - first for s in segments]
            mask = torch.zeros((len(index), sum(own)), dtype=torch.bool, device=device)
            t = k = 0
            for s, n in zip(segments, own, strict=True):
                query = torch.arange(s.start, s.end, device=device).unsqueeze(1)
                mask[t : t + s.tokens, k : k + n] = torch.arange(first, s.end, device=device).unsqueeze(0) <= query
                t, k = t + s.tokens, k + n
            plan.held_chunks.append(HeldChunks(held, segments, index, mask))
    return plan.held_chunks


def held_chunk_attention(query: torch.Tensor, g: HeldChunks, layer: int, scaling: float) -> list[torch.Tensor]:
    """Attention of `g`'s chunk tokens (`query` [heads, packed tokens, head_dim]): the held
    prefix once for all of them, each token's own prompt after it apart, the two merged by
    their log-sum-exps (as `shared_prefix_attention` does for decode rows); [tokens, heads,
    head_dim] per segment. Their prompts' buffers hold no copy of the prefix."""
    q = query.index_select(1, g.index)
    heads, tokens, dim = q.shape
    kv_heads = g.kv.shape[2]
    group = heads // kv_heads
    first = int(g.kv.shape[3])
    qg = q.reshape(1, kv_heads, group * tokens, dim)  # heads are KV-head major
    prefix = attend(qg, g.kv[layer, 0].unsqueeze(0), g.kv[layer, 1].unsqueeze(0), None, scaling)
    keys = torch.cat([s.kv[layer, 0, :, first : s.end] for s in g.segments], dim=1).unsqueeze(0)
    values = torch.cat([s.kv[layer, 1, :, first : s.end] for s in g.segments], dim=1).unsqueeze(0)
    if g.bias is None or g.bias.shape[2] != group * tokens:  # [1, 1, group x tokens, own columns]
        g.bias = _bias(g.mask.repeat(group, 1), q.dtype)[None, None]
    own = attend(qg, keys, values, g.bias, scaling)  # every token attends itself: never all masked
    out = merge(*prefix, *own).reshape(heads, tokens, dim).transpose(0, 1).to(query.dtype)
    return list(out.split([s.tokens for s in g.segments]))


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention [batch, heads, queries, head_dim] and its log-sum-exp [batch, heads, queries]
    (float32), `bias` added to the scores (0 or -inf): on the CPU through the fused kernel
    behind SDPA, which returns both; elsewhere in plain products."""
    if query.device.type == "cpu" and _fused_works():
        out, lse = _fused(query, keys, values, bias, scaling)
        return out.float(), lse.float()
    return _plain(query, keys, values, bias, scaling)


def _fused(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op(query, keys, values, 0.0, False, attn_mask=bias, scale=scaling)
    return out, lse


def _plain(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float()), lse


@functools.cache
def _fused_works() -> bool:
    """Whether this torch's fused CPU attention kernel is there and returns what `_plain`
    does (a private op: checked once on a small case, so a build without it, or with another
    signature, takes the plain products instead of failing a step)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 8, generator=gen) for _ in range(3))
    bias = torch.zeros(2, 1, 3, 3).masked_fill_(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
    try:
        out, lse = _fused(q, k, v, bias, 0.3)
        want, want_lse = _plain(q, k, v, bias, 0.3)
        ok = torch.allclose(out.float(), want, atol=1e-4) and torch.allclose(lse.float(), want_lse, atol=1e-4)
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        log.warning("fused CPU attention unavailable (%s): shared-prefix attention in plain products", exc)
        return False
    if not ok:
        log.warning("fused CPU attention disagrees with plain products: shared-prefix attention in plain products")
    return ok


def merge(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """One softmax over two disjoint sets of keys, from each one's attention and log-sum-exp."""
    top = torch.maximum(lse1, lse2)
    a, b = torch.exp(lse1 - top).unsqueeze(-1), torch.exp(lse2 - top).unsqueeze(-1)
    return (out1 * a + out2 * b) / (a + b)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class PackedLayer(DynamicLayer):
    """One attention layer's cache in a packed forward: writes each token's keys and values
    where its sequence keeps them; attention reads them back through the plan."""

    def __init__(self, plan: PackedPlan, index: int, device: torch.device) -> None:
        super().__init__()
        self.plan, self.index = plan, index
        self.device = device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("a packed forward's cache lives in the engine's buffers")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        plan, i = self.plan, self.index
        if plan.rows and plan.paged is not None:
            rows = plan.rows  # [1, kv_heads, rows, head_dim] -> [rows, kv_heads, head_dim] into their slots
            plan.paged.write(i, key_states[0, :, :rows].transpose(0, 1), value_states[0, :, :rows].transpose(0, 1))
        elif plan.rows:
            keys, values = plan.slots[i]
            # [1, kv_heads, rows, head_dim] -> the rows' column of the slot buffers
            keys[: plan.rows, :, plan.column] = key_states[0, :, : plan.rows].transpose(0, 1)
            values[: plan.rows, :, plan.column] = value_states[0, :, : plan.rows].transpose(0, 1)
        for s in plan.segments:
            s.kv[i, 0, :, s.start : s.end] = key_states[0, :, s.offset : s.offset + s.tokens]
            s.kv[i, 1, :, s.start : s.end] = value_states[0, :, s.offset : s.offset + s.tokens]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0


def packed_cache(plan: PackedPlan, layers: int, device: torch.device) -> Cache:
    return Cache(layers=[PackedLayer(plan, i, device) for i in range(layers)])


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ferry_plan: PackedPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The "ferry" attention implementation: SDPA, per segment when the forward is packed."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if ferry_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    plan, i = ferry_plan, cast(int, module.layer_idx)
    parts = []
    if plan.rows and plan.paged is not None:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        parts.append(paged_rows_attention(query[0, :, : plan.rows].transpose(0, 1), plan, i, scaling)[None])
    elif plan.rows and plan.shared:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        parts.append(shared_prefix_attention(query[0, :, : plan.rows].transpose(0, 1), plan, i, scaling)[None])
    elif plan.rows and plan.kernel is not None and plan.row_mask is not None and query.dtype == torch.float32:
        keys, values = plan.slots[i]
        cols = slice(plan.lo, plan.column + 1)
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        q = query[0, :, : plan.rows].transpose(0, 1)  # [rows, heads, head_dim]
        try:
            out = plan.kernel(q, keys[: plan.rows, :, cols], values[: plan.rows, :, cols], plan.row_mask, scaling)
        except RuntimeError as exc:
            raise KernelError(str(exc)) from exc
        parts.append(out.unsqueeze(0))  # [1, rows, heads, head_dim]
    elif plan.rows:
        keys, values = plan.slots[i]
        cols = slice(plan.lo, plan.column + 1)
        q = query[0, :, : plan.rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, head_dim]
        out, _ = sdpa_attention_forward(
            module, q, keys[: plan.rows, :, cols], values[: plan.rows, :, cols], plan.decode_mask, **kwargs
        )
        parts.append(out.reshape(1, plan.rows, *out.shape[2:]))  # [rows, 1, heads, d] -> [1, rows, heads, d]
    over_held: dict[int, torch.Tensor] = {}
    for g in held_chunks(plan, query.device):
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        outs = held_chunk_attention(query[0], g, i, scaling)
        over_held.update((id(s), out) for s, out in zip(g.segments, outs, strict=True))
    for s in plan.segments:
        if (held := over_held.get(id(s))) is not None:
            parts.append(held.unsqueeze(0))
            continue
        q = query[:, :, s.offset : s.offset + s.tokens]
        k, v = s.kv[i, 0, :, : s.end].unsqueeze(0), s.kv[i, 1, :, : s.end].unsqueeze(0)
        out, _ = sdpa_attention_forward(module, q, k, v, plan.chunk_mask(s, query.device), **kwargs)
        parts.append(out)
    return torch.cat(parts, dim=1), None


def shared_prefix_attention(query: torch.Tensor, plan: PackedPlan, layer: int, scaling: float) -> torch.Tensor:
    """Decode attention [rows, heads, head_dim] of one query per row, where groups of rows
    start with the same prefix (a shared system prompt): each group's queries meet the
    prefix's keys once, as one product over the one copy held of it (the rows' slots do not
    hold it: engine/sharing.py), and each row's own part (the rest of its tokens) is
    attended over a window as narrow as the rows' own parts; the two are merged by their
    log-sum-exps. Without it every row would read its own copy of the prefix at every
    step: at 32 rows of 700 tokens, most of a step's time."""
    keys, values = plan.slots[layer]
    rows, heads, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads  # query heads per KV head
    assert plan.own_start is not None and plan.decode_mask is not None
    lo, hi = int(plan.own_start.min()), plan.column + 1
    q = query.reshape(rows, kv_heads, group, dim)
    # Own parts: [rows, kv_heads, group, window], columns before a row's own start masked.
    if plan.own_bias is None:
        cols = torch.arange(lo, hi, device=query.device)
        allowed = (cols[None, :] >= plan.own_start[:, None]) & plan.decode_mask[:, 0, 0, lo - plan.lo :]
        plan.own_bias = _bias(allowed, query.dtype)[:, None, None, :]
    out, lse = attend(q, keys[:rows, :, lo:hi], values[:rows, :, lo:hi], plan.own_bias, scaling)
    return _with_shared(q, out, lse, plan, layer, scaling).reshape(rows, heads, dim).to(query.dtype)


def paged_rows_attention(query: torch.Tensor, plan: PackedPlan, layer: int, scaling: float) -> torch.Tensor:
    """Decode attention [rows, heads, head_dim] of one query per row over the rows' KV in
    blocks (`plan.paged`): the paged kernel where the engine has it (each row's tokens read
    where they lie), else the rows gathered into a rectangle for SDPA; merged with the
    prefixes groups of rows share (`shared_prefix_attention`'s way) where they do."""
    paged = plan.paged
    assert paged is not None and paged.pool is not None
    rows, heads, dim = query.shape
    kv_heads = int(paged.pool.shape[3])
    group = heads // kv_heads
    q = query.reshape(rows, kv_heads, group, dim)
    if plan.paged_kernel is not None and query.dtype == torch.float32 and query.device.type == "cpu":
        table, lengths = paged.table()
        pool = paged.pool[layer]
        try:
            out, lse = plan.paged_kernel(query, pool[0], pool[1], table, lengths, paged.block, scaling)
        except RuntimeError as exc:
            raise KernelError(str(exc)) from exc
        out, lse = out.reshape(rows, kv_heads, group, dim), lse.reshape(rows, kv_heads, group)
    else:
        keys, values, allowed = gathered(paged, layer)
        out, lse = attend(q, keys, values, _bias(allowed, query.dtype)[:, None, None, :], scaling)
    if plan.shared:
        out = _with_shared(q, out, lse, plan, layer, scaling)
    return out.reshape(rows, heads, dim).to(query.dtype)


def _with_shared(
    q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, plan: PackedPlan, layer: int, scaling: float
) -> torch.Tensor:
    """The rows' attention over their own parts (`out`, `lse`: [rows, kv_heads, group, ...])
    merged, group by group, with their queries `q` [rows, kv_heads, group, head_dim] against
    the prefix the group holds once."""
    _, kv_heads, group, dim = q.shape
    for g in plan.shared:
        n = len(g.rows)
        # [kv_heads, n x group, dim] against [kv_heads, tokens, dim]: one product per KV head.
        qg = q.index_select(0, g.rows).transpose(0, 1).reshape(1, kv_heads, n * group, dim)
        out_g, lse_g = attend(qg, g.kv[layer, 0].unsqueeze(0), g.kv[layer, 1].unsqueeze(0), None, scaling)
        # [1, kv_heads, n x group, x] -> [n, kv_heads, group, x]
        out_g = out_g.reshape(kv_heads, n, group, dim).transpose(0, 1)
        lse_g = lse_g.reshape(kv_heads, n, group).transpose(0, 1)
        merged = merge(out_g, lse_g, out.index_select(0, g.rows), lse.index_select(0, g.rows))
        out.index_copy_(0, g.rows, merged)
    return out


def install(model: Any) -> bool:
    """Switch `model` to the "ferry" attention implementation if it runs SDPA (unchanged in
    every ordinary forward); False, leaving it as it is, if it runs another."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", IMPLEMENTATION):
        return False
    AttentionInterface.register(IMPLEMENTATION, packed_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
    return True
