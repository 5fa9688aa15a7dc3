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

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicLayer

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

    @property
    def end(self) -> int:
        return self.start + self.tokens


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

    @property
    def layers(self) -> int:
        return len(self.slots) if self.slots else int(self.segments[0].kv.shape[0])

    def chunk_mask(self, s: Segment, device: torch.device) -> torch.Tensor:
        """[1, 1, tokens, end] True where a chunk's token may attend: its prompt up to itself."""
        query = torch.arange(s.start, s.end, device=device).unsqueeze(1)
        return (torch.arange(s.end, device=device).unsqueeze(0) <= query)[None, None]


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
        if plan.rows:
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
    if plan.rows:
        keys, values = plan.slots[i]
        cols = slice(plan.lo, plan.column + 1)
        q = query[0, :, : plan.rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, head_dim]
        out, _ = sdpa_attention_forward(
            module, q, keys[: plan.rows, :, cols], values[: plan.rows, :, cols], plan.decode_mask, **kwargs
        )
        parts.append(out.reshape(1, plan.rows, *out.shape[2:]))  # [rows, 1, heads, d] -> [1, rows, heads, d]
    for s in plan.segments:
        q = query[:, :, s.offset : s.offset + s.tokens]
        k, v = s.kv[i, 0, :, : s.end].unsqueeze(0), s.kv[i, 1, :, : s.end].unsqueeze(0)
        out, _ = sdpa_attention_forward(module, q, k, v, plan.chunk_mask(s, query.device), **kwargs)
        parts.append(out)
    return torch.cat(parts, dim=1), None


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
