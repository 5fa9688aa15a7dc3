"""PrefixCache on plain tensors: chained keys, the never-the-last-token rule, LRU order
that evicts chain tails first, the byte budget, counters, and copies (never views).

A token's fake key encodes (layer, position, token), so a block served for the wrong
prefix or position shows up as a wrong number."""

from __future__ import annotations

import pytest
import torch

import engine.prefix_cache as prefix_cache_module
from engine.prefix_cache import PrefixCache, chain_keys

LAYERS, HEADS, DIM, BLOCK = 2, 2, 3, 4


def kv_of(prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer [heads, len(prompt), dim]: what a forward over `prompt` would leave."""
    layers = []
    for layer in range(LAYERS):
        keys = torch.tensor([float(layer * 1_000_000 + pos * 1_000 + tok) for pos, tok in enumerate(prompt)])
        keys = keys.view(1, -1, 1).expand(HEADS, -1, DIM).clone()
        layers.append((keys, -keys))
    return layers


def assert_serves(cache: PrefixCache, prompt: list[int], tokens: int) -> None:
    n, kv = cache.lookup(prompt, count=False)
    assert n == tokens
    if not tokens:
        assert kv is None
        return
    assert kv is not None
    assert kv.shape == (LAYERS, 2, HEADS, tokens, DIM)
    for layer, (keys, values) in enumerate(kv_of(prompt[:tokens])):
        assert torch.equal(kv[layer, 0], keys) and torch.equal(kv[layer, 1], values)


def block_bytes() -> int:
    return LAYERS * 2 * HEADS * BLOCK * DIM * 4  # float32


def stored(cache: PrefixCache, prompt: list[int]) -> int:
    return cache.store(prompt, kv_of(prompt))


def test_keys_chain_each_block_onto_the_whole_prefix_before_it():
    a = chain_keys(list(range(12)), BLOCK)
    assert len(a) == 3 and len(set(a)) == 3
    assert chain_keys([*range(8), 99, 99], BLOCK) == a[:2]  # partial blocks have no key
    # The same third block after a different first block is a different key.
    b = chain_keys([7, 1, 2, 3, *range(4, 12)], BLOCK)
    assert not set(a) & set(b)
    assert chain_keys(list(range(12)), BLOCK, blocks=1) == a[:1]


def test_lookup_serves_full_blocks_but_never_the_last_token():
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    assert stored(cache, prompt) == 2
    assert_serves(cache, prompt, 4)  # 8 tokens: the second block holds the last token
    assert_serves(cache, [*prompt, 13], 8)  # one token left to feed
    assert_serves(cache, [*prompt[:6], 0, 0, 0], 4)  # diverges inside block 2
    assert_serves(cache, [0, *prompt[1:], 1], 0)  # diverges in block 1: nothing after it counts
    assert_serves(cache, prompt[:3], 0)  # shorter than a block
    assert stored(cache, prompt) == 0  # already there
    assert stored(cache, [*prompt, 1, 2, 3, 4]) == 1


def test_counters_count_prompt_tokens_and_tokens_served():
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK)
    prompt = list(range(1, 10))
    assert cache.lookup(prompt) == (0, None)
    stored(cache, prompt)
    n, _ = cache.lookup(prompt)
    assert n == 8
    cache.lookup_many([prompt, prompt[:5]])
    cache.lookup(prompt, count=False)
    assert (cache.queries, cache.hits) == (9 + 9 + 9 + 5, 0 + 8 + 8 + 4)
    assert cache.stats() == {
        "queries": 32,
        "hits": 20,
        "used_bytes": 2 * block_bytes(),
        "max_bytes": 1 << 20,
        "blocks": 2,
    }


def test_prompts_with_one_cached_prefix_share_one_tensor():
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK)
    stored(cache, list(range(9)))
    (n1, kv1), (n2, kv2), (n3, _) = cache.lookup_many([[*range(8), 50], [*range(8), 60], [*range(4), 0, 0]])
    assert (n1, n2, n3) == (8, 8, 4)
    assert kv1 is kv2


def test_least_recently_used_blocks_go_first_and_chain_tails_before_their_heads():
    cache = PrefixCache(max_bytes=4 * block_bytes(), block=BLOCK)
    a, b = list(range(100, 113)), list(range(200, 209))  # 3 and 2 full blocks
    stored(cache, a)
    assert len(cache) == 3
    stored(cache, b)  # one block must go: a's tail, never a's head (that would strand the rest)
    assert len(cache) == 4 and cache.used_bytes == 4 * block_bytes()
    assert_serves(cache, a, 8)
    assert_serves(cache, b, 8)
    cache.lookup(a)  # a used more recently than b now
    stored(cache, list(range(300, 309)))  # two blocks in: b's two go
    assert_serves(cache, b, 0)
    assert_serves(cache, a, 8)


def test_a_chain_over_budget_keeps_its_first_blocks():
    cache = PrefixCache(max_bytes=2 * block_bytes() + 10, block=BLOCK)
    prompt = list(range(40))
    assert stored(cache, prompt) == 2
    assert cache.used_bytes == 2 * block_bytes() <= cache.max_bytes
    assert_serves(cache, prompt, 8)
    empty = PrefixCache(max_bytes=0, block=BLOCK)
    assert stored(empty, prompt) == 0 and empty.used_bytes == 0
    assert_serves(empty, prompt, 0)


def test_entries_are_copies_of_what_was_stored():
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK)
    prompt = list(range(9))
    kv = kv_of(prompt)
    cache.store(prompt, kv)
    for keys, values in kv:
        keys.fill_(-7)
        values.fill_(-7)
    assert_serves(cache, prompt, 8)


def test_clear_empties_the_cache_and_keeps_the_counters():
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK)
    stored(cache, list(range(9)))
    cache.lookup(list(range(9)))
    cache.clear()
    assert (len(cache), cache.used_bytes, cache.hits) == (0, 0, 8)
    assert_serves(cache, list(range(9)), 0)


def test_a_hash_collision_never_serves_another_prefix(monkeypatch):
    # Keys that depend on the block index only: every prompt collides with every other.
    def colliding(prompt_ids, block, blocks=None, known=()):
        n = len(prompt_ids) // block if blocks is None else min(blocks, len(prompt_ids) // block)
        return [bytes([i]) for i in range(n)]

    monkeypatch.setattr(prefix_cache_module, "chain_keys", colliding)
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK)
    x, y = list(range(9)), list(range(50, 59))
    stored(cache, x)
    assert_serves(cache, y, 0)
    assert stored(cache, y) == 0  # does not replace x's blocks either
    assert_serves(cache, x, 8)


@pytest.mark.parametrize(("max_bytes", "block", "setting"), [(-1, 16, "prefix_cache_bytes"), (1, 0, "prefix_block")])
def test_bad_settings_fail_at_construction_naming_the_setting(max_bytes, block, setting):
    with pytest.raises(ValueError, match=setting):
        PrefixCache(max_bytes, block)


def test_lookup_into_copies_the_served_prefix_into_a_buffer_with_room_for_the_prompt():
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK)
    stored(cache, list(range(10)))  # two full blocks
    prompt = [*range(8), 50, 51, 52]
    keys = chain_keys(prompt, BLOCK, cache.usable_blocks(len(prompt)))
    n, buffer = cache.lookup_into(prompt, len(prompt), keys)
    assert n == 8 and buffer is not None
    assert buffer.shape == (LAYERS, 2, HEADS, len(prompt), DIM)  # the rest is the prompt's to fill
    for layer, (k, v) in enumerate(kv_of(prompt[:8])):
        assert torch.equal(buffer[layer, 0, :, :8], k) and torch.equal(buffer[layer, 1, :, :8], v)
    assert (cache.queries, cache.hits) == (len(prompt), 8)
    other = [9, *range(1, 11)]
    assert cache.lookup_into(other, len(other), chain_keys(other, BLOCK, 2)) == (0, None)


def test_lookup_into_serves_but_does_not_copy_the_blocks_the_caller_holds_elsewhere(nan_empty):
    """`skip`: the first blocks are held elsewhere (a prefix held for running rows): counted
    as served, left unwritten (NaN in new buffers here), the rest copied in place."""
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK)
    stored(cache, list(range(13)))  # three full blocks
    prompt = [*range(12), 70, 71]
    keys = chain_keys(prompt, BLOCK, cache.usable_blocks(len(prompt)))
    n, buffer = cache.lookup_into(prompt, len(prompt), keys, skip=BLOCK)
    assert n == 12 and buffer is not None
    assert torch.isnan(buffer[:, :, :, :BLOCK]).all()
    for layer, (k, v) in enumerate(kv_of(prompt[:12])):
        assert torch.equal(buffer[layer, 0, :, BLOCK:12], k[:, BLOCK:])
        assert torch.equal(buffer[layer, 1, :, BLOCK:12], v[:, BLOCK:])
    assert (cache.queries, cache.hits) == (len(prompt), 12)


def test_the_load_line_says_the_cache_is_on_while_it_is_still_empty(tiny_chat_dir, caplog):
    """An empty cache has length 0: the load line once read it as off, and an operator
    reading the log turned on what was already on."""
    import logging

    from engine.generation import HFGenerationEngine

    with caplog.at_level(logging.INFO, logger="ferry.engine"):
        on = HFGenerationEngine(str(tiny_chat_dir), name="t-on")
        off = HFGenerationEngine(str(tiny_chat_dir), name="t-off", prefix_caching=False)
    lines = {m.split(" on ")[0]: m for m in (r.getMessage() for r in caplog.records) if "loaded chat model" in m}
    del on, off
    on_line = lines["loaded chat model t-on"]
    assert "prefix cache off" not in on_line and "-token blocks" in on_line
    assert "prefix cache off" in lines["loaded chat model t-off"]
