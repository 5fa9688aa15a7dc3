"""KV cache events, published as vLLM publishes them, for routers that follow each replica's
prefix cache (llm-d's precise prefix-cache scorer, issue "Beyond one replica").

Every block the prefix cache (engine/prefix_cache.py) stores, evicts or clears becomes an
event in vLLM's wire format (`vllm/distributed/kv_events.py`): a msgpack `EventBatch`
[ts, events, data_parallel_rank] of tagged `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` maps, sent on a ZMQ PUB socket as three frames (topic, an 8-byte
big-endian sequence number, the payload), in order. A subscriber that missed batches asks
the ROUTER socket at `replay_endpoint` for every buffered batch from a sequence number on
(8 bytes, big-endian) and gets them, then an end marker (sequence -1, empty payload).

Block hashes follow vLLM's `sha256_cbor` scheme, the one a Go indexer reproduces from the
token ids it tokenizes itself: hash = sha256(canonical CBOR of (parent hash, the block's
tokens as a tuple, None)), the first block's parent a root hash of sha256(CBOR of the seed),
the seed `PYTHONHASHSEED` where set and "vllm-none-hash" otherwise (vLLM's for sha256).
Events carry each hash as vLLM 0.32 does by default: its low 64 bits as an integer
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: the 32 bytes). The prefix cache keeps its own
blake2b keys for lookups; this hash rides beside each block, computed only when events are on.

`--kv-events-config` takes vLLM's JSON and gives each field vLLM's meaning: an `endpoint`
with a wildcard host (`tcp://*:5557`) or an ipc/inproc address binds the publisher; one
naming a host (`tcp://epp:5557`, llm-d's way) connects to a collector there.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import cbor2
import msgspec
import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

log = logging.getLogger("ferry.kv_events")

DEFAULT_SEED = "vllm-none-hash"  # vLLM's root seed for sha256 hashes when PYTHONHASHSEED is unset
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


class KVEventsConfig(BaseModel):
    """vLLM's `--kv-events-config`, field for field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = Field(False, description="publish the prefix cache's block events")
    publisher: Literal["null", "zmq"] | None = Field(
        None, description="`zmq`, or `null` (none); default: zmq if enabled"
    )
    endpoint: str = Field(
        "tcp://*:5557", min_length=1, description="PUB address: a wildcard host binds, a host connects"
    )
    replay_endpoint: str | None = Field(None, description="ROUTER address subscribers ask for missed batches")
    buffer_steps: int = Field(10_000, ge=1, description="batches kept for replay")
    hwm: int = Field(100_000, ge=0, description="the PUB socket's high-water mark (messages)")
    max_queue_size: int = Field(100_000, ge=1, description="batches waiting for the publisher thread")
    topic: str = Field("", description="the topic frame of every message (llm-d: kv@<pod ip>@<model>)")

    @model_validator(mode="after")
    def _default_publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        return self

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(value: str | dict[str, Any] | None) -> KVEventsConfig | None:
    """A `--kv-events-config` value (vLLM's JSON, or its mapping from a config file) checked;
    ValueError with one line naming the field when it is not."""
    if value is None or value == "":
        return None
    try:
        if isinstance(value, str):
            return KVEventsConfig.model_validate_json(value)
        return KVEventsConfig.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "value"
        raise ValueError(f"kv_events_config: {where}: {first['msg']}") from None


# -- vLLM's schema (msgspec structs, encoded as vLLM encodes them) ---------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name, as vLLM's."""


BlockHashOut = bytes | int  # vLLM's ExternalBlockHash


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHashOut]
    parent_block_hash: BlockHashOut | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHashOut]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- vLLM's block hashes --------------------------------------------------------------------
