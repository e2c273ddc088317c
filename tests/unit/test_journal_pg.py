"""What only the PostgreSQL journal has, against the session's real server
(tests/postgres.py): its schema and migrations, its connection settings, its password
file, its errors, and `journal migrate` from SQLite. The journal's behaviour on both
backends is tests/unit/test_journal.py's (and the stores' tests)."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import cast

import anyio
import anyio.lowlevel
import pytest
import pytest_asyncio

from llmd_supervisor.adapters.journal.campaign_store import CampaignStore, VerifiedPoint
from llmd_supervisor.adapters.journal.db import Db, PostgresDb
from llmd_supervisor.adapters.journal.pg import read_password
from llmd_supervisor.adapters.journal.schema import TABLES
from llmd_supervisor.adapters.journal.store import Journal, NewEvent
from llmd_supervisor.adapters.outbox.store import Outbox
from llmd_supervisor.cli.journal import MIGRATE_CLUSTER, copy_journal
from llmd_supervisor.cli.main import main
from llmd_supervisor.core.config import load_config
from llmd_supervisor.core.events.outbox import DeliveryStatus
from llmd_supervisor.core.ha.fencing import CLUSTER_FROM_PARENT, FENCED_TABLES
from llmd_supervisor.core.ha.lease import LEASE_TABLE
from llmd_supervisor.core.journal.schema_versions import CODE_VERSION
from llmd_supervisor.core.journal.url import PostgresJournal, parse_journal
from llmd_supervisor.core.run.lifecycle import RunState, Submit, step
from llmd_supervisor.core.run.retry_policy import Evidence, NodeFailure
from llmd_supervisor.errors import ConfigError, JournalConflict, JournalError, JournalSchemaTooNew
from tests.postgres import PgServer, lead_for_tests
from tests.unit.test_campaign_store import campaign, job
from tests.unit.test_journal import T0, at, inserted
from tests.unit.test_outbox import SUCCESS, journaled_until, walk


@pytest_asyncio.fixture
async def journal(pg: PostgresJournal) -> AsyncIterator[Journal]:
    async with await Journal.open_postgres(pg) as j:
        await lead_for_tests(j)
        yield j


def _admin_rows(postgres: PgServer, dbname: str, sql: str) -> list[tuple[object, ...]]:
    import psycopg

    with psycopg.connect(
        host=str(postgres.base), port=postgres.port, user="postgres", dbname=dbname
    ) as conn:
        conn.autocommit = True
        cur = conn.execute(sql)
        return list(cur.fetchall()) if cur.description else []


# --- schema and migrations ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_new_database_gets_the_schema_sqlite_has(
    journal: Journal, pg: PostgresJournal, postgres: PgServer, tmp_path: Path
) -> None:
    """The hand-written DDL of both backends names the same tables and columns (plus
    PostgreSQL's own: runs.rowid, schema_version, the lease), and core.ha.fencing fences them
    all."""

    def columns(db: Db) -> dict[str, list[str]]:
        rows = db.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'public' ORDER BY table_name, ordinal_position"
        ).fetchall()
        out: dict[str, list[str]] = {}
        for table, column in rows:
            out.setdefault(str(table), []).append(str(column))
        return out

    got = await journal.read("test", columns)
    async with await Journal.open(tmp_path / "j.sqlite3"):
        pass
    with closing(sqlite3.connect(tmp_path / "j.sqlite3")) as conn:
        names = [
            str(r[0])
            for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            if r[0] not in ("sqlite_sequence", "journal_clock")  # SQLite's own counter
        ]
        want = {t: [str(c[1]) for c in conn.execute(f"PRAGMA table_info({t})")] for t in names}
    assert set(want) == set(TABLES) == set(FENCED_TABLES)
    assert set(got) == set(TABLES) | {"schema_version", LEASE_TABLE, "journal_horizon"}
    children = {child for child, _parent, _key in CLUSTER_FROM_PARENT}
    for table in TABLES:
        extra = ["rowid"] if table == "runs" else []
        extra += ["cluster"] if table in children else []  # the fence's, PostgreSQL's own
        assert sorted(got[table]) == sorted(want[table] + extra), table
    dbname = pg.dbname
    assert _admin_rows(postgres, dbname, "SELECT version FROM schema_version") == [(CODE_VERSION,)]


@pytest.mark.asyncio
async def test_a_newer_schema_is_refused_untouched(pg: PostgresJournal, postgres: PgServer) -> None:
    async with await Journal.open_postgres(pg):
        pass
    newer = CODE_VERSION + 3
    _admin_rows(postgres, pg.dbname, f"UPDATE schema_version SET version = {newer}")
    with pytest.raises(JournalSchemaTooNew) as info:
        await Journal.open_postgres(pg)
    message = str(info.value)
    assert pg.url in message
    assert f"version {newer}, newer than this daemon's {CODE_VERSION}" in message
    assert "upgrade llmd-supervisor" in message
    assert _admin_rows(postgres, pg.dbname, "SELECT version FROM schema_version") == [(newer,)]


@pytest.mark.asyncio
async def test_daemons_starting_together_migrate_once(pg: PostgresJournal) -> None:
    """The advisory lock: five journals open one empty database at once; one creates the
    schema, the others find it made (none fails on a table that already exists)."""
    opened: list[Journal] = []

    async def open_one() -> None:
        opened.append(await Journal.open_postgres(pg))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(open_one)
    try:
        await lead_for_tests(opened[0])
        await inserted(opened[0], "r-1")
        assert [s.run.run_id for s in await opened[4].list_runs()] == ["r-1"]
    finally:
        for j in opened:
            await j.aclose()


# --- connections and transactions --------------------------------------------------------------


@pytest.mark.asyncio
async def test_connections_notice_a_cut_link_and_transactions_are_serializable(
    journal: Journal,
) -> None:
    def settings(db: Db) -> dict[str, str]:
        conn = cast(PostgresDb, db).conn
        params = conn.info.get_parameters()
        for name in ("statement_timeout", "idle_in_transaction_session_timeout"):
            row = db.execute(f"SHOW {name}").fetchone()
            assert row is not None
            params[name] = str(row[0])
        row = db.execute("SHOW transaction_isolation").fetchone()
        assert row is not None
        params["isolation"] = str(row[0])
        return params

    read = await journal.read("test", settings)
    # (keepalives=1 is libpq's default, which get_parameters leaves out)
    names = ("keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout")
    assert {k: read.get(k) for k in names} == {
        "keepalives_idle": "2",
        "keepalives_interval": "2",
        "keepalives_count": "3",
        "tcp_user_timeout": "9000",
    }
    assert read.get("keepalives", "1") == "1"
    assert "password" not in read
    assert (read["statement_timeout"], read["idle_in_transaction_session_timeout"]) == (
        "30s",
        "1min",
    )
    assert read["isolation"] == "repeatable read"
    assert (await journal.write("test", settings))["isolation"] == "serializable"
    with pytest.raises(JournalError, match="read-only transaction"):
        await journal.read("test", lambda db: db.execute("DELETE FROM runs"))


@pytest.mark.asyncio
async def test_a_failed_statement_is_a_journal_error_naming_the_database_and_rolls_back(
    journal: Journal, pg: PostgresJournal, postgres: PgServer
) -> None:
    await inserted(journal, "r-1")
    _admin_rows(
        postgres, pg.dbname, "ALTER TABLE transitions ADD CONSTRAINT no_r2 CHECK (run_id <> 'r-2')"
    )
    with pytest.raises(JournalError) as info:
        await inserted(journal, "r-2")  # the run's row goes in first, then its transition
    message = str(info.value)
    assert pg.url in message and "insert run r-2" in message and "23514" in message
    assert [s.run.run_id for s in await journal.list_runs()] == ["r-1"]
    await journal.add_event("r-1", "after", {}, at(1))  # the journal goes on working
    assert [e["kind"] for e in await journal.events("r-1")] == ["after"]


@pytest.mark.asyncio
async def test_racing_compare_and_set_across_daemons_has_one_winner(pg: PostgresJournal) -> None:
    """Two journals (two pools, as two daemons) race to save one transition: SERIALIZABLE
    writes and their retries leave exactly one winner."""
    async with await Journal.open_postgres(pg) as first, await Journal.open_postgres(pg) as second:
        await lead_for_tests(first)
        await lead_for_tests(second)
        run = await inserted(first, "r-1")
        outcomes: list[str] = []

        async def contender(j: Journal, i: int) -> None:
            candidate, _ = step(run, Submit(), at(i))
            try:
                await j.save(candidate, expected=RunState.ACCEPTED)
            except JournalConflict as exc:
                assert exc.actual == "submitting"
                outcomes.append("conflict")
            else:
                outcomes.append("won")

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(contender, first if i % 2 else second, i)
        assert sorted(outcomes) == ["conflict"] * 9 + ["won"]
        stored = await second.get("r-1")
        assert stored is not None and len(stored.run.transitions) == 2


@pytest.mark.asyncio
async def test_event_loop_runs_while_a_save_waits_for_a_lock(
    journal: Journal, pg: PostgresJournal, postgres: PgServer
) -> None:
    """A save waiting for a row another session holds must not block the loop."""
    import psycopg

    run = await inserted(journal, "r-1")
    ticks = 0
    with psycopg.connect(
        host=str(postgres.base), port=postgres.port, user="postgres", dbname=pg.dbname
    ) as other:
        other.execute("SELECT 1 FROM runs WHERE run_id = 'r-1' FOR UPDATE")

        async def ticker() -> None:
            nonlocal ticks
            while ticks < 200:
                ticks += 1
                await anyio.lowlevel.checkpoint()
            other.rollback()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            submitting, _ = step(run, Submit(), at(1))
            await journal.save(submitting, expected=RunState.ACCEPTED)
    assert ticks == 200
    stored = await journal.get("r-1")
    assert stored is not None and stored.run.state is RunState.SUBMITTING


# --- reaching the database -----------------------------------------------------------------------


def test_the_password_file_must_be_the_accounts_alone(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\nignored\n")
    secret.chmod(0o600)
    assert read_password(str(secret)) == "s3cret"
    secret.chmod(0o640)
    with pytest.raises(ConfigError, match=re.escape(f"chmod 0600 {secret}")):
        read_password(str(secret))
    secret.chmod(0o600)
    if os.geteuid() == 0:  # root may read any file: another owner is refused all the same
        os.chown(secret, 4242, -1)
        with pytest.raises(ConfigError, match="owned by uid 4242"):
            read_password(str(secret))
        os.chown(secret, 0, -1)
    link = tmp_path / "link"
    link.symlink_to(secret)
    with pytest.raises(ConfigError, match=re.escape(f"{link} is a symbolic link;")) as info:
        read_password(str(link))
    assert f"point journal.password_file at the real file ({secret})" in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        read_password(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(ConfigError, match="is empty"):
        read_password(str(empty))


@pytest.mark.asyncio
async def test_a_wrong_password_or_no_server_is_a_journal_error_naming_the_url(
    pg: PostgresJournal, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    with pytest.raises(JournalError) as info:
        await Journal.open_postgres(replace(pg, password_file=str(wrong)))
    assert pg.url in str(info.value) and "password authentication failed" in str(info.value)
    assert "not-the-password" not in str(info.value)
    closed = replace(pg, hosts=(("127.0.0.1", 1),), url="postgresql://llmd@127.0.0.1:1/x")
    with pytest.raises(JournalError, match=re.escape("postgresql://llmd@127.0.0.1:1/x")):
        await Journal.open_postgres(closed)


def test_a_daemon_refuses_to_start_on_a_newer_schema(
    pg: PostgresJournal, postgres: PgServer, tmp_path: Path
) -> None:
    anyio.run(_open_and_close, pg)
    _admin_rows(postgres, pg.dbname, f"UPDATE schema_version SET version = {CODE_VERSION + 1}")
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\nsocket = "{tmp_path / "control.sock"}"\n'
        f'[journal]\nurl = "{pg.url}"\npassword_file = "{pg.password_file}"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", "daemon", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert f"Journal {pg.url} could not be opened" in done.stderr
    assert f"newer than this daemon's {CODE_VERSION}; upgrade llmd-supervisor" in done.stderr
    assert not (tmp_path / "control.sock").exists()


async def _open_and_close(pg: PostgresJournal) -> None:
    async with await Journal.open_postgres(pg):
        pass


def test_the_daemon_config_names_a_postgresql_journal() -> None:
    config = load_config(
        '[journal]\nurl = "postgresql://llmd@db.example.org/llmd"\n'
        'password_file = "/etc/llmd-supervisor/db-password"\n'
    )
    assert isinstance(config.journal, PostgresJournal)
    assert config.journal.password_file == "/etc/llmd-supervisor/db-password"
    assert config.journal.sslmode == "verify-full"
    assert not isinstance(load_config("").journal, PostgresJournal)


# --- journal migrate ---------------------------------------------------------------------------


async def _sqlite_journal(path: Path) -> dict[str, object]:
    """An SQLite journal with a row in every table; what its stores read back."""
    async with await Journal.open(path) as j:
        await journaled_until(j, walk(*SUCCESS), 3)  # run r-1, its events and deliveries
        run = await inserted(j, "r-2")
        await j.save(
            step(run, Submit(), at(1))[0],
            expected=RunState.ACCEPTED,
            events=[NewEvent("run.transition", {"to": "submitting"}, at(1))],
        )
        await j.count_node_failure(
            NodeFailure("dev", "n1", 1000, "r-2", 1, Evidence.OBSERVED, "gone", at(3)),
            forget_before=at(-60),
        )
        store = CampaignStore(j)
        await store.insert(campaign(), [job("a", 0)])
        await store.add_verified(
            [VerifiedPoint("r" * 64, 4, "r-1", "c0ffee000001", "results/c4.json", "ab" * 32, T0)]
        )
        outbox = Outbox(j)
        await outbox.finish_attempt(
            (await outbox.deliveries())[0].event_id,
            "all",
            status=DeliveryStatus.DEAD,
            attempts=3,
            next_at=None,
            error="HTTP 410",
            now=at(5),
            disable=True,
        )
        return await _everything(j)


async def _everything(j: Journal) -> dict[str, object]:
    store = CampaignStore(j)
    outbox = Outbox(j)
    return {
        "runs": await j.list_runs(),
        "events": {r: await j.events(r) for r in ("r-1", "r-2")},
        "failures": await j.node_failures(),
        "campaigns": await store.campaigns(),
        "jobs": await store.jobs("c0ffee000001"),
        "deliveries": await outbox.deliveries(),
        "disabled": await outbox.disabled(),
        "verified": await store.verified(["r" * 64]),
        "bodies": [await outbox.event(d.event_id) for d in await outbox.deliveries()],
    }


@pytest.mark.asyncio
async def test_journal_migrate_copies_every_table_in_one_transaction(
    pg: PostgresJournal, tmp_path: Path
) -> None:
    source = tmp_path / "journal.sqlite3"
    before = await _sqlite_journal(source)
    counts = await copy_journal(source, pg, replace=False)
    assert set(counts) == set(TABLES)
    assert all(counts[t] > 0 for t in TABLES), counts
    async with await Journal.open_postgres(pg) as copied:
        assert await _everything(copied) == before
        await lead_for_tests(copied)
        # New rows after the copy get new ids (the identity sequences moved on).
        await copied.add_event("r-2", "after", {}, at(9))
        await inserted(copied, "r-3")
        assert [e["kind"] for e in await copied.events("r-2")][-1] == "after"
    with pytest.raises(JournalError, match=r"already holds rows .*--replace"):
        await copy_journal(source, pg, replace=False)
    assert await copy_journal(source, pg, replace=True) == counts


@pytest.mark.asyncio
async def test_journal_migrate_writes_as_the_leader_of_its_own_pseudo_cluster(
    pg: PostgresJournal, postgres: PgServer, tmp_path: Path
) -> None:
    """The target's fence accepts the copy because it holds the lease of MIGRATE_CLUSTER
    while it copies; it releases it at the end, and a copy that finds it held (another
    copy running) copies nothing."""
    source = tmp_path / "journal.sqlite3"
    await _sqlite_journal(source)
    counts = await copy_journal(source, pg, replace=False)
    lease = f"SELECT holder, epoch FROM {LEASE_TABLE} WHERE cluster = '{MIGRATE_CLUSTER}'"
    assert _admin_rows(postgres, pg.dbname, lease) == [(None, 1)]  # released
    assert await copy_journal(source, pg, replace=True) == counts
    assert _admin_rows(postgres, pg.dbname, lease) == [(None, 2)]  # a new tenure each
    _admin_rows(
        postgres,
        pg.dbname,
        f"UPDATE {LEASE_TABLE} SET holder = 'journal-migrate@elsewhere:1', "
        f"expires_at = now() + interval '1 hour' WHERE cluster = '{MIGRATE_CLUSTER}'",
    )
    empty = tmp_path / "empty.sqlite3"
    async with await Journal.open(empty):
        pass
    with pytest.raises(JournalError, match=re.escape("(journal-migrate@elsewhere:1) is copying")):
        await copy_journal(empty, pg, replace=True)  # would empty every table
    assert _admin_rows(postgres, pg.dbname, "SELECT count(*) FROM runs") == [(counts["runs"],)]
    assert _admin_rows(postgres, pg.dbname, lease) == [("journal-migrate@elsewhere:1", 2)]


def test_journal_migrate_command_reports_row_counts(
    pg: PostgresJournal, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "journal.sqlite3"
    anyio.run(_sqlite_journal, source)
    argv = ["journal", "migrate", "--from", "sqlite", str(source), "--to", pg.url]
    assert main([*argv, "--password-file", str(pg.password_file)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^runs\s+2$", out, re.MULTILINE), out
    assert re.search(r"^deliveries\s+\d+$", out, re.MULTILINE), out
    assert f"to {pg.url}" in out
    assert main([*argv, "--password-file", str(pg.password_file)]) == 1
    assert "already holds rows" in capsys.readouterr().err
    url_with_password = pg.url.replace("llmd@", "llmd:hunter2@")
    assert (
        main(["journal", "migrate", "--from", "sqlite", str(source), "--to", url_with_password])
        == 2
    )
    err = capsys.readouterr().err
    assert "hunter2" not in err and "password_file" in err
    assert parse_journal({}) != pg
