"""KV cache events in vLLM's wire format: hashes that match vLLM's, batches a subscriber
decodes with structs of vLLM's schema (declared here, apart from engine/kv_events.py's, so
a drift of either shows), sequence numbers, the replay socket, both endpoint modes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
import zmq

from engine.kv_events import (
    BlockEvents,
    BlockHasher,
    KVEventsConfig,
    ZmqEventPublisher,
    parse_kv_events_config,
)
from engine.prefix_cache import PrefixCache

# Computed with vLLM 0.32's own functions (`init_none_hash(sha256_cbor)`, then
# `hash_block_tokens(sha256_cbor, parent, tokens, None)`), PYTHONHASHSEED unset.
VLLM_ROOT = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
VLLM_BLOCK_1_16 = "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"
VLLM_BLOCK_17_32_AFTER = "2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf"


# -- vLLM's schema, as its decoder (vllm/distributed/kv_events.py) declares it ----------------
class Batch(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class Event(msgspec.Struct, omit_defaults=True, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(Event):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(Event):
    pass


class KVBatch(Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVBatch).decode


def low64(hex_digest: str) -> int:
    return int(hex_digest, 16) & ((1 << 64) - 1)


@pytest.fixture(autouse=True)
def vllm_defaults(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)


# -- hashes ----------------------------------------------------------------------------------
def test_block_hashes_equal_vllms_sha256_cbor_for_the_same_tokens():
    h = BlockHasher()
    assert h.root.hex() == VLLM_ROOT
    first, second = h.chain(list(range(1, 33)), 16, 2)
    assert first.hex() == VLLM_BLOCK_1_16
    assert second.hex() == VLLM_BLOCK_17_32_AFTER
    assert h.external(first) == low64(VLLM_BLOCK_1_16)  # vLLM 0.32's default in events: the low 64 bits


def test_the_seed_is_pythonhashseed_as_in_vllm(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    h = BlockHasher()
    assert h.seed == "42" and h.root.hex() != VLLM_ROOT
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert BlockHasher().external(b"\x01" * 32) == b"\x01" * 32


# -- config ----------------------------------------------------------------------------------
def test_vllms_json_is_taken_with_its_meaning():
    c = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv@1.2.3.4@m"}'
    )
    assert c is not None and c.enabled and c.buffer_steps == 10_000 and c.replay_endpoint is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').publisher == "zmq"  # type: ignore[union-attr]
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').enabled  # type: ignore[union-attr]
    assert parse_kv_events_config(None) is None
    with pytest.raises(ValueError, match="buffer_steps"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "buffer_steps": 0}')
    with pytest.raises(ValueError, match="endpont"):
        parse_kv_events_config('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher"):
        parse_kv_events_config('{"publisher": "kafka"}')


# -- publishing ------------------------------------------------------------------------------
BLOCK = 4


def kv_of(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer's keys and values for `tokens` tokens (1 head, head_dim 2): 16 bytes a token."""
    return [(torch.zeros(1, tokens, 2), torch.zeros(1, tokens, 2))]


def receive(sub: zmq.Socket, n: int) -> list[tuple[bytes, int, KVBatch]]:
    out = []
    for _ in range(n):
        assert sub.poll(5000), "no event batch came"
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), DECODE(payload)))
    return out