def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class BlockHasher:
    """vLLM's `hash_block_tokens` with `sha256_cbor`, and its root seed."""

    def __init__(self, seed: str | None = None) -> None:
        self.seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
        self.root = sha256_cbor(self.seed)
        self.as_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") not in ("", "0")

    def block(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return sha256_cbor((parent or self.root, tuple(tokens), None))

    def chain(self, token_ids: Sequence[int], block: int, blocks: int, parent: bytes | None = None) -> list[bytes]:
        """The hashes of the first `blocks` full blocks of `token_ids`, after `parent`."""
        hashes = []
        for i in range(blocks):
            parent = self.block(parent, token_ids[i * block : (i + 1) * block])
            hashes.append(parent)
        return hashes

    def external(self, digest: bytes) -> BlockHashOut:
        """How an event carries a hash (vLLM's `maybe_convert_block_hash`)."""
        return int.from_bytes(digest, "big") & ((1 << 64) - 1) if self.as_int else digest


# -- the publisher --------------------------------------------------------------------------
def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or an ipc/inproc address binds; a named host connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket plus a ROUTER for replays, served by one thread from a queue (sockets are
    not thread-safe: only that thread touches them). Batches are numbered from 0."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self.endpoint = _open(self._pub, config.endpoint)
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, config.replay_endpoint)
        self.published = 0
        self.dropped = 0
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="ferry-kv-events", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        log.info(
            "publishing KV cache events",
            extra={"endpoint": self.endpoint, "replay": self.replay_endpoint, "topic": config.topic},
        )

    def publish(self, batch: EventBatch) -> None:
        """Queue a batch for the thread; a full queue drops it (counted), never blocks the engine."""
        if not self._running:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        atexit.unregister(self.close)

    def _serve(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encode(batch)
                number = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, number, payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.published = seq
        except Exception:  # the engine goes on without events; say so once
            log.exception("KV cache event publisher stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV event replay request")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))  # type: ignore[union-attr]


def _open(sock: zmq.Socket, endpoint: str) -> str:
    if binds(endpoint):
        return _bind(sock, endpoint)
    sock.connect(endpoint)
    return endpoint


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; a tcp port of 0 takes a free one. Returns the endpoint bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = sock.bind_to_random_port(endpoint[: -len(":0")])
        return f"{endpoint[: -len(':0')]}:{port}"
    sock.bind(endpoint)
    return endpoint


class BlockEvents:
    """What the prefix cache reports, as events: collected while it changes, published as
    one batch when it is done (`flush`), in the order they happened."""

    def __init__(self, publisher: ZmqEventPublisher, block: int, medium: str, hasher: BlockHasher | None = None):
        self.publisher = publisher
        self.block = block
        self.medium = medium
        self.hasher = hasher or BlockHasher()
        self._events: list[KVCacheEvent] = []
        # A new cache holds nothing: an indexer that knew this replica before forgets it.
        self._events.append(AllBlocksCleared())
        self.flush()

    def stored(self, parent: bytes | None, hashes: list[bytes], token_ids: Sequence[int]) -> None:
        x = self.hasher.external
        self._events.append(
            BlockStored(
                block_hashes=[x(h) for h in hashes],
                parent_block_hash=None if parent is None else x(parent),
                token_ids=list(token_ids),
                block_size=self.block,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
                group_idx=0,
            )
        )

    def removed(self, digest: bytes) -> None:
        self._events.append(BlockRemoved(block_hashes=[self.hasher.external(digest)], medium=self.medium, group_idx=0))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self.publisher.publish(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def block_events(config: KVEventsConfig | None, block: int, medium: str) -> BlockEvents | None:
    """The events of a prefix cache of `block`-token blocks, or None when not enabled."""
    if config is None or not config.enabled:
        return None
    return BlockEvents(ZmqEventPublisher(config), block, medium)


def cache_events(
    config: KVEventsConfig | dict[str, Any] | str | None, cache: Any, on_gpu: bool, name: str
) -> BlockEvents | None:
    """The events of a chat engine's prefix cache (engine/prefix_cache.py), attached to it,
    where `config` enables them (the medium named as vLLM names its: GPU for a CUDA
    device's cache, else CPU)."""
    parsed = config if isinstance(config, KVEventsConfig) else parse_kv_events_config(config)
    if parsed is None or not parsed.enabled:
        return None
    if cache is None:
        log.warning("KV cache events of %s: none to publish, its prefix cache is off", name)
        return None
    cache.events = block_events(parsed, cache.block, "GPU" if on_gpu else "CPU")
    return cache.events
