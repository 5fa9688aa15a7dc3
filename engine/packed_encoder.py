"""An encoder forward with no padding: a batch's rows packed token after token into one row.

Batches of like lengths leave some padding (12% of the tokens of a long-tailed mix at the
default 2,048-token budget, docs/benchmarks.md); a padded batch computes every layer's
products on it. Here a batch of rows of 7, 30 and 12 tokens is one row of 49 tokens, each
token with its own row's position id, and attention runs per row (block-diagonal) through
PyTorch's SDPA on that row's slice. The products see real tokens only; each row's attention
is exactly its padded one without the masked columns.

Any Hugging Face encoder whose attention goes through transformers' attention interface
(SDPA), and whose forward takes `position_ids`, can run this way; whether it does is
checked at load against the padded forward on several shapes, one at the model's limit
(models whose position ids are not 0..n-1 for each row, e.g. RoBERTa's offset positions,
fail the check and keep padding; attention with a sliding window, soft-capping or a causal
mask is refused by `_attention`, so those keep padding too). The row loop is a
TorchScript function, so a traced packed forward keeps it (one trace serves any number of
rows) and runs in C++ like the padded graph (engine/embeddings.py).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger("ferry.engine")

IMPLEMENTATION = "ferry_packed"
_UNSUPPORTED = ("sliding_window", "softcap", "position_bias", "s_aux", "head_mask", "is_causal", "dropout")
_registered = False


def _rows_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, scale: float
) -> torch.Tensor:
    """query/key/value [1, heads, tokens, dim] of packed rows; bounds [rows + 1] their token
    offsets. Each row attends to itself only. Returns [1, tokens, heads, dim] (the layout
    transformers' attention functions return)."""
    cuts: list[int] = bounds.tolist()
    parts: list[torch.Tensor] = []
    for i in range(len(cuts) - 1):
        lo = cuts[i]
        hi = cuts[i + 1]
        parts.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], scale=scale
            )
        )
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


