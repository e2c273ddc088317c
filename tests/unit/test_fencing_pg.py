"""The fence on a real PostgreSQL (tests/postgres.py, `core.ha.fencing`): a journal write
commits only when it states its cluster's current lease epoch; a stale writer, or one
that states none, is refused as a whole (`errors.FencedWrite`), counted and logged.
The rule itself is tests/unit/test_fencing.py's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import psycopg
import pytest
import pytest_asyncio
import structlog

from llmd_supervisor.adapters.journal.db import Db, PostgresDb
from llmd_supervisor.adapters.journal.pg import PostgresSettings
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.adapters.journal.writer import writing_as
from llmd_supervisor.core.events.model import EventType
from llmd_supervisor.core.events.outbox import Outgoing
from llmd_supervisor.core.ha.fencing import (
    CLUSTER_FROM_PARENT,
    FENCE_FUNCTION,
    FENCED_TABLES,
    Writer,
)
from llmd_supervisor.core.ha.lease import ACQUIRE_SQL, LEASE_S, LEASE_TABLE
from llmd_supervisor.core.journal.schema_versions import CODE_VERSION
from llmd_supervisor.core.journal.url import PostgresJournal
from llmd_supervisor.core.run.lifecycle import Run, RunState, Submit, new_run, step
from llmd_supervisor.core.run.retry_policy import Evidence, NodeFailure
from llmd_supervisor.errors import FencedWrite
from llmd_supervisor.supervision.ha.leading import Roles
from tests.postgres import PgServer
from tests.unit.test_journal import at, inserted, meta

CLUSTER = "dev"  # tests.unit.test_journal.meta's


@pytest_asyncio.fixture
async def journal(pg: PostgresJournal) -> AsyncIterator[Journal]:
    """A journal with no writer of its own (each test says who writes)."""
    async with await Journal.open_postgres(pg) as j:
        yield j


def _admin(postgres: PgServer, dbname: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(
        host=str(postgres.base), port=postgres.port, user="postgres", dbname=dbname
    ) as conn:
        conn.autocommit = True
        cur = conn.execute(sql, params)
        return list(cur.fetchall()) if cur.description else []


def _lock_waiters(postgres: PgServer, dbname: str) -> int:
    """How many sessions on `dbname` wait for a lock now."""
    sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = %(d)s AND wait_event_type = 'Lock'"
    return int(_admin(postgres, dbname, sql, {"d": dbname})[0][0])


async def acquire(journal: Journal, holder: str, cluster: str = CLUSTER) -> Writer:
    """`cluster`'s lease for `holder` (core.ha.lease.ACQUIRE_SQL), as a writer; it must win."""

    def work(db: Db) -> int:
        # Directly on the connection: core.ha.lease's SQL has psycopg's parameters.
        params = {"cluster": cluster, "holder": holder, "lease_s": LEASE_S}
        row = db_conn(db).execute(ACQUIRE_SQL, params).fetchone()
        assert row is not None, f"{holder} did not acquire {cluster}"
        return int(row[0])

    return Writer(cluster, await journal.write(f"acquire {cluster}", work))


def db_conn(db: Db) -> psycopg.Connection[Any]:
    assert isinstance(db, PostgresDb)
    return db.conn


def expire(postgres: PgServer, pg: PostgresJournal, cluster: str = CLUSTER) -> None:
    """The lease of `cluster` runs out (its holder went silent)."""
    _admin(
        postgres,
        pg.dbname,
        f"UPDATE {LEASE_TABLE} SET expires_at = now() WHERE cluster = %(c)s",
        {"c": cluster},
    )


