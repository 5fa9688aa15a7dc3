"""Token-budgeted steps on a fake clock: a long prompt is prefilled a budget at a time
while the running streams decode every iteration, an interactive prompt's chunk goes
ahead of a batch-class one, a failing chunk fails only its item; and the budget itself."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import CollectorRegistry

from batcher.clock import FakeClock
from batcher.cost import CostModel, LinearCost, PackedChunkCost
from batcher.errors import EngineError
from batcher.iteration import MIN_CHUNK, IterationResult, PrefillWork, chunk_budget
from batcher.metrics import Metrics
from batcher.scheduler import GenerationScheduler
from batcher.settings import BatchingSettings
from batcher.types import GenRequest, Priority, TokenCount, WorkItem
from engine.base import SamplingParams, sequence_request
from engine.fake import FakeChunkingEngine, FakePackingEngine, SimulatedEngineThread

from .conftest import run


class ChunkRig:
    def __init__(self, fail_prompts=None, packing=False, **settings):
        settings.setdefault("default_budget_ms", None)
        self.clock = FakeClock()
        kind = FakePackingEngine if packing else FakeChunkingEngine
        self.engine = kind(fail_prompts=fail_prompts, max_context=4096)
        self.sched = GenerationScheduler(
            "g",
            self.engine,
            SimulatedEngineThread(self.clock, self.engine, 0.010, 0.0),
            BatchingSettings(**settings),
            make_request=sequence_request,
            clock=self.clock,
            metrics=Metrics(CollectorRegistry()),
        )

    def submit(self, prompt_len: int, max_tokens: int, first_token: int = 1, **kw):
        prompt = [first_token] + [2] * (prompt_len - 1)
        payload = GenRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return self.sched.submit(payload, cost=prompt_len, **kw)

    def prefills_of(self, item) -> list[int]:
        """Indices in the engine's calls of the prefill calls that fed `item`."""
        return [i for i, (kind, ids) in enumerate(self.engine.calls) if kind == "prefill" and item.id in ids]


def test_a_long_prompt_is_prefilled_a_budget_at_a_time_while_the_streams_decode():
    async def scenario():
        r = ChunkRig(max_batch_tokens=40, max_running=8, max_batch_size=8)
        await r.sched.start()
        streams = [r.submit(3, 40) for _ in range(3)]
        await r.clock.advance(0.05)
        long = r.submit(300, 2)
        await r.clock.run_until_idle()
        assert all(s.future.result().completion_tokens == 40 for s in streams)
        assert long.future.result().completion_tokens == 2
        chunks = r.prefills_of(long)
        assert len(chunks) >= 300 // (40 - 3)
        # Every prefill call fed at most the budget less the three decode rows.
        assert max(r.engine.fed) <= 40 - 3
        # Between two of the long prompt's chunks, a decode step of every stream.
        calls = r.engine.calls
        for a, b in itertools.pairwise(chunks):
            steps = [ids for kind, ids in calls[a:b] if kind == "step"]
            assert any({s.id for s in streams} <= set(ids) for ids in steps)
        await r.sched.stop()

    run(scenario())


def test_admission_sees_the_prompt_tokens_the_engine_is_still_prefilling():
    """A newcomer's first chunk comes after the engine's backlog, less the chunk the
    iteration in flight is computing."""

    async def scenario():
        r = ChunkRig(max_batch_tokens=40, max_running=8, max_batch_size=8)
        await r.sched.start()
        streams = [r.submit(3, 40) for _ in range(3)]
        await r.clock.advance(0.05)
        r.submit(300, 2)
        while not (r.engine.prefill_backlog and r.sched._iteration_ends is not None):
            await r.clock.advance(0.001)  # taken by the engine, an iteration in flight
        backlog = r.engine.prefill_backlog
        load = r.sched.load(r.clock.now())
        assert 0 < load.prefill_backlog == backlog - load.prefill_chunk
        for s in streams:
            r.sched.cancel(s)
        await r.clock.run_until_idle()
        assert r.sched.load(r.clock.now()).prefill_backlog == 0 == r.engine.prefill_backlog
        await r.sched.stop()

    run(scenario())


