"""Leadership of a cluster on a real PostgreSQL (tests/postgres.py): `LeaseKeeper`
(supervision.ha.leadership) driving `core.ha.lease` through `PostgresLease`
(adapters.journal.lease_pg). The rules themselves are tests/unit/test_lease.py's.

Times are asserted as generous upper bounds only (a loaded 2-core machine stretches
every step); the state machine's own lower bounds are test_lease.py's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import pytest
import pytest_asyncio

from llmd_supervisor.adapters.journal.lease_pg import Held, PostgresLease, Won
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.core.ha.lease import (
    ACQUIRE_EVERY_S,
    LEASE_TABLE,
    RENEW_EVERY_S,
    STATEMENT_TIMEOUT_S,
    STOP_ACTING_AFTER_S,
    Leader,
)
from llmd_supervisor.core.journal.url import PostgresJournal
from llmd_supervisor.errors import LeaseError
from llmd_supervisor.supervision.ha.leadership import LeaseKeeper
from tests.postgres import PgServer
from tests.waiting import until

CLUSTER = "alpha"
# Upper bounds, with room for a loaded machine.
SLACK_S = 5.0
# From the first try to acting: an attempt (a connection and two statements).
ACQUIRE_WITHIN_S = ACQUIRE_EVERY_S + SLACK_S
# A renewal that updates no row: the next renewal is due within RENEW_EVERY_S.
LOST_WITHIN_S = RENEW_EVERY_S + STATEMENT_TIMEOUT_S + SLACK_S
SILENCE_WITHIN_S = STOP_ACTING_AFTER_S + SLACK_S


@dataclass
class Db:
    """A new database of the session's server with the journal's schema (the lease table)."""

    server: PgServer
    name: str
    config: PostgresJournal

    def admin(
        self, sql: str, params: dict[str, Any] | None = None, dbname: str | None = None
    ) -> list[tuple[Any, ...]]:
        """Run `sql` as the superuser on this database, or on `dbname` (blocking: call it
        in a thread)."""
        with psycopg.connect(
            host=str(self.server.base),
            port=self.server.port,
            user="postgres",
            dbname=dbname or self.name,
            autocommit=True,
        ) as conn:
            cur = conn.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []

    async def sql(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return await anyio.to_thread.run_sync(self.admin, sql, params)

    async def allow_connections(self, allow: bool) -> None:
        """Let clients connect to this database or not (the open sessions end too)."""
        await anyio.to_thread.run_sync(
            self.admin,
            f"ALTER DATABASE {self.name} WITH ALLOW_CONNECTIONS {allow}",
            None,
            "postgres",
        )
        if not allow:
            await anyio.to_thread.run_sync(
                self.admin,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %(d)s AND pid <> pg_backend_pid()",
                {"d": self.name},
                "postgres",
            )

    async def row(self) -> tuple[Any, ...] | None:
        rows = await self.sql(
            f"SELECT holder, epoch, expires_at > now() FROM {LEASE_TABLE} WHERE cluster = %(c)s",
            {"c": CLUSTER},
        )
        return rows[0] if rows else None


@pytest_asyncio.fixture
async def db(postgres: PgServer) -> AsyncIterator[Db]:
    name = await anyio.to_thread.run_sync(postgres.new_database)
    config = postgres.journal_config(name)
    journal = await Journal.open_postgres(config)  # creates the schema
    await journal.aclose()
    d = Db(postgres, name, config)
    yield d
    await d.allow_connections(True)


@dataclass
class Changes:
    """What a keeper's ``on_change`` said, in order."""

    seen: list[tuple[bool, int | None]] = field(default_factory=list)
    acted: anyio.Event = field(default_factory=anyio.Event)  # set once it acts

    def __call__(self, acting: bool, epoch: int | None) -> None:
        self.seen.append((acting, epoch))
        if acting:
            self.acted.set()


class CountingLease(PostgresLease):
    """The real adapter, keeping what its acquisitions and renewals answered, in order."""

    def __init__(self, config: PostgresJournal) -> None:
        super().__init__(config)
        self.answers: list[Won | Held | datetime | None] = []

    async def acquire(self, cluster: str, holder: str) -> Won | Held:
        answer = await super().acquire(cluster, holder)
        self.answers.append(answer)
        return answer

    async def renew(self, cluster: str, holder: str, epoch: int) -> datetime | None:
        answer = await super().renew(cluster, holder, epoch)
        self.answers.append(answer)
        return answer

    def count(self, kind: type[object], since: int = 0) -> int:
        """How many answers from index `since` on are a `kind` (datetime: a renewal)."""
        return sum(isinstance(a, kind) for a in self.answers[since:])