@pytest.mark.asyncio
async def test_the_leaders_write_commits_and_a_deposed_leaders_commits_nothing(
    journal: Journal, pg: PostgresJournal, postgres: PgServer
) -> None:
    first = await acquire(journal, "daemon-a")
    journal.set_default_writer(lambda: first)
    run = await inserted(journal, "r-1")  # the current epoch: accepted
    assert journal.fenced_refusals == 0
    row_sql = "SELECT state, attempt, reason, updated_at FROM runs"
    row = _admin(postgres, pg.dbname, row_sql)

    # Daemon a goes silent; daemon b takes the lease over with the next epoch.
    expire(postgres, pg)
    async with await Journal.open_postgres(pg) as other:
        second = await acquire(other, "daemon-b")
        assert second.epoch == (first.epoch or 0) + 1
        other.set_default_writer(lambda: second)

        submitting, _ = step(run, Submit(), at(1))
        with structlog.testing.capture_logs() as logs, pytest.raises(FencedWrite) as info:
            await journal.save(submitting, expected=RunState.ACCEPTED)
        error = info.value
        assert (error.cluster, error.writer_epoch, error.lease_epoch) == (
            CLUSTER,
            first.epoch,
            second.epoch,
        )
        message = str(error)
        assert f"epoch {first.epoch}" in message and f"epoch {second.epoch}" in message
        assert pg.url in message
        assert journal.fenced_refusals == 1 and other.fenced_refusals == 0
        assert [
            {k: e[k] for k in ("cluster", "writer_epoch", "lease_epoch", "operation")}
            for e in logs
            if e["event"] == "journal.write_fenced"
        ] == [
            {
                "cluster": CLUSTER,
                "writer_epoch": first.epoch,
                "lease_epoch": second.epoch,
                "operation": "save run r-1",
            }
        ]
        assert [e["log_level"] for e in logs if e["event"] == "journal.write_fenced"] == ["warning"]

        # Nothing of the refused transaction was committed: the row, its transitions.
        stored = await other.get("r-1")
        assert stored is not None and stored.run == run
        assert _admin(postgres, pg.dbname, row_sql) == row
        assert _admin(postgres, pg.dbname, "SELECT count(*) FROM transitions") == [(1,)]

        # Every kind of write is refused alike (an event, a new run), each counted.
        with pytest.raises(FencedWrite):
            await journal.add_event("r-1", "late", {}, at(2))
        with pytest.raises(FencedWrite):
            await inserted(journal, "r-2")
        assert journal.fenced_refusals == 3
        assert [e["kind"] for e in await other.events("r-1")] == []

        # The new leader's write of the same transition commits.
        await other.save(submitting, expected=RunState.ACCEPTED)
        stored = await journal.get("r-1")  # a read needs no current epoch
        assert stored is not None and stored.run.state is RunState.SUBMITTING


@pytest.mark.asyncio
async def test_a_write_that_states_no_writer_is_refused(
    journal: Journal, pg: PostgresJournal, postgres: PgServer
) -> None:
    await acquire(journal, "daemon-a")  # the lease table itself is not fenced
    with pytest.raises(FencedWrite) as info:
        await inserted(journal, "r-1")
    error = info.value
    assert (error.cluster, error.writer_epoch, error.lease_epoch) == ("", None, None)
    assert "stated no cluster and epoch" in str(error)
    assert journal.fenced_refusals == 1
    assert _admin(postgres, pg.dbname, "SELECT count(*) FROM runs") == [(0,)]
    # A source that says the daemon no longer acts for any cluster (None) is the same.
    journal.set_default_writer(lambda: None)
    with pytest.raises(FencedWrite):
        await inserted(journal, "r-1")
    assert journal.fenced_refusals == 2


@pytest.mark.asyncio
async def test_a_writer_of_a_cluster_without_a_lease_is_refused(journal: Journal) -> None:
    journal.set_default_writer(lambda: Writer("nowhere", 1))
    with pytest.raises(FencedWrite) as info:
        await inserted(journal, "r-1")
    assert (info.value.cluster, info.value.writer_epoch, info.value.lease_epoch) == (
        "nowhere",
        1,
        None,
    )
    assert "the cluster has no lease" in str(info.value)