def test_an_interactive_prompts_chunk_goes_ahead_of_a_batch_class_one():
    async def scenario():
        r = ChunkRig(max_batch_tokens=64, max_running=8, max_batch_size=8, interactive_lane=False)
        await r.sched.start()
        stream = r.submit(3, 60, priority=Priority.INTERACTIVE)
        await r.clock.advance(0.05)
        bulk = r.submit(600, 1, priority=Priority.BATCH)
        await r.clock.advance(0.05)
        urgent = r.submit(100, 1, priority=Priority.INTERACTIVE)
        await r.clock.run_until_idle()
        for item in (stream, bulk, urgent):
            assert item.future.result().completion_tokens >= 1
        urgent_calls, bulk_calls = r.prefills_of(urgent), r.prefills_of(bulk)
        assert bulk_calls[0] < urgent_calls[0]  # the batch-class prompt had started
        assert urgent_calls[-1] < bulk_calls[-1]  # the interactive one finished first
        for i in urgent_calls:
            assert r.engine.calls[i][1][0] == urgent.id  # its chunk first in every call
        await r.sched.stop()

    run(scenario())


def test_a_failing_chunk_fails_only_its_item():
    async def scenario():
        r = ChunkRig(fail_prompts={66}, max_batch_tokens=50, max_running=8, max_batch_size=8)
        await r.sched.start()
        good, bad = r.submit(120, 3), r.submit(120, 3, first_token=66)
        await r.clock.run_until_idle()
        assert good.future.result().completion_tokens == 3
        assert isinstance(bad.future.exception(), EngineError)
        assert r.sched.running == 0 and r.engine.running == 0
        await r.sched.stop()

    run(scenario())


def fitted(fixed: float, per_item: float, per_token: float) -> CostModel:
    model = CostModel()
    model._fit = LinearCost(fixed, per_item, per_token)
    return model


def test_the_budget_is_max_batch_tokens_less_the_decode_rows_or_what_fits_the_decode_step():
    prefill, decode = fitted(0.002, 0.0, 0.0001), fitted(0.010, 0.001, 0.0)
    fixed = BatchingSettings(max_batch_tokens=100)
    assert chunk_budget(fixed, 10, prefill, decode) == 90
    assert chunk_budget(fixed, 90, prefill, decode) == MIN_CHUNK
    auto = BatchingSettings()
    assert chunk_budget(auto, 0, prefill, decode) is None  # nothing decodes: prompts go whole
    # A 20 ms decode step at 10 rows: a chunk of (20 - 2) ms at 0.1 ms a token.
    assert chunk_budget(auto, 10, prefill, decode) == 180
    # Within max_itl_ms: 25 ms leaves 5 ms beside the step, 30 tokens, raised to the floor.
    assert chunk_budget(BatchingSettings(max_itl_ms=25), 10, prefill, decode) == MIN_CHUNK
    assert chunk_budget(BatchingSettings(max_itl_ms=60), 10, prefill, decode) == 180
    # Packed into the decode step's forward, a chunk costs its tokens only: 20 ms, 200 tokens.
    assert chunk_budget(auto, 10, prefill, decode, packed=True) == 200
    assert chunk_budget(fixed, 10, prefill, decode, packed=True) == 90  # a set budget is the budget


def test_a_packing_engine_gets_chunks_as_large_as_its_decode_step_without_a_forward_of_their_own():
    """The prefill model's fixed cost (a forward of its own) is as large as the decode step:
    counted against a packed chunk, it left the floor alone (one short prompt per step)."""

    async def scenario():
        r = ChunkRig(packing=True, max_running=8, max_batch_size=8)
        await r.sched.start()
        streams = [r.submit(3, 400) for _ in range(3)]
        await r.clock.advance(0.05)
        assert r.engine.running == 3
        r.sched.prefill_cost._fit = LinearCost(0.020, 0.0, 0.0001)
        r.sched.decode_cost._fit = LinearCost(0.020, 0.0, 0.0)
        assert r.sched._chunking(decode=True).budget == 200  # 20 ms of tokens at 0.1 ms
        assert r.sched._chunking(decode=False).budget == MIN_CHUNK  # a forward of its own: 20 - 20 ms
        assert r.sched.load(r.clock.now()).prefill_chunk == 200  # admission predicts the same chunks
        for s in streams:
            r.sched.cancel(s)
        await r.sched.stop()

    run(scenario())


