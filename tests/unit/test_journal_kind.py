"""A run's kind in the journal (schema step 10, both backends): a version-9 journal
migrates and each run's ``kind`` is filled from its stored spec text (TOML: a rendered
spec; JSON: a foreign spec, adopted when its ``kind`` says "adopt"; JSON that does not
parse: a script's, which then fails to load as it did before). A new run keeps the kind
it was accepted as."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path

import anyio
import psycopg
import pytest

from llmd_supervisor.adapters.journal.schema import MIGRATIONS, POSTGRES_MIGRATIONS
from llmd_supervisor.adapters.journal.store import Journal, RunMeta
from llmd_supervisor.core.journal.schema_versions import SCHEMA_VERSION_TABLE_DDL
from llmd_supervisor.core.run.kinds import OwnScript, kind_of, load_kind
from llmd_supervisor.core.run.lifecycle import new_run
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.errors import SpecError
from tests.postgres import PgServer, lead_for_tests

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STAMP = T0.isoformat(timespec="microseconds")


def _foreign(kind: str, **extra: object) -> str:
    body = {"kind": kind, "script": "#!/bin/bash\n", "env": {"kind": "adopt"}, **extra}
    return json.dumps({"foreign": body}, indent=1, sort_keys=True) + "\n"


# run id -> (stored spec text, the kind step 10 fills in)
ROWS = {
    "r-spec": ('[run]\nname = "demo"\n', "spec"),
    "r-script": (_foreign("script"), "script"),  # its env's "kind" is not the spec's
    "r-adopt": (_foreign("adopt", job_id="4711"), "adopted"),
    "r-spaced": ("\n \t" + _foreign("adopt", job_id="4712"), "adopted"),
    "r-broken": ('{"foreign": {"kind": "adopt"', "script"),
}


def _row(run_id: str, text: str) -> tuple[object, ...]:
    return (
        *(run_id, f"llmd-{run_id}", "accepted", 1, None, "[]", 0, None, "", 1000, "dev"),
        *(text, "", "/shared/r", "/archive/r", STAMP, STAMP, 1),
    )


INSERT = (
    "INSERT INTO runs (run_id, job_name, state, attempt, slurm_job_id, nodes, "
    "cancel_requested, outcome, reason, owner_uid, cluster, spec_toml, script, log_dir, "
    "archive_dir, created_at, updated_at, submission) VALUES "
)


async def _kinds(journal: Journal) -> dict[str, str]:
    return {s.run.run_id: s.meta.kind for s in await journal.list_runs()}


def _sqlite_version_9(path: Path) -> dict[object, object]:
    """A version-9 SQLite journal holding `ROWS`; each run's ``changed``."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        for statement in (s for step in MIGRATIONS[:9] for s in step):
            conn.execute(statement)
        for run_id, (text, _) in ROWS.items():
            conn.execute(INSERT + "(" + ", ".join("?" * 18) + ")", _row(run_id, text))
        changed = dict(conn.execute("SELECT run_id, changed FROM runs").fetchall())
        conn.execute("PRAGMA user_version = 9")
        conn.execute("COMMIT")
    return changed


def _sqlite_after(path: Path) -> tuple[int, dict[object, object]]:
    with closing(sqlite3.connect(path)) as conn:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        query = "SELECT run_id, changed FROM runs WHERE run_id != 'r-new'"
        return version, dict(conn.execute(query).fetchall())