@pytest.mark.asyncio
async def test_the_writer_does_not_outlive_its_transaction(pg: PostgresJournal) -> None:
    """One pooled connection: a write with a writer, then one without on the same
    session; the settings were transaction-local, so the second is refused (fails
    closed on '')."""
    async with await Journal.open_postgres(pg, PostgresSettings(pool_size=1)) as journal:
        writer = await acquire(journal, "daemon-a")
        journal.set_default_writer(lambda: writer)
        await inserted(journal, "r-1")
        journal.set_default_writer(None)
        with pytest.raises(FencedWrite) as info:
            await inserted(journal, "r-2")
        assert info.value.writer_epoch is None
        assert [s.run.run_id for s in await journal.list_runs()] == ["r-1"]


@pytest.mark.asyncio
async def test_reads_need_no_writer_and_do_not_ask_for_one(journal: Journal) -> None:
    asked: list[str] = []

    def source() -> Writer | None:
        asked.append("asked")
        return None

    journal.set_default_writer(source)
    assert await journal.list_runs() == []
    assert await journal.get("r-1") is None
    assert await journal.read("count", lambda db: db.execute("SELECT 1").fetchone()) == (1,)
    assert asked == []
    with pytest.raises(FencedWrite):
        await inserted(journal, "r-1")
    assert asked == ["asked"]  # once, when the write was handed over; never retried


@pytest.mark.asyncio
async def test_a_task_s_own_writer_comes_before_the_default(journal: Journal) -> None:
    """`writing_as`: a task that works for one cluster writes as that cluster's leader;
    its source is asked when each write is handed over, so a leader that stopped acting
    (source: None) writes nothing more."""
    writer = await acquire(journal, "daemon-a")
    acting = True
    journal.set_default_writer(lambda: Writer(CLUSTER, 999))  # would be refused

    def source() -> Writer | None:
        return writer if acting else None

    with writing_as(source):
        await inserted(journal, "r-1")
        acting = False
        with pytest.raises(FencedWrite) as info:
            await journal.add_event("r-1", "after", {}, at(1))
        assert info.value.writer_epoch is None
    with pytest.raises(FencedWrite) as info:
        await journal.add_event("r-1", "after", {}, at(1))
    assert (info.value.writer_epoch, info.value.lease_epoch) == (999, writer.epoch)


@pytest.mark.asyncio
async def test_every_journal_table_has_the_fence(journal: Journal, pg: PostgresJournal) -> None:
    rows = await journal.read(
        "triggers",
        lambda db: db.execute(
            "SELECT c.relname, t.tgname, p.proname FROM pg_trigger AS t "
            "JOIN pg_class AS c ON c.oid = t.tgrelid JOIN pg_proc AS p ON p.oid = t.tgfoid "
            "WHERE NOT t.tgisinternal AND t.tgenabled = 'O' ORDER BY c.relname"
        ).fetchall(),
    )
    assert sorted((str(r[0]), str(r[1]), str(r[2])) for r in rows if "fence" in str(r[1])) == (
        sorted((t, f"{t}_fence", FENCE_FUNCTION) for t in FENCED_TABLES)
    )