with warnings.catch_warnings():  # TorchScript is deprecated (so is the trace it serves)
    warnings.simplefilter("ignore", DeprecationWarning)
    # Scripted so that a traced forward records the call with its loop, not one unrolled pass.
    rows_attention = torch.jit.script(_rows_attention)


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any):
    """transformers' attention interface: packed rows when the forward passes their bounds,
    else plain SDPA (the padded forward of the same model)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.pop("ferry_bounds", None)
    kernel = kwargs.pop("ferry_kernel", None)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if key.shape[1] != query.shape[1]:
        raise ValueError("packed rows need as many key heads as query heads")
    # Attention that is more than each row over all of its own tokens (a sliding window,
    # ModernBERT's local layers; soft-capping; a bias; sinks; causal) is not what rows_attention
    # computes: refused, so the check at load keeps the model padded.
    extra = [k for k in _UNSUPPORTED if _set(kwargs.get(k))]
    if extra:
        raise ValueError(f"packed rows do not support {', '.join(extra)}")
    scale = kwargs.get("scaling")
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    if kernel is not None:  # engine/rows_attention.py: every row and head in one call
        return kernel(query, key, value, bounds, scale), None
    return rows_attention(query, key, value, bounds, scale), None


def _set(value: Any) -> bool:
    """A keyword that asks for something: not None, False or zero (a tensor always does)."""
    return value is not None and (not isinstance(value, (bool, int, float)) or bool(value))


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(IMPLEMENTATION, _attention)
        # Padded batches (no bounds) must get SDPA's mask, not none: transformers builds the
        # mask by the implementation's name.
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
        _registered = True


class PackedEncoder(torch.nn.Module):
    """(input_ids [1, tokens], position_ids [1, tokens], bounds [rows + 1]) -> the last
    hidden state of every token [tokens, hidden]."""

    def __init__(self, model: Any, token_types: bool, kernel: Any = None) -> None:
        super().__init__()
        self.inner = model
        self.token_types = token_types
        self.kernel = kernel  # engine/rows_attention.py's, or None: SDPA per row
        # A 4D mask passes through transformers' mask building untouched; attention ignores it.
        device = next(model.parameters()).device
        self.register_buffer("mask", torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device), persistent=False)

    def forward(self, input_ids: Any, position_ids: Any, bounds: Any) -> Any:
        extra = {"token_type_ids": torch.zeros_like(input_ids)} if self.token_types else {}
        out = self.inner(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self.mask,
            ferry_bounds=bounds,
            ferry_kernel=self.kernel,
            **extra,
        )
        return out.last_hidden_state[0]


def pack_rows(batch: Sequence[Sequence[int]], device: Any) -> tuple[Any, Any, Any, Any]:
    """A batch of token id rows as the packed forward's inputs, and each row's length."""
    lengths = torch.tensor([len(ids) for ids in batch], dtype=torch.long)
    ids = torch.tensor([list(itertools.chain.from_iterable(batch))], dtype=torch.long)
    positions = torch.cat([torch.arange(len(row), dtype=torch.long) for row in batch]).unsqueeze(0)
    bounds = torch.zeros(len(batch) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=bounds[1:])
    return ids.to(device), positions.to(device), bounds, lengths.to(device)


def mean_pool(hidden: Any, lengths: Any) -> Any:
    """Each row's mean over its own tokens: [tokens, hidden] -> [rows, hidden]."""
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
    sums = torch.zeros((len(lengths), hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)
    return sums.index_add_(0, rows, hidden) / lengths.unsqueeze(1).to(hidden.dtype)


def build_packed(
    model: Any,
    padded: Callable[[Any, Any], Any],
    *,
    name: str,
    pad_id: int,
    device: Any,
    trace: bool,
    max_length: int = 0,
    native_attention: bool = True,
) -> Any | None:
    """The model's packed forward (traced when `trace`), or None where the model cannot run
    packed or its packed forward does not give the padded forward's hidden states. With
    `native_attention`, its attention through engine/rows_attention.py's kernel where that
    applies and gives the padded forward's states, else SDPA per row."""
    params = inspect.signature(model.forward).parameters
    impl = getattr(model.config, "_attn_implementation", None)
    if "position_ids" not in params or impl != "sdpa":
        log.info(
            "embeddings model %s keeps padded batches (attention %s, takes position ids: %s)",
            name,
            impl,
            "position_ids" in params,
        )
        return None
    vocab = int(getattr(model.config, "vocab_size", 1000))
    gen = torch.Generator().manual_seed(1)

    def rows(lengths: Sequence[int]) -> list[list[int]]:
        return [torch.randint(min(1000, vocab - 1), vocab, (n,), generator=gen).tolist() for n in lengths]

    def padded_batch(batch: list[list[int]]) -> tuple[Any, Any]:
        ids = torch.full((len(batch), max(map(len, batch))), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, row in enumerate(batch):
            ids[r, : len(row)] = torch.tensor(row)
            mask[r, : len(row)] = 1
        return ids.to(device), mask.to(device)

    same = _agreement(model.dtype)
    cases: list[tuple[Sequence[int], list[list[int]], Any, Any, Any]] = []

    def _checked(attention: Any) -> Any | None:
        """The packed forward through `attention` (None: SDPA per row) where it gives the
        padded forward's states for every case, else None."""
        forward: Any = PackedEncoder(model, "token_type_ids" in params, attention).eval()
        if trace:
            example = pack_rows(rows((5, 9)), device)[:3]
            forward = torch.jit.trace(forward, example, check_trace=False, strict=False)
            forward.kernel = attention  # what the graph calls, for the engine's log and tests
        for lengths, batch, ids, mask, want in cases:
            got = forward(*pack_rows(batch, device)[:3]).float()
            keep = mask.bool()
            same_padded = same(padded(ids, mask).float()[keep], want[keep])
            if got.shape != want[keep].shape or not same_padded or not same(got, want[keep]):
                log.warning(
                    "embeddings model %s: packed rows%s differ from padded ones at lengths %s",
                    name,
                    " through the attention kernel" if attention is not None else "",
                    lengths,
                )
                return None
        return forward

    try:
        _register()
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # The padded forward's answers, taken before the implementation changes: both the
            # packed forward and the padded one after the change must give them.
            shapes: list[tuple[int, ...]] = [(7,), (3, 12, 30), (40, 2, 17, 9, 1), (12, 12)]
            if max_length > 40:  # a row at the model's limit (positions, windows) beside a short one
                shapes.append((max_length, 3))
            for lengths in shapes:
                batch = rows(lengths)
                ids, mask = padded_batch(batch)
                cases.append((lengths, batch, ids, mask, padded(ids, mask).float()))
            model.set_attn_implementation(IMPLEMENTATION)
            kernel = _kernel(model, device) if native_attention else None
            for attention in [kernel, None] if kernel is not None else [None]:
                try:
                    forward = _checked(attention)
                except Exception as exc:
                    if attention is None:
                        raise
                    # The kernel refused this model's shapes (a check in C++ the Python side
                    # did not foresee): SDPA per row still packs.
                    log.warning(
                        "embeddings model %s: the attention kernel failed (%s: %s); SDPA per row",
                        name,
                        type(exc).__name__,
                        exc,
                    )
                    continue
                if forward is not None:
                    # The model keeps the packed implementation: without bounds it is plain
                    # SDPA, so the padded forward (the fallback) is unchanged.
                    return forward
        log.warning("embeddings model %s: keeping padding", name)
        _restore(model, impl, name)
        return None
    except Exception as exc:  # any model may refuse: padding is always correct
        log.warning("embeddings model %s cannot run packed (%s: %s); keeping padding", name, type(exc).__name__, exc)
        _restore(model, impl, name)
        return None


def _kernel(model: Any, device: Any) -> Any | None:
    """engine/rows_attention.py's kernel for this model's heads, or None (SDPA per row)."""
    from .rows_attention import rows_kernel_for

    config = model.config
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    head_dim = int(getattr(config, "head_dim", 0) or (hidden // heads if heads else 0))
    if heads <= 0 or head_dim <= 0:
        return None
    return rows_kernel_for(heads, head_dim, model.dtype, torch.device(device))


HALF_EPS = 4  # a half-precision token's hidden state may differ by this many eps of its norm


def _agreement(dtype: Any) -> Callable[[Any, Any], bool]:
    """Whether packed hidden states agree with padded ones, [tokens, hidden] each. Float32:
    elementwise within 1e-4. Half precision (bfloat16, float16): packed and padded forwards
    sum in other orders and round every layer's output, so an element can differ by a few
    units in the last place of the larger values beside it (all-MiniLM-L6-v2 in bfloat16:
    up to 0.031 where values reach 6, 1.2-1.7% of a token's norm, on the load check's rows):
    each token's difference within HALF_EPS eps of its norm (3.1% in bfloat16), where a
    wrong position or a row attending to another's tokens is tens of percent."""
    if dtype == torch.float32 or dtype == torch.float64:
        return lambda got, want: bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))
    limit = HALF_EPS * torch.finfo(dtype).eps

    def close(got: Any, want: Any) -> bool:
        norm = want.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        return bool(((got - want).norm(dim=-1) / norm).max() <= limit)

    return close


def _restore(model: Any, impl: str, name: str) -> None:
    if getattr(model.config, "_attn_implementation", None) == impl:
        return
    try:
        model.set_attn_implementation(impl)
    except Exception as exc:  # the packed implementation without bounds is SDPA: still right
        log.warning("embeddings model %s: attention left as %s (%s)", name, IMPLEMENTATION, exc)
