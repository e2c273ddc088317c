"""Group commit (adapters.journal.batch): queued operations run together, in order, each
with its own result or error; cancellation before a batch is taken does nothing."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.journal.batch import MAX_BATCH, Batches, Op
from llmd_supervisor.adapters.journal.db import Db
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.errors import JournalError


class _Recorder:
    """An executor that records each batch's operations and can hold the first batch."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, batch: list[Op[list[str]]]) -> None:
        self.release.wait(10)
        self.batches.append([op.operation for op in batch])
        for op in batch:
            if op.operation.startswith("bad"):
                op.error = ValueError(op.operation)
            else:
                op.result = op.fn(["conn"])


async def _wait_for(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await anyio.sleep(0.005)
    raise AssertionError("the condition did not hold within 5 s")


@pytest.mark.asyncio
async def test_operations_queued_while_one_runs_go_as_one_batch_in_order() -> None:
    executor = _Recorder()
    batches: Batches[list[str]] = Batches(executor, anyio.CapacityLimiter(1))
    executor.release.clear()
    results: dict[str, object] = {}

    async def call(name: str) -> None:
        results[name] = await batches.call(name, lambda conn: (name, conn[0]), write=True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "first")
        await _wait_for(lambda: batches._leading)
        for i in range(5):
            tg.start_soon(call, f"op{i}")
        await _wait_for(lambda: len(batches._queue) == 5)
        executor.release.set()
    assert executor.batches == [["first"], [f"op{i}" for i in range(5)]]
    assert results == {n: (n, "conn") for n in ["first", *(f"op{i}" for i in range(5))]}


@pytest.mark.asyncio
async def test_a_failing_operation_raises_for_its_caller_only() -> None:
    executor = _Recorder()
    batches: Batches[list[str]] = Batches(executor, anyio.CapacityLimiter(1))
    executor.release.clear()
    outcome: dict[str, str] = {}

    async def call(name: str) -> None:
        try:
            await batches.call(name, lambda conn: None, write=True)
            outcome[name] = "ok"
        except ValueError as exc:
            outcome[name] = f"error {exc}"

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "first")
        await _wait_for(lambda: batches._leading)
        for name in ("a", "bad-b", "c"):
            tg.start_soon(call, name)
        await _wait_for(lambda: len(batches._queue) == 3)
        executor.release.set()
    assert outcome == {"first": "ok", "a": "ok", "bad-b": "error bad-b", "c": "ok"}


@pytest.mark.asyncio
async def test_a_caller_cancelled_before_its_batch_is_taken_runs_nothing() -> None:
    executor = _Recorder()
    batches: Batches[list[str]] = Batches(executor, anyio.CapacityLimiter(1))
    executor.release.clear()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: batches.call("first", lambda conn: None, write=True))
        await _wait_for(lambda: batches._leading)
        scope = anyio.CancelScope()

        async def cancelled() -> None:
            with scope:
                await batches.call("cancelled", lambda conn: None, write=True)

        tg.start_soon(lambda: batches.call("after", lambda conn: None, write=True))
        tg.start_soon(cancelled)
        await _wait_for(lambda: len(batches._queue) == 2)
        scope.cancel()
        await _wait_for(lambda: len(batches._queue) == 1)
        executor.release.set()
    assert executor.batches == [["first"], ["after"]]
    assert not batches._leading


@pytest.mark.asyncio
async def test_a_cancelled_leader_finishes_its_batch_and_hands_over() -> None:
    executor = _Recorder()
    batches: Batches[list[str]] = Batches(executor, anyio.CapacityLimiter(1))
    executor.release.clear()
    done: list[str] = []

    async def call(name: str) -> None:
        await batches.call(name, lambda conn: None, write=True)
        done.append(name)

    async with anyio.create_task_group() as tg:
        leader = anyio.CancelScope()

        async def lead() -> None:
            with leader:
                await call("leader")

        tg.start_soon(lead)
        await _wait_for(lambda: batches._leading)
        leader.cancel()  # its batch is in the thread: it runs to its end
        tg.start_soon(call, "next")
        await _wait_for(lambda: len(batches._queue) == 1)
        executor.release.set()
    assert executor.batches == [["leader"], ["next"]]
    # The leader's operation was applied and answered (its cancellation comes at its next
    # checkpoint), and the next caller led its own batch.
    assert done == ["leader", "next"]


@pytest.mark.asyncio
async def test_a_long_queue_is_taken_in_batches_of_max_batch() -> None:
    executor = _Recorder()
    batches: Batches[list[str]] = Batches(executor, anyio.CapacityLimiter(1))
    executor.release.clear()
    async with anyio.create_task_group() as tg:
        for i in range(MAX_BATCH + 10):
            tg.start_soon(functools.partial(batches.call, f"op{i}", _nothing, write=False))
        await _wait_for(lambda: len(batches._queue) == MAX_BATCH + 9)
        executor.release.set()
    assert [len(b) for b in executor.batches] == [1, MAX_BATCH, 9]


def _nothing(conn: list[str]) -> None:
    return None


# --- the SQLite journal's batches --------------------------------------------------------------


@pytest.mark.asyncio
async def test_journal_writes_in_one_batch_each_apply_alone(tmp_path: Path) -> None:
    journal = await Journal.open(tmp_path / "journal.db")

    def create(conn: Db) -> None:
        conn.execute("CREATE TABLE t (x INTEGER NOT NULL UNIQUE)")

    await journal.write("create", create)

    def insert(x: int) -> object:
        def work(conn: Db) -> None:
            conn.execute("INSERT INTO t VALUES (?)", (x,))
            conn.execute("INSERT INTO t VALUES (?)", (x + 100,))

        return work

    errors: list[str] = []

    async def write(x: int) -> None:
        try:
            await journal.write(f"insert {x}", insert(x))  # type: ignore[arg-type]
        except JournalError as exc:
            errors.append(str(exc))

    async with anyio.create_task_group() as tg:
        for x in (1, 2, 1, 3):  # the second 1 breaks the unique constraint: undone alone
            tg.start_soon(write, x)
    rows = await journal.read("all", lambda c: sorted(r[0] for r in c.execute("SELECT x FROM t")))
    assert rows == [1, 2, 3, 101, 102, 103]
    assert len(errors) == 1 and "could not insert 1" in errors[0]
    await journal.aclose()
    await journal.aclose()  # idempotent
    with pytest.raises(JournalError, match="the journal is closed"):
        await journal.read("late", lambda c: None)