def test_a_packing_engine_gets_its_decode_rows_and_chunks_in_one_call():
    async def scenario():
        r = ChunkRig(packing=True, max_batch_tokens=40, max_running=8, max_batch_size=8)
        await r.sched.start()
        streams = [r.submit(3, 30) for _ in range(3)]
        await r.clock.advance(0.05)
        long = r.submit(200, 2)
        await r.clock.run_until_idle()
        assert all(s.future.result().completion_tokens == 30 for s in streams)
        assert long.future.result().completion_tokens == 2
        calls = r.engine.calls
        chunks = r.prefills_of(long)
        assert len(chunks) >= 200 // (40 - 3)
        # Every chunk of the long prompt that ran beside decode rows ran in a packed call.
        beside = [i for i in chunks if calls[i - 1][0] == "step"]
        assert beside and all(calls[i - 2][0] == "packed" for i in beside)
        # Both phases' metrics and cost models saw the packed iterations.
        assert r.sched.cost_models["prefill"]._obs and r.sched.cost_models["decode"]._obs
        await r.sched.stop()

    run(scenario())


def test_a_packed_iterations_time_is_shared_out_as_the_cost_models_predict():
    costs = {"decode": fitted(0.010, 0.001, 0.0), "prefill": fitted(0.002, 0.0, 0.0001)}
    work = PrefillWork(rows=1, tokens=TokenCount(80, 80), computed=TokenCount(80, 80))
    # Predicted: decode 10 + 10 x 1 = 20 ms, prefill 2 + 80 x 0.1 = 10 ms; measured 45 ms in all.
    result = IterationResult([], {}, 0.0, 0.030, 10, prefill=work, packed=True)
    result.apportion(0.045, costs)
    assert abs(result.decode_seconds - 0.030) < 1e-9 and abs(result.prefill_seconds - 0.015) < 1e-9
    apart = IterationResult([], {}, 0.010, 0.030, 10, prefill=work)
    apart.apportion(0.080, costs)  # measured apart: the worker's own proportion
    assert abs(apart.decode_seconds - 0.060) < 1e-9 and abs(apart.prefill_seconds - 0.020) < 1e-9


def test_a_packed_step_shows_what_its_chunks_add_and_keeps_the_shares_the_cost_models_predict():
    """A packed step of 10 rows and 80 chunk tokens that took 45 ms, its rows predicted at
    20 ms: it adds 25 ms to what chunks were measured to add; the phases' shares (the
    metrics, and what the decode model learns) stay as the cost models predict them."""
    costs = {"decode": fitted(0.010, 0.001, 0.0), "prefill": fitted(0.002, 0.0, 0.0001)}
    chunks = PackedChunkCost(min_seen=1, refresh_every=1)
    work = PrefillWork(rows=1, tokens=TokenCount(80, 80), computed=TokenCount(80, 80))
    result = IterationResult([], {}, 0.0, 0.030, 10, prefill=work, packed=True)
    result.apportion(0.045, costs, chunks)
    assert abs(result.decode_seconds - 0.030) < 1e-9 and abs(result.prefill_seconds - 0.015) < 1e-9
    assert chunks.predict(80) == pytest.approx(0.025)
    alone = IterationResult([], {}, 0.0, 0.030, 10)  # no chunks: nothing to show
    alone.apportion(0.020, costs, chunks)
    assert chunks.predict(80) == pytest.approx(0.025)


def test_a_step_whose_rows_took_drafts_teaches_the_decode_model_the_time_a_token():
    """Speculation: a step of 10 rows that gave them 20 tokens (drafts taken) counts as two
    steps of one token each, for the decode model's time between a row's tokens (admission,
    the slots and the inter-token targets read it so); in a packed step its share of the
    forward grows with the tokens it gave."""
    from batcher.metrics import Metrics

    costs = {"decode": fitted(0.010, 0.001, 0.0), "prefill": fitted(0.002, 0.0, 0.0001)}
    seen: list[tuple[int, float]] = []
    costs["decode"].observe = lambda n, tokens, seconds: seen.append((n, seconds)) or 0.0  # type: ignore[method-assign]
    result = IterationResult([], {}, 0.0, 0.040, 10, decoded_tokens=20)
    result.apportion(0.040, costs)
    result.record([], Metrics(CollectorRegistry()), "g", costs)
    assert seen == [(10, 0.020)]
    work = PrefillWork(rows=1, tokens=TokenCount(80, 80), computed=TokenCount(80, 80))
    # Predicted: decode 20 ms a token x 2, prefill 10 ms; measured 50 ms in all.
    packed = IterationResult([], {}, 0.0, 0.030, 10, prefill=work, packed=True, decoded_tokens=20)
    packed.apportion(0.050, costs)
    assert abs(packed.decode_seconds - 0.040) < 1e-9 and abs(packed.prefill_seconds - 0.010) < 1e-9


