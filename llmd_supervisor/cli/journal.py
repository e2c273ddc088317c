"""``llmd-supervisor journal migrate --from sqlite PATH --to URL``: copy a daemon's SQLite
journal into a PostgreSQL database (README.md, "A PostgreSQL journal").

The SQLite file is opened as the daemon opens it (brought to this version's schema if it
is older) and read in one snapshot; the PostgreSQL schema is created or migrated
(`adapters.journal.pg`); then every table is copied in ONE PostgreSQL transaction, so
the target holds all of the journal or none of it. A target that already holds rows is
refused unless ``--replace`` is given (its rows are deleted in the same transaction).
Stop the daemon first: what it writes after the snapshot is not copied.

The target's fence (`core.ha.fencing`) accepts only the writes of a cluster's current
leader, so the copy leads a pseudo cluster of its own, `MIGRATE_CLUSTER`: it acquires
that cluster's lease (`core.ha.lease.ACQUIRE_SQL`, holder naming the host and the process),
copies as its writer, and releases the lease at the end (best effort: it expires after
`core.ha.lease.LEASE_S` anyway). A second copy into the same database started meanwhile
finds the lease held and copies nothing, or, once the lease expired, takes it over, and
the first copy is then refused as a whole.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import anyio

from llmd_supervisor.adapters.journal.db import Db, PostgresDb, Row, SqliteDb
from llmd_supervisor.adapters.journal.pg import PostgresSettings, table_counts
from llmd_supervisor.adapters.journal.schema import TABLES
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.core.ha.fencing import Writer
from llmd_supervisor.core.ha.lease import ACQUIRE_SQL, LEASE_S, LEASE_TABLE, RELEASE_SQL
from llmd_supervisor.core.journal.url import PostgresJournal, parse_journal
from llmd_supervisor.errors import ConfigError, ConfigErrors, JournalError

__all__ = ["IDENTITY_COLUMNS", "MIGRATE_CLUSTER", "add_parsers", "copy_journal"]

_PROG = "llmd-supervisor journal migrate"
# PostgreSQL's generated columns, copied with their SQLite values; their sequences are
# moved past the largest copied value so that new rows do not collide.
IDENTITY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("runs", "rowid"),
    ("events", "id"),
    ("node_failures", "id"),
)

# The pseudo cluster whose lease a copy holds, to write past the target's fence.
MIGRATE_CLUSTER = "@journal-migrate"  # core.ha.fencing.MAINTENANCE_PREFIX: every row

# table -> (columns, rows)
Dump = Mapping[str, tuple[tuple[str, ...], list[Row]]]


def add_parsers(sub: argparse._SubParsersAction[Any]) -> None:
    top = sub.add_parser(
        "journal",
        help="the daemon's journal: copy it from SQLite to PostgreSQL",
        description="The daemon's journal. See README.md, A PostgreSQL journal.",
    )
    jsub = top.add_subparsers(dest="journal_op", metavar="OP", required=True)
    p = jsub.add_parser(
        "migrate",
        help="copy an SQLite journal into a PostgreSQL database",
        description=(
            "Copy every table of an SQLite journal into a PostgreSQL journal in one "
            "transaction and print the rows copied per table. Stop the daemon first. The "
            "target's schema is created (or migrated) first; a target that already holds "
            "rows is refused unless --replace is given."
        ),
    )
    p.add_argument(
        "--from",
        dest="source",
        nargs=2,
        metavar=("sqlite", "PATH"),
        required=True,
        help="the SQLite journal (the daemon's STATE_DIR/journal.sqlite3)",
    )
    p.add_argument(
        "--to",
        dest="target",
        metavar="URL",
        required=True,
        help="postgresql://USER@HOST[:PORT]/DBNAME, as [journal] url in the daemon config "
        "(no password in it)",
    )
    p.add_argument(
        "--password-file",
        default=None,
        metavar="FILE",
        help="the role's password (mode 0600), as [journal] password_file",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="delete what the target journal holds, in the same transaction as the copy",
    )
    p.set_defaults(handler=_cmd_migrate)


def _cmd_migrate(args: argparse.Namespace) -> int:
    kind, source = args.source
    if kind != "sqlite":
        print(f"{_PROG}: --from {kind}: only 'sqlite' journals can be copied", file=sys.stderr)
        return 2
    path = Path(source)
    if not path.is_file():
        print(f"{_PROG}: {path} is not a file; name the SQLite journal", file=sys.stderr)
        return 2
    table: dict[str, object] = {"url": args.target}
    if args.password_file is not None:
        table["password_file"] = args.password_file
    try:
        target = parse_journal(table)
    except ConfigErrors as many:
        for problem in many.problems:
            print(f"{_PROG}: {problem}", file=sys.stderr)
        return 2
    if not isinstance(target, PostgresJournal):  # parse_journal with a url
        print(f"{_PROG}: --to must be a postgresql:// URL", file=sys.stderr)
        return 2
    try:
        counts = anyio.run(copy_journal, path, target, args.replace)
    except (JournalError, ConfigError) as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    width = max(len(t) for t in counts)
    for name, n in counts.items():
        print(f"{name:<{width}}  {n}")
    print(f"copied {sum(counts.values())} rows from {path} to {target.url}")
    return 0


async def copy_journal(source: Path, target: PostgresJournal, replace: bool) -> dict[str, int]:
    """Copy the SQLite journal at `source` into `target` in one transaction; the rows
    copied per table. JournalError (nothing copied) when the target holds rows and not
    `replace`, or on any database error."""
    async with await Journal.open(source) as journal:
        dump = await journal.read(f"read {source} to copy it", _dump)
    settings = PostgresSettings(pool_size=1, statement_timeout_s=0)
    async with await Journal.open_postgres(target, settings) as journal:
        holder = f"journal-migrate@{socket.gethostname()}:{os.getpid()}"
        writer = await _acquire(journal, holder)
        try:
            journal.set_default_writer(lambda: writer)
            operation = f"copy the SQLite journal {source}"
            where = journal.location
            return await journal.write(operation, lambda db: _load(db, dump, replace, where))
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(JournalError):
                await _release(journal, holder, writer)


async def _acquire(journal: Journal, holder: str) -> Writer:
    """`MIGRATE_CLUSTER`'s lease for `holder`, as the copy's writer; JournalError when
    another copy holds it."""

    def acquire(db: Db) -> tuple[int | None, str | None]:
        conn = cast(PostgresDb, db).conn  # core.ha.lease's SQL has psycopg's parameters
        params = {"cluster": MIGRATE_CLUSTER, "holder": holder, "lease_s": LEASE_S}
        won = conn.execute(ACQUIRE_SQL, params).fetchone()
        if won is not None:
            return int(won[0]), None
        held = conn.execute(
            f"SELECT holder FROM {LEASE_TABLE} WHERE cluster = %(cluster)s", params
        ).fetchone()
        return None, None if held is None else str(held[0])

    # The lease table is not fenced: acquiring needs no writer.
    operation = f"hold the {MIGRATE_CLUSTER} lease"
    epoch, other = await journal.write(operation, acquire)
    if epoch is None:
        raise JournalError(
            journal.location,
            operation,
            f"another journal migrate ({other}) is copying into this database; nothing was "
            f"copied. Wait for it to end (or {LEASE_S:g} s after it died) and run this again",
        )
    return Writer(MIGRATE_CLUSTER, epoch)


async def _release(journal: Journal, holder: str, writer: Writer) -> None:
    def release(db: Db) -> None:
        conn = cast(PostgresDb, db).conn
        conn.execute(
            RELEASE_SQL, {"cluster": MIGRATE_CLUSTER, "holder": holder, "epoch": writer.epoch}
        )

    await journal.write(f"release the {MIGRATE_CLUSTER} lease", release)


def _dump(db: Db) -> Dump:
    conn = cast(SqliteDb, db).conn
    out: dict[str, tuple[tuple[str, ...], list[Row]]] = {}
    for table in TABLES:
        columns = tuple(str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})"))
        if table == "runs":
            columns = ("rowid", *columns)
        rows = conn.execute(f"SELECT {', '.join(columns)} FROM {table}").fetchall()
        out[table] = (columns, rows)
    return out


def _load(db: Db, dump: Dump, replace: bool, where: str) -> dict[str, int]:
    operation = "copy the SQLite journal"
    held = {t: n for t, n in table_counts(db, TABLES).items() if n}
    if held and not replace:
        listed = ", ".join(f"{n} {t}" for t, n in held.items())
        raise JournalError(
            where,
            operation,
            f"the target journal already holds rows ({listed}); nothing was copied. Pass "
            "--replace to delete them and copy, or name an empty database",
        )
    for table in reversed(TABLES):  # children first
        db.execute(f"DELETE FROM {table}")
    for table in TABLES:
        columns, rows = dump[table]
        marks = ", ".join("?" * len(columns))
        db.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", rows)
    for table, column in IDENTITY_COLUMNS:
        db.execute(
            f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'), max({column})) "
            f"FROM {table}"
        )
    counts = table_counts(db, TABLES)
    wrong = [t for t in TABLES if counts[t] != len(dump[t][1])]
    if wrong:
        raise JournalError(
            where,
            operation,
            f"the copy of {', '.join(wrong)} does not hold as many rows as the source; "
            "nothing was copied",
        )
    return counts
