"""One forward of a Hugging Face causal LM as the generation engine calls it: explicit
2D attention mask and position ids, the given cache, the logits of the last position only.
And the load-time check that its cache layers are ones the engine can merge across
sequences."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from .packed import PackedPlan, Segment, packed_cache

_NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


class CausalForward:
    def __init__(self, model: Any, name: str) -> None:
        self.model, self.name = model, name
        self.device: torch.device = model.device
        self._cache_kwarg = _cache_kwarg(model)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, Any]:
        """(logits [rows, vocab] at the last position, the cache after the forward)."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        cache = out.cache if self._cache_kwarg == "cache" else out.past_key_values
        return out.logits[:, -1, :], cache

    def packed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: PackedPlan, keep: torch.Tensor
    ) -> torch.Tensor:
        """One packed forward (engine/packed.py) of `input_ids` [1, tokens] at `positions`;
        the logits [len(keep), vocab] of the tokens at indices `keep`."""
        out = self.model(
            input_ids=input_ids,
            # A 4D mask is passed through as it is (no mask is built); the plan says who attends where.
            attention_mask=_NO_MASK,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep,
            ferry_plan=plan,
            **{self._cache_kwarg: packed_cache(plan, plan.layers, self.device)},
        )
        return out.logits[0]

    def packed_works(self, device: torch.device) -> bool:
        """Whether a packed forward gives the logits of a plain one on this model (a model
        that does not pass the forward's keywords down to attention would silently attend
        over nothing): a 3-token prompt both ways, at load."""
        ids = torch.tensor([[1, 2, 3]], device=device)
        positions = torch.arange(3, device=device).unsqueeze(0)
        with torch.inference_mode():
            _, cache = self(ids, positions, torch.ones_like(ids), self.new_cache())
            like = cache.layers[0].keys  # [1, kv_heads, 3, head_dim]
            kv = like.new_zeros((len(cache.layers), 2, like.shape[1], 3, like.shape[3]))
            plan = PackedPlan(0, [], 0, 0, None, [Segment(0, 0, 3, kv)])
            got = self.packed(ids, positions, plan, torch.tensor([2], device=device))[0].float()
            want = self.all_logits(ids)[0, -1].float()
        tolerance = 1e-4 if like.dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got, want, atol=tolerance, rtol=tolerance))

    def all_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, len, vocab] at every position of unpadded prompts, no cache (len x
        vocab floats per row: what a prompt's log probabilities cost in memory)."""
        return self.model(input_ids=input_ids, use_cache=False).logits

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def check_cache_layout(self, device: torch.device) -> tuple[bool, int, torch.Tensor]:
        """Fail at load, not mid-traffic, if the merge recipe cannot apply to this model.
        True if every layer's keys and values have one shape, as prefix cache blocks need;
        the bytes one token's keys and values take over all layers; and an empty prompt KV
        buffer, [layers, 2, kv_heads, 0, head_dim], of the cache's dtype and device (what
        prompts' buffers are shaped after)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            _, cache = self(ids, torch.zeros_like(ids), mask, self.new_cache())
        token_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        unsupported = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
        if unsupported:
            raise NotImplementedError(
                f"model {self.name!r} uses cache layers {sorted(unsupported)}; only full-attention "
                "DynamicLayer caches can be merged across sequences"
            )
        shapes = {(layer.keys.shape, layer.values.shape, layer.keys.dtype) for layer in cache.layers}
        keys = cache.layers[0].keys  # [1, kv_heads, 1, head_dim]
        empty = keys.new_empty((len(cache.layers), 2, keys.shape[1], 0, keys.shape[3]))
        return len(shapes) == 1, token_bytes, empty


def _cache_kwarg(model: Any) -> str:
    """transformers 5.x renamed `past_key_values` to `cache` (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
