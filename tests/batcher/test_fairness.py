"""Fair shares between tenants (batcher/fairness.py): virtual token counters, their lift on
return from idle, weights, quotas; the queue's order within each class; admission refusing
the tenant over its share first; service charged as it is computed; on a fake clock."""

from __future__ import annotations

import pytest

from batcher import admission
from batcher.errors import DeadlineInfeasible
from batcher.fairness import CUT_IN_TENANTS, WINDOW, TenantPolicy, TenantQuota, Tenants
from batcher.load import Load
from batcher.queue import RequestQueue
from batcher.settings import BatchingSettings
from batcher.types import GenRequest, Priority, WorkItem
from engine.base import SamplingParams

from .conftest import COST, cost, exact_rig, run
from .test_scheduler import GenRig

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


def item(tenant: str, deadline: float | None = 10.0, cost: int = 10, priority: Priority = INTERACTIVE) -> WorkItem:
    return WorkItem(payload=None, arrival=0.0, deadline=deadline, priority=priority, cost=cost, tenant=tenant)


# -- counters ---------------------------------------------------------------------------
def test_counters_grow_with_weighted_tokens_over_the_tenants_weight():
    t = Tenants({"gold": TenantPolicy(weight=4.0)}, input_weight=1.0, output_weight=2.0)
    t.charge("plain", 0.0, input_tokens=10, output_tokens=5)  # 10 + 2 x 5
    t.charge("gold", 0.0, input_tokens=10, output_tokens=5)
    assert t.counter("plain") == 20.0
    assert t.counter("gold") == 5.0
    assert t.tokens("plain") == {"input": 10, "output": 5}


def test_a_tenant_back_from_idle_is_lifted_to_the_smallest_active_counter_and_banks_no_credit():
    t = Tenants()
    t.arrive("busy", 1)
    t.charge("busy", 0.0, input_tokens=500)
    t.arrive("other", 1)  # arrives while busy is active: lifted to busy's 500
    assert t.counter("other") == 500.0
    t.charge("other", 0.0, input_tokens=100)
    t.left("other")
    t.charge("busy", 1.0, input_tokens=1000)  # busy kept working while other was away
    t.arrive("other", 1)
    assert t.counter("other") == 1500.0  # not 600: the time away is not credit
    t.left("busy")
    t.left("other")
    # Nobody active: a newcomer starts at the last one to leave, not at zero.
    t.arrive("new", 1)
    assert t.counter("new") == 1500.0


def test_jains_index_is_one_for_service_in_proportion_to_weight_and_falls_as_one_takes_all():
    t = Tenants({"b": TenantPolicy(weight=3.0)})
    t.charge("a", 0.0, input_tokens=100)
    t.charge("b", 0.0, input_tokens=300)  # three times a's, at three times the weight
    assert t.jain(1.0) == pytest.approx(1.0)
    t.charge("a", 1.0, input_tokens=10_000)
    assert t.jain(1.0) < 0.6
    assert t.jain(WINDOW + 2.0) is None  # the window forgot them both


# -- quotas -------------------------------------------------------------------------------
def test_a_tenant_over_its_concurrency_quota_is_refused_and_others_are_not():
    t = Tenants({"small": TenantPolicy(max_concurrent=2)})
    t.arrive("small", 2)
    with pytest.raises(TenantQuota) as refused:
        t.check_quota("small", 1, 0.0)
    assert refused.value.code == "tenant_quota" and refused.value.retry_after == 1
    t.check_quota("anyone", 50, 0.0)
    t.left("small")
    t.check_quota("small", 1, 0.0)


def test_a_tenant_over_its_tokens_a_minute_waits_until_the_window_lets_go_of_enough():
    t = Tenants({"metered": TenantPolicy(tokens_per_minute=100)})
    t.charge("metered", 0.0, input_tokens=60)
    t.charge("metered", 20.0, input_tokens=50)  # 110 in the window
    with pytest.raises(TenantQuota) as refused:
        t.check_quota("metered", 1, 30.0)
    assert refused.value.retry_after == 30  # the first 60 leave the window at 60 s
    t.check_quota("metered", 1, 60.5)  # 50 left in the window