def subscribed(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def await_subscription(events: BlockEvents, sub: zmq.Socket) -> None:
    """PUB drops what it sends before a subscriber has joined: send empty clears until one
    arrives (each is a batch of its own), then drain them."""
    for _ in range(100):
        events.cleared()
        events.flush()
        if sub.poll(100):
            break
    while sub.poll(200):
        sub.recv_multipart()


def test_stores_evictions_and_clears_are_published_in_order_with_vllms_hashes():
    ctx = zmq.Context()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", topic="kv@10.0.0.7@m")
    publisher = ZmqEventPublisher(config, ctx)
    events = BlockEvents(publisher, BLOCK, "CPU")
    sub = subscribed(ctx, publisher.endpoint.replace("*", "127.0.0.1"))
    try:
        await_subscription(events, sub)
        cache = PrefixCache(max_bytes=3 * 2 * BLOCK * 2 * 4, block=BLOCK, events=events)  # three blocks of 64 bytes
        prompt = list(range(100, 109))  # two full blocks and one token
        assert cache.store(prompt, kv_of(9)) == 2
        ((topic, seq, batch),) = receive(sub, 1)
        assert topic == b"kv@10.0.0.7@m" and batch.data_parallel_rank == 0
        (stored,) = batch.events
        h = BlockHasher()
        first, second = h.chain(prompt, BLOCK, 2)
        assert isinstance(stored, BlockStored)
        assert stored.block_hashes == [h.external(first), h.external(second)]
        assert stored.parent_block_hash is None and stored.token_ids == prompt[:8]
        assert stored.block_size == BLOCK and stored.medium == "CPU" and stored.lora_id is None

        # A longer prompt on the same prefix: its third block, chained on the second.
        longer = [*prompt[:8], 7, 7, 7, 7]
        assert cache.store(longer, kv_of(12)) == 1
        ((_, seq2, batch),) = receive(sub, 1)
        assert seq2 == seq + 1
        (stored,) = batch.events
        assert stored.parent_block_hash == h.external(second)
        assert stored.block_hashes == [h.external(h.block(second, [7, 7, 7, 7]))]

        # A prompt of its own evicts the least recently used leaf first, then stores.
        other = [1, 2, 3, 4, 5]
        assert cache.store(other, kv_of(5)) == 1
        ((_, _, batch),) = receive(sub, 1)
        removed, stored = batch.events
        assert isinstance(removed, BlockRemoved) and isinstance(stored, BlockStored)
        assert removed.block_hashes == [h.external(h.block(second, [7, 7, 7, 7]))]
        assert stored.block_hashes == [h.external(h.block(None, [1, 2, 3, 4]))]

        cache.clear()
        ((_, _, batch),) = receive(sub, 1)
        assert [type(e) for e in batch.events] == [AllBlocksCleared]
    finally:
        sub.close()
        events.close()
        ctx.term()


def test_a_subscriber_that_missed_batches_gets_them_from_the_replay_socket():
    ctx = zmq.Context()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    publisher = ZmqEventPublisher(config, ctx)
    events = BlockEvents(publisher, BLOCK, "CPU")  # batch 0: the new cache holds nothing
    cache = PrefixCache(max_bytes=1 << 20, block=BLOCK, events=events)
    cache.store([1, 2, 3, 4, 5], kv_of(5))  # batch 1
    cache.store([9, 9, 9, 9, 9], kv_of(5))  # batch 2
    req = ctx.socket(zmq.DEALER)  # one request, many replies
    req.setsockopt(zmq.LINGER, 0)
    req.connect(publisher.replay_endpoint.replace("*", "127.0.0.1"))
    try:
        for _ in range(100):  # the publisher thread numbers the batches as it sends them
            if publisher.published == 3:
                break
            assert req.poll(20) == 0
        req.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            assert req.poll(5000)
            _, _topic, seq, payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), DECODE(payload)))
        assert [s for s, _ in replayed] == [1, 2]
        assert [e.token_ids for _, b in replayed for e in b.events] == [[1, 2, 3, 4], [9, 9, 9, 9]]
    finally:
        req.close()
        events.close()
        ctx.term()


def test_an_endpoint_naming_a_host_connects_to_a_collector_there():
    """llm-d's way: the endpoint picker binds, each replica connects to it."""
    ctx = zmq.Context()
    collector = ctx.socket(zmq.SUB)
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    collector.setsockopt(zmq.LINGER, 0)
    port = collector.bind_to_random_port("tcp://127.0.0.1")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}", topic="kv@p@m")
    events = BlockEvents(ZmqEventPublisher(config, ctx), BLOCK, "GPU")
    try:
        await_subscription(events, collector)
        PrefixCache(max_bytes=1 << 20, block=BLOCK, events=events).store([5, 6, 7, 8, 9], kv_of(5))
        ((topic, _, batch),) = receive(collector, 1)
        assert topic == b"kv@p@m" and batch.events[0].medium == "GPU"
    finally:
        collector.close()
        events.close()
        ctx.term()


@pytest.mark.model
def test_a_chat_engines_prefill_publishes_its_prompts_blocks(tiny_chat_dir):
    """The engine's own prefix cache, through `kv_events`: a subscriber sees the prompt's
    full blocks with the hashes an indexer computes from the same token ids."""
    from engine.base import SamplingParams, SequenceRequest
    from engine.generation import HFGenerationEngine

    ctx = zmq.Context.instance()
    collector = ctx.socket(zmq.SUB)
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    collector.setsockopt(zmq.LINGER, 0)
    port = collector.bind_to_random_port("tcp://127.0.0.1")
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv@pod@tiny"}
    engine = HFGenerationEngine(str(tiny_chat_dir), max_running=2, kv_events=config)
    try:
        assert engine.kv_events is not None
        await_subscription(engine.kv_events, collector)
        prompt = engine.encode_prompt("Ferry publishes the blocks of this prompt to the router. " * 3)
        engine.add([SequenceRequest(1, prompt, SamplingParams(max_tokens=1, temperature=0))])
        stored = []
        while len(stored) * 16 < len(prompt) // 16 * 16 and collector.poll(5000):
            _, _, payload = collector.recv_multipart()
            stored += [h for e in DECODE(payload).events if isinstance(e, BlockStored) for h in e.block_hashes]
        h = BlockHasher()
        assert stored == [h.external(d) for d in h.chain(prompt, 16, len(prompt) // 16)]
    finally:
        collector.close()
        engine.kv_events.close()