def test_a_packing_engine_with_packing_off_is_called_apart_and_timed_apart():
    async def scenario():
        r = ChunkRig(packing=True, max_batch_tokens=40, max_running=8, max_batch_size=8)
        r.engine.packs_steps = False
        await r.sched.start()
        streams = [r.submit(3, 10) for _ in range(2)]
        await r.clock.advance(0.05)
        long = r.submit(100, 2)
        await r.clock.run_until_idle()
        assert long.future.result().completion_tokens == 2 and all(s.future.done() for s in streams)
        assert not any(kind == "packed" for kind, _ in r.engine.calls)
        await r.sched.stop()

    run(scenario())


def test_a_steps_ceiling_for_drafts_is_the_tightest_inter_token_target_and_the_interactive_reserve():
    """What a speculating engine's drafts may take a step to (`step_ceiling`, set before each
    iteration): nothing without targets; `max_itl_ms`, or a request's own tighter target;
    and while interactive prompts arrive, the decode step's share of their reserve."""
    from batcher.slots import DECODE_SHARE

    async def scenario():
        r = ChunkRig(packing=True, max_batch_tokens=40, max_running=8, max_batch_size=8)
        await r.sched.start()

        async def ceilings_with(*items) -> set[float | None]:
            r.engine.ceilings.clear()
            streams = [r.submit(3, 6, priority=Priority.BATCH) for _ in range(2)]
            await r.clock.advance(0.02)
            long = r.submit(200, 1, priority=Priority.BATCH)  # chunks beside the streams: packed calls
            await r.clock.run_until_idle()
            assert all(i.future.result().completion_tokens for i in [*streams, long, *items])
            assert r.engine.ceilings
            return set(r.engine.ceilings)

        assert await ceilings_with() == {None}
        r.sched.update(max_itl_ms=50)  # live, as PATCH /admin/models/{model}/batching does
        assert await ceilings_with() == {0.05}
        tight = r.submit(3, 40, itl_target=0.03, priority=Priority.BATCH)
        assert await ceilings_with(tight) == {0.03}
        r.sched.update(max_itl_ms=None)
        chat = r.submit(3, 2, budget=0.4, priority=Priority.INTERACTIVE)
        # The reserve: the budget less the margins and the prompt's own prefill (as its cost
        # model learns, it moves a little).
        got = await ceilings_with(chat)
        assert all(c is not None and 0.0 < c <= DECODE_SHARE * 0.4 for c in got), got
        await r.sched.stop()

    run(scenario())


async def _chunks_after_a_quiet_tenant_joins(fairness: str) -> tuple[list[list[int]], int, int]:
    """A quiet tenant's stream running beside a noisy tenant's two long prompts being
    prefilled 40 tokens a step, then a long prompt of the quiet one (its tenant active, not
    lifted: counted 3 + 100 prompt tokens against the noisy one's 600): the prefill calls
    from its joining on, and the two tenants' ids."""
    r = ChunkRig(max_batch_tokens=40, max_running=8, max_batch_size=8, fairness=fairness)
    await r.sched.start()
    stream = r.submit(3, 60, tenant="quiet", priority=Priority.BATCH)
    await r.clock.advance(0.015)
    noisy = [r.submit(300, 2, tenant="noisy", priority=Priority.BATCH) for _ in range(2)]
    await r.clock.advance(0.035)  # a few chunks of theirs
    quiet = r.submit(100, 2, tenant="quiet", priority=Priority.BATCH)
    await r.clock.run_until_idle()
    assert all(i.future.result().completion_tokens == 2 for i in [*noisy, quiet])
    assert stream.future.result().completion_tokens == 60
    calls = r.engine.calls
    joined = next(k for k, (kind, ids) in enumerate(calls) if kind == "enqueue" and quiet.id in ids)
    await r.sched.stop()
    return [ids for kind, ids in calls[joined:] if kind == "prefill"], quiet.id, noisy[0].id


