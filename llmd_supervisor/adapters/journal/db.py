"""The connection the journal's stores write their SQL against, for either backend.

Why a synchronous connection in a worker thread, for PostgreSQL too: every store
(`adapters.journal.store`, `adapters.journal.campaign_store`, `adapters.outbox.store`) is a set of
plain functions ``work(db: Db) -> T`` that the journal runs as one transaction in a
worker thread. PostgreSQL runs the SAME functions on a connection of psycopg's
thread-safe pool (`adapters.journal.pg`), so there is one copy of every statement and of
every check between them. psycopg's async API would have made every store function a
coroutine and needed an async SQLite (a thread per statement), or two copies of the
stores; here a transaction is one hop to a worker thread whichever the backend, the
event loop never waits on the database, and the pool still gives reconnection, health
checks and libpq's keepalives. (The lease of a later phase, which needs LISTEN/NOTIFY and
per-statement timeouts on the loop, can use psycopg's async connection on its own.)

The statements are written once, in the SQL both engines accept:

- ``?`` placeholders; `PostgresDb` turns them into psycopg's ``%s`` (and a literal ``%``
  into ``%%``). No statement holds a ``?`` or ``%`` inside a string literal.
- ``INSERT ... ON CONFLICT DO NOTHING`` and ``ON CONFLICT (key) DO UPDATE`` (SQLite
  3.24+), never ``INSERT OR IGNORE``/``OR REPLACE``; ``WHERE TRUE``, never ``WHERE 1``.
- Times are fixed-width UTC ISO 8601 text on both (``COLLATE "C"`` on PostgreSQL), so
  text order is time order and a row reads back the same from either.
- ``runs.rowid`` is SQLite's implicit row id, and an identity column of that name on
  PostgreSQL: insertion order breaks ties in the same way.

What differs (transactions, the schema's version, errors) is the backend's, not the
stores'.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import psycopg

__all__ = ["Db", "PostgresDb", "Row", "Rows", "SqliteDb"]

Row = tuple[Any, ...]


class Rows(Protocol):
    """A statement's result: its rows, and how many rows it changed."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Row | None: ...

    def fetchall(self) -> list[Row]: ...

    def __iter__(self) -> Iterator[Row]: ...


class Db(Protocol):
    """What a store's transaction function may do with the journal's connection.

    Errors of the driver propagate (the journal turns them into JournalError).
    """

    def execute(self, sql: str, params: Sequence[object] = ()) -> Rows:
        """Run one statement (``?`` placeholders) with `params`."""
        ...

    def executemany(self, sql: str, rows: Iterable[Sequence[object]]) -> int:
        """Run one statement once per row of `rows`; how many rows it changed in all."""
        ...


class SqliteDb:
    """`Db` on an sqlite3 connection (in the journal's worker thread)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn  # for the SQLite backend's own pragmas and tests

    def execute(self, sql: str, params: Sequence[object] = ()) -> Rows:
        return self.conn.execute(sql, tuple(params))

    def executemany(self, sql: str, rows: Iterable[Sequence[object]]) -> int:
        cur = self.conn.executemany(sql, (tuple(r) for r in rows))
        return max(cur.rowcount, 0)


class PostgresDb:
    """`Db` on a psycopg connection that the backend holds for one transaction."""

    def __init__(self, conn: psycopg.Connection[Row]) -> None:
        self.conn = conn

    def execute(self, sql: str, params: Sequence[object] = ()) -> Rows:
        return self.conn.execute(_postgres_sql(sql), tuple(params))

    def executemany(self, sql: str, rows: Iterable[Sequence[object]]) -> int:
        batch = [tuple(r) for r in rows]
        if not batch:
            return 0
        with self.conn.cursor() as cur:
            cur.executemany(_postgres_sql(sql), batch)
            return max(cur.rowcount, 0)


@functools.lru_cache(maxsize=512)
def _postgres_sql(sql: str) -> str:
    """`sql` with psycopg's placeholders (``?`` -> ``%s``, ``%`` -> ``%%``)."""
    return sql.replace("%", "%%").replace("?", "%s")
