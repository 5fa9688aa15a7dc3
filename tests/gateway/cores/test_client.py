"""gateway/cores/client.py against a real engine core (gateway/cores/core.py) in the same
event loop: a MicroBatcher over the fake embeddings engine, served on an ipc:// socket.
The process around a core is tests/gateway/cores/test_core.py's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import zmq.asyncio

from batcher.errors import (
    Cancelled,
    DeadlineInfeasible,
    ModelUnavailable,
    QueueFull,
    RequestTooLarge,
    ShuttingDown,
)
from batcher.microbatcher import MicroBatcher
from batcher.settings import BatchingSettings, SettingsError
from batcher.types import Outcome, Priority
from engine.fake import FakeEmbeddingEngine, fake_vector
from gateway.cores.client import CoreClient
from gateway.cores.core import EngineCore
from gateway.submission import timing_headers
from tests.waiting import async_wait_until

# What the admin GET reports of each phase's cost model.
COST_REPORT_FIELDS = {"fixed_ms", "per_item_ms", "per_token_ms", "per_token_row_ms", "observations", "slowdown", "tail"}


@contextlib.asynccontextmanager
async def core_and_front(tmp_path, engine: FakeEmbeddingEngine, **settings: Any) -> AsyncIterator[tuple]:
    async def execute(payloads):
        return await asyncio.to_thread(engine.embed, payloads)

    batcher = MicroBatcher(engine.name, execute, BatchingSettings(**settings))
    await batcher.start()
    ctx = zmq.asyncio.Context()
    core = EngineCore(batcher, f"ipc://{tmp_path}/core", ctx)
    serving = asyncio.create_task(core.serve())
    remote = CoreClient(engine.name, core.address, batcher.settings, ctx=ctx)
    await remote.start()
    try:
        yield batcher, core, remote
    finally:
        await remote.stop()
        serving.cancel()
        await batcher.stop()
        await core.close()
        ctx.term()


def run(coro) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_results_are_the_engine_s_own_with_the_timing_headers(tmp_path):
    engine = FakeEmbeddingEngine()
    texts = ["hello", "two words", "three little words"]

    async def main():
        async with core_and_front(tmp_path, engine) as (_, core, remote):
            items = await remote.submit_many(engine.tokenize(texts), costs=[3, 4, 5], request_id="r1")
            results = await asyncio.gather(*(i.future for i in items))
            assert [len(r.vector) for r in results] == [8, 8, 8]
            for r, t in zip(results, texts, strict=True):
                assert r.vector.dtype == np.float32
                np.testing.assert_array_equal(r.vector, fake_vector(t, 8))
            assert [r.tokens for r in results] == [3, 4, 5]
            assert all(i.outcome is Outcome.RESULT and i.batch_size == 3 for i in items)
            headers = timing_headers(items)
            assert headers["X-Ferry-Batch-Size"] == "3" and float(headers["X-Ferry-Queue-Ms"]) >= 0
            assert headers["X-Ferry-Dispatch-Reason"] in {"full", "max_wait", "adaptive", "deadline"}
            await async_wait_until(lambda: not core.requests, message="the core to forget the finished request")
            assert remote.queue._req_of == {}

    run(main())


def test_refusals_raise_the_local_errors_with_retry_after(tmp_path):
    engine = FakeEmbeddingEngine(fixed=0.3)

    async def main():
        async with core_and_front(tmp_path, engine, max_queue=2, max_wait_ms=0) as (_, __, remote):
            with pytest.raises(RequestTooLarge):
                await remote.submit_many([[1], [2], [3]])
            running = await remote.submit_many([[1, 2]])
            await async_wait_until(lambda: engine.calls, message="the first batch to reach the engine")
            with pytest.raises(DeadlineInfeasible) as late:  # behind a 0.3 s batch
                await remote.submit_many([[4]], budget=0.001, priority=Priority.INTERACTIVE)
            assert late.value.retry_after is not None
            queued = await remote.submit_many([[1], [2]])
            with pytest.raises(QueueFull) as full:
                await remote.submit_many([[3]])
            assert full.value.retry_after is not None and full.value.retry_after > 0
            await asyncio.gather(*(i.future for i in running + queued))

    run(main())


def test_quiet_submits_hear_only_results_or_their_refusal(tmp_path):
    """one_shot=True: the items come back before the core has seen them and it sends
    no Admitted; a refusal fails them with the error a waited submit raises; an unsent one
    (the core gone) fails them too. Nothing is left tracked here."""
    engine = FakeEmbeddingEngine(fixed=0.3)

    async def main():
        async with core_and_front(tmp_path, engine, max_queue=2, max_wait_ms=0) as (_, core, remote):
            sent: list[str] = []
            send = core._send
            core._send = lambda peer, m: (sent.append(type(m).__name__), send(peer, m))[1]  # type: ignore[method-assign]
            running = await remote.submit_many(engine.tokenize(["first"]), one_shot=True)
            assert not running[0].finished
            await async_wait_until(lambda: engine.calls, message="the first batch to reach the engine")
            late = await remote.submit_many([[4]], budget=0.001, one_shot=True)
            with pytest.raises(DeadlineInfeasible) as refused:  # behind a 0.3 s batch
                await late[0].future
            assert refused.value.retry_after is not None and late[0].outcome is Outcome.ERROR
            assert remote.cancel(late[0]) is False  # finished: nothing to withdraw
            np.testing.assert_array_equal((await running[0].future).vector, fake_vector("first", 8))
            assert "Admitted" not in sent and sent.count("Refused") == 1 and sent.count("Result") == 1
            assert remote.queue._req_of == {} and remote.in_flight == 0
            await remote.lost("engine core killed by SIGKILL")
            with pytest.raises(ModelUnavailable):
                await remote.submit_many([[1]], one_shot=True)

    run(main())


def test_cancel_withdraws_the_whole_request_in_the_core_before_it_runs(tmp_path):
    engine = FakeEmbeddingEngine(fixed=0.3)

    async def main():
        async with core_and_front(tmp_path, engine, max_wait_ms=0) as (batcher, _, remote):
            first = await remote.submit_many(engine.tokenize(["first"]))
            await async_wait_until(lambda: engine.calls, message="the first batch to reach the engine")
            queued = await remote.submit_many(engine.tokenize(["queued one", "queued two"]))
            await async_wait_until(lambda: len(batcher.queue) == 2, message="both items queued in the core")
            assert queued[0] in remote.queue
            assert remote.cancel(queued[0]) is True
            assert all(i.outcome is Outcome.CANCELLED for i in queued)  # at once, here
            for item in queued:
                with pytest.raises(Cancelled):
                    await item.future
            assert remote.cancel(queued[1]) is False  # idempotent
            await async_wait_until(lambda: len(batcher.queue) == 0, message="the core to drop the cancelled items")
            await first[0].future
            assert engine.calls == [1]  # the cancelled items never reached the engine
            assert batcher.metrics.cancellations.labels(engine.name, "queued")._value.get() == 2

    run(main())


def test_a_submit_cancelled_while_awaiting_admission_is_withdrawn(tmp_path):
    engine = FakeEmbeddingEngine(fixed=0.3)

    async def main():
        async with core_and_front(tmp_path, engine, max_wait_ms=0) as (batcher, core, remote):
            first = await remote.submit_many(engine.tokenize(["first"]))
            await async_wait_until(lambda: engine.calls, message="the first batch to reach the engine")
            task = asyncio.create_task(remote.submit_many(engine.tokenize(["left early"])))
            await asyncio.sleep(0)  # sent, not yet answered
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await async_wait_until(
                lambda: batcher.outcomes[Outcome.CANCELLED] == 1, message="the core to cancel the abandoned request"
            )
            await first[0].future
            await async_wait_until(lambda: not core.requests, message="the core to forget both requests")
            assert engine.calls == [1] and remote.table.pending == {} and remote.table.requests == {}

    run(main())


def test_settings_change_and_read_through_the_core(tmp_path):
    engine = FakeEmbeddingEngine()

    async def main():
        async with core_and_front(tmp_path, engine) as (batcher, _, remote):
            new = await remote.update(max_wait_ms=2.5, policy="fixed")
            assert new.max_wait_ms == 2.5 and batcher.settings.policy == "fixed"
            assert remote.settings == batcher.settings
            with pytest.raises(SettingsError) as bad:
                await remote.update(max_batch_size=0)
            assert bad.value.field == "max_batch_size"
            assert batcher.settings.max_batch_size == 32
            described = await remote.describe()
            assert described["max_wait_ms"] == 2.5
            assert set(described["cost_model"]["embed"]) == COST_REPORT_FIELDS

    run(main())


def test_a_lost_core_fails_every_open_request_at_once_and_every_later_one(tmp_path):
    engine = FakeEmbeddingEngine(fixed=0.5)

    async def main():
        async with core_and_front(tmp_path, engine, max_wait_ms=0) as (_, __, remote):
            items = await remote.submit_many(engine.tokenize(["in flight"]))
            await remote.lost("engine core killed by SIGKILL")
            with pytest.raises(ModelUnavailable) as gone:
                await items[0].future
            assert "SIGKILL" in gone.value.message and remote.failed == "engine core killed by SIGKILL"
            with pytest.raises(ModelUnavailable):
                await remote.submit_many([[1]])
            with pytest.raises(ModelUnavailable):
                await remote.describe()

    run(main())


def test_a_reconnect_fails_what_was_open_on_the_old_core_and_serves_what_comes_after(tmp_path):
    """A front end that missed the core's loss (it came while the front end attached) hears
    of the new core only: what it had sent to the old one fails at once, not never."""
    engine = FakeEmbeddingEngine(fixed=0.5)

    async def main():
        async with core_and_front(tmp_path, engine, max_wait_ms=0) as (_, core, remote):
            items = await remote.submit_many(engine.tokenize(["in flight"]))
            await remote.reconnect(core.address)  # the "new" core: the same one serves here
            with pytest.raises(ModelUnavailable) as gone:
                await items[0].future
            assert "restarted" in gone.value.message and gone.value.retry_after == 1
            engine.fixed = 0.0
            [again] = await remote.submit_many(engine.tokenize(["after"]))
            np.testing.assert_array_equal((await again.future).vector, fake_vector("after", 8))

    run(main())


def test_a_front_end_attaching_applies_the_loss_it_heard_while_attaching(tmp_path, monkeypatch):
    """The supervisor's "lost" came while attach_core waited for the core's settings (the
    gateway skips it for a model not attached yet; the view holds it): the client it returns
    is failed, not connected to a core that is gone."""
    from gateway.cores.process import attach_core
    from gateway.models.catalogue import ModelSpec
    from gateway.models.kinds import EMBEDDING

    engine = FakeEmbeddingEngine()

    async def main():
        async with core_and_front(tmp_path, engine) as (batcher, core, _):
            view = {
                "address": core.address,
                "failed": None,
                "restarting": False,
                "settings": batcher.settings.to_dict(),
                "facts": {},
            }

            async def lost_meanwhile(self):
                view.update(failed="engine core killed by SIGKILL", restarting=True)

            monkeypatch.setattr(CoreClient, "update", lost_meanwhile)
            spec = ModelSpec(kind=EMBEDDING, load=lambda: engine, front=lambda facts: engine)
            _, client = await attach_core(spec, view)
            try:
                assert client.failed == "engine core killed by SIGKILL" and client.restarting
                with pytest.raises(ModelUnavailable):
                    await client.submit_many([[1]])
            finally:
                await client.stop()

    run(main())


def test_a_closing_remote_refuses_new_work_as_shutting_down(tmp_path):
    engine = FakeEmbeddingEngine()

    async def main():
        async with core_and_front(tmp_path, engine) as (_, __, remote):
            await remote.drain(1.0)  # no core process behind it: only this side closes
            with pytest.raises(ShuttingDown):
                await remote.submit_many([[1]])

    run(main())


def test_generation_streams_each_delta_before_its_result(tmp_path):
    from batcher.engine_thread import EngineThread
    from batcher.scheduler import GenerationScheduler
    from batcher.types import Delta, GenRequest, GenResult
    from engine.base import SamplingParams, sequence_request
    from engine.fake import FakeGenerationEngine

    engine = FakeGenerationEngine()
    thread = EngineThread(engine.name, replace_on_timeout=False)

    async def main():
        batcher = GenerationScheduler(engine.name, engine, thread, BatchingSettings(), make_request=sequence_request)
        await batcher.start()
        ctx = zmq.asyncio.Context()
        core = EngineCore(batcher, f"ipc://{tmp_path}/core", ctx)
        serving = asyncio.create_task(core.serve())
        remote = CoreClient(engine.name, core.address, batcher.settings, ctx=ctx, tokenizer=engine)
        await remote.start()
        try:
            events: list[Any] = []
            payloads = [
                GenRequest(engine.encode_prompt("ab"), SamplingParams(max_tokens=3)),
                GenRequest(engine.encode_prompt("cde"), SamplingParams(max_tokens=9, stop=["w2"], seed=7)),
            ]
            items = await remote.submit_many(payloads, costs=[2, 3], on_delta=events.append)
            for item in items:
                item.result_future.add_done_callback(lambda _, item=item: events.append(item))
            results = await asyncio.gather(*(i.result_future for i in items))
            assert results == [GenResult("w0 w1 w2 ", "length", 2, 3), GenResult("w0 w1 ", "stop", 3, 3)]
            for item, result in zip(items, results, strict=True):
                mine = [e for e in events if e is item or (isinstance(e, Delta) and e.item is item)]
                deltas, end = mine[:-1], mine[-1]
                assert end is item and all(isinstance(d, Delta) for d in deltas)  # deltas, then the end
                assert "".join(d.text for d in deltas) == result.text
                assert sum(d.tokens for d in deltas) == result.completion_tokens
                assert [list(d.token_ids) for d in deltas] == [[1], [2], [3]]  # the fake engine's ids
                assert [d.finish_reason for d in deltas] == [None, None, result.finish_reason]
        finally:
            await remote.stop()
            serving.cancel()
            await batcher.stop()
            await core.close()
            ctx.term()
            thread.close()

    run(main())


def test_the_front_end_detokenizes_and_a_failure_there_fails_only_its_item(tmp_path):
    from batcher.engine_thread import EngineThread
    from batcher.errors import EngineError
    from batcher.scheduler import GenerationScheduler
    from batcher.types import GenRequest, GenResult
    from engine.base import SamplingParams, sequence_request
    from engine.fake import FakeGenerationEngine

    engine = FakeGenerationEngine()
    thread = EngineThread(engine.name, replace_on_timeout=False)

    class Tokenizer(FakeGenerationEngine):
        """The fake's words, except that token 5 cannot be decoded (a bug's stand-in)."""

        def decode(self, ids, **kw):
            if 5 in ids:
                raise ValueError("no such token")
            return super().decode(ids, **kw)

    async def main():
        batcher = GenerationScheduler(engine.name, engine, thread, BatchingSettings(), make_request=sequence_request)
        await batcher.start()
        ctx = zmq.asyncio.Context()
        core = EngineCore(batcher, f"ipc://{tmp_path}/core", ctx)
        serving = asyncio.create_task(core.serve())
        remote = CoreClient(engine.name, core.address, batcher.settings, ctx=ctx, tokenizer=Tokenizer())
        await remote.start()
        try:
            payloads = [
                GenRequest(engine.encode_prompt("ok"), SamplingParams(max_tokens=5, stop=[" w3"])),
                GenRequest(engine.encode_prompt("bad"), SamplingParams(max_tokens=5)),
            ]
            items = await remote.submit_many(payloads, costs=[2, 3])  # not streamed: ids all the same
            results = await asyncio.gather(*(i.result_future for i in items), return_exceptions=True)
            assert results[0] == GenResult("w0 w1 w2", "stop", 2, 4)  # cut in the front end
            assert isinstance(results[1], EngineError) and "no such token" in str(results[1])
            # The receiver still serves: a later request is answered.
            [again] = await remote.submit_many([payloads[0]], costs=[2])
            assert (await again.result_future) == results[0]
            await async_wait_until(lambda: batcher.running == 0, message="both sequences to leave the core")
        finally:
            await remote.stop()
            serving.cancel()
            await batcher.stop()
            await core.close()
            ctx.term()
            thread.close()

    run(main())


def test_an_inter_token_target_crosses_to_the_core_and_is_checked_there(tmp_path):
    from batcher.cost import CostModel, LinearCost
    from batcher.engine_thread import EngineThread
    from batcher.scheduler import GenerationScheduler
    from batcher.types import GenRequest
    from engine.base import SamplingParams, sequence_request
    from engine.fake import FakeGenerationEngine

    engine = FakeGenerationEngine()
    thread = EngineThread(engine.name, replace_on_timeout=False)
    step = 0.05  # what the core's decode cost model predicts of one step

    async def main():
        batcher = GenerationScheduler(engine.name, engine, thread, BatchingSettings(), make_request=sequence_request)
        batcher.decode_cost = CostModel(LinearCost(step, 0.0, 0.0))
        await batcher.start()
        ctx = zmq.asyncio.Context()
        core = EngineCore(batcher, f"ipc://{tmp_path}/core", ctx)
        serving = asyncio.create_task(core.serve())
        remote = CoreClient(engine.name, core.address, batcher.settings, ctx=ctx, tokenizer=engine)
        await remote.start()
        try:
            prompt = GenRequest(engine.encode_prompt("ab"), SamplingParams(max_tokens=2))
            with pytest.raises(DeadlineInfeasible) as refused:
                await remote.submit_many([prompt], itl_target=step / 2)
            assert "inter-token" in refused.value.message and refused.value.retry_after >= 1
            (item,) = await remote.submit_many([prompt], itl_target=step * 2)
            assert (await item.result_future).completion_tokens == 2
            # The request's own on_infeasible crosses too: served best-effort, and says so.
            (item,) = await remote.submit_many([prompt], itl_target=step / 2, on_infeasible="serve")
            assert item.best_effort and (await item.result_future).completion_tokens == 2
        finally:
            await remote.stop()
            serving.cancel()
            await batcher.stop()
            await core.close()
            ctx.term()
            thread.close()

    run(main())


class GatedGrammars:
    """A grammar cache whose compile waits for the test to open the gate (what a slow
    schema is to the core), and fails on the text "bad"."""

    def __init__(self) -> None:
        import threading

        self.gate = threading.Event()
        self.compiled: list[str] = []

    def __contains__(self, text: str) -> bool:
        return text in self.compiled

    def compile(self, text: str) -> None:
        self.gate.wait(30)
        if text == "bad":
            raise ValueError("cannot follow it")
        self.compiled.append(text)


def test_a_submit_with_a_schema_waits_for_its_compile_off_the_loop(tmp_path):
    """The core compiles a Submit's schemas in a worker thread before its prompts reach the
    batcher; a Cancel meanwhile still cancels them, a schema that fails is a refusal."""
    from gateway.cores import wire

    engine = FakeEmbeddingEngine()

    async def main():
        async with core_and_front(tmp_path, engine, max_wait_ms=0) as (batcher, core, _):
            grammars = core.grammars = GatedGrammars()
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.connect(core.address)

            def submit(req: int, schema: str) -> None:
                sampling = [wire.Sampling(4, json_schema=schema)]
                sock.send(wire.pack([wire.Submit(req, engine.name, [wire.ids([1, 2])], [2], None, sampling=sampling)]))

            async def answers(n: int) -> list:
                got: list = []
                while len(got) < n:  # a frame holds the messages of one turn of the core's loop
                    got += wire.unpack_to_front_end(await sock.recv())
                return got

            submit(1, '{"type":"boolean"}')
            await async_wait_until(lambda: core.compiling, message="the core to start compiling")
            await asyncio.sleep(0.05)
            assert len(batcher.queue) == 0 and not core.requests  # nothing queued yet
            sock.send(wire.pack([wire.Cancel(1)]))
            await async_wait_until(lambda: any(core.compiling.values()), message="the core to note the cancel")
            grammars.gate.set()
            admitted, result = await answers(2)
            assert isinstance(admitted, wire.Admitted) and admitted.req == 1
            assert isinstance(result, wire.Result) and wire.outcome_of(result) is Outcome.CANCELLED
            assert grammars.compiled == ['{"type":"boolean"}']

            submit(2, "bad")
            (refused,) = await answers(1)
            assert isinstance(refused, wire.Refused) and refused.code == "invalid_schema"
            assert not core.compiling and not core.requests
            sock.close(0)

    run(main())
