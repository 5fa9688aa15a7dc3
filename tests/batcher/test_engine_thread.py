"""EngineThread (batcher/engine_thread.py): blocking engine calls run off the event loop on one
worker thread, one at a time; a call past the timeout fails with EngineTimeout and, where
the engine allows it, later calls move to a fresh thread.

Calls block on threading.Events the test opens, so the order of events is decided by the
test, not by the speed of the machine; nothing here asserts on elapsed time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from batcher.engine_thread import EngineThread, EngineTimeout

from ..waiting import async_wait_until

LONG = 30.0  # a bound on every blocking wait, so that a broken runner fails instead of hanging
SHORT = 0.05  # a timeout the calls below always exceed: they wait for a gate the test holds shut


class Gate:
    """A call that blocks until the test opens the gate; it records the thread it ran on."""

    def __init__(self) -> None:
        self.entered, self.opened, self.left = threading.Event(), threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None

    def __call__(self, result: object = "done") -> object:
        self.thread = threading.current_thread()
        self.entered.set()
        self.opened.wait(LONG)
        self.left.set()
        return result


def current_thread() -> threading.Thread:
    return threading.current_thread()


def test_calls_run_one_at_a_time_in_order_on_one_worker_thread():
    log: list[str] = []

    def record(tag: str) -> threading.Thread:
        log.append(tag)
        return threading.current_thread()

    async def scenario():
        runner = EngineThread("serial")
        gate = Gate()
        try:
            first = runner.start(gate)
            later = [runner.start(record, f"call {k}") for k in range(3)]  # handed over while the first blocks
            await async_wait_until(gate.entered.is_set, message="the first call to start")
            assert log == []  # nothing overtook the blocked call
            gate.opened.set()
            assert await first == "done"
            threads = [await call for call in later]
        finally:
            gate.opened.set()
            runner.close()
        assert log == ["call 0", "call 1", "call 2"]
        assert {t.ident for t in threads} == {gate.thread.ident}  # one worker thread for all
        assert gate.thread is not threading.main_thread()

    asyncio.run(scenario())


def test_await_the_runner_itself_for_a_result():
    async def scenario():
        runner = EngineThread("call")
        try:
            assert await runner(sum, [1, 2, 3]) == 6
            worker = await runner(current_thread)
            assert worker is not threading.current_thread()  # not on the event loop's thread
        finally:
            runner.close()

    asyncio.run(scenario())


def test_start_hands_the_call_over_at_once_and_the_caller_awaits_it_later():
    async def scenario():
        runner = EngineThread("start")
        gate = Gate()
        try:
            pending = runner.start(gate, "result")
            # The call runs before anyone awaits `pending`: the loop is free meanwhile.
            await async_wait_until(gate.entered.is_set, message="the call to start before it is awaited")
            gate.opened.set()
            assert await pending == "result"
        finally:
            gate.opened.set()
            runner.close()

    asyncio.run(scenario())


def test_an_exception_reaches_the_caller_and_the_worker_keeps_serving():
    def boom() -> None:
        raise ValueError("engine bug")

    async def scenario():
        runner = EngineThread("errors")
        try:
            before = await runner(current_thread)
            with pytest.raises(ValueError, match="engine bug"):
                await runner(boom)
            assert await runner(current_thread) is before
        finally:
            runner.close()

    asyncio.run(scenario())


def test_the_initializer_runs_on_the_worker_thread_before_its_first_call():
    ran_on: list[threading.Thread] = []

    async def scenario():
        runner = EngineThread("init", initializer=lambda: ran_on.append(threading.current_thread()))
        try:
            assert ran_on == []  # not on the caller's thread at construction
            worker = await runner(current_thread)
            await runner(current_thread)
        finally:
            runner.close()
        assert ran_on == [worker]  # once per thread, on that thread

    asyncio.run(scenario())


async def time_out(runner: EngineThread, gate: Gate) -> None:
    """Hand `gate` to the runner and let its timeout pass while the gate is shut. The limit
    counts from when the caller awaits, so waiting first for the call to start makes sure
    it is the call, not a slow thread start, that overruns."""
    pending = runner.start(gate)
    await async_wait_until(gate.entered.is_set, message="the call to start")
    with pytest.raises(EngineTimeout, match="exceeded"):
        await pending


def release(gate: Gate) -> None:
    """Let the stuck call return, and its thread deliver the result that nobody awaits."""
    gate.opened.set()
    if gate.thread is not None:
        assert gate.left.wait(LONG)


def test_a_call_past_the_timeout_fails_and_later_calls_move_to_a_fresh_thread():
    started: list[threading.Thread] = []

    async def scenario():
        runner = EngineThread("hung", timeout=SHORT, initializer=lambda: started.append(threading.current_thread()))
        gate = Gate()
        try:
            await time_out(runner, gate)
            assert runner.abandoned == 1
            assert not gate.left.is_set()  # the stuck call is still stuck
            runner.timeout = LONG  # where the next call runs matters here, not how fast
            fresh = await runner(current_thread)
            assert fresh is not gate.thread
            assert started == [gate.thread, fresh]  # the fresh thread was initialized too
            assert not gate.left.is_set()  # served while the old thread is still stuck
            runner.close()  # does not wait for the abandoned thread, which may never return
            assert not gate.left.is_set()
        finally:
            release(gate)
            runner.close()
            if gate.thread is not None:
                gate.thread.join(LONG)  # its pool was shut down: it ends after the call

    asyncio.run(scenario())
    assert issubclass(EngineTimeout, TimeoutError)


def test_without_replacement_a_timed_out_call_fails_and_the_next_waits_behind_it_on_the_same_thread():
    """For engines with state (generation's running batch and KV cache): no second thread
    may touch the engine while the stuck call might still run."""
    order: list[str] = []

    def after_the_stuck_call() -> threading.Thread:
        order.append("next")
        return threading.current_thread()

    async def scenario():
        runner = EngineThread("stateful", timeout=SHORT, replace_on_timeout=False)
        gate = Gate()
        try:
            await time_out(runner, gate)
            assert runner.abandoned == 0
            runner.timeout = LONG  # only the order matters from here
            following = runner.start(after_the_stuck_call)
            assert order == [] and not gate.left.is_set()
            gate.opened.set()
            thread = await following
            assert gate.left.is_set() and order == ["next"]
            assert thread is gate.thread
        finally:
            release(gate)
            runner.close()

    asyncio.run(scenario())


def test_close_waits_for_the_worker_to_finish_and_refuses_new_calls():
    async def scenario():
        runner = EngineThread("close")
        worker = await runner(current_thread)
        runner.close()
        assert not worker.is_alive()
        with pytest.raises(RuntimeError):
            runner.start(current_thread)

    asyncio.run(scenario())


def test_a_niced_thread_and_its_companion_run_beside_each_other_at_their_own_priorities():
    """The interactive lane's layout: the main thread niced, the lane's companion not, and
    a call on the companion runs while the main thread is held by another."""

    def niceness() -> int:
        import os

        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def scenario():
        import os

        base = os.getpriority(os.PRIO_PROCESS, 0)
        main = EngineThread("m", nice=5)
        lane = main.companion("lane")
        gate = Gate()
        held = main.start(gate)
        await asyncio.to_thread(gate.entered.wait, LONG)
        assert await lane(niceness) == base  # ran although the main thread is held
        gate.opened.set()
        assert await held == "done"
        assert await main(niceness) == min(19, base + 5)
        main.close()  # closes the companion too
        with pytest.raises(RuntimeError):
            await lane(niceness)

    asyncio.run(scenario())


def test_a_thread_asked_to_run_ahead_does_so_where_the_process_may_raise_a_priority():
    import os

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def scenario() -> tuple[int, int]:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        lane = EngineThread("m", nice=-5)
        try:
            return base, await lane(niceness)
        finally:
            lane.close()

    base, got = asyncio.run(scenario())
    if os.geteuid() == 0:  # may raise a priority (CAP_SYS_NICE)
        assert got == max(-20, base - 5)
    else:  # refused: it keeps the process's own, and the call still runs
        assert got in (base, max(-20, base - 5))