@pytest.mark.asyncio
async def test_a_version_9_sqlite_journal_gets_each_run_s_kind(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    changed = await anyio.to_thread.run_sync(_sqlite_version_9, path)
    async with await Journal.open(path) as journal:
        assert await _kinds(journal) == {k: v[1] for k, v in ROWS.items()}
        run = new_run("r-new", "llmd-r-new", T0)
        meta = RunMeta(1000, "dev", _foreign("script"), "", "/l", "/a", T0, kind="script")
        await journal.insert_run(run, meta)
        stored = await journal.get("r-new")
        assert stored is not None and stored.meta.kind == "script"
    version, again = await anyio.to_thread.run_sync(_sqlite_after, path)
    assert version == len(MIGRATIONS) == 10
    assert again == changed  # the fill is not a change of the runs: nothing new to read


def _superuser(postgres: PgServer, dbname: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(
        host=str(postgres.base), port=postgres.port, user="postgres", dbname=dbname
    )


def _postgres_version_9(postgres: PgServer, dbname: str) -> dict[object, object]:
    """A version-9 PostgreSQL journal holding `ROWS` (made by the journal's role, the rows
    written past the fence: no lease yet); each run's ``changed``."""
    with closing(_superuser(postgres, dbname)) as conn:
        conn.execute("SET ROLE llmd")
        conn.execute(SCHEMA_VERSION_TABLE_DDL)
        for statement in (s for step in POSTGRES_MIGRATIONS[:9] for s in step):
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version (one, version) VALUES (TRUE, 9)")
        conn.execute("RESET ROLE")
        conn.execute("SET session_replication_role = replica")
        for run_id, (text, _) in ROWS.items():
            conn.execute(INSERT + "(" + ", ".join(["%s"] * 18) + ")", _row(run_id, text))
        rows = conn.execute("SELECT run_id, changed FROM runs").fetchall()
        conn.commit()
    return {row[0]: row[1] for row in rows}


def _postgres_after(postgres: PgServer, dbname: str) -> tuple[object, ...]:
    """The schema version, each old run's ``changed``, the runs' triggers and whether the
    migration's helper function is left."""
    with closing(_superuser(postgres, dbname)) as conn:
        version = conn.execute("SELECT version FROM schema_version").fetchall()
        query = "SELECT run_id, changed FROM runs WHERE run_id != 'r-new'"
        changed = {row[0]: row[1] for row in conn.execute(query).fetchall()}
        triggers = conn.execute(
            "SELECT tgname, tgenabled FROM pg_trigger WHERE tgrelid = 'runs'::regclass "
            "AND NOT tgisinternal ORDER BY tgname"
        ).fetchall()
        left = conn.execute("SELECT proname FROM pg_proc WHERE proname LIKE 'llmd_kind%'")
        return version, changed, triggers, left.fetchall()


@pytest.mark.asyncio
async def test_a_version_9_postgresql_journal_gets_each_run_s_kind(postgres: PgServer) -> None:
    dbname = await anyio.to_thread.run_sync(postgres.new_database)
    changed = await anyio.to_thread.run_sync(_postgres_version_9, postgres, dbname)
    async with await Journal.open_postgres(postgres.journal_config(dbname)) as journal:
        assert await _kinds(journal) == {k: v[1] for k, v in ROWS.items()}
        await lead_for_tests(journal, "dev")
        run = new_run("r-new", "llmd-r-new", T0)
        meta = RunMeta(1000, "dev", _foreign("adopt"), "", "/l", "/a", T0, kind="adopted")
        await journal.insert_run(run, meta)  # the fence is back on, and lets the leader by
        stored = await journal.get("r-new")
        assert stored is not None and stored.meta.kind == "adopted"
    after = await anyio.to_thread.run_sync(_postgres_after, postgres, dbname)
    assert after == (
        [(10,)],
        changed,  # the fill is not a change of the runs: nothing new to read
        [("runs_changed", "O"), ("runs_fence", "O")],  # on again
        [],  # the helper is dropped
    )


def test_a_kind_is_loaded_from_its_column_and_refused_when_the_text_is_another_s() -> None:
    text = ROWS["r-adopt"][0].replace('"env": {\n  "kind": "adopt"\n },', '"env": {},')
    spec = foreign_spec.load(
        json.dumps(
            {
                "foreign": {
                    "kind": "script",
                    "script": "#!/bin/bash\ntrue\n",
                    "script_name": "job.sh",
                    "log_dir": "/shared/logs",
                    "logs": [],
                    "marker": None,
                    "results": [],
                }
            }
        )
    )
    kind = kind_of(spec)
    assert isinstance(kind, OwnScript) and kind.column == "script"
    assert load_kind("script", foreign_spec.dump(spec)) == kind
    with pytest.raises(SpecError, match="kind"):
        load_kind("adopted", foreign_spec.dump(spec))
    with pytest.raises(SpecError, match="kind"):
        load_kind("nonsense", text)