# -- the queue's order --------------------------------------------------------------------
def fair_queue(*items: WorkItem, tenants: Tenants | None = None) -> RequestQueue:
    q = RequestQueue(aging=100.0, tenants=tenants or Tenants())
    for i in items:
        q.push(i)
    return q


def test_within_a_class_the_tenant_with_the_smallest_counter_goes_first_each_its_own_edf():
    noisy = [item("noisy", deadline=1.0 + k) for k in range(4)]
    quiet = [item("quiet", deadline=9.0), item("quiet", deadline=8.0)]
    tenants = Tenants()
    tenants.charge("noisy", 0.0, input_tokens=15)  # served a little already
    q = fair_queue(*noisy, *quiet, tenants=tenants)
    order = list(q.ordered(0.0))
    # quiet (counter 0) takes two turns of 10 tokens before noisy (15) gets its first; each
    # tenant's items in deadline order.
    assert order == [quiet[1], quiet[0], *noisy]
    assert [q.count_before(i) for i in order] == list(range(6))


def test_fairness_orders_tenants_inside_a_class_never_across_classes():
    job = item("quiet", priority=BATCH)
    chats = [item("noisy", deadline=1.0 + k) for k in range(3)]
    tenants = Tenants()
    tenants.charge("noisy", 0.0, input_tokens=1000)
    q = fair_queue(job, *chats, tenants=tenants)
    assert list(q.ordered(0.0)) == [*chats, job]


def test_weights_give_service_turns_in_proportion():
    tenants = Tenants({"heavy": TenantPolicy(weight=3.0)})
    q = fair_queue(*(item("light") for _ in range(8)), *(item("heavy") for _ in range(8)), tenants=tenants)
    first = [i.tenant for i in q.peek(8, 0.0)]
    assert first.count("heavy") == 6 and first.count("light") == 2


def test_off_restores_earliest_deadline_first():
    a, b = item("a", deadline=1.0), item("b", deadline=2.0)
    tenants = Tenants(enabled=False)
    tenants.charge("a", 0.0, input_tokens=1000)
    assert list(fair_queue(b, a, tenants=tenants).ordered(0.0)) == [a, b]


def test_a_new_items_place_counts_the_items_its_tenants_counter_lets_ahead():
    tenants = Tenants()
    q = fair_queue(*(item("noisy") for _ in range(20)), tenants=tenants)
    tenants.arrive("noisy", len(q))
    tenants.charge("noisy", 0.0, input_tokens=200)
    # Lifted to noisy's counter: only noisy's first item (the tie goes to the earlier one)
    # comes before it; noisy's next waits behind all its own.
    assert q.count_before(item("quiet")) == 1
    assert q.count_before(item("noisy", deadline=99.0)) == 20


def test_a_tenant_over_its_share_does_not_keep_one_within_it_out_by_its_promises():
    """Admission protects the promises of queued prompts a newcomer would join or go before
    (`earliest_promise`); with fair shares only those of its own tenant and of tenants
    served less than it."""
    tenants = Tenants()
    noisy = [item("noisy", deadline=1.0 + k) for k in range(3)]
    quiet = item("quiet", deadline=5.0)
    q = fair_queue(*noisy, quiet, tenants=tenants)
    tenants.arrive("noisy", 3)
    tenants.arrive("quiet", 1)
    tenants.charge("noisy", 0.0, input_tokens=300)
    tenants.charge("quiet", 0.0, input_tokens=20)
    assert q.earliest_promise(INTERACTIVE, "quiet") == 5.0  # noisy's earlier deadlines do not count
    assert q.earliest_promise(INTERACTIVE, "noisy") == 1.0  # its own, and quiet's, do
    # Back from idle, lifted to the least served active tenant's level (quiet's): a tie,
    # which keeps neither out.
    assert q.earliest_promise(INTERACTIVE, "other") == float("inf")
    off = fair_queue(*noisy, quiet, tenants=Tenants(enabled=False))
    assert off.earliest_promise(INTERACTIVE, "quiet") == 1.0
    # The first of a new tenant, while another's alone are queued: fair already.
    alone = Tenants()
    only_noisy = fair_queue(*noisy, tenants=alone)
    alone.arrive("noisy", 3)
    alone.charge("noisy", 0.0, input_tokens=300)
    assert only_noisy.earliest_promise(INTERACTIVE, "quiet") == float("inf")
    assert only_noisy.earliest_promise(INTERACTIVE, "noisy") == 1.0