@asynccontextmanager
async def keeper(
    db: Db,
    holder: str,
    changes: Callable[[bool, int | None], None] | None = None,
    adapter: CountingLease | None = None,
) -> AsyncIterator[LeaseKeeper]:
    """A running keeper of CLUSTER on its own adapter; closed (the lease released) at the end."""
    adapter = adapter or CountingLease(db.config)
    k = LeaseKeeper(CLUSTER, holder, adapter, on_change=changes)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(k.run)
            try:
                yield k
            finally:
                with anyio.fail_after(4 * STATEMENT_TIMEOUT_S + SLACK_S):
                    await k.aclose()
    finally:
        await adapter.aclose()


@contextmanager
def within(seconds: float) -> Iterator[None]:
    with anyio.fail_after(seconds):
        yield


@pytest.mark.asyncio
async def test_the_adapter_runs_core_leases_statements(db: Db) -> None:
    """acquire/renew/release as the database answers them: a won epoch, the holder when
    not won, no row renewed for a stale epoch, and a release that frees the row."""
    a, b = PostgresLease(db.config), PostgresLease(db.config)
    try:
        won = await a.acquire(CLUSTER, "a")
        assert isinstance(won, Won) and won.epoch == 1
        held = await b.acquire(CLUSTER, "b")
        assert isinstance(held, Held) and held.holder == "a"
        renewed = await a.renew(CLUSTER, "a", 1)
        assert renewed is not None and renewed >= won.expires_at
        assert await b.renew(CLUSTER, "b", 1) is None
        assert await a.renew(CLUSTER, "a", 2) is None
        assert await a.release(CLUSTER, "a", 1) is True
        assert await a.release(CLUSTER, "a", 1) is False
        again = await b.acquire(CLUSTER, "b")
        assert isinstance(again, Won) and again.epoch == 2
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.asyncio
async def test_an_unreachable_database_is_a_lease_error_naming_it(db: Db) -> None:
    await db.allow_connections(False)
    adapter = PostgresLease(db.config)
    try:
        with within(STATEMENT_TIMEOUT_S + SLACK_S), pytest.raises(LeaseError) as info:
            await adapter.acquire(CLUSTER, "a")
        assert CLUSTER in str(info.value) and db.config.url in str(info.value)
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_one_of_two_keepers_leads_and_the_other_takes_over_at_a_graceful_stop(
    db: Db,
) -> None:
    """Two keepers started together: one acts with epoch 1, the other stays standby while
    the first renews; when the first stops it releases, and the second acts with epoch 2
    within about one attempt (the release is notified)."""
    first_changes = Changes()
    second_changes = Changes(acted=first_changes.acted)  # set by whichever acts first
    first_lease, second_lease = CountingLease(db.config), CountingLease(db.config)
    async with (
        keeper(db, "daemon-1", first_changes, first_lease) as k1,
        keeper(db, "daemon-2", second_changes, second_lease) as k2,
    ):
        with within(ACQUIRE_WITHIN_S):
            await first_changes.acted.wait()
        leader, standby = (k1, k2) if k1.acting else (k2, k1)
        leader_changes, standby_changes = (
            (first_changes, second_changes) if k1.acting else (second_changes, first_changes)
        )
        leader_lease, standby_lease = (
            (first_lease, second_lease) if k1.acting else (second_lease, first_lease)
        )
        assert leader.epoch == 1
        assert leader.acting_time_left() > 0
        # Several renewals and standby attempts go by; nothing changes hands.
        await until(
            lambda: leader_lease.count(datetime) >= 2 and standby_lease.count(Held) >= 2,
            10 * RENEW_EVERY_S + SLACK_S,
            "two renewals of the leader and two refused attempts of the standby",
        )
        assert leader.acting and not standby.acting
        assert await db.row() == (leader.holder, 1, True)
        assert isinstance(leader.state, Leader)
        assert leader.state.last_renewed > 0

        with within(4 * STATEMENT_TIMEOUT_S + SLACK_S):
            await leader.aclose()
        assert not leader.acting
        with within(ACQUIRE_EVERY_S + 1 + SLACK_S):
            await standby.wait_acting()
        assert standby.epoch == 2
        assert await db.row() == (standby.holder, 2, True)
    assert leader_changes.seen == [(True, 1), (False, 1)]
    assert standby_changes.seen == [(True, 2), (False, 2)]
    # The second released at its own stop too.
    row = await db.row()
    assert row is not None and row[0] is None and row[1] == 2


