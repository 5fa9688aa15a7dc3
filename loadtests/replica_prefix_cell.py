"""Routing by prefix across replicas, measured (issue "Beyond one replica"): three real
`ferry serve` replicas on this machine's loopback, each publishing its prefix cache's KV
events (`--kv-events-config`, bind mode, a port each), and multi-turn conversations that
share a few system prompts, routed two ways over fresh replicas each time:

- round-robin, what a plain Service does;
- a router that follows the events, as llm-d's precise prefix-cache scorer does (for the
  figure only: the product relies on the real picker, docs/deploy.md): it subscribes to the
  three replicas, keeps which block hashes each holds (`BlockStored` adds, `BlockRemoved`
  drops, `AllBlocksCleared` forgets), tokenizes each request with the model's chat template,
  hashes its 16-token blocks with vLLM's scheme (engine/kv_events.py) and sends it to the
  replica holding the longest run of them from the first; ties to the replica with the
  fewest requests in flight, then the lowest index.

Each conversation is a closed loop of `--turns` requests, each turn's prompt the whole
conversation so far (its answers included). Reported per routing: the prefix-cache hit rate
(`usage.prompt_tokens_details.cached_tokens` over prompt tokens) and requests per second,
medians over `--repeats` rounds, and each round's ratio.

    python -m loadtests.bench_replicas --events [--chat-model default] [--repeats 3]
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import msgspec
import orjson
import zmq

from engine.kv_events import AllBlocksCleared, BlockHasher, BlockRemoved, BlockStored, KVEventBatch

from .openloop import GatewayProcess, free_port

SERVED = {"default": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "ferry-tiny-chat"}
BLOCK = 16  # Ferry's prefix-cache block (engine/prefix_cache.py DEFAULT_BLOCK)
SYSTEMS = (
    (
        "You are the harbour master of a busy ferry port. You know every timetable, every berth and every "
        "fare, and you answer travellers briefly and precisely, always naming the crossing you mean. "
    ),
    (
        "You are a ship's engineer who explains diesel engines, propellers and ballast to passengers who "
        "ask. Keep every answer to one or two sentences and never use jargon without explaining it. "
    ),
    (
        "You are a travel agent for island hopping. Suggest routes between the islands, mention how long "
        "each crossing takes, and warn about the last ferry of the day when it matters to the plan. "
    ),
)


def conversation_system(i: int) -> str:
    return SYSTEMS[i % len(SYSTEMS)] * 3  # ~120-150 tokens each


class EventIndex:
    """Which block hashes each replica holds, from the events it publishes."""

    def __init__(self, endpoints: list[str]) -> None:
        self.held: list[set[int | bytes]] = [set() for _ in endpoints]
        self.batches = 0
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._subs = []
        for endpoint in endpoints:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(endpoint)
            self._subs.append(sub)
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(100):
                _, _, payload = sock.recv_multipart()
                replica = self._subs.index(sock)
                batch = decode(payload)
                with self._lock:
                    self.batches += 1
                    for e in batch.events:
                        if isinstance(e, BlockStored):
                            self.held[replica].update(e.block_hashes)
                        elif isinstance(e, BlockRemoved):
                            self.held[replica].difference_update(e.block_hashes)
                        elif isinstance(e, AllBlocksCleared):
                            self.held[replica].clear()

    def run_held(self, replica: int, hashes: list[int | bytes]) -> int:
        with self._lock:
            held = self.held[replica]
            return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        for sub in self._subs:
            sub.close()
        self._ctx.term()


@dataclass
class RoundOutcome:
    routing: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def run_conversations(
    urls: list[str],
    model: str,
    pick,
    conversations: int,
    turns: int,
    max_tokens: int,
    outcome: RoundOutcome,
) -> None:
    in_flight = [0] * len(urls)

    async def conversation(c: int, client: httpx.AsyncClient) -> None:
        messages = [{"role": "system", "content": conversation_system(c)}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Traveller {c}, question {turn}: what about crossing {turn}?"})
            replica = pick(messages, in_flight)
            in_flight[replica] += 1
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            t0 = time.perf_counter()
            try:
                r = await client.post(
                    urls[replica] + "/v1/chat/completions",
                    content=orjson.dumps(body),
                    headers={"content-type": "application/json"},
                )
            finally:
                in_flight[replica] -= 1
            r.raise_for_status()
            out = r.json()
            outcome.latencies.append(time.perf_counter() - t0)
            usage = out["usage"]
            outcome.requests += 1
            outcome.prompt_tokens += usage["prompt_tokens"]
            outcome.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c, client) for c in range(conversations)))
        outcome.seconds = time.perf_counter() - t0


def tokenizer_for(chat_model: str):
    from engine.chat_tokenizer import ChatTokenizer

    if chat_model == "tiny":
        from engine.tiny_chat import ensure_tiny_chat

        path = str(ensure_tiny_chat())
    else:
        from gateway.models.catalogue import chat_directory

        path = chat_directory(None if chat_model == "default" else chat_model)[0]
    return ChatTokenizer(path, name=SERVED.get(chat_model, chat_model), max_context=1 << 20)


def one_round(chat_model: str, routing: str, conversations: int, turns: int, max_tokens: int) -> RoundOutcome:
    model = SERVED.get(chat_model, chat_model)
    ports = [free_port() for _ in range(3)]
    replicas = []
    try:
        for i, port in enumerate(ports):
            config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": f"kv@replica-{i}@{model}"}
            args = ["--embedding-model", "none", "--chat-model", chat_model, "--kv-events-config", json.dumps(config)]
            replicas.append(GatewayProcess(*args))
        urls = [r.url for r in replicas]
        outcome = RoundOutcome(routing)
        if routing == "round-robin":
            turn = itertools.cycle(range(3))

            def pick(messages, in_flight) -> int:
                return next(turn)

            asyncio.run(run_conversations(urls, model, pick, conversations, turns, max_tokens, outcome))
            return outcome
        index = EventIndex([f"tcp://127.0.0.1:{p}" for p in ports])
        tok, hasher = tokenizer_for(chat_model), BlockHasher()
        try:

            def pick(messages, in_flight) -> int:
                ids = tok.encode_chat(messages)
                hashes = [hasher.external(d) for d in hasher.chain(ids, BLOCK, len(ids) // BLOCK)]
                held = [index.run_held(i, hashes) for i in range(3)]
                return min(range(3), key=lambda i: (-held[i], in_flight[i], i))

            asyncio.run(run_conversations(urls, model, pick, conversations, turns, max_tokens, outcome))
        finally:
            index.close()
        return outcome
    finally:
        for r in replicas:
            r.stop()


def run_replica_cell(chat_model: str, repeats: int, conversations: int, turns: int, max_tokens: int) -> None:
    print(
        f"three replicas of {SERVED.get(chat_model, chat_model)} on loopback; {conversations} conversations of"
        f" {turns} turns ({len(SYSTEMS)} system prompts), {max_tokens} new tokens a turn; {repeats} rounds"
    )
    results: dict[str, list[RoundOutcome]] = {"round-robin": [], "events": []}
    for r in range(repeats):
        for routing in results:
            out = one_round(chat_model, routing, conversations, turns, max_tokens)
            results[routing].append(out)
            print(
                f"  round {r + 1} {routing:11s}: {out.requests} requests in {out.seconds:.1f} s = {out.rate:.2f} req/s,"
                f" prefix hits {100 * out.hit_rate:.1f}% of {out.prompt_tokens} prompt tokens,"
                f" p50 {statistics.median(out.latencies):.2f} s",
                flush=True,
            )
    print("\n| routing | req/s (median) | prefix hit rate (median) | p50 request s |\n| --- | --- | --- | --- |")
    for routing, outs in results.items():
        print(
            f"| {routing} | {statistics.median(o.rate for o in outs):.2f} "
            f"| {100 * statistics.median(o.hit_rate for o in outs):.1f}% "
            f"| {statistics.median(statistics.median(o.latencies) for o in outs):.2f} |"
        )
    ratios = [e.rate / rr.rate for rr, e in zip(results["round-robin"], results["events"], strict=True)]
    print(
        f"\nevents / round-robin req/s: {statistics.median(ratios):.2f}x (rounds: "
        + ", ".join(f"{x:.2f}" for x in ratios)
        + ")"
    )