def test_a_floods_item_is_predicted_behind_what_a_quiet_tenants_arrivals_will_put_ahead_of_it():
    """A quiet tenant's requests keep going ahead of a flood's queued ones (lifted to the
    flood's counter on return): a flood item's predicted completion counts them, at the
    quiet tenant's recent rate and no more than its counter lets go first, or admitted
    flood work is served late. A quiet item's is not stretched by the flood's."""
    s = BatchingSettings(policy="adaptive", max_batch_size=4, max_wait_ms=0, deadline_margin_ms=0)
    tenants = Tenants()
    q = fair_queue(*(item("noisy", cost=1) for _ in range(8)), tenants=tenants)
    tenants.arrive("noisy", 8)
    tenants.charge("noisy", 0.0, input_tokens=1000)
    for t in range(10):  # 10 tokens a second for the last 10 s; idle between requests
        tenants.charge("quiet", float(t), input_tokens=10)
    now, load = 10.0, Load()
    flood = item("noisy", deadline=99.0, cost=1)
    turn = q.fair_turn(flood)
    assert turn == pytest.approx(1008.0)  # noisy's counter and its eight queued items' prices
    assert tenants.cut_ins("noisy", turn, now) == [(pytest.approx(10.0), pytest.approx(8.0))]
    queued = 2 * cost(4)  # its eight ahead in two full batches, then its own of one
    per_token = cost(4) / 4
    horizon = queued / (1 - 10.0 * per_token)
    expected = now + queued + per_token * min(10.0 * horizon, 8.0) + cost(1)
    assert admission.predicted_completion(q, flood, now, s, COST, load) == pytest.approx(expected)
    assert expected > now + queued + cost(1)
    # The quiet tenant's next item: lifted to the flood's counter, only the flood's first
    # item goes before it (the tie), and the flood's arrivals do not cut in.
    assert tenants.cut_ins("quiet", q.fair_turn(item("quiet")), now) == []
    assert admission.predicted_completion(q, item("quiet"), now, s, COST, load) == pytest.approx(now + cost(2))
    # Fairness off: earliest deadline first, nobody cuts in.
    tenants.enabled = False
    assert admission.predicted_completion(q, flood, now, s, COST, load) == pytest.approx(now + queued + cost(1))
    # A tenant served so much that it cannot pass the turn: a bounded cut-in.
    assert tenants.cut_ins("noisy", 1000.5, now) == [(pytest.approx(10.0), pytest.approx(0.5))]


def test_cut_ins_count_only_the_busiest_tenants_so_admission_costs_the_same_under_many_names():
    tenants = Tenants()
    for k in range(CUT_IN_TENANTS + 40):
        tenants.charge(f"t{k}", 0.0, input_tokens=k + 1)  # t{k} served k + 1 tokens
    cuts = tenants.cut_ins("noisy", 1e9, 1.0)
    assert len(cuts) == CUT_IN_TENANTS
    assert min(rate for rate, _ in cuts) == pytest.approx(41.0)  # the busiest: t40 .. t71
    tenants.charge("late", 1.5, input_tokens=10_000)
    assert len(tenants.cut_ins("noisy", 1e9, 1.5)) == CUT_IN_TENANTS  # ranked a second at most ago: not yet
    assert max(rate for rate, _ in tenants.cut_ins("noisy", 1e9, 2.0)) == pytest.approx(10_000 / 1.0)


