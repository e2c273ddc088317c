"""Leadership of one cluster: the driver of `core.ha.lease`'s state machine.

`LeaseKeeper` feeds `core.ha.lease.step` with what it saw, stamped with the monotonic
clock, carries out the decided actions in their order, and calls `step` with a `Tick`
again by the decision's ``next_tick``. The rules (when to acquire, renew, stop acting)
are `core.ha.lease`'s; the statements are the adapter's (`adapters.journal.lease_pg`); this module
only connects them:

- ``Act``/``StopActing`` change what the keeper says at once: `LeaseKeeper.acting`,
  `LeaseKeeper.epoch`, the ``on_change(acting, epoch)`` callback and the waiters of
  `LeaseKeeper.wait_acting`.
- ``Acquire``/``Renew``/``Release`` go, in order and one at a time, to a worker task that
  runs each (bounded by the adapter's statement timeout) and posts what the database
  said back as an event. The next one is handed over only after that event was stepped,
  and only while it still applies: an ``Acquire`` while the keeper is a standby, a
  ``Renew`` while it leads with that epoch (a statement decided while an earlier one was
  slow would otherwise acquire again a lease this keeper already holds, with a new epoch,
  and lose its own tenure). The driver never waits for a statement: a tick that is due
  (the stop-acting deadline among them) is taken while one is in flight.
- A release notified by the database (LISTEN) is a `Notified` event: a standby tries at
  once instead of at its next attempt.

Shutdown: `LeaseKeeper.aclose` asks the state machine to stop (`ShutdownRequested`): a
leader stops acting at once, then releases the lease (and notifies), and an acquisition
still in flight that wins is released too; `run` returns once the worker has nothing
left, within about two statement timeouts.

Cancellation of the task running `run`: the keeper stops acting at once (``on_change``
is called) and releases the lease if it led, in a shielded scope bounded by the statement
timeout; then the cancellation goes on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Final, Generic, Protocol, TypeVar

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters.journal.lease_pg import Held, Won
from llmd_supervisor.core.ha.lease import (
    STATEMENT_TIMEOUT_S,
    Acquire,
    Acquired,
    AcquireFailed,
    Act,
    Decision,
    Event,
    Leader,
    NotAcquired,
    Notified,
    Release,
    Renew,
    RenewalFailed,
    RenewalLost,
    Renewed,
    ShutdownRequested,
    Standby,
    State,
    StopActing,
    Stopping,
    StopReason,
    Tick,
    acting_time_left,
    start,
    step,
)
from llmd_supervisor.errors import LeaseError

__all__ = ["LeaseKeeper", "LeaseStore", "OnChange"]

log = structlog.get_logger("llmd_supervisor.leadership")

_T = TypeVar("_T")

# What the worker runs; Act and StopActing are the driver's own.
_Statement = Acquire | Renew | Release
OnChange = Callable[[bool, "int | None"], None]
# The release at a cancellation: the statement's timeout and a little for the connection.
_RELEASE_ON_CANCEL_S: Final = STATEMENT_TIMEOUT_S + 0.5


class LeaseStore(Protocol):
    """The lease statements (`adapters.journal.lease_pg.PostgresLease`); each raises LeaseError
    when its outcome is unknown."""

    async def acquire(self, cluster: str, holder: str) -> Won | Held: ...

    async def renew(self, cluster: str, holder: str, epoch: int) -> datetime | None: ...

    async def release(self, cluster: str, holder: str, epoch: int) -> bool: ...

    async def listen(
        self,
        cluster: str,
        on_release: Callable[[], None],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None: ...


class _Mailbox(Generic[_T]):
    """A queue whose reader waits with a deadline and never loses an item to it."""

    def __init__(self) -> None:
        self._items: deque[_T] = deque()
        self._wake = anyio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: _T) -> None:
        self._items.append(item)
        self._wake.set()

    async def get(self, within: float | None) -> _T | None:
        """The oldest item; None when none came within `within` seconds (None: forever)."""
        if not self._items:
            self._wake = anyio.Event()
            with anyio.move_on_after(within):
                await self._wake.wait()
        return self._items.popleft() if self._items else None


class _Performed:
    """The worker finished a statement; ``event`` is what it saw (None for a release)."""

    __slots__ = ("event",)

    def __init__(self, event: Event | None) -> None:
        self.event = event


class LeaseKeeper:
    """Holds (or waits for) one cluster's lease for one daemon, as `core.ha.lease` decides.

    Start `run` in a task group (``await tg.start(keeper.run)``); stop it with `aclose`.
    ``holder`` must be unique per daemon process (host, pid and a per-start nonce).
    """

    def __init__(
        self,
        cluster: str,
        holder: str,
        adapter: LeaseStore,
        clock: Callable[[], float] = anyio.current_time,
        *,
        on_change: OnChange | None = None,
    ) -> None:
        if not holder:
            raise ValueError("a lease keeper needs a non-empty holder name")
        self.cluster = cluster
        self.holder = holder
        self._adapter = adapter
        self._clock = clock
        self._on_change = on_change
        self._log = log.bind(cluster=cluster, holder=holder)
        # The driver's state: the machine's state and when it wants its next tick ...
        self._state: State | None = None  # None until `run` starts
        self._next_tick: float | None = None
        # ... what it said (Act/StopActing): the epoch it acts with, None when it does not
        self._acting_epoch: int | None = None
        self._changed = anyio.Event()  # set (and replaced) at every change of that
        # ... and the traffic with the worker.
        self._inbox: _Mailbox[Event | _Performed] = _Mailbox()
        self._pending: deque[_Statement] = deque()  # decided, not handed to the worker
        self._statements: _Mailbox[_Statement] = _Mailbox()  # to the worker: one at most
        self._busy = False  # the worker has a statement whose event was not stepped yet
        self._started = False  # `run` was called
        self._finished = anyio.Event()  # `run` returned
        self._answered = anyio.Event()  # a first statement's outcome was stepped

    @property
    def acting(self) -> bool:
        """Whether this daemon acts for the cluster now (`epoch`)."""
        return self.epoch is not None

    @property
    def epoch(self) -> int | None:
        """The epoch every write of this daemon carries while it acts; None otherwise,
        and None as soon as the stop-acting deadline has passed, even before the tick
        that says so was taken (a process that was stopped, SIGSTOP or a stalled loop,
        wakes up past its deadline with other tasks' timers due too)."""
        if self._acting_epoch is None or self.acting_time_left() <= 0:
            return None
        return self._acting_epoch

    @property
    def state(self) -> State | None:
        """`core.ha.lease`'s state (None before `run`): for status pages."""
        return self._state

    def acting_time_left(self) -> float:
        """Seconds this daemon may still act before a renewal must have succeeded (0 when
        it does not act): start a side effect of up to T seconds only when this is > T."""
        if self._state is None or self._acting_epoch is None:
            return 0.0
        return acting_time_left(self._state, self._clock())

    async def wait_acting(self, acting: bool = True) -> None:
        """Return once `acting` is what the keeper says (at once if it is)."""
        while self.acting != acting:
            await self._changed.wait()

    async def wait_first_answer(self) -> None:
        """Return once the first statement's outcome (won, held, failed) was stepped: the
        keeper then says whether this daemon leads, as far as it can know."""
        await self._answered.wait()

    async def wait_epoch_change(self, epoch: int | None) -> None:
        """Return once the epoch this keeper acts with is not `epoch` (None: not acting)."""
        while self._acting_epoch == epoch:
            await self._changed.wait()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep the lease until `aclose` (see the module docstring for cancellation).
        Started once the first acquisition is on its way."""
        if self._started:
            raise RuntimeError(f"the lease keeper of {self.cluster!r} ran already")
        self._started = True
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._perform_statements)
                await tg.start(self._adapter.listen, self.cluster, self._notified)
                self._apply(start(self._clock()))
                task_status.started()
                await self._drive()
                tg.cancel_scope.cancel()
        finally:
            await self._abandon()
            self._finished.set()

    async def aclose(self) -> None:
        """Stop acting, release the lease if held, and wait until `run` has returned."""
        if not self._started:
            return
        self._inbox.put(ShutdownRequested(self._clock()))
        await self._finished.wait()

    # --- the driver ---------------------------------------------------------------------

    async def _drive(self) -> None:
        while not (isinstance(self._state, Stopping) and not self._busy and not self._pending):
            timeout = None if self._next_tick is None else max(0.0, self._next_tick - self._clock())
            item = await self._inbox.get(timeout)
            if item is None:
                event: Event | None = Tick(self._clock())
            elif isinstance(item, _Performed):
                self._busy = False
                event = item.event
            else:
                event = item
            if event is not None:
                assert self._state is not None
                self._apply(step(self._state, event))
            if isinstance(item, _Performed):
                self._answered.set()
            self._dispatch()

    def _apply(self, decision: Decision) -> None:
        """Take `decision`'s state and carry out its actions in order (the statements are
        queued for the worker in that order)."""
        before, self._state = self._state, decision.state
        self._next_tick = decision.next_tick
        for action in decision.actions:
            if isinstance(action, Act):
                self._set_acting(action.epoch)
                expires = self._state.expires_at if isinstance(self._state, Leader) else None
                self._log.info("lease.acquired", epoch=action.epoch, expires_at=expires)
            elif isinstance(action, StopActing):
                self._set_acting(None)
                if action.reason is StopReason.SHUTDOWN:
                    self._log.info("lease.stepping_down", epoch=action.epoch)
                else:
                    # How long ago acting really ended (the deadline, when this stop comes
                    # late: the process was stopped or its loop stalled), for the record.
                    late = (
                        max(0.0, self._clock() - before.acting_until)
                        if isinstance(before, Leader) and action.reason is StopReason.SILENCE
                        else 0.0
                    )
                    self._log.warning(
                        "lease.lost",
                        epoch=action.epoch,
                        reason=action.reason.value,
                        late_s=round(late, 3),
                    )
            else:
                self._pending.append(action)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand the worker the next pending statement that still applies, if it is idle."""
        while not self._busy and self._pending:
            statement = self._pending.popleft()
            if isinstance(statement, Acquire):
                wanted = isinstance(self._state, Standby)
            elif isinstance(statement, Renew):
                wanted = isinstance(self._state, Leader) and self._state.epoch == statement.epoch
            else:
                wanted = True  # a release, even while stopping
            if not wanted:
                self._log.debug("lease.statement_dropped", statement=type(statement).__name__)
                continue
            self._busy = True
            self._statements.put(statement)

    def _set_acting(self, epoch: int | None) -> None:
        previous, self._acting_epoch = self._acting_epoch, epoch
        if previous == epoch:
            return
        changed, self._changed = self._changed, anyio.Event()
        changed.set()
        if self._on_change is not None:
            self._on_change(epoch is not None, epoch if epoch is not None else previous)

    def _notified(self) -> None:
        self._inbox.put(Notified(self._clock()))

    async def _abandon(self) -> None:
        """After `run` ended, however: stop acting, and release the lease if it was held
        (a cancellation or an error, not `aclose`: that one released it already)."""
        state = self._state
        self._state = Stopping()
        self._next_tick = None
        if not isinstance(state, Leader):
            self._set_acting(None)
            return
        self._set_acting(None)
        # The keeper's task is cancelled when the daemon stops (SIGTERM): a stop, not a loss.
        self._log.info("lease.stepping_down", epoch=state.epoch, reason="cancelled")
        with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_ON_CANCEL_S):
            await self._release(state.epoch)

    # --- the worker -----------------------------------------------------------------------

    async def _perform_statements(self) -> None:
        while True:
            statement = await self._statements.get(None)
            if statement is not None:
                self._inbox.put(_Performed(await self._perform(statement)))

    async def _perform(self, statement: _Statement) -> Event | None:
        """Run one statement; the event that says what the database answered."""
        if isinstance(statement, Release):
            await self._release(statement.epoch)
            return None
        sent = self._clock()
        if isinstance(statement, Acquire):
            try:
                got = await self._adapter.acquire(self.cluster, self.holder)
            except LeaseError as exc:
                self._log.warning("lease.acquire_failed", error=str(exc))
                return AcquireFailed(str(exc), self._clock())
            if isinstance(got, Won):
                return Acquired(got.epoch, sent, got.expires_at, self._clock())
            self._log.debug("lease.standby", leader=got.holder, expires_at=got.expires_at)
            return NotAcquired(got.holder, got.expires_at, self._clock())
        try:
            expires = await self._adapter.renew(self.cluster, self.holder, statement.epoch)
        except LeaseError as exc:
            self._log.warning("lease.renew_failed", epoch=statement.epoch, error=str(exc))
            return RenewalFailed(statement.epoch, str(exc), self._clock())
        if expires is None:
            return RenewalLost(statement.epoch, self._clock())
        return Renewed(statement.epoch, sent, expires, self._clock())

    async def _release(self, epoch: int) -> None:
        try:
            released = await self._adapter.release(self.cluster, self.holder, epoch)
        except LeaseError as exc:
            self._log.warning("lease.release_failed", epoch=epoch, error=str(exc))
            return
        self._log.info("lease.released", epoch=epoch, released=released)