@pytest.mark.asyncio
async def test_a_journal_of_version_6_migrates_to_the_fence(
    pg: PostgresJournal, postgres: PgServer
) -> None:
    """A journal made before the fence (version 6, with a run in it) gets the function
    and the triggers when a daemon of this version opens it; its rows stay."""
    async with await Journal.open_postgres(pg) as old:
        writer = await acquire(old, "daemon-a")
        old.set_default_writer(lambda: writer)
        await inserted(old, "r-old")
    # Back to version 6: the same schema and rows without the fence.
    assert CODE_VERSION >= 8  # later steps apply over the version-8 schema made here
    _admin(postgres, pg.dbname, f"DROP FUNCTION {FENCE_FUNCTION}() CASCADE")  # and triggers
    _admin(postgres, pg.dbname, "UPDATE schema_version SET version = 6")
    _admin(postgres, pg.dbname, "DROP VIEW journal_horizon")  # and version 8's columns
    for function in ("llmd_run_changed", "llmd_row_cluster"):
        _admin(postgres, pg.dbname, f"DROP FUNCTION {function}() CASCADE")
    _admin(postgres, pg.dbname, "ALTER TABLE runs DROP COLUMN changed")
    for child, _parent, _key in CLUSTER_FROM_PARENT:
        _admin(postgres, pg.dbname, f"ALTER TABLE {child} DROP COLUMN cluster")
    assert _admin(
        postgres, pg.dbname, "SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal"
    ) == [(0,)]

    with structlog.testing.capture_logs() as logs:
        journal = await Journal.open_postgres(pg)
    async with journal:
        migrated = [e for e in logs if e["event"] == "journal.migrated"]
        assert [(e["from_version"], e["to_version"]) for e in migrated] == [(6, CODE_VERSION)]
        assert _admin(postgres, pg.dbname, "SELECT version FROM schema_version") == [
            (CODE_VERSION,)
        ]
        triggers = _admin(
            postgres,
            pg.dbname,
            "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal ORDER BY tgname",
        )
        assert sorted(str(r[0]) for r in triggers) == sorted(
            [f"{t}_fence" for t in FENCED_TABLES]
            + [f"{t}_cluster" for t, _p, _k in CLUSTER_FROM_PARENT]
            + ["runs_changed"]
        )
        assert _admin(postgres, pg.dbname, "SELECT run_id, cluster FROM transitions") == [
            ("r-old", CLUSTER)
        ]
        assert [s.run.run_id for s in await journal.list_runs()] == ["r-old"]
        with pytest.raises(FencedWrite):
            await inserted(journal, "r-new")
        journal.set_default_writer(lambda: writer)
        await inserted(journal, "r-new")
        assert [s.run.run_id for s in await journal.list_runs()] == ["r-old", "r-new"]