# -- batchers ------------------------------------------------------------------------------
def test_a_micro_batcher_serves_a_quiet_tenant_ahead_of_a_flood_and_charges_what_it_ran():
    async def scenario():
        r = exact_rig(max_batch_size=4, max_wait_ms=0)
        b = r.batcher
        await b.start()
        flood = [b.submit(f"n{k}", cost=10, tenant="noisy") for k in range(12)]
        await r.clock.advance(0.0)  # the first batch of four leaves: noisy has been served
        quiet = [b.submit(f"q{k}", cost=10, tenant="quiet") for k in range(2)]
        await r.clock.run_until_idle()
        # Lifted to noisy's counter on arrival, quiet takes every other turn: both of its
        # items in the next batch, ahead of the rest of the flood.
        assert r.batches[1] == ["n4", "q0", "n5", "q1"]
        assert all(i.future.done() for i in flood + quiet)
        assert b.tenants.tokens("noisy") == {"input": 120, "output": 0}
        assert r.value("ferry_tenant_tokens_total", model="m", tenant="quiet", kind="input") == 20
        assert b.tenants.active("noisy") == 0
        await b.stop()

    run(scenario())


def test_a_micro_batcher_refuses_a_tenant_over_its_quota_with_tenant_quota():
    async def scenario():
        r = exact_rig(max_batch_size=4, max_wait_ms=0)
        b = r.batcher
        b.tenants.set_policies({"small": TenantPolicy(max_concurrent=1)})
        await b.start()
        b.submit("x", tenant="small")
        with pytest.raises(TenantQuota):
            b.submit("y", tenant="small")
        assert r.value("ferry_tenant_refusals_total", model="m", tenant="small", reason="tenant_quota") == 1
        await r.clock.run_until_idle()
        b.submit("z", tenant="small")  # the first one finished
        await r.clock.run_until_idle()
        await b.stop()

    run(scenario())


def test_chat_admission_refuses_the_tenant_over_its_share_and_admits_the_one_within_it():
    async def scenario():
        r = GenRig(max_running=2, max_batch_size=2, max_wait_ms=0)
        r.seed_decode_cost()
        s = r.sched
        await s.start()

        def submit(tenant: str, budget: float | None = None) -> WorkItem:
            payload = GenRequest([1, 2, 3], SamplingParams(max_tokens=20, temperature=0.0))
            return s.submit(payload, cost=3, tenant=tenant, budget=budget)

        for _ in range(2):
            submit("noisy")
        await r.clock.advance(0.001)
        # Noisy queues work with a 1 s budget until admission says no: its own queued work
        # is ahead of its next request.
        queued = []
        with pytest.raises(DeadlineInfeasible):
            for _ in range(20):
                queued.append(submit("noisy", budget=1.0))
        assert 2 <= len(queued) < 20
        # Quiet's request with the same budget goes first at the next free slot: admitted.
        quiet = submit("quiet", budget=1.0)
        await r.clock.run_until_idle()
        assert quiet.future.result().completion_tokens == 20
        assert quiet.dispatched_at <= r.clock.now() and quiet.dispatched_at - quiet.arrival <= 1.0
        assert quiet.dispatched_at < max(i.dispatched_at or 0.0 for i in queued)
        # Output tokens are charged as generated: 20 per sequence, twice an input token.
        assert s.tenants.tokens("quiet") == {"input": 3, "output": 20}
        served = 2 + sum(i.future.exception() is None for i in queued)
        assert s.tenants.tokens("noisy")["output"] == 20 * served
        await s.stop()

    run(scenario())


def test_memory_stays_bounded_under_many_tenant_names(monkeypatch):
    import batcher.fairness as fairness

    monkeypatch.setattr(fairness, "MAX_TENANTS", 3)
    t = Tenants()
    t.arrive("busy", 1)
    for k in range(10):  # each served and gone: forgotten once the table is full
        t.arrive(f"once-{k}", 1)
        t.left(f"once-{k}")
    assert len(t.names) <= 3 and "busy" in t.names
    assert t.active("busy") == 1


