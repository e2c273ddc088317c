"""Group commit for the journal: the operations waiting for the database run as one batch.

The journal has one connection and one worker thread. Run one by one, each operation costs
a commit (an fsync) and two trips through the event loop (to the thread and back), and on
a busy loop those trips, not the database, are most of the wait: ten runs ending in the same
second queued their journal writes for ~0.2 s each. Here the first caller leads: it takes
every operation queued so far to the worker thread in one go (`Executor`: one transaction,
each write in its own savepoint, one commit); the others wait for their result, or for
their turn to lead the next batch.

Each caller sees what it saw before: its operation applied completely or not at all, its
own result or error, in the order the operations were queued. Cancellation keeps the
journal's rule: a caller cancelled before its batch was taken does nothing; once taken,
the batch runs to its end and the cancellation is delivered afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar, cast

import anyio
import anyio.to_thread

__all__ = ["MAX_BATCH", "Batches", "Op"]

_C = TypeVar("_C")
_T = TypeVar("_T")

# Enough for every run of a large campaign ending together; a longer queue is taken in turns.
MAX_BATCH: Final = 64


@dataclass(eq=False)
class Op(Generic[_C]):
    """One queued operation: `fn` on the connection, in a write (or read) transaction;
    `close` ends the batch and then the connection."""

    operation: str
    fn: Callable[[_C], object]
    write: bool
    close: bool = False
    result: object = None
    error: BaseException | None = None
    taken: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)
    # Set when the operation is done or when its caller is to lead the next batch.
    turn: anyio.Event = field(default_factory=anyio.Event)


# Runs in the worker thread: fills in each operation's `result` or `error`.
Executor = Callable[[list[Op[_C]]], None]


class Batches(Generic[_C]):
    """The queue of journal operations and who takes it to the worker thread."""

    def __init__(self, execute: Executor[_C], limiter: anyio.CapacityLimiter) -> None:
        self._execute = execute
        self._limiter = limiter
        self._queue: list[Op[_C]] = []
        self._leading = False

    async def call(self, operation: str, fn: Callable[[_C], _T], *, write: bool) -> _T:
        """`fn`'s result, run in the next batch (its error raised here)."""
        op: Op[_C] = Op(operation, fn, write)
        await self._run(op)
        if op.error is not None:
            raise op.error
        return cast(_T, op.result)

    async def close(self, close: Callable[[_C], None]) -> None:
        """Run `close` after every operation queued before it."""
        op: Op[_C] = Op("close the database", close, write=False, close=True)
        with anyio.CancelScope(shield=True):
            await self._run(op)
        if op.error is not None:
            raise op.error

    async def _run(self, op: Op[_C]) -> None:
        self._queue.append(op)
        if self._leading:
            try:
                await op.turn.wait()
            except anyio.get_cancelled_exc_class():
                if op.taken:  # its batch is running: it ends first
                    with anyio.CancelScope(shield=True):
                        await op.done.wait()
                else:
                    self._queue.remove(op)
                    if op.turn.is_set():  # made leader just now: pass it on
                        self._hand_over()
                raise
            if op.done.is_set():
                return
        else:
            self._leading = True
        try:
            while not op.done.is_set():  # its own operation is in the first batch
                batch = self._take()
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._execute, batch, limiter=self._limiter)
                for taken in batch:
                    taken.done.set()
                    taken.turn.set()
        finally:
            self._hand_over()

    def _take(self) -> list[Op[_C]]:
        """The next batch: up to MAX_BATCH operations, cut after a close."""
        end = min(len(self._queue), MAX_BATCH)
        for i, queued in enumerate(self._queue[:end]):
            if queued.close:
                end = i + 1
                break
        batch, self._queue = self._queue[:end], self._queue[end:]
        for queued in batch:
            queued.taken = True
        return batch

    def _hand_over(self) -> None:
        if self._queue:
            self._queue[0].turn.set()  # its caller leads the next batch
        else:
            self._leading = False
