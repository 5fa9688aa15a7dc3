"""loadtests/bench_replicas.py: the endpoint picker's scoring, a replica's continuous batching,
and the simulation's outcome, all in simulated time."""

from __future__ import annotations

from loadtests.bench_replicas import (
    STALE_AFTER_S,
    STEP_COST,
    MetricPicker,
    Replica,
    Request,
    RoundRobin,
    Scrape,
    read_metrics,
    simulate,
    three_replicas,
)

NOW = 100.0


def scrape(queue: int = 0, kv: float = 0.0, age: float = 0.0) -> Scrape:
    return Scrape(NOW - age, queue, 0, kv)


def test_the_picker_prefers_the_replica_with_the_shorter_queue():
    scrapes = [scrape(queue=6, kv=0.5), scrape(queue=1, kv=0.5), scrape(queue=4, kv=0.5)]
    assert MetricPicker().pick(scrapes, NOW) == 1


def test_the_picker_prefers_the_replica_with_less_kv_cache_in_use():
    scrapes = [scrape(kv=0.9), scrape(kv=0.7), scrape(kv=0.2)]
    assert MetricPicker().pick(scrapes, NOW) == 2


def test_a_long_queue_outweighs_a_little_kv_room():
    # Queue scores are normalised over the candidates (0 for the longest, 1 for the shortest),
    # KV scores are 1 - usage: the idle-queue replica wins unless its KV is much fuller.
    scrapes = [scrape(queue=10, kv=0.1), scrape(queue=0, kv=0.3)]
    assert MetricPicker().pick(scrapes, NOW) == 1


def test_a_replica_whose_metrics_are_stale_counts_as_saturated():
    stale = scrape(queue=0, kv=0.0, age=STALE_AFTER_S + 0.1)
    busy = scrape(queue=8, kv=0.9)
    assert MetricPicker().pick([stale, busy], NOW) == 1
    # Never scraped is as good as stale.
    assert MetricPicker().pick([None, busy], NOW) == 1
    # When every replica is stale, the picker still picks one, by the same scores.
    older = scrape(queue=5, kv=0.8, age=STALE_AFTER_S + 1)
    assert MetricPicker().pick([older, stale], NOW) == 1


def test_round_robin_ignores_the_metrics():
    scrapes = [scrape(queue=50, kv=1.0), scrape(), scrape()]
    rr = RoundRobin()
    assert [rr.pick(scrapes, NOW) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_a_replica_admits_what_its_kv_cache_holds_and_reports_it():
    r = Replica("r", max_running=8, kv_capacity=100)
    first, second = Request(0, 0.0, prompt=40, output=10), Request(1, 0.0, prompt=40, output=10)
    r.waiting.extend([first, second])
    step = r.start_step()
    # Both fit, exactly: each reserves prompt + output = 50 tokens of the 100.
    assert [q.id for q in r.running] == [0, 1]
    assert step == STEP_COST.predict(2, 80)
    r.waiting.append(Request(2, 0.0, prompt=10, output=1))
    assert r.start_step() == STEP_COST.predict(2, 0)  # no room: the third waits
    assert r.scrape(NOW) == Scrape(NOW, 1, 2, 1.0)
    for _ in range(10):
        r.end_step(NOW)
    assert first.finished == NOW and r.kv_reserved == 0 and r.running == []


def test_the_slow_replica_runs_its_steps_slower():
    fast, slow = Replica("fast"), Replica("slow", slowdown=2.0)
    for r in (fast, slow):
        r.waiting.append(Request(0, 0.0, prompt=32, output=4))
    assert slow.start_step() == 2 * fast.start_step()


def test_the_picker_sends_the_slow_replica_less_and_beats_round_robin_on_p99():
    make = three_replicas(2.0)
    args = (make, 30.0, 60.0, 3, 1.0, 0.1)  # rate, simulated seconds, seed, TTFT and TPOT SLOs
    rr = simulate(RoundRobin(), *args)
    epp = simulate(MetricPicker(), *args)
    assert rr.share[2] > 0.3 and epp.share[2] < rr.share[2]
    assert epp.p99_s < rr.p99_s
    assert epp.goodput >= rr.goodput
    assert rr.unfinished == 0 and epp.unfinished == 0


def test_the_picker_reads_a_replicas_metrics_as_prometheus_text():
    r = Replica("r", kv_capacity=200)
    r.waiting.extend(Request(i, 0.0, prompt=20, output=5) for i in range(3))
    r.start_step()  # all three admitted (75 of 200 tokens)
    r.waiting.extend(Request(i, 0.0, prompt=20, output=5) for i in range(3, 5))
    text = r.metrics()
    assert "ferry_queue_depth{" in text and "ferry_kv_cache_usage_ratio{" in text
    assert read_metrics(text, NOW) == Scrape(NOW, 2, 3, 75 / 200)
    # Another model's series, and every priority class of this one's queue.
    extra = 'ferry_queue_depth{model="chat",class="batch"} 4.0\nferry_queue_depth{model="other",class="batch"} 9.0\n'
    assert read_metrics(text + extra, NOW).queue_depth == 2 + 4