async def _backlogged(fairness: str) -> dict[str, int]:
    """Four tenants of weights 1:1:2:4, each with more closed-loop clients than the slots its
    share would give it (always some queued), on 16 slots; output tokens each got in 20 s."""
    from batcher.fairness import TenantPolicy

    r = GenRig(max_running=16, max_batch_size=16, max_wait_ms=0, fairness=fairness)
    s = r.sched
    s.tenants.set_policies({"w2": TenantPolicy(weight=2.0), "w4": TenantPolicy(weight=4.0)})
    await s.start()
    end = r.clock.now() + 20

    async def client(tenant: str) -> None:
        while r.clock.now() < end:
            payload = GenRequest([1, 2, 3], SamplingParams(max_tokens=16, temperature=0.0))
            await s.submit(payload, cost=3, tenant=tenant).future

    import asyncio

    tasks = [asyncio.create_task(client(t)) for t in ("w1a", "w1b", "w2", "w4") for _ in range(16)]
    await asyncio.sleep(0)
    while not all(t.done() for t in tasks):  # past `end`, each client ends with its last answer
        await r.clock.advance(0.01)
    await s.stop()
    return {t: s.tenants.tokens(t)["output"] for t in ("w1a", "w1b", "w2", "w4")}


def test_backlogged_tenants_are_served_in_proportion_to_their_weights_and_equally_with_fairness_off():
    served = run(_backlogged("on"))
    total = sum(served.values())
    for tenant, share in {"w1a": 1 / 8, "w1b": 1 / 8, "w2": 2 / 8, "w4": 4 / 8}.items():
        assert served[tenant] / total == pytest.approx(share, rel=0.05)
    off = run(_backlogged("off"))
    assert max(off.values()) / min(off.values()) < 1.1


async def _sharing_steps(margin: float, per_row: float = 0.1, **settings) -> tuple[float, float, int]:
    """Tenant a runs six long answers, b two, equal weights, on 8 slots; steps cost 10 ms
    and `per_row` a row (100 ms: a CPU's, the step's time follows its rows). What a had been served when
    b's last answer came over b's, when that was against a's last, and the rows held."""
    r = GenRig(
        max_running=8,
        max_batch_size=8,
        max_wait_ms=0,
        per_row=per_row,
        touched=True,
        fair_hold_margin=margin,
        **settings,
    )
    r.seed_decode_cost()
    s = r.sched
    await s.start()
    start = r.clock.now()
    jobs = {t: [r.submit(100, tenant=t) for _ in range(n)] for t, n in (("a", 6), ("b", 2))}
    done_at, a_at_b = {}, 0
    while len(done_at) < 2:
        await r.clock.advance(0.05)
        for t, items in jobs.items():
            if t not in done_at and all(i.future.done() for i in items):
                done_at[t] = r.clock.now() - start
                if t == "b":
                    a_at_b = s.tenants.tokens("a")["output"]
    await s.stop()
    lengths = {t: {i.future.result().completion_tokens for i in items} for t, items in jobs.items()}
    assert lengths == {"a": {100}, "b": {100}}  # every answer whole: a held row only waited
    held = r.registry.get_sample_value("ferry_tenant_held_rows_total", {"model": "g"}) or 0
    return a_at_b / 200, done_at["b"] / done_at["a"], int(held)


def test_a_tenant_ahead_of_its_share_sits_out_steps_so_the_other_is_served_its_share_meanwhile():
    # Slots alone cannot correct it: nothing frees until the answers end.
    ratio_off, when_off, held_off = run(_sharing_steps(0))
    assert held_off == 0 and ratio_off == pytest.approx(3.0, rel=0.02) and when_off == pytest.approx(1.0, abs=0.02)
    # Holding a's rows while it is ahead by more than the margin: while both ran, a was
    # served about what b was (b's 200 tokens, plus the margin and a step's worth), and b
    # finished first; a's rows ran every step after.
    ratio, when, held = run(_sharing_steps(16))
    assert held > 0
    assert ratio < 1.5 and when < 0.8


def test_rows_are_not_held_where_it_gains_nobody_anything_or_could_cost_a_deadline():
    # A step whose time does not follow its rows (a GPU's, bound by reading the weights):
    # holding rows would only waste them.
    assert run(_sharing_steps(16, per_row=0.0))[2] == 0
    # Whole answers due by a deadline (85 s: 100 steps of 810 ms and a little): a row
    # misses a step only while twice its steps left fit before it, and every answer comes
    # whole (the helper checks: none expired).
    free = run(_sharing_steps(16))[2]
    assert run(_sharing_steps(16, budget_scope="total", default_budget_ms=85_000))[2] < free / 4
