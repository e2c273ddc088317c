"""The run journal on PostgreSQL (``[journal] url``; `core.journal.url` parses the table).

The stores' transaction functions are the SQLite journal's, run on a connection of
psycopg's thread-safe pool in a worker thread (`adapters.journal.db` says why this and
not psycopg's async API). This module owns what differs:

- Connecting: the password is read from ``journal.password_file`` (not followed if it is
  a link; refused unless it is a regular file of this account or root, mode 0600 or
  stricter), never from the URL; libpq's keepalives, ``tcp_user_timeout`` and
  ``connect_timeout`` come from `core.journal.url.LINK_SETTINGS`, and every session
  gets a ``statement_timeout`` and an ``idle_in_transaction_session_timeout``. The
  pool checks a connection before lending it, so one the server dropped (a restart, a
  cut link) is replaced instead of failing the next write.
- Transactions: a write is ``BEGIN ISOLATION LEVEL SERIALIZABLE`` ... ``COMMIT``, the
  equivalent of SQLite's ``BEGIN IMMEDIATE``: the stores' read-check-write steps
  (compare-and-set of a run's state, a run id taken) stay correct when another
  connection (another daemon, `journal migrate`) writes at the same time. A
  serialization failure or deadlock rolls back and runs the function again (it has no
  effect outside the transaction), up to `MAX_TRIES` times. Writes of one journal are
  also serialised in the process (as on SQLite), so they rarely conflict with each
  other. A read is ``REPEATABLE READ, READ ONLY``: one snapshot, and a store function
  that writes in a read fails.
- The schema: `core.journal.schema_versions.plan` decides; the steps of
  `adapters.journal.schema.POSTGRES_MIGRATIONS` are applied in ONE transaction under
  ``pg_advisory_xact_lock(MIGRATION_LOCK_KEY)``, reading the version again under the
  lock, so two daemons starting together migrate once. A schema newer than this code is
  refused (`errors.JournalSchemaTooNew`) and left untouched.
- Errors: psycopg's and the pool's become JournalError naming the URL (it never holds a
  password) and the operation, with the SQLSTATE. A connection lost during COMMIT is an
  error whose outcome is unknown; the caller re-reads, as after a cancellation.

Fencing (`core.ha.fencing`; leadership itself is `core.ha.lease` and `adapters.journal.lease_pg`):
schema version 7 puts the fence trigger on every journal table, and every write
transaction states its writer (`core.ha.fencing.SET_WRITER_SQL`, right after the ``BEGIN``
of `_transaction`), so no store function changes. The writer is resolved on the event
loop when the write's turn comes: the writing task's `adapters.journal.writer.writing_as`
source, else the journal's default (`PostgresBackend.set_default_writer`), else none, and
a write without a writer is refused (fails closed). Reads state none and need none. The
fence's refusals (SQLSTATE ``LD001`` stale epoch, ``LD002`` no epoch, ``LD003`` a row of
another cluster than the writer's) roll the whole
transaction back, are never retried, and become `errors.FencedWrite` (`fenced_write`),
counted (`PostgresBackend.fenced_refusals`) and logged (``journal.write_fenced``). The
schema migration states no writer either: its steps create tables and triggers, which
fire no row trigger; a later step that writes rows of a fenced table must disable that
table's trigger around it (`adapters.journal.schema`).

Cancellation is the SQLite journal's: a task cancelled while it waits for its turn does
nothing; once its transaction runs in the worker thread it runs to its end (commit or
rollback) and the cancellation is delivered afterwards.

psycopg is imported in the worker threads only: importing it takes long enough to stall
the event loop, and a daemon on SQLite never imports it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar

import anyio
import anyio.to_thread
import structlog

from llmd_supervisor.adapters.journal.db import Db, PostgresDb, Row
from llmd_supervisor.adapters.journal.schema import POSTGRES_MIGRATIONS
from llmd_supervisor.adapters.journal.writer import WriterSource, current_writer
from llmd_supervisor.core.ha.fencing import (
    NO_EPOCH_SQLSTATE,
    SET_WRITER_SQL,
    STALE_EPOCH_SQLSTATE,
    WRONG_CLUSTER_SQLSTATE,
    Writer,
)
from llmd_supervisor.core.journal.schema_versions import (
    CODE_VERSION,
    MIGRATION_LOCK_KEY,
    SCHEMA_VERSION_TABLE_DDL,
    Apply,
    Refuse,
    plan,
)
from llmd_supervisor.core.journal.url import PostgresJournal, password_file_problem
from llmd_supervisor.errors import ConfigError, FencedWrite, JournalError, JournalSchemaTooNew

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

__all__ = ["MAX_TRIES", "PostgresBackend", "PostgresSettings", "fenced_write", "read_password"]

_T = TypeVar("_T")

log = structlog.get_logger("llmd_supervisor.adapters.journal_pg")

MAX_TRIES: Final = 8  # of one write transaction that keeps failing to serialise
_PASSWORD_MAX: Final = 4096
# SQLSTATEs after which the transaction is run again: nothing of it was committed.
_RETRY_SQLSTATES: Final = ("40001", "40P01")  # serialization_failure, deadlock_detected
# The fence's refusals (core.ha.fencing): never retried, errors.FencedWrite.
_FENCE_SQLSTATES: Final = (STALE_EPOCH_SQLSTATE, NO_EPOCH_SQLSTATE, WRONG_CLUSTER_SQLSTATE)
_PASSWORD_KEY: Final = "journal.password_file"

assert len(POSTGRES_MIGRATIONS) == CODE_VERSION, "POSTGRES_MIGRATIONS and schema_versions"


@dataclass(frozen=True)
class PostgresSettings:
    """How the journal uses its connections (the daemon's defaults)."""

    pool_size: int = 4  # connections; writes take one at a time, reads the others
    wait_s: float = 10.0  # for a connection of the pool, then the operation fails
    statement_timeout_s: float = 30.0  # 0: none (`journal migrate` copies big tables)
    idle_in_transaction_s: float = 60.0  # a session stuck inside a transaction is ended


def read_password(path: str, service_uid: int | None = None) -> str:
    """The password in `path` (its first line), after checking the file as libpq checks
    ``.pgpass``; ConfigError naming the path and the fix otherwise."""
    uid = os.geteuid() if service_uid is None else service_uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(
            _PASSWORD_KEY, path, f"{path} does not exist; create it with the role's password"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):  # O_NOFOLLOW met a link
            raise ConfigError(
                _PASSWORD_KEY,
                path,
                f"{path} is a symbolic link; the daemon does not follow links for the"
                f" password file: point {_PASSWORD_KEY} at the real file"
                f" ({os.path.realpath(path)})",
            ) from None
        raise ConfigError(
            _PASSWORD_KEY,
            path,
            f"{path} cannot be opened ({exc.strerror}); it must be a regular file, not a "
            "link, readable by the daemon's account",
        ) from None
    try:
        st = os.fstat(fd)
        problem = password_file_problem(path, st.st_mode, st.st_uid, uid)
        if problem is not None:
            raise ConfigError(_PASSWORD_KEY, path, problem)
        data = os.read(fd, _PASSWORD_MAX + 1)
    finally:
        os.close(fd)
    if stat.S_ISREG(st.st_mode) and len(data) > _PASSWORD_MAX:
        raise ConfigError(_PASSWORD_KEY, path, f"{path} is larger than a password can be")
    try:
        password = data.decode("utf-8").split("\n", 1)[0].rstrip("\r")
    except UnicodeDecodeError:
        raise ConfigError(_PASSWORD_KEY, path, f"{path} is not UTF-8 text") from None
    if not password:
        raise ConfigError(_PASSWORD_KEY, path, f"{path} is empty; write the password in it")
    return password


def connect_params(
    config: PostgresJournal, settings: PostgresSettings, password: str | None
) -> dict[str, str]:
    """libpq's connection keywords: the URL's, the link settings, the session timeouts
    and the password."""
    params = config.conninfo()
    params["options"] = (
        f"-c statement_timeout={round(settings.statement_timeout_s * 1000)} "
        f"-c idle_in_transaction_session_timeout={round(settings.idle_in_transaction_s * 1000)}"
    )
    if password is not None:
        params["password"] = password
    return params


class PostgresBackend:
    """The journal's transactions on a PostgreSQL pool (`adapters.journal.store.Backend`)."""

    def __init__(
        self, config: PostgresJournal, pool: ConnectionPool[psycopg.Connection[Row]], size: int
    ) -> None:
        self._config = config
        self._pool: ConnectionPool[psycopg.Connection[Row]] | None = pool
        self._threads = anyio.CapacityLimiter(size)  # one per connection
        self._writes = anyio.Lock()  # this journal's writes, one at a time
        self._default_writer: WriterSource | None = None
        self._fenced_refusals = 0

    @property
    def location(self) -> str:
        return self._config.url

    @property
    def fenced_refusals(self) -> int:
        """How many write transactions the fence refused (`errors.FencedWrite`)."""
        return self._fenced_refusals

    def set_default_writer(self, source: WriterSource | None) -> None:
        """Who writes when the writing task states no source of its own
        (`adapters.journal.writer`); None: nobody, every such write is refused."""
        self._default_writer = source

    @classmethod
    async def open(
        cls, config: PostgresJournal, settings: PostgresSettings | None = None
    ) -> PostgresBackend:
        """Connect, create or migrate the schema, and open the pool.

        Raises ConfigError for an unusable password file, JournalSchemaTooNew for a
        schema newer than this code, and JournalError when the database cannot be
        reached or the migration fails (nothing of it is applied then).
        """
        s = settings or PostgresSettings()
        with anyio.CancelScope(shield=True):
            pool, before, after = await anyio.to_thread.run_sync(_open_sync, config, s)
        if before != after:
            log.info("journal.migrated", journal=config.url, from_version=before, to_version=after)
        return cls(config, pool, s.pool_size)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._writes.acquire()
            try:
                pool, self._pool = self._pool, None
                if pool is not None:
                    await anyio.to_thread.run_sync(pool.close, 5.0, limiter=self._threads)
            finally:
                self._writes.release()

    async def run(self, operation: str, fn: Callable[[Db], _T], *, write: bool) -> _T:
        if not write:
            return await anyio.to_thread.run_sync(
                self._run_sync, operation, fn, False, None, limiter=self._threads
            )
        async with self._writes:
            # Once it is this write's turn, on the event loop: the writer as it is now
            # (a leader that stopped acting while the write waited states no epoch).
            writer = current_writer(self._default_writer)
            try:
                return await anyio.to_thread.run_sync(
                    self._run_sync, operation, fn, True, writer, limiter=self._threads
                )
            except FencedWrite as exc:
                self._fenced_refusals += 1
                log.warning(
                    "journal.write_fenced",
                    journal=self.location,
                    cluster=exc.cluster,
                    writer_epoch=exc.writer_epoch,
                    lease_epoch=exc.lease_epoch,
                    row_cluster=exc.row_cluster,
                    operation=operation,
                )
                raise

    def _run_sync(
        self, operation: str, fn: Callable[[Db], _T], write: bool, writer: Writer | None
    ) -> _T:
        import psycopg
        from psycopg_pool import PoolTimeout

        pool = self._pool
        if pool is None:
            raise JournalError(self.location, operation, "the journal is closed")
        begin = (
            "BEGIN ISOLATION LEVEL SERIALIZABLE"
            if write
            else "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
        )
        try:
            with pool.connection() as conn:
                for attempt in range(1, MAX_TRIES + 1):
                    try:
                        return _transaction(conn, begin, fn, writer)
                    except psycopg.Error as exc:
                        if exc.sqlstate not in _RETRY_SQLSTATES or attempt == MAX_TRIES:
                            raise
                        log.debug(
                            "journal.retry",
                            journal=self.location,
                            operation=operation,
                            attempt=attempt,
                            sqlstate=exc.sqlstate,
                        )
                        time.sleep(random.uniform(0, min(0.2, 0.002 * 2**attempt)))  # jittered
                raise AssertionError("unreachable: the last try returns or raises")
        except PoolTimeout as exc:
            raise JournalError(
                self.location, operation, f"no database connection was free or could be made: {exc}"
            ) from exc
        except psycopg.Error as exc:
            if exc.sqlstate in _FENCE_SQLSTATES:
                raise fenced_write(self.location, writer, exc) from exc
            raise pg_error(self.location, operation, exc) from exc


def _transaction(
    conn: psycopg.Connection[Row],
    begin: str,
    fn: Callable[[Db], _T],
    writer: Writer | None = None,
) -> _T:
    """Run ``fn`` in one transaction on `conn` (autocommit: we issue BEGIN/COMMIT),
    stating `writer` to the fence first when there is one (`core.ha.fencing`)."""
    import psycopg.pq

    conn.execute(begin)
    try:
        if writer is not None and writer.cluster and writer.epoch is not None:
            # Directly on the connection: SET_WRITER_SQL's parameters are psycopg's.
            conn.execute(SET_WRITER_SQL, {"cluster": writer.cluster, "epoch": str(writer.epoch)})
        result = fn(PostgresDb(conn))
        conn.execute("COMMIT")
    except BaseException:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE and not conn.broken:
            # The original error is the one worth reporting; the pool drops a broken conn.
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        raise
    return result


def fenced_write(location: str, writer: Writer | None, exc: psycopg.Error) -> FencedWrite:
    """The fence's refusal (SQLSTATE `core.ha.fencing.STALE_EPOCH_SQLSTATE`,
    `NO_EPOCH_SQLSTATE` or `WRONG_CLUSTER_SQLSTATE`) as FencedWrite: the cluster is the
    writer's, the epochs (and the row's cluster) are the trigger's DETAIL's
    (``cluster=%s writer_epoch=%s lease_epoch=%s [row_cluster=%s]``; None when empty,
    and both None when the transaction stated no writer, which has no DETAIL)."""
    fields: dict[str, str] = {}
    for part in (exc.diag.message_detail or "").split():
        key, sep, value = part.partition("=")
        if sep:
            fields[key] = value
    cluster = writer.cluster if writer is not None and writer.cluster else fields.get("cluster")
    row_cluster = fields.get("row_cluster") if exc.sqlstate == WRONG_CLUSTER_SQLSTATE else None
    return FencedWrite(
        location,
        cluster or "",
        _epoch(fields.get("writer_epoch")),
        _epoch(fields.get("lease_epoch")),
        row_cluster,
    )


def _epoch(text: str | None) -> int | None:
    try:
        return None if not text else int(text)
    except ValueError:
        return None


def pg_error(location: str, operation: str, exc: BaseException) -> JournalError:
    """A psycopg error as a JournalError naming the database and the operation."""
    sqlstate = getattr(exc, "sqlstate", None)
    text = " ".join(str(exc).split()) or type(exc).__name__
    detail = f"{text} (SQLSTATE {sqlstate})" if sqlstate else text
    return JournalError(location, operation, detail)


def _open_sync(
    config: PostgresJournal, settings: PostgresSettings
) -> tuple[ConnectionPool[psycopg.Connection[Row]], int, int]:
    try:
        import psycopg
        from psycopg.conninfo import make_conninfo
        from psycopg_pool import ConnectionPool, PoolTimeout
    except ImportError as exc:
        raise JournalError(
            config.url,
            "be opened",
            f"{exc.name or 'psycopg'} is not installed; install the PostgreSQL extra into the "
            "daemon's environment (pip install 'llmd-supervisor[postgresql]', or "
            "'psycopg[binary]>=3.3.6' 'psycopg-pool>=3.2')",
        ) from exc

    password = None if config.password_file is None else read_password(config.password_file)
    params = connect_params(config, settings, password)
    # One connection first: its error says why the database cannot be reached (the
    # pool's would only say it timed out), and it migrates the schema.
    try:
        with psycopg.connect(make_conninfo("", **params), autocommit=True) as conn:
            before, after = migrate_sync(conn, config.url)
    except psycopg.Error as exc:
        raise pg_error(config.url, "connect and check the schema", exc) from exc
    pool: ConnectionPool[psycopg.Connection[Row]] = ConnectionPool(
        "",
        kwargs={**params, "autocommit": True},
        min_size=1,
        max_size=settings.pool_size,
        timeout=settings.wait_s,
        check=ConnectionPool.check_connection,
        name="llmd-journal",
        open=False,
    )
    try:
        pool.open(wait=True, timeout=settings.wait_s)
    except PoolTimeout as exc:
        pool.close(timeout=1.0)
        raise JournalError(
            config.url, "open its connection pool", f"no connection within {settings.wait_s:g} s"
        ) from exc
    return pool, before, after


def schema_version(db: Db) -> int:
    """The version the ``schema_version`` table holds (0: no table, an empty database)."""
    exists = db.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
    if exists is None or not exists[0]:
        return 0
    row = db.execute("SELECT version FROM schema_version").fetchone()
    return 0 if row is None else int(row[0])


def migrate_sync(conn: psycopg.Connection[Row], location: str) -> tuple[int, int]:
    """Bring the schema to this code's version in one transaction under the migration
    lock; (version before, version after). JournalSchemaTooNew for a newer schema."""

    def work(db: Db) -> tuple[int, int]:
        db.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK_KEY,))
        version = schema_version(db)  # under the lock: another daemon may have migrated
        decision = plan(version)
        if isinstance(decision, Refuse):
            if version > CODE_VERSION:
                raise JournalSchemaTooNew(location, version, CODE_VERSION)
            raise JournalError(location, "check the schema", decision.why)
        if not isinstance(decision, Apply):
            return version, version
        if version == 0:
            db.execute(SCHEMA_VERSION_TABLE_DDL)
        for step in decision.steps:
            for statement in POSTGRES_MIGRATIONS[step - 1]:
                db.execute(statement)
        db.execute(
            "INSERT INTO schema_version (one, version) VALUES (TRUE, ?) "
            "ON CONFLICT (one) DO UPDATE SET version = excluded.version",
            (decision.to_version,),
        )
        return version, decision.to_version

    return _transaction(conn, "BEGIN", work)


def table_counts(db: Db, tables: Sequence[str]) -> dict[str, int]:
    """How many rows each of `tables` (the journal's own names) holds."""
    out: dict[str, int] = {}
    for table in tables:
        row = db.execute(f"SELECT count(*) FROM {table}").fetchone()
        out[table] = 0 if row is None else int(row[0])
    return out
