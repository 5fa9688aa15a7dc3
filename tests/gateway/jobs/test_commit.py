"""Group commit: lines finishing together share one store transaction, each learns whether
it was recorded, and a failed transaction fails every line of it (they stay pending)."""

from __future__ import annotations

import asyncio

from gateway.jobs.commit import GroupCommit


class FakeStore:
    """Records each transaction; a line is recorded unless its number is in `taken`."""

    def __init__(self, fail: bool = False, taken: tuple[int, ...] = ()) -> None:
        self.transactions: list[list[tuple[str, int, str, str]]] = []
        self.fail = fail
        self.taken = taken

    def commit_lines(self, results: list[tuple[str, int, str, str]]) -> list[bool]:
        if self.fail:
            raise OSError("disk full")
        self.transactions.append(results)
        return [line not in self.taken for _, line, _, _ in results]

    async def write(self, fn, *args):
        return fn(*args)


def test_lines_finishing_together_share_one_transaction() -> None:
    async def scenario() -> None:
        store = FakeStore(taken=(2,))
        commits = GroupCommit(store)  # type: ignore[arg-type]
        commits.start()
        try:
            flags = await asyncio.gather(*(commits.commit("b", n, "completed", f"r{n}") for n in (1, 2, 3)))
        finally:
            await commits.stop()
        assert flags == [True, False, True]  # line 2 was no longer pending
        assert store.transactions == [[("b", n, "completed", f"r{n}") for n in (1, 2, 3)]]

    asyncio.run(scenario())


def test_a_failed_transaction_fails_each_of_its_lines() -> None:
    async def scenario() -> None:
        commits = GroupCommit(FakeStore(fail=True))  # type: ignore[arg-type]
        commits.start()
        try:
            results = await asyncio.gather(
                *(commits.commit("b", n, "completed", "") for n in (1, 2)), return_exceptions=True
            )
        finally:
            await commits.stop()
        assert [type(r) for r in results] == [OSError, OSError]

    asyncio.run(scenario())


def test_stop_before_start_is_harmless() -> None:
    async def scenario() -> None:
        await GroupCommit(FakeStore()).stop()  # type: ignore[arg-type]

    asyncio.run(scenario())
