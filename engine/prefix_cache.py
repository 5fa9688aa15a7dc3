"""Prefix cache: the KV of full blocks of prompt tokens, reused by every later prompt that
starts with the same tokens (a shared system prompt, the conversations of one batched
request, the earlier turns of a conversation).

As in vLLM's automatic prefix caching and nano-vllm's block_manager, a block's key hashes
its tokens onto the key of the block before it, so one key names the whole prefix that
ends with that block and a lookup walks a prompt's blocks until the first miss. Each entry
keeps its parent's key and its tokens and a hit checks both, so even a hash collision
cannot serve another prefix's KV.

Eviction is LRU over whole blocks under a byte budget. Every use of a chain refreshes its
blocks from the last to the first, so a block is always more recently used than any block
that extends it: the LRU victim is always a leaf, and the cache stays prefix-closed (no
entry is left unreachable behind an evicted parent).

Entries are copies, never views of a running batch's buffers, so nothing that happens to a
running row (decode writes, compaction, a failed step) can change them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kv_events import BlockEvents

DEFAULT_BLOCK = 16

# Per attention layer: keys and values [kv_heads, tokens, head_dim].
LayerKV = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True, frozen=True)
class _Block:
    parent: bytes
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2 (keys, values), kv_heads, block, head_dim]
    digest: bytes | None = None  # vLLM's hash of the prefix ending here (engine/kv_events.py), when published

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


_ROOT = b""  # the parent key of a prompt's first block


def chain_keys(
    prompt_ids: Sequence[int], block: int, blocks: int | None = None, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Keys of the first `blocks` full blocks of `prompt_ids` (all full blocks by default):
    key i = hash(key i-1, tokens of block i). `known`: its first keys, already hashed."""
    n = len(prompt_ids) // block if blocks is None else min(blocks, len(prompt_ids) // block)
    keys = list(known[:n])
    parent = keys[-1] if keys else _ROOT
    for i in range(len(keys), n):
        tokens = array("q", prompt_ids[i * block : (i + 1) * block]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """KV of full prompt blocks under a byte budget; see the module doc.

    `queries` and `hits` count prompt tokens looked up and tokens served from the cache.
    A lookup never serves a prompt's last token: the prefill must feed at least one token
    to get the logits of the next.
    """

    def __init__(self, max_bytes: int, block: int = DEFAULT_BLOCK, events: BlockEvents | None = None) -> None:
        if block < 1:
            raise ValueError(f"prefix_block: a prefix cache block must be at least 1 token, got {block}")
        if max_bytes < 0:
            raise ValueError(f"prefix_cache_bytes: the prefix cache budget must be >= 0, got {max_bytes}")
        self.block = block
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.events = events  # every block stored, evicted or cleared, published (engine/kv_events.py)
        self.used_bytes = 0
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def usable_blocks(self, prompt_len: int) -> int:
        """Blocks a prompt of this length may take from the cache (never its last token)."""
        return max(prompt_len - 1, 0) // self.block

    def cached_blocks(self, prompt_ids: Sequence[int], keys: list[bytes] | None = None) -> int:
        """How many of the prompt's usable blocks a lookup would serve; changes nothing.
        `keys`: the prompt's usable chain, where the caller has it."""
        return self._match(prompt_ids, self._usable_keys(prompt_ids) if keys is None else keys)

    def lookup(self, prompt_ids: Sequence[int], *, count: bool = True) -> tuple[int, torch.Tensor | None]:
        """(tokens served, their KV [layers, 2 (keys, values), kv_heads, tokens, head_dim] or
        None). `count=False` leaves the counters alone (the engine's look-ups while it plans)."""
        return self.lookup_many([prompt_ids], count=count)[0]

    def cached_keys(self, keys: list[bytes]) -> int:
        """How many of a prompt's chain `keys` are cached, from the first to the first miss,
        by key and parent alone (the scheduler's estimate; `lookup` checks tokens too)."""
        parent = _ROOT
        for i, key in enumerate(keys):
            entry = self._blocks.get(key)
            if entry is None or entry.parent != parent:
                return i
            parent = key
        return len(keys)

    def lookup_into(
        self, prompt_ids: Sequence[int], columns: int, keys: list[bytes], *, count: bool = True, skip: int = 0
    ) -> tuple[int, torch.Tensor | None]:
        """`lookup` into a new buffer [layers, 2, kv_heads, columns, head_dim] (the prompt's
        own, which its chunks fill on): (tokens served, the buffer) or (0, None). Each block
        is copied once, straight into place, where a lookup's joined tensor and then a copy
        of it into the prompt's buffer copied the prefix twice. `keys`: the prompt's usable
        chain. The blocks within its first `skip` tokens are served but not copied (the
        caller has them elsewhere: a prefix held for running rows, engine/sharing.py)."""
        keys = self._served(prompt_ids, keys, count)
        n = len(keys) * self.block
        if not keys:
            return 0, None
        first = self._blocks[keys[0]].kv
        buffer = first.new_empty((*first.shape[:3], max(columns, n), first.shape[4]))
        lo = min(skip // self.block, len(keys))
        if lo < len(keys):
            # One concatenation written straight into place: half the time of a copy per block.
            torch.cat([self._blocks[key].kv for key in keys[lo:]], dim=3, out=buffer[:, :, :, lo * self.block : n])
        return n, buffer

    def lookup_many(
        self, prompts: Sequence[Sequence[int]], *, count: bool = True
    ) -> list[tuple[int, torch.Tensor | None]]:
        """`lookup` of each prompt; prompts with the same cached prefix share one tensor
        (read-only: the caller must not write into it)."""
        joined: dict[bytes, torch.Tensor] = {}
        results: list[tuple[int, torch.Tensor | None]] = []
        for prompt in prompts:
            keys = self._served(prompt, self._usable_keys(prompt), count)
            n = len(keys) * self.block
            if not keys:
                results.append((0, None))
                continue
            if keys[-1] not in joined:
                joined[keys[-1]] = torch.cat([self._blocks[k].kv for k in keys], dim=3)
            results.append((n, joined[keys[-1]]))
        return results

    def store(self, prompt_ids: Sequence[int], kv: LayerKV, known: Sequence[bytes] = ()) -> int:
        """Keep every full block of the prompt not already cached; returns blocks added.

        `kv[layer]` holds that layer's keys and values of the prompt's tokens from its first,
        [kv_heads, >= tokens in full blocks, head_dim]. Blocks are copied out first and
        inserted after, so a failure part-way stores nothing of this prompt; a chain longer
        than the budget keeps only the blocks that fit from its start. `known`: the first
        keys of the prompt's chain, where the caller has them (not hashed again).
        """
        keys = chain_keys(prompt_ids, self.block, known=known)
        if any(t.shape[1] < len(keys) * self.block for pair in kv for t in pair):
            raise ValueError("store needs the KV of every token in the prompt's full blocks")
        have = self._match(prompt_ids, keys)
        block_bytes = sum(t[:, : self.block].numel() * t.element_size() for pair in kv for t in pair)
        chain_bytes = sum(self._blocks[key].nbytes for key in keys[:have])
        # The chain's blocks must fit beside each other; the rest of the cache yields.
        fit = max(0, (self.max_bytes - chain_bytes) // block_bytes) if block_bytes else 0
        end = have
        while end < min(len(keys), have + fit) and keys[end] not in self._blocks:
            end += 1  # (a key present but unmatched is a hash collision: never mix the two)
        new: list[tuple[bytes, _Block]] = []
        digests: list[bytes] = []
        if end > have:
            # One gather of the new span, then one copy per block, so that each block owns
            # its memory (a view would keep the whole span alive after the block is evicted).
            lo, hi = have * self.block, end * self.block
            span = torch.stack([torch.stack((k[:, lo:hi], v[:, lo:hi])) for k, v in kv])
            digests = self._digests(prompt_ids, keys, have, end)
            for i, part in enumerate(span.split(self.block, dim=3), start=have):
                tokens = tuple(prompt_ids[i * self.block : (i + 1) * self.block])
                digest = digests[i - have] if digests else None
                new.append((keys[i], _Block(keys[i - 1] if i else _ROOT, tokens, part.clone(), digest)))
        self._touch(keys[:have])
        incoming = sum(entry.nbytes for _, entry in new)
        while self._blocks and self.used_bytes + incoming > self.max_bytes:
            _, victim = self._blocks.popitem(last=False)
            self.used_bytes -= victim.nbytes
            if self.events is not None and victim.digest is not None:
                self.events.removed(victim.digest)
        for key, entry in new:
            self._blocks[key] = entry
            self.used_bytes += entry.nbytes
        self._touch(keys[: have + len(new)])
        if self.events is not None:
            if new:
                parent = self._blocks[keys[have - 1]].digest if have else None
                self.events.stored(parent, digests, prompt_ids[have * self.block : end * self.block])
            self.events.flush()
        return len(new)

    def clear(self) -> None:
        """Drop every entry (counters stay)."""
        self._blocks.clear()
        self.used_bytes = 0
        if self.events is not None:
            self.events.cleared()
            self.events.flush()

    def _digests(self, prompt_ids: Sequence[int], keys: list[bytes], have: int, end: int) -> list[bytes]:
        """vLLM's hashes of blocks `have`..`end` of the prompt (none without events), chained
        on the hash its cached prefix already has."""
        if self.events is None or end <= have:
            return []
        parent = self._blocks[keys[have - 1]].digest if have else None
        start = have if parent is not None or not have else 0  # a parent without one: hash from the first block
        hashes = self.events.hasher.chain(prompt_ids[start * self.block :], self.block, end - start, parent)
        return hashes[have - start :]

    def stats(self) -> dict[str, int]:
        return {
            "queries": self.queries,
            "hits": self.hits,
            "used_bytes": self.used_bytes,
            "max_bytes": self.max_bytes,
            "blocks": len(self._blocks),
        }

    # -- internals -------------------------------------------------------------------

    def _usable_keys(self, prompt_ids: Sequence[int]) -> list[bytes]:
        return chain_keys(prompt_ids, self.block, self.usable_blocks(len(prompt_ids)))

    def _match(self, prompt_ids: Sequence[int], keys: list[bytes]) -> int:
        """How many of `keys` (the prompt's chain) are cached, from the first to the first miss."""
        parent = _ROOT
        for i, key in enumerate(keys):
            entry = self._blocks.get(key)
            lo = i * self.block
            if entry is None or entry.parent != parent or entry.tokens != tuple(prompt_ids[lo : lo + self.block]):
                return i
            parent = key
        return len(keys)

    def _served(self, prompt_ids: Sequence[int], keys: list[bytes], count: bool) -> list[bytes]:
        """The prompt's chain as far as a lookup serves it, marked used and, with `count`, counted."""
        keys = keys[: self._match(prompt_ids, keys)]
        self._touch(keys)
        if count:
            self.queries += len(prompt_ids)
            self.hits += len(keys) * self.block
        return keys

    def _touch(self, keys: list[bytes]) -> None:
        """Mark a chain used, its first block most recently: evictions take leaves first."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)
