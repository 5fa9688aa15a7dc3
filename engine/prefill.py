"""Batched prefill of new prompts, reusing cached prefix KV (engine/prefix_cache.py).

Each prompt is fed from the end of its cached prefix. The forward's cache starts with the
cached prefixes, left-padded to the longest, and the fed suffixes are left-padded too, so
a row reads [pads][cached prefix][pads][suffix], mask 0 on every pad, and each fed token's
position is the number of real tokens before it. After the forward each row's real columns
are packed to the right: the left-padded layout `RunningBatch.admit` takes, with no
padding left in the middle for decode steps to attend over for the rest of the row's life.
Every full block of every prompt is then stored in the prefix cache.

Prompts of one call that share an uncached prefix of a block or more have it computed
once first, one row per distinct prefix (32 conversations of one request with one system
prompt compute it once, not 32 times).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from .prefix_cache import PrefixCache, chain_keys

# (input_ids, position_ids, 2D attention mask, cache) -> (last-position logits, cache)
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, Any]]
KVLayers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer [rows, kv_heads, seq, head_dim]
CHAINS_KEPT = 1024  # prompts whose block keys `cached_prefix` remembers (the queued ones, in practice)


@dataclass(slots=True)
class Prefilled:
    logits: torch.Tensor  # [rows, vocab] at each prompt's last token
    layers: KVLayers  # each row's prompt right-aligned, left-padded
    mask: torch.Tensor  # [rows, width], 1 = real token
    cached: list[int]  # per row, prompt tokens taken from the prefix cache


class Prefiller:
    """Runs prefills through `forward`, reading and filling `prefix_cache` (None: off)."""

    def __init__(self, forward: Forward, config: Any, device: torch.device, prefix_cache: PrefixCache | None) -> None:
        self.forward = forward
        self.config = config
        self.device = device
        self.prefix_cache = prefix_cache
        self._chains: dict[int, tuple[Sequence[int], list[bytes]]] = {}  # id -> (prompt, its usable keys)

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens a prefill would serve from the prefix cache now; changes nothing
        (read from the event loop while the worker thread may store: an estimate). Asked
        again for queued prompts as the cache fills, so each prompt's chain of block keys
        is hashed once and kept with the prompt (`_chains`, the event loop's own, by the
        prompt object: a queued prompt is one list until it runs), and asking again walks
        the keys (`PrefixCache.cached_keys`): no hashing, no token comparison."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        kept = self._chains.pop(id(prompt_ids), None)
        if kept is None or kept[0] is not prompt_ids:
            kept = (prompt_ids, chain_keys(prompt_ids, cache.block, cache.usable_blocks(len(prompt_ids))))
        self._chains[id(prompt_ids)] = kept  # most recent last; holding the prompt keeps its id unique
        if len(self._chains) > CHAINS_KEPT:
            del self._chains[next(iter(self._chains))]
        return cache.cached_keys(kept[1]) * cache.block

    def cache_stats(self) -> dict[str, int]:
        """queries and hits (prompt tokens looked up, and served from the cache), used_bytes,
        max_bytes, blocks; all 0 with prefix caching off."""
        if self.prefix_cache is None:
            return {"queries": 0, "hits": 0, "used_bytes": 0, "max_bytes": 0, "blocks": 0}
        return self.prefix_cache.stats()

    def run(self, prompts: Sequence[list[int]]) -> Prefilled:
        if self.prefix_cache is not None:
            shared = shared_prefixes(prompts, self.prefix_cache)
            if shared:
                self._prefill(shared, count=False)
        return self._prefill(prompts, count=True)

    def _prefill(self, prompts: Sequence[list[int]], count: bool) -> Prefilled:
        cache = self.prefix_cache
        hits = cache.lookup_many(prompts, count=count) if cache is not None else [(0, None)] * len(prompts)
        return self.extend(prompts, hits)

    def extend(self, prompts: Sequence[list[int]], hits: Sequence[tuple[int, torch.Tensor | None]]) -> Prefilled:
        """One forward that feeds each of `prompts` from the end of what `hits` gives it
        (tokens whose KV is known, [layers, 2, kv_heads, tokens, head_dim], as
        `PrefixCache.lookup` returns it, or the part of the prompt an earlier chunk
        computed); every full block of every prompt is then stored in the prefix cache."""
        cache = self.prefix_cache
        input_ids, positions, mask, past = prefill_inputs(prompts, hits, self.device)
        logits, out = self.forward(
            input_ids, positions, mask, self._new_cache(past, mask.shape[1] - input_ids.shape[1])
        )
        layers, mask = right_align([(layer.keys, layer.values) for layer in out.layers], mask)
        if cache is not None:
            # Only after the forward succeeded: a failed one leaves the cache as it was.
            width = mask.shape[1]
            for row, prompt in enumerate(prompts):
                lo = width - len(prompt)
                cache.store(prompt, [(keys[row, :, lo:], values[row, :, lo:]) for keys, values in layers])
        return Prefilled(logits, layers, mask, [n for n, _ in hits])

    def _new_cache(self, past: torch.Tensor | None, past_width: int) -> Any:
        from transformers.cache_utils import Cache, DynamicCache

        if past is None:
            return DynamicCache(config=self.config)
        # Every layer is a full-attention DynamicLayer (checked at load), so this is the same cache.
        return Cache(layers=[_FilledLayer(past[i, 0], past[i, 1], past_width) for i in range(past.shape[0])])


class _FilledLayer(DynamicLayer):
    """A prefill's layer allocated at its final width with the cached prefix already in
    place: the forward writes its keys and values into the columns left for them, where a
    DynamicLayer would concatenate, copying the whole prefix once more."""

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        super().__init__()
        self.keys, self.values, self.filled = keys, values, filled
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("allocated by prefill_inputs")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        lo, hi = self.filled, self.filled + key_states.shape[-2]
        self.keys[:, :, lo:hi] = key_states
        self.values[:, :, lo:hi] = value_states
        self.filled = hi
        return self.keys[:, :, :hi], self.values[:, :, :hi]

    def get_seq_length(self) -> int:
        return self.filled


def prefill_inputs(
    prompts: Sequence[list[int]], hits: Sequence[tuple[int, torch.Tensor | None]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Input ids, position ids, 2D mask (cached columns, then fed ones) and the initial
    cache of a prefill that feeds each prompt from the end of its cached prefix.

    `hits[i]` is (cached tokens, their KV [layers, 2, kv_heads, tokens, head_dim]) as
    `PrefixCache.lookup` returns it; (0, None) for none. The cache (None if nothing is
    cached) is [layers, 2, rows, kv_heads, width of the mask, head_dim]: cached columns
    filled, their padding zeroed, the fed columns left for the forward to write.
    """
    rows = len(prompts)
    cached = [n for n, _ in hits]
    past_width = max(cached)
    fed_width = max(len(p) - n for p, n in zip(prompts, cached, strict=True))
    ids = torch.zeros((rows, fed_width), dtype=torch.long)  # pad id 0: never attended to
    mask = torch.zeros((rows, past_width + fed_width), dtype=torch.long)
    for row, (prompt, n) in enumerate(zip(prompts, cached, strict=True)):
        suffix = prompt[n:]
        ids[row, fed_width - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
        mask[row, past_width - n : past_width] = 1
        mask[row, past_width + fed_width - len(suffix) :] = 1
    fed = mask[:, past_width:]
    positions = (torch.tensor(cached).unsqueeze(1) + fed.cumsum(dim=1) - 1).clamp_(min=0)
    past = None
    if past_width:
        like = next(kv for _, kv in hits if kv is not None)
        layers, _, heads, _, head_dim = like.shape
        past = like.new_empty((layers, 2, rows, heads, past_width + fed_width, head_dim))
        for row, (n, kv) in enumerate(hits):
            # Padding zeroed, never left as garbage: a masked column still meets a 0 weight,
            # and 0 * NaN = NaN.
            past[:, :, row, :, : past_width - n] = 0
            if kv is not None:
                past[:, :, row, :, past_width - n : past_width] = kv
    return ids.to(device), positions.to(device), mask.to(device), past


def right_align(layers: KVLayers, mask: torch.Tensor) -> tuple[KVLayers, torch.Tensor]:
    """Move each row's real columns, in order, to the right end of a width just wide enough
    for the longest row; a mask that is already so is returned as it is (no copy)."""
    lengths = mask.sum(dim=1)
    width = int(lengths.max())
    packed = (torch.arange(width, device=mask.device) >= (width - lengths).unsqueeze(1)).to(mask.dtype)
    if mask.shape[1] == width and torch.equal(mask, packed):
        return layers, mask
    # A stable sort of 0/1 puts each row's pads first and its real columns last, in order.
    order = torch.sort(mask, dim=1, stable=True).indices[:, -width:]
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1)

    def packed_columns(t: torch.Tensor) -> torch.Tensor:
        return t[rows, :, order].transpose(1, 2)  # the gather is [rows, width, kv_heads, head_dim]

    return [(packed_columns(keys), packed_columns(values)) for keys, values in layers], packed


def shared_prefixes(prompts: Sequence[list[int]], cache: PrefixCache) -> list[list[int]]:
    """Block-aligned prefixes that two or more of `prompts` share beyond what `cache` holds
    for them: the longest for each prompt, once each, dropping any that is the start of
    another (computing the longer one stores its blocks too)."""
    block = cache.block
    chains = [chain_keys(p, block, cache.usable_blocks(len(p))) for p in prompts]
    counts = Counter(key for keys in chains for key in set(keys))
    ends: dict[bytes, list[int]] = {}
    inner: set[bytes] = set()
    for prompt, keys in zip(prompts, chains, strict=True):
        depth = 0
        while depth < len(keys) and counts[keys[depth]] > 1:
            depth += 1
        if depth > cache.cached_blocks(prompt):
            ends[keys[depth - 1]] = prompt[: depth * block]
            inner.update(keys[: depth - 1])
    return [prefix for key, prefix in ends.items() if key not in inner]
