"""Routing across replicas: a SIMULATION, not a measurement (issue: Beyond one machine).

Three simulated Ferry chat replicas, one of them twice as slow, receive the same open-loop
Poisson load of chat requests, routed two ways:

- round-robin: what a plain Kubernetes Service (or nginx without health metrics) does;
- an endpoint picker that scores replicas from their scraped metrics as the Gateway API
  Inference Extension's endpoint picker (the llm-d router's EPP) does: its queue scorer
  ((max - q) / (max - min) of `ferry_queue_depth` over the candidates) plus its KV-cache
  utilisation scorer (1 - `ferry_kv_cache_usage_ratio`), equal weights, the highest score
  wins (ties to the lowest index). Each replica renders its /metrics body with
  prometheus-client, and the picker reads it with prometheus-client's parser every 50 ms
  (no HTTP: the simulation has no sockets). So the picker sees each replica as it was at
  its last scrape, not now; a replica whose metrics are older than 2 s counts as saturated
  and is picked only when every replica is.

Each replica does continuous batching: at every decode step it admits waiting requests in
arrival order while it has a free slot (at most 32 running) and KV room for the prompt and the
whole completion (reserved at admission, released at the end); a step costs
`batcher.cost.LinearCost(fixed, per running sequence, per prefilled prompt token)` seconds,
times 2 on the slow replica. Prompts are 16..256 tokens, completions 4..64 (uniform). A
request meets the SLO when its time to first token is within `--ttft-slo-ms` and its mean
time per output token after the first within `--tpot-slo-ms`; goodput is such requests per
second. Time is simulated (a heap of events), so a run is deterministic for its seed and
takes well under a minute of CPU.

    python -m loadtests.bench_replicas [--seeds 5] [--duration 120] [--load 0.7]

`--events` runs instead the measured cell of real replicas routed by the KV cache events
they publish, against round-robin (loadtests/replica_prefix_cell.py).

Prints, per routing, the medians over the seeds of p99 end-to-end latency, p99 time to
first token, goodput and each replica's share of the requests; then the ratios.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batcher.cost import LinearCost
from tuner.percentile import percentile

# The cost of one decode step of a simulated replica (the same form as engine/fake.py's
# SimulatedEngineThread, fixed + per running row, plus the prompt tokens prefilled in it).
STEP_COST = LinearCost(fixed=0.010, per_item=0.001, per_token=0.00005)
PROMPT_TOKENS = (16, 256)
OUTPUT_TOKENS = (4, 64)
SCRAPE_INTERVAL_S = 0.050  # the EPP scrapes /metrics about every 50 ms
STALE_AFTER_S = 2.0  # metrics older than this: the replica counts as saturated
MODEL = "chat"  # the one model every replica serves


@dataclass
class Request:
    id: int
    arrival: float
    prompt: int
    output: int
    replica: int = -1
    generated: int = 0
    first_token: float | None = None
    finished: float | None = None

    @property
    def kv_need(self) -> int:
        return self.prompt + self.output


@dataclass(frozen=True)
class Scrape:
    """What one scrape of a replica's /metrics says (Ferry's series for the one model)."""

    at: float
    queue_depth: int  # ferry_queue_depth
    running: int  # ferry_running_sequences
    kv_usage: float  # ferry_kv_cache_usage_ratio, 0..1


def read_metrics(text: str, at: float, model: str = MODEL) -> Scrape:
    """What the picker keeps of one scrape: the model's series in Prometheus text format,
    read with prometheus-client's parser (queue depth summed over the priority classes)."""
    queue, running, kv = 0.0, 0.0, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name == "ferry_queue_depth":
                queue += sample.value
            elif sample.name == "ferry_running_sequences":
                running = sample.value
            elif sample.name == "ferry_kv_cache_usage_ratio":
                kv = sample.value
    return Scrape(at, int(queue), int(running), kv)


@dataclass
class Replica:
    name: str
    slowdown: float = 1.0
    max_running: int = 32
    kv_capacity: int = 4096  # tokens
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    kv_reserved: int = 0
    stepping: bool = False
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        # The three series the endpoint picker reads, named and labelled as Ferry exports them.
        r = self.registry
        self._queue = Gauge("ferry_queue_depth", "Items waiting in the queue.", ["model", "class"], registry=r)
        self._running = Gauge("ferry_running_sequences", "Sequences in the running batch.", ["model"], registry=r)
        self._kv = Gauge("ferry_kv_cache_usage_ratio", "Share of the KV cache in use.", ["model"], registry=r)

    def metrics(self) -> str:
        """The replica's /metrics body now."""
        self._queue.labels(MODEL, "interactive").set(len(self.waiting))
        self._running.labels(MODEL).set(len(self.running))
        self._kv.labels(MODEL).set(self.kv_reserved / self.kv_capacity)
        return generate_latest(self.registry).decode()

    def scrape(self, now: float) -> Scrape:
        return read_metrics(self.metrics(), now)

    def start_step(self) -> float:
        """Admit what fits, then return the step's duration."""
        prefill = 0
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            if self.kv_reserved + head.kv_need > self.kv_capacity and self.running:
                break  # wait for room (a request larger than the whole cache still runs alone)
            self.waiting.popleft()
            self.running.append(head)
            self.kv_reserved += head.kv_need
            prefill += head.prompt
        return STEP_COST.predict(len(self.running), prefill) * self.slowdown

    def end_step(self, now: float) -> None:
        """Every running sequence got one token; finished ones leave and free their KV."""
        still = []
        for r in self.running:
            r.generated += 1
            if r.first_token is None:
                r.first_token = now
            if r.generated >= r.output:
                r.finished = now
                self.kv_reserved -= r.kv_need
            else:
                still.append(r)
        self.running = still


