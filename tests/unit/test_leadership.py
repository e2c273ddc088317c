"""The lease keeper's driving (supervision.ha.leadership) with a store whose statements the
test controls: slow, hanging, or winning after a shutdown. The keeper on the real
database is tests/unit/test_lease_pg.py; the rules are tests/unit/test_lease.py's."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio
import anyio.abc
import pytest

from llmd_supervisor.adapters.journal.lease_pg import Held, Won
from llmd_supervisor.core.ha.lease import ACQUIRE_EVERY_S, STOP_ACTING_AFTER_S
from llmd_supervisor.supervision.ha.leadership import LeaseKeeper
from tests.waiting import until

EXPIRES = datetime(2026, 1, 1, tzinfo=UTC)
SLACK_S = 5.0


@dataclass
class FakeStore:
    """One lease row in memory; `acquire_s` delays each acquisition, and a renewal waits
    for `renew_gate` when one is set."""

    acquire_s: float = 0.0
    renew_gate: anyio.Event | None = None
    holder: str | None = None
    epoch: int = 0
    calls: list[tuple[str, int]] = field(default_factory=list)  # (statement, epoch)

    async def acquire(self, cluster: str, holder: str) -> Won | Held:
        self.calls.append(("acquire", self.epoch))
        await anyio.sleep(self.acquire_s)
        if self.holder not in (None, holder):
            return Held(self.holder, EXPIRES)
        self.holder, self.epoch = holder, self.epoch + 1
        return Won(self.epoch, EXPIRES)

    async def renew(self, cluster: str, holder: str, epoch: int) -> datetime | None:
        self.calls.append(("renew", epoch))
        if self.renew_gate is not None:
            await self.renew_gate.wait()
        return EXPIRES if (self.holder, self.epoch) == (holder, epoch) else None

    async def release(self, cluster: str, holder: str, epoch: int) -> bool:
        self.calls.append(("release", epoch))
        if (self.holder, self.epoch) != (holder, epoch):
            return False
        self.holder = None
        return True

    async def listen(
        self,
        cluster: str,
        on_release: Callable[[], None],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        await anyio.sleep_forever()

    def count(self, statement: str) -> int:
        return sum(1 for name, _ in self.calls if name == statement)


@asynccontextmanager
async def running(
    store: FakeStore, changes: list[tuple[bool, int | None]]
) -> AsyncIterator[LeaseKeeper]:
    k = LeaseKeeper(
        "alpha", "daemon-1", store, on_change=lambda acting, epoch: changes.append((acting, epoch))
    )
    async with anyio.create_task_group() as tg:
        await tg.start(k.run)
        try:
            yield k
        finally:
            with anyio.fail_after(SLACK_S):
                await k.aclose()


@pytest.mark.asyncio
async def test_an_acquisition_that_wins_after_the_shutdown_is_released() -> None:
    store = FakeStore(acquire_s=0.5)
    changes: list[tuple[bool, int | None]] = []
    async with running(store, changes) as k:
        pass  # aclose at once: the acquisition is on its way
    assert not k.acting
    assert changes == []
    assert store.calls == [("acquire", 0), ("release", 1)]
    assert store.holder is None


@pytest.mark.asyncio
async def test_an_acquisition_decided_while_one_is_slow_is_dropped_once_the_first_wins() -> None:
    """The second attempt falls due while the first is still running; the first wins, and
    the second is not sent (it would win again with a new epoch and lose the first's)."""
    store = FakeStore(acquire_s=ACQUIRE_EVERY_S + 0.5)
    changes: list[tuple[bool, int | None]] = []
    async with running(store, changes) as k:
        with anyio.fail_after(ACQUIRE_EVERY_S + SLACK_S):
            await k.wait_acting()
        # The keeper goes on to renew: a second acquisition would have gone before that.
        await until(lambda: store.count("renew") >= 1, what="the first renewal")
        assert store.count("acquire") == 1
        assert k.acting and k.epoch == 1 and store.epoch == 1
        assert 0 < k.acting_time_left() <= STOP_ACTING_AFTER_S
    assert changes == [(True, 1), (False, 1)]
    assert store.calls[-1] == ("release", 1)


@pytest.mark.asyncio
async def test_the_stop_acting_deadline_is_kept_while_a_renewal_hangs() -> None:
    """A renewal that does not come back does not hold the driver: it stops acting at the
    silence limit, and once the statement ends it acquires again with a new epoch."""
    store = FakeStore(renew_gate=anyio.Event())
    changes: list[tuple[bool, int | None]] = []
    async with running(store, changes) as k:
        with anyio.fail_after(SLACK_S):
            await k.wait_acting()
        with anyio.fail_after(STOP_ACTING_AFTER_S + SLACK_S):
            await k.wait_acting(False)
        assert store.count("renew") == 1  # still hanging
        assert k.acting_time_left() == 0.0
        assert store.renew_gate is not None
        store.renew_gate.set()
        with anyio.fail_after(SLACK_S):
            await k.wait_acting()
        assert k.epoch == 2
    assert changes == [(True, 1), (False, 1), (True, 2), (False, 2)]