@pytest.mark.asyncio
async def test_a_keeper_whose_database_goes_away_stops_acting_after_the_silence_limit(
    db: Db,
) -> None:
    """No connection can be made and the ones it had are gone: it stops acting within
    STOP_ACTING_AFTER_S (plus slack), and acts again, with a new epoch, once it can."""
    changes = Changes()
    async with keeper(db, "daemon-1", changes) as k:
        with within(ACQUIRE_WITHIN_S):
            await k.wait_acting()
        assert k.epoch == 1
        await db.allow_connections(False)
        with within(SILENCE_WITHIN_S):
            await k.wait_acting(False)
        assert changes.seen == [(True, 1), (False, 1)]

        await db.allow_connections(True)
        with within(ACQUIRE_WITHIN_S):
            await k.wait_acting()
        assert k.epoch == 2  # its own row again, but a new tenure
    assert changes.seen == [(True, 1), (False, 1), (True, 2), (False, 2)]


@pytest.mark.asyncio
async def test_a_keeper_whose_statements_hang_stops_acting_after_the_silence_limit(
    db: Db,
) -> None:
    """The lease table is locked: every renewal waits until its timeout. The event loop
    keeps running (the conftest guard), and the keeper stops acting in time."""
    async with keeper(db, "daemon-1") as k:
        with within(ACQUIRE_WITHIN_S):
            await k.wait_acting()
        locker = await anyio.to_thread.run_sync(
            lambda: psycopg.connect(
                host=str(db.server.base), port=db.server.port, user="postgres", dbname=db.name
            )
        )
        try:
            await anyio.to_thread.run_sync(
                locker.execute, f"LOCK TABLE {LEASE_TABLE} IN ACCESS EXCLUSIVE MODE"
            )
            with within(SILENCE_WITHIN_S):
                await k.wait_acting(False)
        finally:
            await anyio.to_thread.run_sync(locker.close)  # rolls back: the lock is gone
        with within(ACQUIRE_WITHIN_S + STATEMENT_TIMEOUT_S):
            await k.wait_acting()
        assert k.epoch == 2


@pytest.mark.asyncio
async def test_a_renewal_that_updates_no_row_stops_acting_at_once(db: Db) -> None:
    """Another holder took the row (as after an expiry): the next renewal updates nothing
    and the keeper stops acting then, not after the silence limit; it stays standby while
    the other holds the lease."""
    changes = Changes()
    lease = CountingLease(db.config)
    async with keeper(db, "daemon-1", changes, lease) as k:
        with within(ACQUIRE_WITHIN_S):
            await k.wait_acting()
        await db.sql(
            f"UPDATE {LEASE_TABLE} SET holder = 'daemon-9', epoch = epoch + 1, "
            "expires_at = now() + interval '60 seconds' WHERE cluster = %(c)s",
            {"c": CLUSTER},
        )
        with within(LOST_WITHIN_S):
            await k.wait_acting(False)
        lost_at = len(lease.answers)
        await until(  # an attempt or two: the row is not free
            lambda: lease.count(Held, since=lost_at) >= 2,
            10 * ACQUIRE_EVERY_S + SLACK_S,
            "two attempts answered that daemon-9 holds the lease",
        )
        assert not k.acting
        assert await db.row() == ("daemon-9", 2, True)
    assert changes.seen == [(True, 1), (False, 1)]


@pytest.mark.asyncio
async def test_a_cancelled_keeper_stops_acting_and_releases(db: Db) -> None:
    changes = Changes()
    adapter = PostgresLease(db.config)
    try:
        k = LeaseKeeper(CLUSTER, "daemon-1", adapter, on_change=changes)
        async with anyio.create_task_group() as tg:
            await tg.start(k.run)
            with within(ACQUIRE_WITHIN_S):
                await k.wait_acting()
            tg.cancel_scope.cancel()
        assert not k.acting
        assert changes.seen == [(True, 1), (False, 1)]
        row = await db.row()
        assert row is not None and row[0] is None and row[1] == 1
        with within(1):
            await k.aclose()  # after the end: returns at once
    finally:
        await adapter.aclose()
