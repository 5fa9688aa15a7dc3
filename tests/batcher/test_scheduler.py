"""Continuous vs static batching, counted in engine iterations on a fake clock."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import CollectorRegistry

from batcher.clock import FakeClock
from batcher.cost import CostModel, LinearCost
from batcher.errors import DeadlineExceeded, DeadlineInfeasible, EngineError
from batcher.metrics import Metrics
from batcher.scheduler import GenerationScheduler
from batcher.settings import BatchingSettings
from batcher.types import GenRequest, Outcome, Priority
from engine.base import SamplingParams, sequence_request
from engine.fake import FakeGenerationEngine, SimulatedEngineThread

from .conftest import run

STEP = 0.010  # what one engine iteration (a prefill or a decode step) costs, plus `per_row` per running row


class GenRig:
    def __init__(self, fail_prompts=None, per_row=0.0, touched=False, **settings):
        settings.setdefault("default_budget_ms", None)
        self.clock = FakeClock()
        self.engine = FakeGenerationEngine(fail_prompts=fail_prompts)
        self.registry = CollectorRegistry()
        self.per_row = per_row
        self.sched = GenerationScheduler(
            "g",
            self.engine,
            SimulatedEngineThread(self.clock, self.engine, STEP, per_row, per_touched_row=touched),
            BatchingSettings(**settings),
            make_request=sequence_request,
            clock=self.clock,
            metrics=Metrics(self.registry),
        )

    def seed_decode_cost(self) -> None:
        """Let the decode cost model know the simulated steps exactly, as a warm-up profile
        would, and keep it: a refit would learn from the worker thread's wall-clock split of
        an iteration between prefill and decode, which on a fake engine is noise (the
        simulated time is the clock's, the measured one microseconds of Python)."""
        self.sched.decode_cost = CostModel(LinearCost(STEP, self.per_row, 0.0), refit_every=10**9)

    def submit(self, max_tokens: int, first_token: int = 1, **kw):
        payload = GenRequest([first_token, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return self.sched.submit(payload, cost=3, **kw)

    def rows(self) -> list[int]:
        """Active rows per iteration: decoded plus newly admitted."""
        return [len(decoded) + len(admitted) for _, decoded, admitted in self.sched.trace]

    async def cancel_all(self, jobs) -> None:
        """Cancel `jobs` and run until idle: each heard its cancellation."""
        for job in jobs:
            self.sched.cancel(job)
        await self.clock.run_until_idle()
        assert all(job.future.exception() is not None for job in jobs)  # cancelled, each heard it

    def admitted_at(self, item) -> int:
        return next(i for i, _, admitted in self.sched.trace if item.id in admitted)

    def finished_at(self, item) -> int:
        return max(i for i, decoded, admitted in self.sched.trace if item.id in decoded or item.id in admitted)


async def _exercise(mode: str):
    r = GenRig(mode=mode, max_running=3, max_batch_size=3, max_wait_ms=0)
    await r.sched.start()
    a, b, c = r.submit(2), r.submit(5), r.submit(8)
    await r.clock.advance(0.001)  # the group of three is prefilled: iteration 1
    d = r.submit(4)  # just after them
    await r.clock.run_until_idle()
    results = {k: i.future.result() for k, i in zip("abcd", (a, b, c, d), strict=True)}
    await r.sched.stop()
    return r, (a, b, c, d), results


def test_static_batching_makes_the_fourth_request_wait_for_the_whole_group():
    r, (_a, _b, c, d), results = run(_exercise("static"))
    assert [results[k].completion_tokens for k in "abc"] == [2, 5, 8]
    assert all(results[k].finish_reason == "length" for k in "abcd")
    assert r.finished_at(c) == 8
    assert r.admitted_at(d) == 9  # waited the full 8 iterations of the group
    assert r.rows() == [3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1]
    assert r.sched.iterations == 12


def test_continuous_batching_lets_the_fourth_join_when_the_first_finishes():
    r, (a, _b, _c, d), results = run(_exercise("continuous"))
    assert [results[k].completion_tokens for k in "abcd"] == [2, 5, 8, 4]
    assert r.finished_at(a) == 2
    assert r.admitted_at(d) == 3  # the slot freed by the first request
    assert r.finished_at(d) == 6
    assert r.rows() == [3, 3, 3, 3, 3, 2, 1, 1]
    assert r.sched.iterations == 8  # 12 in static mode


def test_independent_stopping_in_one_batch():
    async def scenario():
        r = GenRig(max_running=8, max_batch_size=8)
        await r.sched.start()
        items = [r.submit(n) for n in (2, 5, 8)]
        await r.clock.run_until_idle()
        out = [i.future.result() for i in items]
        assert [o.completion_tokens for o in out] == [2, 5, 8]
        assert [o.text.split() for o in out] == [[f"w{k}" for k in range(n)] for n in (2, 5, 8)]
        assert r.admitted_at(items[0]) == r.admitted_at(items[2]) == 1  # one batch
        await r.sched.stop()

    run(scenario())


def test_cancellation_frees_a_slot_that_a_waiting_request_takes():
    async def scenario():
        r = GenRig(max_running=2, max_batch_size=2, max_wait_ms=0)
        await r.sched.start()
        long1, long2 = r.submit(50), r.submit(50)
        await r.clock.advance(0.001)
        waiting = r.submit(3)
        await r.clock.advance(0.05)
        assert waiting.dispatched_at is None and r.sched.running == 2
        r.sched.cancel(long1)
        await r.clock.advance(0.015)
        assert waiting.dispatched_at is not None
        await r.clock.advance(0.02)
        assert long1.id not in r.engine._seqs  # the engine dropped the row
        await r.clock.advance(0.1)
        assert waiting.future.result().completion_tokens == 3
        assert long1.outcome is Outcome.CANCELLED
        assert r.registry.get_sample_value("ferry_cancellations_total", {"model": "g", "phase": "running"}) == 1
        r.sched.cancel(long2)
        await r.clock.run_until_idle()
        assert r.engine.running == 0
        await r.sched.stop()

    run(scenario())


def test_fixed_admits_waiting_prompts_together_by_size_or_max_wait():
    async def scenario():
        r = GenRig(policy="fixed", max_running=16, max_batch_size=3, max_wait_ms=30)
        await r.sched.start()
        first = r.submit(40)
        await r.clock.advance(0.001)
        x, y = r.submit(2), r.submit(2)
        await r.clock.advance(0.021)
        assert x.dispatched_at is None  # running work exists: wait for company or max_wait
        z = r.submit(2)
        await r.clock.advance(0.011)  # size cap of 3 reached at the next boundary
        assert x.dispatched_at == y.dispatched_at == z.dispatched_at is not None
        assert x.reason.value == "full"
        lone = r.submit(2)
        await r.clock.advance(0.025)
        assert lone.dispatched_at is None
        await r.clock.advance(0.02)
        assert lone.reason.value == "max_wait"
        r.sched.cancel(first)
        await r.sched.stop()

    run(scenario())


def test_prefill_failure_is_isolated_to_the_failing_prompt():
    async def scenario():
        r = GenRig(fail_prompts={66}, max_running=8, max_batch_size=8)
        await r.sched.start()
        good1, bad, good2 = r.submit(3), r.submit(3, first_token=66), r.submit(3)
        await r.clock.run_until_idle()
        assert good1.future.result().completion_tokens == 3
        assert good2.future.result().completion_tokens == 3
        assert isinstance(bad.future.exception(), EngineError)
        await r.sched.stop()

    run(scenario())


def test_max_itl_limits_running_sequences():
    async def scenario():
        # Decode costs STEP + 2 ms per running row: 5 rows reach the 20 ms target.
        r = GenRig(max_running=16, max_batch_size=16, max_itl_ms=20, per_row=0.002)
        r.seed_decode_cost()
        await r.sched.start()
        items = [r.submit(30) for _ in range(8)]
        await r.clock.advance(0.001)
        assert r.sched.running == 5
        await r.clock.run_until_idle()
        assert all(i.future.result().completion_tokens == 30 for i in items)
        assert max(r.rows()) <= 5
        await r.sched.stop()

    run(scenario())


def test_admission_refuses_at_once_when_no_slot_can_free_in_time():
    async def scenario():
        from batcher.errors import DeadlineInfeasible

        r = GenRig(max_running=2, max_batch_size=2, max_wait_ms=0)
        r.seed_decode_cost()
        await r.sched.start()
        r.submit(100), r.submit(100)
        await r.clock.advance(0.001)
        assert r.sched.running == 2
        # Both slots are busy for ~99 more steps of STEP: a 200 ms TTFT budget cannot be met.
        with pytest.raises(DeadlineInfeasible):
            r.submit(3, budget=0.2)
        late_ok = r.submit(3, budget=5.0)
        assert late_ok.dispatched_at is None
        for item in list(r.sched._running.values()):
            r.sched.cancel(item.item)
        await r.clock.run_until_idle()
        assert late_ok.future.result().completion_tokens == 3
        await r.sched.stop()

    run(scenario())


def test_a_newcomer_waits_only_for_what_the_iteration_in_flight_has_left():
    """The next iteration boundary is the one the iteration in flight was predicted to end
    at, not `now` plus a whole step: where in an iteration a request lands is known."""

    async def scenario():
        r = GenRig(per_row=0.004, max_wait_ms=0)
        r.seed_decode_cost()
        await r.sched.start()
        for _ in range(4):
            r.submit(50)
        await r.clock.advance(0.03)  # prefilled, decoding: a step of 4 rows costs 26 ms
        step = r.sched.decode_cost.predict(4)
        ends = set()
        for _ in range(10):  # 1 ms apart, within the few iterations that run meanwhile
            now, iteration = r.clock.now(), r.sched.iterations
            boundary = r.sched.busy_until(now)
            assert now <= boundary <= now + step + 1e-9
            if r.sched.iterations == iteration:
                ends.add((iteration, round(boundary, 9)))
            await r.clock.advance(0.001)
        # Each iteration kept one end however late in it the question came.
        assert len(ends) == len({i for i, _ in ends}) < 10
        for item in list(r.sched._running.values()):
            r.sched.cancel(item.item)
        await r.clock.run_until_idle()
        assert r.sched.busy_until(r.clock.now()) == r.clock.now()  # nothing in flight
        await r.sched.stop()

    run(scenario())


def test_slots_of_answers_that_end_before_their_limit_are_predicted_to_free_then():
    """A real instruct model ends most answers long before max_tokens: once finished
    sequences show it, a slot is predicted to free where such answers end, not at the
    limit, and a request that fits is admitted (it was refused) and served on time."""

    async def scenario():
        r = GenRig(max_running=2, max_batch_size=2, max_wait_ms=0)
        r.seed_decode_cost()
        await r.sched.start()

        def answer(**kw):  # the fake engine's words are w0 w1 ...: "w5" ends it at 6 tokens of 100
            payload = GenRequest([1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0, stop=["w5"]))
            return r.sched.submit(payload, cost=3, **kw)

        answer(), answer()
        await r.clock.advance(0.001)
        with pytest.raises(DeadlineInfeasible):  # nothing seen yet: the slots free at the limit, 99 steps away
            answer(budget=0.2)
        await r.clock.run_until_idle()
        for _ in range(3):  # eight answers seen, each 6 tokens
            batch = [answer(), answer()]
            await r.clock.run_until_idle()
            assert [i.future.result().completion_tokens for i in batch] == [6, 6]
        assert r.sched._slots.lengths.known
        busy = [answer(), answer()]
        await r.clock.advance(0.001)
        assert r.sched.running == 2
        late = answer(budget=0.2)  # both slots free in about 6 steps of 10 ms
        await r.clock.run_until_idle()
        assert late.future.result().completion_tokens == 6 and not late.best_effort
        assert late.dispatched_at is not None and late.dispatched_at + STEP <= late.deadline  # its first token on time
        assert all(i.future.result().finish_reason == "stop" for i in busy)
        await r.sched.stop()

    run(scenario())


def test_first_tokens_later_than_promised_make_admission_promise_later():
    async def scenario():
        r = GenRig(per_row=0.030, max_wait_ms=0)  # a lone prefill takes 40 ms
        # ...where the prefill's cost model, kept as it is, says 25.
        r.sched.prefill_cost = r.sched.cost = CostModel(LinearCost(0.025, 0.0, 0.0), refit_every=10**9)
        await r.sched.start()
        budget = 0.045  # the 25 ms prediction and the 10 ms margin fit; 1.6x of it does not
        for _ in range(8):  # one at a time, each admitted and on time, each first token 15 ms later than promised
            item = r.submit(1, budget=budget)
            assert item.predicted_wait == pytest.approx(0.025)
            await r.clock.run_until_idle()
            assert item.future.result().completion_tokens == 1
        # 40 ms observed against 25 promised: 1.6x, past the batch cost models' 1.5 cap.
        assert r.sched.first_tokens[Priority.INTERACTIVE].factor == pytest.approx(1.6)
        assert r.sched.first_tokens[Priority.BATCH].factor == 1.0  # by class: batch-class promises are their own
        with pytest.raises(DeadlineInfeasible):
            r.submit(1, budget=budget)
        assert r.submit(1, budget=0.052).future is not None  # 40 + 10 ms fits in 52
        await r.clock.run_until_idle()
        gauge = {"model": "g", "class": "interactive"}
        assert r.registry.get_sample_value("ferry_first_token_slowdown", gauge) == pytest.approx(1.6)
        await r.sched.stop()

    run(scenario())


def test_a_request_that_expires_before_its_first_token_calibrates_the_promise_too():
    async def scenario():
        # The same 40 ms prefill promised in 25; budgets of 36 ms, and a budget that covers the
        # whole sequence: each expires before its first token, and its wait so far still counts.
        r = GenRig(per_row=0.030, max_wait_ms=0, budget_scope="total")
        r.sched.prefill_cost = r.sched.cost = CostModel(LinearCost(0.025, 0.0, 0.0), refit_every=10**9)
        await r.sched.start()
        for _ in range(8):
            item = r.submit(2, budget=0.036)
            await r.clock.run_until_idle()
            assert item.outcome is Outcome.EXPIRED
        assert r.sched.first_tokens[Priority.INTERACTIVE].factor >= 0.036 / 0.025  # at least the wait it expired at
        with pytest.raises(DeadlineInfeasible):
            r.submit(1, budget=0.036)
        await r.sched.stop()

    run(scenario())


def test_a_delivery_failure_ends_only_the_item_it_hit():
    """Tokens are delivered after the next step is handed to the engine, when finished
    sequences are no longer in the running set: a callback that raises must still end its
    own item (with an error) and no other."""

    async def scenario():
        r = GenRig(max_running=4, max_batch_size=4, max_wait_ms=0)
        await r.sched.start()
        good = r.submit(3)
        bad = r.submit(3)

        def explode(delta):
            if delta.finish_reason is not None:
                raise RuntimeError("client callback bug")

        bad.on_delta = explode
        await r.clock.run_until_idle()
        await r.sched.stop()
        return good, bad

    good, bad = run(scenario())
    assert good.outcome is Outcome.RESULT and good.future.result().completion_tokens == 3
    assert bad.outcome is Outcome.ERROR
    with pytest.raises(EngineError, match="delivering the output failed"):
        bad.future.result()


def test_a_chat_burst_after_a_quiet_spell_is_admitted_in_full():
    """Three requests one after another, a quiet second, then 100 at once (32 tokens, 10 s
    budget): every slot's end is predicted from the decode cost, so the burst is admitted
    (64 now, 36 as slots free) instead of refused for the few completions lately."""

    async def scenario():
        r = GenRig(max_running=64, max_batch_size=32, max_wait_ms=5, default_budget_ms=10_000, per_row=0.0002)
        r.seed_decode_cost()
        await r.sched.start()
        for _ in range(3):
            one = r.submit(32)
            await r.clock.run_until_idle()
            assert one.future.result().completion_tokens == 32
        await r.clock.advance(1.0)
        burst = [r.submit(32) for _ in range(100)]  # raises DeadlineInfeasible if refused
        await r.clock.run_until_idle()
        assert all(i.future.result().completion_tokens == 32 for i in burst)
        assert all(i.dispatched_at <= i.deadline for i in burst)
        await r.sched.stop()

    run(scenario())


def test_chat_batch_class_prompts_leave_slots_to_interactive_ones():
    """Interactive first for generation: with interactive requests arriving, batch-class
    prompts do not take the slots they need, so an interactive request admitted while
    batch work waits gets a slot at the next iteration."""

    async def scenario():
        from batcher.types import Priority

        r = GenRig(max_running=8, max_batch_size=8, max_wait_ms=0, default_budget_ms=None, interactive_first=True)
        r.seed_decode_cost()
        await r.sched.start()
        first = r.submit(50, budget=5.0)  # interactive: from now on interactive work is arriving
        jobs = [r.submit(50, budget=60.0, priority=Priority.BATCH) for _ in range(20)]
        await r.clock.advance(0.05)
        assert r.sched.running < 8  # batch-class work left slots free
        late = r.submit(5, budget=0.1)
        await r.clock.advance(0.05)
        # Within two iterations: the step running when it arrived, and the next.
        assert late.dispatched_at is not None and late.dispatched_at <= late.arrival + 2 * STEP
        await r.clock.run_until_idle()
        assert first.future.result().completion_tokens == 50 and late.future.result().completion_tokens == 5
        assert all(j.finished for j in jobs)
        await r.sched.stop()

    run(scenario())


def test_batch_class_work_alone_leaves_one_slot_for_the_first_interactive_prompt():
    """Before any interactive request is seen, batch-class prompts still leave one slot:
    the first interactive prompt joins at the next iteration, not when a whole batch-class
    sequence ends (or refused for it). Throughput first leaves none."""
    from batcher.types import Priority

    async def scenario(first: bool):
        r = GenRig(max_running=8, max_batch_size=8, max_wait_ms=0, interactive_first=first)
        r.seed_decode_cost()
        await r.sched.start()
        jobs = [r.submit(50, budget=30.0, priority=Priority.BATCH) for _ in range(20)]
        await r.clock.advance(0.1)
        running = r.sched.running
        try:
            late = r.submit(5, budget=0.1)
        except DeadlineInfeasible:
            late = None  # no slot frees in time: every one holds a 50-token sequence
        await r.clock.advance(0.1)
        await r.cancel_all(jobs)
        await r.sched.stop()
        if late is None:
            return running, None
        assert late.future.result().completion_tokens == 5
        return running, late.dispatched_at - late.arrival

    running, admitted_within = run(scenario(True))
    assert running == 7 and admitted_within is not None and admitted_within <= 2 * STEP
    running, admitted_within = run(scenario(False))
    assert running == 8 and admitted_within is None


def test_slots_kept_for_interactive_prompts_outlast_a_lull_in_their_arrivals(monkeypatch):
    """Interactive prompts at 10/s (5 tokens) beside batch-class sequences that hold a slot
    for 10 s; then 3 s without an interactive arrival, longer than the 2 s their rate is
    measured over. The slots kept for them are kept through the lull (sized on the
    interactive sequences' own length, not the batch-class ones'), so a burst of three
    interactive prompts after it is admitted and joins at once. With no memory of the rate
    (the last check), batch-class work takes all but one slot in the lull, for 10 s, and
    the burst is refused. (Aging is set past the test: an aged batch-class prompt may take a
    kept slot, so that none starves.)"""
    import batcher.slots
    from batcher.types import Priority

    async def scenario():
        r = GenRig(max_running=16, max_batch_size=16, max_wait_ms=0, aging_ms=60_000)
        r.seed_decode_cost()
        await r.sched.start()
        chats, jobs = [], []
        for i in range(20):
            if i == 10:
                jobs = [r.submit(1000, budget=60.0, priority=Priority.BATCH) for _ in range(40)]
            chats.append(r.submit(5, budget=1.0))
            await r.clock.advance(0.1)
        await r.clock.advance(3.0)
        try:
            burst = [r.submit(5, budget=0.1) for _ in range(3)]
        finally:
            await r.clock.advance(0.1)
            await r.cancel_all(jobs)
            assert all(c.future.result().completion_tokens == 5 for c in chats)
            await r.sched.stop()
        assert all(b.future.result().completion_tokens == 5 for b in burst)
        assert all(b.dispatched_at - b.arrival <= 2 * STEP for b in burst)

    run(scenario())
    monkeypatch.setattr(batcher.slots, "SLOT_RATE_MEMORY", 1e-9)
    with pytest.raises(DeadlineInfeasible):
        run(scenario())


async def _first_token_beside_batch_class_work(lane: bool):
    """40 batch-class sequences decoding (a step of them costs 10 + 40 ms), then an
    interactive prompt: when its first token comes, and the iteration that prefilled it."""
    from batcher.types import Priority

    r = GenRig(max_running=64, max_batch_size=16, max_wait_ms=0, per_row=0.001, touched=True, interactive_lane=lane)
    r.seed_decode_cost()
    await r.sched.start()
    r.submit(2, budget=1.0)  # interactive work has been arriving
    jobs = [r.submit(200, budget=30.0, priority=Priority.BATCH) for _ in range(40)]
    await r.clock.advance(0.5)
    assert r.sched.running == 40
    firsts: list[float] = []
    late = r.submit(4, budget=0.2, on_delta=lambda d: firsts.append(r.clock.now()) if not firsts else None)
    await r.clock.advance(0.3)
    assert late.future.result().completion_tokens == 4
    ttft = firsts[0] - late.arrival
    i = r.admitted_at(late)
    its = {n: (decoded, admitted) for n, decoded, admitted in r.sched.trace}
    await r.cancel_all(jobs)
    await r.sched.stop()
    lane_batches = r.registry.get_sample_value("ferry_batches_total", {"model": "g", "reason": "lane"})
    return ttft, its[i], its[i + 1], lane_batches


def test_an_interactive_prompt_is_prefilled_alone_ahead_of_batch_class_decoding():
    """Interactive first with the lane (the defaults): an interactive prompt arriving while
    batch-class sequences decode joins in an iteration that is its prefill alone (the
    running sequences wait for it), then decodes with everyone; its first token waits for
    the step in flight and its own prefill, not for another step of all 40 rows."""
    ttft, (decoded, admitted), (next_decoded, _), lane_batches = run(_first_token_beside_batch_class_work(True))
    assert decoded == [] and len(admitted) == 1
    assert len(next_decoded) == 41  # everyone decodes next, the newcomer too
    assert lane_batches == 2  # the first interactive prompt's too: batch-class work was queued behind it
    assert ttft <= (STEP + 0.040) + (STEP + 0.001) + 1e-9  # the step in flight, then its prefill alone

    ttft_off, (decoded, admitted), _, lane_batches = run(_first_token_beside_batch_class_work(False))
    assert len(decoded) == 40 and len(admitted) == 1  # without the lane it shares a step of all 40
    assert not lane_batches
    assert ttft < ttft_off


async def _interactive_beside_many_batch_rows(interactive: bool) -> tuple[int, float | None, int]:
    """80 batch-class sequences offered to 64 slots whose decode step costs 10 + 4 ms a row
    (266 ms full); interactive prompts with a 200 ms budget arriving every 100 ms (none where
    `interactive` is False). The rows that run, the first token of an interactive prompt
    that arrives once they do, after its arrival (None: refused), and how many of the
    interactive prompts before it were refused."""
    from batcher.types import Priority

    r = GenRig(max_running=64, max_batch_size=64, max_wait_ms=0, per_row=0.004, touched=True, aging_ms=60_000)
    r.seed_decode_cost()
    await r.sched.start()
    chats, jobs, refused = [], [], 0
    for i in range(10):
        try:
            chats += [r.submit(2, budget=0.2)] if interactive else []
        except DeadlineInfeasible:
            refused += 1
        if i == 0:
            jobs = [r.submit(400, priority=Priority.BATCH) for _ in range(80)]  # no deadline
        await r.clock.advance(0.1)
    running = r.sched.running
    firsts: list[float] = []
    try:
        late = r.submit(4, budget=0.2, on_delta=lambda d: firsts.append(r.clock.now()) if not firsts else None)
    except DeadlineInfeasible:
        late = None
    await r.clock.advance(0.5)
    await r.cancel_all(jobs)
    assert all(c.future.result().completion_tokens == 2 for c in chats)
    await r.sched.stop()
    if late is None:
        return running, None, refused
    assert late.future.result().completion_tokens == 4
    return running, firsts[0] - late.arrival, refused


def test_batch_class_rows_are_capped_to_a_decode_step_within_the_interactive_budgets(monkeypatch):
    """While interactive prompts arrive, batch-class prompts join only while the decode step
    fits a share of the interactive reserve (batcher/slots.py, DECODE_SHARE): an interactive
    prompt that arrives just as a step starts waits for it, and a step of 64 rows (266 ms)
    alone is longer than its 200 ms budget. Without interactive traffic they fill the slots
    (one kept for the first interactive prompt); with no cap the newcomer is refused or late."""
    import batcher.slots

    full, _, _ = run(_interactive_beside_many_batch_rows(False))
    assert full == 63
    capped, first_token, refused = run(_interactive_beside_many_batch_rows(True))
    assert capped < 40  # at most (0.75 x 200 ms - 10 ms) / 4 ms rows, less the margins
    assert first_token is not None and first_token <= 0.2 and refused == 0
    monkeypatch.setattr(batcher.slots, "DECODE_SHARE", 100.0)
    uncapped, first_token, refused = run(_interactive_beside_many_batch_rows(True))
    assert uncapped > capped
    assert refused > 0 or first_token is None or first_token > 0.2


def test_prefill_alone_never_twice_in_a_row_and_not_for_interactive_traffic_alone():
    """Interactive prompts every few milliseconds beside batch-class decoding: between two
    prefill-only iterations there is always a decode step (the running sequences are never
    starved). With interactive traffic alone nothing waits on another class: every
    iteration decodes."""
    from batcher.types import Priority

    async def scenario(batch_class: bool):
        r = GenRig(max_running=64, max_batch_size=16, max_wait_ms=0, per_row=0.001, touched=True)
        r.seed_decode_cost()
        await r.sched.start()
        jobs = [r.submit(30, budget=30.0, priority=Priority.BATCH if batch_class else Priority.INTERACTIVE)]
        jobs += [r.submit(30, budget=30.0, priority=Priority.BATCH if batch_class else Priority.INTERACTIVE)]
        for _ in range(60):
            await r.clock.advance(0.004)
            jobs.append(r.submit(3, budget=1.0))
        await r.clock.run_until_idle()
        assert all(j.future.result().completion_tokens in (3, 30) for j in jobs)
        await r.sched.stop()
        return [(decoded, admitted) for _, decoded, admitted in r.sched.trace]

    trace = run(scenario(True))
    alone = [n for n, (decoded, admitted) in enumerate(trace) if admitted and not decoded and n > 0]
    assert len(alone) > 5  # the lane was used
    assert all(b - a > 1 for a, b in itertools.pairwise(alone))
    trace = run(scenario(False))
    assert all(decoded for n, (decoded, admitted) in enumerate(trace) if n > 0)


def test_static_mode_has_no_lane():
    """Static batching, the comparison baseline, admits whole groups whatever their class:
    an interactive prompt never runs a prefill of its own there."""
    from batcher.types import Priority

    async def scenario():
        r = GenRig(mode="static", max_running=8, max_batch_size=8, max_wait_ms=0, touched=True, per_row=0.001)
        r.seed_decode_cost()
        await r.sched.start()
        items = [r.submit(5, budget=30.0, priority=Priority.BATCH) for _ in range(3)]
        items += [r.submit(5, budget=1.0) for _ in range(2)]
        items += [r.submit(5, budget=30.0, priority=Priority.BATCH) for _ in range(3)]
        await r.clock.run_until_idle()
        assert all(i.future.result().completion_tokens == 5 for i in items)
        await r.sched.stop()
        return r, items

    r, items = run(scenario())
    assert not r.registry.get_sample_value("ferry_batches_total", {"model": "g", "reason": "lane"})
    first_group = next(admitted for _, _, admitted in r.sched.trace if admitted)
    assert {items[3].id, items[4].id} < set(first_group)  # the interactive pair, with batch-class company


async def _stopped_by_the_caller():
    """An item whose engine makes no text (an engine core's, detokenize=False): a delta for
    every token; after its third, the caller (the front end) found a stop string."""
    r = GenRig(max_wait_ms=0)
    await r.sched.start()
    deltas = []

    def on_delta(d):
        deltas.append(d)
        if len(deltas) == 3:
            assert r.sched.stop_sequence(d.item)

    payload = GenRequest([1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0, stop=["w1"], detokenize=False))
    item = r.sched.submit(payload, cost=3, on_delta=on_delta)
    other = r.submit(6)
    await r.clock.run_until_idle()
    await r.sched.stop()
    return r, item, other, deltas


def test_a_sequence_the_caller_stops_leaves_the_engine_before_its_next_step():
    r, item, other, deltas = run(_stopped_by_the_caller())
    assert [(d.text, d.tokens, list(d.token_ids), d.finish_reason) for d in deltas] == [
        ("", 1, [1], None),
        ("", 1, [2], None),
        ("", 1, [3], None),
    ]  # the engine ignored the stop string: the caller applies it
    result = item.future.result()
    assert (result.finish_reason, result.completion_tokens, result.text) == ("stop", 3, "")
    assert not r.sched.stop_sequence(item)  # finished: skipped
    # Prefill (token 1), two decode steps (2, 3), and the step under way while token 3 was
    # delivered (delivery overlaps the next step; its token is dropped); then it is gone.
    stepped = [ids for kind, ids in r.engine.calls if kind == "step"]
    assert [item.id in ids for ids in stepped] == [True, True, True] + [False] * (len(stepped) - 3)
    assert other.future.result().completion_tokens == 6


def test_a_tpot_target_is_checked_against_the_predicted_decode_step():
    """x-llm-d-slo-tpot-ms: refused at once when the decode step at the occupancy the
    request would join is slower than its target; admitted, its target bounds the batch."""

    async def scenario():
        from batcher.errors import DeadlineInfeasible

        # Decode costs STEP + 2 ms per running row (seeded, as a warm-up profile would).
        r = GenRig(max_running=16, max_batch_size=16, per_row=0.002)
        r.seed_decode_cost()
        step = r.sched.decode_cost.predict
        await r.sched.start()
        # Idle: even alone a step takes step(1); a tighter target is never met here.
        with pytest.raises(DeadlineInfeasible) as alone:
            r.submit(5, itl_target=step(1) * 0.9)
        assert "alone" in alone.value.message and alone.value.retry_after == 60
        running = [r.submit(40) for _ in range(8)]
        await r.clock.advance(0.001)
        assert r.sched.running == 8
        # Joining the eight makes nine rows: between step(1) and step(9) is a matter of load.
        with pytest.raises(DeadlineInfeasible) as loaded:
            r.submit(5, itl_target=(step(1) + step(9)) / 2)
        assert "9 sequences" in loaded.value.message and loaded.value.retry_after >= 1
        rejected = r.registry.get_sample_value(
            "ferry_rejections_total", {"model": "g", "reason": "deadline_infeasible"}
        )
        assert rejected == 2
        # A target step(10) admits it; while it runs, the batch stays at ten rows at most.
        target = step(10)
        tight = r.submit(30, itl_target=target)
        assert tight.itl_target == target and not tight.best_effort
        more = [r.submit(5) for _ in range(6)]
        await r.clock.advance(STEP * 3)
        assert r.sched.running == 10
        while not tight.finished:
            await r.clock.advance(STEP)
            assert r.sched.running <= 10
        await r.clock.run_until_idle()
        assert tight.future.result().completion_tokens == 30
        assert all(i.future.result().completion_tokens for i in running + more)
        await r.sched.stop()

    run(scenario())


def test_a_tpot_target_is_served_best_effort_when_asked():
    async def scenario():
        r = GenRig(max_running=4, per_row=0.002, on_infeasible="serve")
        r.seed_decode_cost()
        await r.sched.start()
        item = r.submit(3, itl_target=r.sched.decode_cost.predict(1) / 2)
        assert item.best_effort
        await r.clock.run_until_idle()
        assert item.future.result().completion_tokens == 3
        await r.sched.stop()

    run(scenario())


def test_a_prompt_is_priced_by_the_tokens_its_prefill_computes():
    """A prompt whose prefix the engine's cache holds is admitted and timed as the cheap
    prompt it is; the same length uncached is refused at once for the same budget."""

    async def scenario():
        r = GenRig(max_batch_size=4, max_wait_ms=0)
        r.seed_decode_cost()
        per_token = 0.001  # prefill: STEP + 1 ms per computed token
        r.sched.prefill_cost._fit = LinearCost(STEP, 0.0, per_token)
        await r.sched.start()
        params = SamplingParams(max_tokens=2, temperature=0.0)
        system = [7 + i % 50 for i in range(384)]  # 24 blocks of 16 tokens
        first = r.sched.submit(GenRequest([*system, *range(100, 116)], params), cost=400, budget=10.0)
        await r.clock.run_until_idle()
        assert first.future.result().completion_tokens == 2  # its blocks are in the cache now
        block = r.engine.prefix_block
        later = GenRequest([*system, *range(200, 216)], params)
        assert r.engine.cached_prefix(later.prompt_ids) == len(system) // block * block
        # 400 tokens uncached predict STEP + 0.4 s to the first token; 16 computed, STEP + 16 ms.
        budget = 0.1
        cheap = r.sched.submit(later, cost=400, budget=budget)
        assert cheap.cost == 400 - len(system)
        with pytest.raises(DeadlineInfeasible):
            r.sched.submit(GenRequest([*range(300, 700)], params), cost=400, budget=budget)
        await r.clock.run_until_idle()
        assert cheap.future.result().completion_tokens == 2
        await r.sched.stop()

    run(scenario())


def test_queued_prompts_are_priced_again_as_the_prefix_cache_fills():
    """Five conversations with one uncached system prompt arrive together: each is priced in
    full, so one fits the prefill token budget and joins alone; once its blocks are
    stored, the four queued behind it are priced by their own turn and join as one group."""

    async def scenario():
        r = GenRig(max_batch_size=8, max_wait_ms=0, prefill_token_budget=500)
        r.seed_decode_cost()
        await r.sched.start()
        params = SamplingParams(max_tokens=2, temperature=0.0)
        system = [7 + i % 50 for i in range(384)]  # 24 blocks of 16 tokens
        items = [
            r.sched.submit(GenRequest([*system, *range(100 * k, 100 * k + 16)], params), cost=400) for k in range(1, 6)
        ]
        assert [i.cost for i in items] == [400] * 5  # nothing cached yet
        await r.clock.run_until_idle()
        assert all(i.future.result().completion_tokens == 2 for i in items)
        assert items[0].batch_size == 1
        assert [i.batch_size for i in items[1:]] == [4] * 4
        assert {r.admitted_at(i) for i in items[1:]} == {r.admitted_at(items[1])}
        assert [i.cost for i in items[1:]] == [16] * 4  # 400 less the 384 cached
        await r.sched.stop()

    run(scenario())


def test_the_warm_up_profile_measures_prefills_the_prefix_cache_cannot_serve():
    """The seed of the prefill cost model is what an uncached prompt costs: no row of the
    profile shares a prefix with another, in its group or an earlier one."""
    from batcher.iteration import WARMUP_SIZES, profile

    engine = FakeGenerationEngine()
    served: list[int] = []
    add = engine.add

    def counting_add(requests):
        outputs = add(requests)
        served.extend(o.cached_tokens for o in outputs)
        return outputs

    engine.add = counting_add
    prompt = list(range(10, 10 + 3 * engine.prefix_block + 5))  # three whole blocks and more
    obs = profile(engine, sequence_request, prompt)
    assert len(served) == sum(WARMUP_SIZES) and served == [0] * len(served)
    assert [o[2] for o in obs if o[0] == "prefill"] == [n * len(prompt) for n in WARMUP_SIZES]


def test_an_expiry_sooner_than_its_prediction_says_nothing_of_the_promises():
    async def scenario():
        r = GenRig()
        await r.sched.start()
        calibration = r.sched.first_tokens[Priority.INTERACTIVE]
        for _ in range(8):  # first tokens 1.6x as late as promised
            calibration.observe(0.100, 0.160)
        assert calibration.factor == pytest.approx(1.6)
        now = r.clock.now()
        for _ in range(100):  # best effort, promised 100 ms past a 50 ms budget: expired at 50 ms
            item = r.submit(3, budget=5.0)
            r.sched.queue.remove(item)
            item.arrival, item.predicted_wait = now - 0.050, 0.150
            r.sched._finish(item, Outcome.EXPIRED, DeadlineExceeded("expired"))
        assert calibration.factor == pytest.approx(1.6)  # not dragged down by 100 readings of 1/3
        await r.sched.stop()

    run(scenario())
