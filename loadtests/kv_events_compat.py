"""Does vLLM read Ferry's KV cache events? A live `ferry serve --kv-events-config`, chat
requests that share a system prompt (and a prefix cache small enough to evict), every event
batch it published taken back through the replay socket, then handed to a python that has
vLLM (`--vllm-python`, a venv of its own, never part of `make test`), which decodes each with
vLLM's own `vllm.distributed.kv_events.KVEventBatch` and recomputes every stored block's hash
with vLLM's `hash_block_tokens(sha256_cbor, ...)` from the token ids in the event.

Ferry runs with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` here, so the events carry whole
32-byte hashes and each block's hash can be recomputed from its parent's; the 64-bit form (the
default) is the same hash cut by vLLM's own `maybe_convert_block_hash`, checked as well.

    python -m loadtests.kv_events_compat --vllm-python /tmp/vllm-venv/bin/python [--chat-model tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import httpx
import orjson
import zmq

from .openloop import GatewayProcess, free_port

SERVED = {"default": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "ferry-tiny-chat"}
SYSTEM = "You are the ferry's purser. Answer in one short sentence, politely, about timetables and fares. " * 4

# Run by the vLLM python: decode with vLLM's classes, recompute with vLLM's hash.
CHECK = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k
k.init_none_hash(sha256_cbor)
frames = json.load(sys.stdin)
decode = msgspec.msgpack.Decoder(KVEventBatch).decode
counts = {"batches": 0, "stored_blocks": 0, "removed_blocks": 0, "cleared": 0, "mismatches": 0}
for payload in frames:
    batch = decode(bytes.fromhex(payload))
    counts["batches"] += 1
    for e in batch.events:
        if isinstance(e, BlockStored):
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                tokens = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
                mine = k.hash_block_tokens(sha256_cbor, parent, tokens, None)
                counts["stored_blocks"] += 1
                counts["mismatches"] += mine != h
                parent = mine
        elif isinstance(e, BlockRemoved):
            counts["removed_blocks"] += len(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            counts["cleared"] += 1
digest = k.hash_block_tokens(sha256_cbor, None, list(range(16)), None)
counts["int_form"] = k.maybe_convert_block_hash(digest)  # vLLM's default: an int of the low 64 bits
print(json.dumps(counts))
"""


def collect(chat_model: str, requests: int, prefix_cache_mb: int) -> tuple[list[str], dict]:
    port, replay = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": f"kv@127.0.0.1@{SERVED.get(chat_model, chat_model)}",
    }
    args = ["--embedding-model", "none", "--chat-model", chat_model, "--prefix-cache-mb", str(prefix_cache_mb)]
    env = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}
    with GatewayProcess(*args, "--kv-events-config", json.dumps(config), env=env) as gw:
        model = SERVED.get(chat_model, chat_model)
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            for i in range(requests):
                body = {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": SYSTEM if i % 2 == 0 else f"Passenger {i}. " * 30},
                        {"role": "user", "content": f"Question {i}: when does the {i}th crossing leave?"},
                    ],
                    "max_tokens": 4,
                    "temperature": 0,
                }
                r = http.post(
                    "/v1/chat/completions", content=orjson.dumps(body), headers={"content-type": "application/json"}
                )
                r.raise_for_status()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{replay}")
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        payloads, topics = [], set()
        while True:
            if not sock.poll(10_000):
                raise RuntimeError("the replay socket did not answer")
            _, topic, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            topics.add(topic.decode())
            payloads.append(payload.hex())
        sock.close()
        ctx.term()
    return payloads, {"topics": sorted(topics)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="a python whose environment has vllm")
    p.add_argument("--chat-model", default="tiny")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prefix-cache-mb", type=int, default=1, help="small, so that blocks are evicted too")
    a = p.parse_args()
    payloads, seen = collect(a.chat_model, a.requests, a.prefix_cache_mb)
    with tempfile.TemporaryFile("w+") as f:
        json.dump(payloads, f)
        f.seek(0)
        env = {k: v for k, v in os.environ.items() if k != "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"}
        out = subprocess.run(
            [a.vllm_python, "-c", CHECK], stdin=f, capture_output=True, text=True, check=False, env=env
        )
    if out.returncode != 0:
        sys.exit(f"vLLM's check failed:\n{out.stderr[-3000:]}")
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    from engine.kv_events import BlockHasher

    ours = BlockHasher(seed=None)
    ours.as_int = True
    expected_int = ours.external(ours.block(None, list(range(16))))
    counts["int_form_matches"] = counts.pop("int_form") == expected_int
    print(f"Ferry ({a.chat_model}) -> vLLM's decoder: {json.dumps({**counts, **seen})}")
    if counts["mismatches"] or not counts["stored_blocks"] or not counts["int_form_matches"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