def test_with_fair_shares_a_quiet_tenants_chunks_go_before_a_noisy_tenants():
    """The chunk order within a class follows the tenants' counters (the noisy tenant was
    charged its prompts): the quiet tenant's prompt is prefilled first and whole in three
    steps, the noisy one's wait; with `--fairness off` it waits behind them, in join order."""
    fair, quiet, noisy = run(_chunks_after_a_quiet_tenant_joins("on"))
    assert [ids[0] for ids in fair[:3]] == [quiet] * 3
    assert noisy not in fair[0] and noisy not in fair[1]
    unfair, quiet, noisy = run(_chunks_after_a_quiet_tenant_joins("off"))
    assert unfair[0][0] == noisy and quiet not in unfair[0]


def test_admission_counts_the_chunks_that_go_before_the_newcomers():
    """`prefill_ahead`: interactive prompts' chunks go before a batch-class newcomer's, never
    after an interactive one; with fair shares a tenant counted over the newcomer's tenant
    waits behind it; without, its whole class counts."""
    from batcher.admission import prefill_ahead
    from batcher.fairness import Tenants
    from batcher.load import Load
    from batcher.queue import RequestQueue
    from batcher.types import WorkItem

    tenants = Tenants()
    tenants.arrive("quiet", 1)  # both active; the noisy one served 500 tokens since
    tenants.arrive("noisy", 1)
    tenants.charge("noisy", 0.0, input_tokens=500)
    q = RequestQueue(tenants=tenants)
    load = Load(
        prefill_backlog=700,
        prefilling=((int(Priority.INTERACTIVE), "noisy", 100), (int(Priority.BATCH), "noisy", 600)),
    )

    def item(priority: Priority, tenant: str) -> WorkItem:
        return WorkItem(payload=None, cost=50, arrival=0.0, deadline=10.0, priority=priority, tenant=tenant)

    assert prefill_ahead(q, item(Priority.BATCH, "quiet"), load) == 100  # the noisy batch-class prompt waits
    assert prefill_ahead(q, item(Priority.BATCH, "noisy"), load) == 700  # its own tenant's go first
    assert prefill_ahead(q, item(Priority.INTERACTIVE, "quiet"), load) == 0
    tenants.configure(False, 1.0, 2.0)  # --fairness off: the class in join order
    assert prefill_ahead(q, item(Priority.BATCH, "quiet"), load) == 700
    assert prefill_ahead(q, item(Priority.BATCH, "quiet"), Load(prefill_backlog=300)) == 300


class ChunksAddCost:
    """An engine thread whose iterations cost 10 ms and 2 ms a decoding row, and 6 ms more
    where they carry prompt chunks (what a packed step's prefill adds), on the fake clock."""

    def __init__(self, clock: FakeClock, engine: FakePackingEngine) -> None:
        self.clock, self.engine = clock, engine

    async def __call__(self, fn, *args):
        before = len(self.engine.calls)
        result = fn(*args)
        calls = self.engine.calls[before:]
        rows = max((len(ids) for kind, ids in calls if kind == "step"), default=0)
        chunks = any(kind == "prefill" and ids for kind, ids in calls)
        await self.clock.sleep(0.010 + 0.002 * rows + (0.006 if chunks else 0.0))
        return result


def test_an_iteration_that_takes_a_new_prompt_is_predicted_at_what_chunks_add_to_a_packed_step():
    """A prompt joining a packed step adds what chunks were measured to add to such steps
    (6 ms here), not a prefill forward of its own as the prefill model prices it (30 ms and
    10 ms a token): the iteration in flight, which every newcomer's first token waits out,
    is predicted to end when such iterations ended."""

    async def scenario():
        r = ChunkRig(packing=True, max_running=32, max_batch_size=8, max_wait_ms=0)
        r.sched.engine_thread = ChunksAddCost(r.clock, r.engine)
        await r.sched.start()
        r.sched.decode_cost = CostModel(LinearCost(0.010, 0.002, 0.0), refit_every=10**9)
        r.sched.prefill_cost = r.sched.cost = CostModel(LinearCost(0.030, 0.0, 0.010), refit_every=10**9)
        for _ in range(4):
            r.submit(3, 500)
        await r.clock.advance(0.05)
        for _ in range(12):  # one prompt joins each of the next iterations
            r.submit(3, 500)
            await r.clock.advance(0.03)
        rows = len(r.sched._running)
        joining = WorkItem(payload=None, arrival=r.clock.now(), cost=3)
        assert r.sched.packed_chunk.predict(3) == pytest.approx(0.006, abs=1e-4)
        assert r.sched._predicted_iteration([joining], rows) == pytest.approx(0.010 + 0.002 * rows + 0.006, abs=1e-4)
        await r.sched.stop()

    run(scenario())
