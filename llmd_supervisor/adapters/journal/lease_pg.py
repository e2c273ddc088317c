"""A cluster's leadership lease on PostgreSQL: `core.ha.lease`'s statements, carried out.

`core.ha.lease` holds the rules and their SQL (`ACQUIRE_SQL`, `RENEW_SQL`, `RELEASE_SQL`);
this module only runs them and reports what the database said:

- `PostgresLease.acquire` -> `Won(epoch, expires_at)` or `Held(holder, expires_at)`;
- `PostgresLease.renew` -> the new ``expires_at``, or None when the renewal updated no
  row (the lease is someone else's: `core.ha.lease.RenewalLost`);
- `PostgresLease.release` -> whether a row was released (its NOTIFY is `RELEASE_SQL`'s);
- `PostgresLease.listen` -> calls back on every release notified for a cluster.

Every call is bounded by `core.ha.lease.STATEMENT_TIMEOUT_S` on the client (connecting
included) and by the same ``statement_timeout`` on the server; a timeout or any database
error is a `LeaseError`, and the connection is dropped and made again on the next call,
so a statement that never came back cannot hold up the next one.

Why psycopg's async connection here and not the journal's pool in a worker thread
(`adapters.journal.db`): a statement must be abandoned after 1.5 s even when the link is
half-open, which a blocked worker thread cannot be, and LISTEN needs a connection that
waits on the event loop. These are autocommit connections of their own (one for the
statements, one for LISTEN), with the journal's link settings and password file.

psycopg is imported in a worker thread on first use (importing it stalls the event loop
for longer than the tests allow, `adapters.journal.pg` does the same).

Cancellation: a call cancelled from outside drops its connection (its statement may or
may not have reached the database; the caller's state machine treats the row as unknown)
and raises the cancellation.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import structlog

from llmd_supervisor.adapters.journal.pg import PostgresSettings, connect_params, read_password
from llmd_supervisor.core.ha.lease import (
    ACQUIRE_EVERY_S,
    ACQUIRE_SQL,
    LEASE_NOTIFY_CHANNEL,
    LEASE_S,
    LEASE_TABLE,
    RELEASE_SQL,
    RENEW_SQL,
    STATEMENT_TIMEOUT_S,
)
from llmd_supervisor.core.journal.url import PostgresJournal
from llmd_supervisor.errors import LeaseError, SupervisorError

if TYPE_CHECKING:
    import psycopg

__all__ = ["Held", "PostgresLease", "Won"]

log = structlog.get_logger("llmd_supervisor.adapters.lease_pg")

_Row = tuple[Any, ...]
_T = TypeVar("_T")
_HOLDER_SQL: Final = f"SELECT holder, expires_at FROM {LEASE_TABLE} WHERE cluster = %(cluster)s"
_CLOSE_WITHIN_S: Final = 1.0


@dataclass(frozen=True)
class Won:
    """The acquisition wrote the row: this holder leads with ``epoch`` until ``expires_at``
    (the database's clock)."""

    epoch: int
    expires_at: datetime


@dataclass(frozen=True)
class Held:
    """The acquisition wrote nothing: the row names ``holder`` until ``expires_at``."""

    holder: str | None
    expires_at: datetime


_PSYCOPG_MODULES: Final = ("psycopg", "psycopg.conninfo", "psycopg.sql")


def _import_psycopg() -> None:
    for name in _PSYCOPG_MODULES:
        importlib.import_module(name)


async def _load_psycopg() -> None:
    """Import psycopg in a worker thread, once (afterwards a look in `sys.modules`)."""
    if not all(name in sys.modules for name in _PSYCOPG_MODULES):
        await anyio.to_thread.run_sync(_import_psycopg)


class PostgresLease:
    """The lease statements of one daemon on the shared journal's database."""

    def __init__(self, config: PostgresJournal, *, timeout_s: float = STATEMENT_TIMEOUT_S) -> None:
        self._config = config
        self._timeout_s = timeout_s
        self._params: dict[str, str] | None = None  # libpq keywords, password read once
        self._conn: psycopg.AsyncConnection[_Row] | None = None  # the statements' connection
        self._lock = anyio.Lock()  # one statement at a time on it

    @property
    def location(self) -> str:
        return self._config.url

    async def acquire(self, cluster: str, holder: str) -> Won | Held:
        """Try to take `cluster`'s lease for `holder` (`ACQUIRE_SQL`); LeaseError when the
        outcome is unknown."""
        params = {"cluster": cluster, "holder": holder, "lease_s": LEASE_S}

        async def work(conn: psycopg.AsyncConnection[_Row]) -> Won | Held:
            won = await (await conn.execute(ACQUIRE_SQL, params)).fetchone()
            if won is not None:
                return Won(int(won[0]), won[1])
            row = await (await conn.execute(_HOLDER_SQL, params)).fetchone()
            if row is None:  # deleted between the two statements: nothing to report
                raise LeaseError(self.location, cluster, "be acquired", "its row vanished")
            return Held(row[0], row[1])

        return await self._run(cluster, "be acquired", work)

    async def renew(self, cluster: str, holder: str, epoch: int) -> datetime | None:
        """Extend `holder`'s tenure `epoch` (`RENEW_SQL`): the new expiry, or None when no
        row was updated (the lease is no longer `holder`'s)."""
        params = {"cluster": cluster, "holder": holder, "epoch": epoch, "lease_s": LEASE_S}

        async def work(conn: psycopg.AsyncConnection[_Row]) -> datetime | None:
            row = await (await conn.execute(RENEW_SQL, params)).fetchone()
            return None if row is None else row[0]

        return await self._run(cluster, f"be renewed (epoch {epoch})", work)

    async def release(self, cluster: str, holder: str, epoch: int) -> bool:
        """Release `holder`'s tenure `epoch` and notify the standbys (`RELEASE_SQL`);
        False when the row was not `holder`'s with `epoch` any more."""
        params = {"cluster": cluster, "holder": holder, "epoch": epoch}

        async def work(conn: psycopg.AsyncConnection[_Row]) -> bool:
            return bool(await (await conn.execute(RELEASE_SQL, params)).fetchall())

        return await self._run(cluster, f"be released (epoch {epoch})", work)

    async def holder(self, cluster: str) -> Held | None:
        """Who holds `cluster`'s lease now and until when (None: no row); LeaseError when
        the database cannot say."""
        params = {"cluster": cluster}

        async def work(conn: psycopg.AsyncConnection[_Row]) -> Held | None:
            row = await (await conn.execute(_HOLDER_SQL, params)).fetchone()
            return None if row is None else Held(row[0], row[1])

        return await self._run(cluster, "be read", work)

    async def listen(
        self,
        cluster: str,
        on_release: Callable[[], None],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call `on_release` for every release of `cluster`'s lease the database notifies,
        until cancelled. Started once it listens, or once listening first failed: a lost
        connection is made again every `ACQUIRE_EVERY_S` (a notification missed meanwhile
        only delays a takeover to the standby's next attempt)."""
        await _load_psycopg()
        import psycopg

        started = False
        while True:
            conn: psycopg.AsyncConnection[_Row] | None = None
            try:
                with anyio.fail_after(self._timeout_s):
                    conn = await self._connect()
                    await conn.execute(
                        psycopg.sql.SQL("LISTEN {}").format(
                            psycopg.sql.Identifier(LEASE_NOTIFY_CHANNEL)
                        )
                    )
                if not started:
                    task_status.started()
                    started = True
                log.debug("lease.listening", cluster=cluster, journal=self.location)
                async for notify in conn.notifies():
                    if notify.payload == cluster:
                        on_release()
            except (psycopg.Error, TimeoutError, SupervisorError) as exc:
                log.warning(
                    "lease.listen_failed",
                    cluster=cluster,
                    journal=self.location,
                    error=_describe(exc, self._timeout_s),
                    retry_in_s=ACQUIRE_EVERY_S,
                )
            finally:
                if conn is not None:
                    await _close(conn)
            if not started:
                task_status.started()
                started = True
            await anyio.sleep(ACQUIRE_EVERY_S)

    async def aclose(self) -> None:
        """Close the statements' connection (a running `listen` ends with its task)."""
        async with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                await _close(conn)

    async def _run(
        self,
        cluster: str,
        operation: str,
        work: Callable[[psycopg.AsyncConnection[_Row]], Awaitable[_T]],
    ) -> _T:
        """Run `work` on the statements' connection within the timeout; LeaseError (the
        connection dropped) on a timeout, a database error or an unusable password file."""
        await _load_psycopg()
        import psycopg

        async with self._lock:
            done = False
            try:
                with anyio.fail_after(self._timeout_s):
                    if self._conn is None or self._conn.closed:
                        self._conn = await self._connect()
                    result = await work(self._conn)
                done = True
                return result
            except LeaseError:
                raise
            except (psycopg.Error, TimeoutError, SupervisorError) as exc:
                raise LeaseError(
                    self.location, cluster, operation, _describe(exc, self._timeout_s)
                ) from exc
            finally:
                if not done and self._conn is not None:
                    conn, self._conn = self._conn, None
                    await _close(conn)

    async def _connect(self) -> psycopg.AsyncConnection[_Row]:
        import psycopg
        from psycopg.conninfo import make_conninfo

        if self._params is None:
            self._params = await anyio.to_thread.run_sync(self._read_params)
        return await psycopg.AsyncConnection.connect(
            make_conninfo("", **self._params), autocommit=True
        )

    def _read_params(self) -> dict[str, str]:
        _import_psycopg()
        pf = self._config.password_file
        settings = PostgresSettings(statement_timeout_s=self._timeout_s)
        return connect_params(self._config, settings, None if pf is None else read_password(pf))


async def _close(conn: psycopg.AsyncConnection[_Row]) -> None:
    """Drop `conn` (shielded and bounded: it may be a cancelled statement's)."""
    with (
        anyio.CancelScope(shield=True),
        anyio.move_on_after(_CLOSE_WITHIN_S),
        contextlib.suppress(Exception),
    ):
        await conn.close()


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    sqlstate = getattr(exc, "sqlstate", None)
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{text} (SQLSTATE {sqlstate})" if sqlstate else text