def replica_capacity(replica: Replica) -> float:
    """Requests/s a replica sustains when full (mean prompt and completion), for sizing the load."""
    prompt = sum(PROMPT_TOKENS) / 2
    output = sum(OUTPUT_TOKENS) / 2
    rows = min(replica.max_running, int(replica.kv_capacity // (prompt + output)))
    # Per step: every row decodes one token, and rows/output requests arrive to be prefilled.
    step = STEP_COST.predict(rows, int(rows / output * prompt)) * replica.slowdown
    return rows / output / step


# -- routing --------------------------------------------------------------------------------


class RoundRobin:
    name = "round-robin"
    reads_metrics = False

    def __init__(self) -> None:
        self._next = itertools.count()

    def pick(self, scrapes: Sequence[Scrape | None], now: float) -> int:
        return next(self._next) % len(scrapes)


class MetricPicker:
    """The EPP's scoring over the last scrape of each replica: queue scorer + KV-cache scorer."""

    name = "endpoint picker (queue + KV)"
    reads_metrics = True

    def __init__(self, queue_weight: float = 1.0, kv_weight: float = 1.0, stale_after: float = STALE_AFTER_S):
        self.queue_weight, self.kv_weight, self.stale_after = queue_weight, kv_weight, stale_after

    def scores(self, scrapes: Sequence[Scrape | None], now: float) -> list[float]:
        fresh = [i for i, s in enumerate(scrapes) if s is not None and now - s.at <= self.stale_after]
        # Saturated replicas (stale or never scraped) are candidates only when all are.
        candidates = fresh or list(range(len(scrapes)))
        scores = [float("-inf")] * len(scrapes)
        depths = [s.queue_depth if (s := scrapes[i]) else 0 for i in candidates]
        low, high = min(depths), max(depths)
        for i, depth in zip(candidates, depths, strict=True):
            s = scrapes[i]
            queue = 1.0 if high == low else (high - depth) / (high - low)
            kv = 1.0 - (s.kv_usage if s else 0.0)
            scores[i] = self.queue_weight * queue + self.kv_weight * kv
        return scores

    def pick(self, scrapes: Sequence[Scrape | None], now: float) -> int:
        scores = self.scores(scrapes, now)
        return max(range(len(scores)), key=lambda i: (scores[i], -i))


# -- the simulation -------------------------------------------------------------------------


@dataclass
class RoutingOutcome:
    routing: str
    p99_s: float
    p99_ttft_s: float
    goodput: float  # requests/s within the SLO
    throughput: float  # requests/s finished
    share: list[float]  # of requests, per replica
    unfinished: int


def simulate(
    router: RoundRobin | MetricPicker,
    make_replicas: Callable[[], list[Replica]],
    rate: float,
    duration: float,
    seed: int,
    ttft_slo: float,
    tpot_slo: float,
    scrape_interval: float = SCRAPE_INTERVAL_S,
) -> RoutingOutcome:
    """Open-loop Poisson arrivals for `duration` simulated seconds, then run until drained."""
    rng = random.Random(seed)
    replicas = make_replicas()
    scrapes: list[Scrape | None] = [None] * len(replicas)
    events: list[tuple[float, int, str, int]] = []
    seq = itertools.count()
    requests: list[Request] = []

    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        req = Request(len(requests), t, rng.randint(*PROMPT_TOKENS), rng.randint(*OUTPUT_TOKENS))
        requests.append(req)
        heapq.heappush(events, (t, next(seq), "arrive", req.id))
    for i in range(len(replicas) if router.reads_metrics else 0):  # scrapes of replicas are not in step
        heapq.heappush(events, (rng.uniform(0, scrape_interval), next(seq), "scrape", i))

    horizon = duration * 20  # bound: an overloaded replica still ends the run
    while events:
        now, _, kind, index = heapq.heappop(events)
        if now > horizon:
            break
        if kind == "scrape":
            scrapes[index] = replicas[index].scrape(now)
            if any(r.waiting or r.running for r in replicas) or now < duration:
                heapq.heappush(events, (now + scrape_interval, next(seq), "scrape", index))
            continue
        if kind == "arrive":
            req = requests[index]
            req.replica = router.pick(scrapes, now)
            replica = replicas[req.replica]
            replica.waiting.append(req)
            if not replica.stepping:
                replica.stepping = True
                heapq.heappush(events, (now + replica.start_step(), next(seq), "step", req.replica))
            continue
        replica = replicas[index]  # a step ended
        replica.end_step(now)
        if replica.waiting or replica.running:
            heapq.heappush(events, (now + replica.start_step(), next(seq), "step", index))
        else:
            replica.stepping = False

    done = [r for r in requests if r.finished is not None]
    latencies = [r.finished - r.arrival for r in done if r.finished is not None]
    ttfts = [r.first_token - r.arrival for r in done if r.first_token is not None]

    def good(r: Request) -> bool:
        assert r.first_token is not None and r.finished is not None
        tpot = (r.finished - r.first_token) / max(1, r.output - 1)
        return r.first_token - r.arrival <= ttft_slo and tpot <= tpot_slo

    counts = [sum(1 for r in requests if r.replica == i) for i in range(len(replicas))]
    return RoutingOutcome(
        routing=router.name,
        p99_s=percentile(latencies, 99),
        p99_ttft_s=percentile(ttfts, 99),
        goodput=sum(1 for r in done if good(r)) / duration,
        throughput=len(done) / duration,
        share=[c / max(1, len(requests)) for c in counts],
        unfinished=len(requests) - len(done),
    )


def three_replicas(slow: float = 2.0) -> Callable[[], list[Replica]]:
    return lambda: [Replica("fast-0"), Replica("fast-1"), Replica("slow", slowdown=slow)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals")
    p.add_argument("--load", type=float, default=0.7, help="offered load, as a share of the three's capacity")
    p.add_argument("--slow", type=float, default=2.0, help="how many times slower the slow replica is")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--scrape-ms", type=float, default=SCRAPE_INTERVAL_S * 1000)
    real = p.add_argument_group(
        "--events: real replicas routed by their KV cache events (loadtests/replica_prefix_cell.py)"
    )
    real.add_argument("--events", action="store_true", help="run the measured cell, not the simulation")
    real.add_argument("--chat-model", default="default", help="what each replica's `--chat-model` takes")
    real.add_argument("--repeats", type=int, default=3)
    real.add_argument("--conversations", type=int, default=12)
    real.add_argument("--turns", type=int, default=4)
    real.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    if a.events:
        from .replica_prefix_cell import run_replica_cell

        run_replica_cell(a.chat_model, a.repeats, a.conversations, a.turns, a.max_tokens)
        return
    make = three_replicas(a.slow)
    total = sum(replica_capacity(r) for r in make())
    rate = a.load * total
    print("SIMULATION (simulated time, a cost model; not a measurement of a real server)")
    print(
        f"three replicas (one {a.slow:g}x slower), capacity ~{total:.1f} req/s together; offered {rate:.1f} req/s "
        f"(Poisson) for {a.duration:g} s; SLO: TTFT <= {a.ttft_slo_ms:g} ms and TPOT <= {a.tpot_slo_ms:g} ms; "
        f"metrics scraped every {a.scrape_ms:g} ms; medians over {a.seeds} seeds"
    )
    results: dict[str, list[RoutingOutcome]] = {}
    for router_class in (RoundRobin, MetricPicker):
        for seed in range(a.seeds):
            out = simulate(
                router_class(),
                make,
                rate,
                a.duration,
                seed,
                a.ttft_slo_ms / 1000,
                a.tpot_slo_ms / 1000,
                scrape_interval=a.scrape_ms / 1000,
            )
            results.setdefault(out.routing, []).append(out)

    def med(outs: list[RoutingOutcome], f: Callable[[RoutingOutcome], float]) -> float:
        return statistics.median(f(o) for o in outs)

    print(
        "\n| routing | p99 latency s | p99 TTFT s | goodput req/s | finished req/s | share fast-0/fast-1/slow |"
        "\n| --- | --- | --- | --- | --- | --- |"
    )
    for name, outs in results.items():
        share = "/".join(f"{statistics.median(o.share[i] for o in outs):.2f}" for i in range(3))
        print(
            f"| {name} | {med(outs, lambda o: o.p99_s):.2f} | {med(outs, lambda o: o.p99_ttft_s):.2f} "
            f"| {med(outs, lambda o: o.goodput):.1f} | {med(outs, lambda o: o.throughput):.1f} | {share} |"
        )
    rr, epp = results[RoundRobin.name], results[MetricPicker.name]
    print(
        f"\nround-robin p99 / picker p99: {med(rr, lambda o: o.p99_s) / med(epp, lambda o: o.p99_s):.2f}x;"
        f" picker goodput / round-robin goodput: {med(epp, lambda o: o.goodput) / med(rr, lambda o: o.goodput):.2f}x"
        " (medians over seeds)"
    )


if __name__ == "__main__":
    main()