@pytest.mark.asyncio
async def test_a_takeover_waits_for_the_write_that_passed_the_fence(
    journal: Journal, pg: PostgresJournal, postgres: PgServer
) -> None:
    """The trigger reads the lease row FOR SHARE: an acquisition waits for a write
    transaction that already passed the check, so that write commits before the new
    epoch exists (and one that starts after the acquisition is refused)."""
    writer = await acquire(journal, "daemon-a")
    journal.set_default_writer(lambda: writer)
    await inserted(journal, "r-1")
    expire(postgres, pg)
    passed = anyio.Event()
    release = anyio.Event()
    token = anyio.lowlevel.current_token()

    def slow_write(db: Db) -> None:
        db.execute("INSERT INTO events (run_id, at, kind, fields) VALUES ('r-1', 'x', 'k', '{}')")
        anyio.from_thread.run_sync(passed.set, token=token)
        anyio.from_thread.run(release.wait, token=token)

    acquired_epoch: list[int] = []

    def takeover() -> None:
        rows = _admin(
            postgres,
            pg.dbname,
            ACQUIRE_SQL,
            {"cluster": CLUSTER, "holder": "daemon-b", "lease_s": LEASE_S},
        )
        acquired_epoch.append(int(rows[0][0]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(journal.write, "slow write", slow_write)
        await passed.wait()
        tg.start_soon(anyio.to_thread.run_sync, takeover)
        with anyio.fail_after(30):  # the takeover's statement waits on a lock
            while not await anyio.to_thread.run_sync(_lock_waiters, postgres, pg.dbname):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert acquired_epoch == []  # waiting for the write's FOR SHARE lock
        release.set()
    assert acquired_epoch == [(writer.epoch or 0) + 1]
    assert _admin(postgres, pg.dbname, "SELECT kind FROM events") == [("k",)]
    with pytest.raises(FencedWrite):
        await journal.add_event("r-1", "late", {}, at(2))


# --- whose rows (schema version 8) --------------------------------------------------------

OTHER = "gpu-b"


async def insert_of(journal: Journal, run_id: str, cluster: str) -> Run:
    """A new run of `cluster` (as `inserted`, which writes cluster 'dev')."""
    run = new_run(run_id, f"llmd-{run_id}", at(0))
    await journal.insert_run(run, meta(cluster=cluster))
    return run


@pytest.mark.asyncio
async def test_a_leader_of_one_cluster_cannot_write_another_cluster_s_rows(
    journal: Journal, pg: PostgresJournal, postgres: PgServer
) -> None:
    """The leader of gpu-a, with gpu-a's current epoch, saves, inserts and deletes rows
    of gpu-b (a run, its transitions and events, a node failure, a campaign): the
    database refuses each (`FencedWrite.row_cluster`), and nothing of it is committed.
    The team's rows (the outbox, the ledger) take any current leader."""
    x = await acquire(journal, "daemon-a", CLUSTER)
    async with await Journal.open_postgres(pg) as other:
        y = await acquire(other, "daemon-b", OTHER)
        with writing_as(lambda: y):
            run_y = await insert_of(other, "r-y", OTHER)
        snapshot = "SELECT state, cluster, changed FROM runs ORDER BY run_id"
        before = _admin(postgres, pg.dbname, snapshot)

        journal.set_default_writer(lambda: x)
        submitting, _ = step(run_y, Submit(), at(1))
        with pytest.raises(FencedWrite) as info:
            await journal.save(submitting, expected=RunState.ACCEPTED)  # update
        error = info.value
        assert (error.cluster, error.writer_epoch, error.lease_epoch, error.row_cluster) == (
            CLUSTER,
            x.epoch,
            x.epoch,
            OTHER,
        )
        assert f"row of cluster {OTHER!r}" in str(error)
        with pytest.raises(FencedWrite) as info:
            await insert_of(journal, "r-y2", OTHER)  # insert
        assert info.value.row_cluster == OTHER
        with pytest.raises(FencedWrite) as info:  # delete (and its transitions' cascade)
            await journal.write("delete", lambda db: db.execute("DELETE FROM runs"))
        assert info.value.row_cluster == OTHER
        with pytest.raises(FencedWrite) as info:  # a child row takes its parent's cluster
            await journal.add_event("r-y", "foreign", {}, at(2))
        assert info.value.row_cluster == OTHER
        with pytest.raises(FencedWrite):  # a child row cannot claim another cluster
            await journal.write(
                "event claiming gpu-a",
                lambda db: db.execute(
                    "INSERT INTO events (run_id, at, kind, fields, cluster) "
                    "VALUES ('r-y', 'x', 'k', '{}', ?)",
                    (CLUSTER,),
                ),
            )
        failure = NodeFailure(OTHER, "n1", 1000, "r-y", 1, Evidence.OBSERVED, "down", at(3))
        with pytest.raises(FencedWrite):
            await journal.count_node_failure(failure, forget_before=at(0))
        with pytest.raises(FencedWrite):
            await journal.write(
                "move a run", lambda db: db.execute("UPDATE runs SET cluster = ?", (CLUSTER,))
            )
        assert journal.fenced_refusals == 7
        assert _admin(postgres, pg.dbname, snapshot) == before
        assert _admin(postgres, pg.dbname, "SELECT count(*) FROM events") == [(0,)]
        assert _admin(postgres, pg.dbname, "SELECT count(*) FROM node_failures") == [(0,)]

        # Its own cluster's rows, and the team's, it writes.
        await insert_of(journal, "r-x", CLUSTER)
        await journal.write(
            "a verified point",
            lambda db: db.execute(
                "INSERT INTO verified_points (recipe_id, concurrency, run_id, campaign_id, "
                "result_file, sha256, verified_at) VALUES ('rec', 1, 'r-y', NULL, 'f', 's', 't')"
            ),
        )
        # gpu-b's leader still writes its own run, and the team's rows too.
        with writing_as(lambda: y):
            await other.save(submitting, expected=RunState.ACCEPTED)
            await other.write(
                "forget a point", lambda db: db.execute("DELETE FROM verified_points")
            )
        rows = _admin(postgres, pg.dbname, "SELECT run_id, cluster FROM transitions")
        assert sorted(rows) == [("r-x", CLUSTER), ("r-y", OTHER), ("r-y", OTHER)]


@pytest.mark.asyncio
async def test_a_team_row_needs_a_current_leader(
    journal: Journal, pg: PostgresJournal, postgres: PgServer
) -> None:
    """A row of no cluster (the ledger) is refused from a standby (no writer) and from a
    deposed leader, whatever cluster it names."""
    first = await acquire(journal, "daemon-a")
    point = (
        "INSERT INTO verified_points (recipe_id, concurrency, run_id, campaign_id, "
        "result_file, sha256, verified_at) VALUES ('rec', 1, 'r', NULL, 'f', 's', 't')"
    )
    with pytest.raises(FencedWrite):
        await journal.write("a point", lambda db: db.execute(point))
    expire(postgres, pg)
    async with await Journal.open_postgres(pg) as other:
        await acquire(other, "daemon-b")
        journal.set_default_writer(lambda: first)
        with pytest.raises(FencedWrite) as info:
            await journal.write("a point", lambda db: db.execute(point))
        assert info.value.row_cluster is None and info.value.writer_epoch == first.epoch
    assert _admin(postgres, pg.dbname, "SELECT count(*) FROM verified_points") == [(0,)]


class _Believes:
    """A keeper that believes what the test says (a leader that has not yet noticed)."""

    def __init__(self, epoch: int | None) -> None:
        self.epoch = epoch

    def acting_time_left(self) -> float:
        return 0.0 if self.epoch is None else 10.0

    async def wait_epoch_change(self, epoch: int | None) -> None:
        await anyio.sleep_forever()


@pytest.mark.asyncio
async def test_a_lease_lost_between_require_and_the_write_refuses_it_and_loses_no_run(
    journal: Journal, pg: PostgresJournal, postgres: PgServer
) -> None:
    """A control request checks that the daemon leads the cluster (`Roles.require`),
    then the lease is lost (expired, taken by daemon b) before its write: the write,
    made as the cluster's writer (`writing_as`), is refused whole, with its outbox
    row; the run is still in the journal as it was, and the new leader finds it (as a
    standby's changed-since read and a takeover's load) and writes its next step."""
    first = await acquire(journal, "daemon-a")
    roles = Roles("daemon-a", {CLUSTER: _Believes(first.epoch)}, shared=True)
    roles.begin_tenure(CLUSTER, first.epoch or 0)
    journal.set_default_writer(roles.any_writer)
    with writing_as(lambda: roles.writer(CLUSTER)):
        run = await insert_of(journal, "r-1", CLUSTER)
    _, horizon = await journal.runs_changed_since(0)

    await roles.require(CLUSTER)  # passes: daemon a believes it leads
    expire(postgres, pg)
    async with await Journal.open_postgres(pg) as other:
        second = await acquire(other, "daemon-b")
        cancelling = replace(run, cancel_requested=True)
        outgoing = [_an_outgoing()]
        with (
            writing_as(lambda: roles.writer(CLUSTER)),
            pytest.raises(FencedWrite) as info,
        ):
            await journal.save(cancelling, expected=RunState.ACCEPTED, outgoing=outgoing)
        assert (info.value.writer_epoch, info.value.lease_epoch) == (first.epoch, second.epoch)
        assert _admin(postgres, pg.dbname, "SELECT count(*) FROM outbox_events") == [(0,)]

        # Not lost: the new leader reads it (a standby's read of what changed, and all).
        changed, _ = await other.runs_changed_since(0)
        assert [s.run for s in changed] == [run]
        changed, _ = await other.runs_changed_since(horizon)
        assert changed == []  # nothing was written since: the refused write left nothing
        other.set_default_writer(lambda: second)
        submitting, _ = step(run, Submit(), at(1))
        await other.save(submitting, expected=RunState.ACCEPTED, outgoing=outgoing)
        changed, _ = await journal.runs_changed_since(horizon)
        assert [s.run.state for s in changed] == [RunState.SUBMITTING]


def _an_outgoing() -> Outgoing:
    return Outgoing(
        id="ev-1",
        type=EventType.RUN_SUBMITTED,
        subject="run/r-1",
        seq="1",
        at=at(1),
        body=b"{}",
        destinations=(),
    )
