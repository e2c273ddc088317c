"""The daemon's run journal (DESIGN.md section 3): SQLite in the state directory (the
default), or a shared PostgreSQL database (`adapters.journal.pg`, ``[journal] url``).

Every operation is a function of one `adapters.journal.db.Db` run in a worker thread as
one transaction (that module says why, and which SQL both engines share), so the event
loop never waits on the database. The backend is chosen once, at `open_journal`, and the
journal and its stores never ask which one they have.

SQLite: one connection, used by one worker thread at a time (a dedicated
``CapacityLimiter(1)``), so every operation is serialised; the operations queued while
one runs go to the thread together, one transaction and one commit for all
(`adapters.journal.batch`), each in its own savepoint. The database is in WAL mode
with ``synchronous=FULL``: when a write method returns, the write is on disk and
survives a crash of the daemon or the machine.

Guarantees every public method keeps, on both backends:

- A write is one transaction: it is applied completely or not at all.
- Driver and OS errors (disk full, read-only file, corrupt database, a lost connection)
  surface as :class:`JournalError` naming the database (its path, or its URL, which
  never holds a password) and the operation.
- A schema newer than this code is refused at open, untouched
  (:class:`~llmd_supervisor.errors.JournalSchemaTooNew`, `core.journal.schema_versions`).
- Cancellation: a task cancelled while waiting for its turn does nothing. Once the
  operation has started in the worker thread it runs to its end (commit or rollback) and
  the cancellation is delivered afterwards, so a cancelled caller that needs to know
  whether its write landed re-reads the run.
- Times are stored as UTC ISO 8601 with microseconds and come back timezone-aware in UTC;
  naive datetimes are refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final, Protocol, TypeVar, cast

import anyio
import anyio.to_thread

from llmd_supervisor.adapters.journal.batch import Batches, Op
from llmd_supervisor.adapters.journal.db import Db, SqliteDb
from llmd_supervisor.adapters.journal.rows import (
    RUN_COLUMNS,
    RunMeta,
    StoredRun,
    check_consistent,
    decode_json,
    insert_transitions,
    iso,
    load_runs,
    load_transitions,
    parse_time,
    run_values,
    transition_rows,
)
from llmd_supervisor.adapters.journal.schema import MIGRATIONS
from llmd_supervisor.adapters.journal.writer import WriterSource
from llmd_supervisor.adapters.outbox.rows import insert_outgoing
from llmd_supervisor.core.events.outbox import Outgoing
from llmd_supervisor.core.journal.schema_versions import CODE_VERSION, Refuse, plan
from llmd_supervisor.core.journal.url import JournalBackend, PostgresJournal
from llmd_supervisor.core.run.lifecycle import Run, RunState
from llmd_supervisor.core.run.retry_policy import Evidence, NodeFailure
from llmd_supervisor.errors import JournalConflict, JournalError, JournalSchemaTooNew

if TYPE_CHECKING:
    from llmd_supervisor.adapters.journal.pg import PostgresSettings

__all__ = ["SCHEMA_VERSION", "Journal", "NewEvent", "RunMeta", "StoredRun", "open_journal"]

_T = TypeVar("_T")

BUSY_TIMEOUT_MS: Final = 10_000
_DIR_MODE: Final = 0o750
# Owner only: a run of `submit --script --export-env` keeps the client's environment here.
_FILE_MODE: Final = 0o600
_RESERVED_EVENT_KEYS: Final = frozenset({"at", "kind"})

SCHEMA_VERSION: Final = len(MIGRATIONS)
assert SCHEMA_VERSION == CODE_VERSION, "journal_schema.MIGRATIONS and schema_versions.VERSIONS"

_FINAL_STATES: Final = tuple(s.value for s in RunState if s.is_final)
_F_COLUMNS: Final = "cluster, node, owner_uid, run_id, attempt, evidence, reason, at"


def _failure(row: tuple[object, ...], where: str, operation: str) -> NodeFailure:
    cluster, node, owner_uid, run_id, attempt, evidence, reason, when = row
    try:
        kind = Evidence(str(evidence))
    except ValueError:
        raise JournalError(where, operation, f"a node failure has evidence {evidence!r}") from None
    return NodeFailure(
        str(cluster),
        str(node),
        int(str(owner_uid)),
        str(run_id),
        int(str(attempt)),
        kind,
        str(reason),
        parse_time(str(when), where, operation),
    )


class Backend(Protocol):
    """Where the journal's transactions run (SQLite here, PostgreSQL in `adapters.journal.pg`)."""

    @property
    def location(self) -> str:
        """The database for messages: a file's path, or a URL (never with a password)."""
        ...

    async def run(self, operation: str, fn: Callable[[Db], _T], *, write: bool) -> _T:
        """Run ``fn`` as one transaction (a write, or a read of one snapshot); driver
        errors as JournalError naming `location` and `operation`."""
        ...

    async def aclose(self) -> None:
        """Close (idempotent); later calls raise JournalError."""
        ...

    @property
    def fenced_refusals(self) -> int:
        """How many writes the fence refused (`core.ha.fencing`; always 0 on SQLite)."""
        ...

    def set_default_writer(self, source: WriterSource | None) -> None:
        """The writer of writes whose task states none (`adapters.journal.writer`);
        ignored by SQLite."""
        ...


async def open_journal(backend: JournalBackend, sqlite_path: Path) -> Journal:
    """The journal the daemon config names: SQLite at `sqlite_path` by default, or the
    PostgreSQL database of ``[journal] url`` (created or migrated either way)."""
    if isinstance(backend, PostgresJournal):
        return await Journal.open_postgres(backend)
    return await Journal.open(sqlite_path)


class Journal:
    """The run journal; create with :meth:`open` (SQLite), :meth:`open_postgres` or
    `open_journal`, end with :meth:`aclose`."""

    def __init__(self, backend: Backend, path: Path | None = None) -> None:
        self._backend = backend
        self._path = path

    @property
    def location(self) -> str:
        """The database, for messages: the SQLite file's path or the PostgreSQL URL."""
        return self._backend.location

    @property
    def fenced_refusals(self) -> int:
        """How many writes a shared journal's fence refused since it was opened
        (`errors.FencedWrite`, `core.ha.fencing`): stale writes rejected. 0 on SQLite."""
        return self._backend.fenced_refusals

    def set_default_writer(self, source: WriterSource | None) -> None:
        """Who writes (`core.ha.fencing.Writer`: cluster and lease epoch) when the writing
        task runs in no `adapters.journal.writer.writing_as`; ``source()`` is called as
        each write is handed to the database, and a write without a writer is refused by
        a PostgreSQL journal's fence. A no-op on SQLite (one daemon, no lease)."""
        self._backend.set_default_writer(source)

    @property
    def path(self) -> Path:
        """The SQLite database file (JournalError for a PostgreSQL journal)."""
        if self._path is None:
            raise JournalError(self.location, "name its file", "it is a PostgreSQL journal")
        return self._path

    # --- lifetime ---------------------------------------------------------------------------

    @classmethod
    async def open(cls, path: Path) -> Journal:
        """Open (creating it and its directory, mode 0o750, if needed) and migrate the
        SQLite journal at `path`.

        Raises JournalError when the file is not a usable SQLite database, WAL cannot be
        enabled, or its schema version is newer than this code knows (JournalSchemaTooNew).
        """
        return cls(await _SqliteBackend.open(path), path)

    @classmethod
    async def open_postgres(
        cls, config: PostgresJournal, settings: PostgresSettings | None = None
    ) -> Journal:
        """Connect to (and create or migrate the schema of) a PostgreSQL journal
        (`adapters.journal.pg.PostgresBackend.open` says what is checked)."""
        from llmd_supervisor.adapters.journal.pg import PostgresBackend

        return cls(await PostgresBackend.open(config, settings))

    async def aclose(self) -> None:
        """Close the connection (idempotent). Waits for a running operation to finish first."""
        await self._backend.aclose()

    async def __aenter__(self) -> Journal:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- runs -------------------------------------------------------------------------------

    async def insert_run(self, run: Run, meta: RunMeta, outgoing: Sequence[Outgoing] = ()) -> None:
        """Journal a new run with its transitions, and the outbound events they make
        (`core.events.outbox`) in the same transaction.

        Raises JournalConflict when a run with the same run id or job name exists.
        """
        operation = f"insert run {run.run_id}"
        check_consistent(self.location, operation, run)
        now = iso(datetime.now(UTC), self.location, operation)
        created = iso(meta.created_at, self.location, operation)
        transitions = transition_rows(run, 0, self.location, operation)

        def work(conn: Db) -> None:
            clash = conn.execute(
                "SELECT run_id, job_name FROM runs WHERE run_id = ? OR job_name = ?",
                (run.run_id, run.job_name),
            ).fetchone()
            if clash is not None:
                what = "run id" if clash[0] == run.run_id else f"job name {run.job_name!r}"
                raise JournalConflict(
                    self.location,
                    operation,
                    run.run_id,
                    f"the journal already holds run {clash[0]} with that {what}",
                )
            conn.execute(
                f"INSERT INTO runs ({RUN_COLUMNS}, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    *run_values(run)[:-1],
                    meta.owner_uid,
                    meta.cluster,
                    meta.spec_toml,
                    meta.script,
                    meta.log_dir,
                    meta.archive_dir,
                    created,
                    run.submission,
                    meta.kind,
                    now,
                ),
            )
            insert_transitions(conn, run.run_id, transitions)
            insert_outgoing(conn, outgoing, self.location, operation)

        await self._backend.run(operation, work, write=True)

    async def save(
        self,
        run: Run,
        *,
        expected: RunState,
        outgoing: Sequence[Outgoing] = (),
        events: Sequence[NewEvent] = (),
    ) -> None:
        """Compare-and-set: store ``run`` only if the stored run's state is ``expected``,
        with the outbound events its transition makes (`core.events.outbox`) and `events` for the
        run's event log (its ``run.transition``, as `add_event` would add them), in one
        transaction.

        The stored transitions must be a prefix of ``run.transitions`` (the new ones are
        appended), so a stale copy that happens to be in the same state (pending, requeued,
        pending again) is refused too. With ``expected == run.state`` this records non-state
        changes such as ``cancel_requested``. Raises JournalConflict (state or history
        mismatch, unknown run) and leaves the stored run untouched.
        """
        operation = f"save run {run.run_id}"
        check_consistent(self.location, operation, run)
        now = iso(datetime.now(UTC), self.location, operation)
        where = self.location
        rows = [self._event_row(run.run_id, e, operation) for e in events]

        def work(conn: Db) -> None:
            row = conn.execute(
                "SELECT state, job_name FROM runs WHERE run_id = ?", (run.run_id,)
            ).fetchone()
            if row is None:
                raise JournalConflict(
                    where,
                    operation,
                    run.run_id,
                    "the journal holds no such run",
                    expected=expected.value,
                )
            actual, job_name = row
            if actual != expected.value:
                raise JournalConflict(
                    where,
                    operation,
                    run.run_id,
                    f"run {run.run_id} is in state {actual!r}, not the expected "
                    f"{expected.value!r}; the save was rejected",
                    expected=expected.value,
                    actual=actual,
                )
            if job_name != run.job_name:
                raise JournalConflict(
                    where,
                    operation,
                    run.run_id,
                    f"the job name of a run never changes (stored {job_name!r}, "
                    f"given {run.job_name!r})",
                    expected=expected.value,
                    actual=actual,
                )
            stored = load_transitions(conn, run.run_id, self.location, operation)
            if run.transitions[: len(stored)] != stored:
                raise JournalConflict(
                    where,
                    operation,
                    run.run_id,
                    f"the run's {len(run.transitions)} transitions do not extend the "
                    f"{len(stored)} already journaled (a stale copy of the run?)",
                    expected=expected.value,
                    actual=actual,
                )
            conn.execute(
                "UPDATE runs SET state = ?, attempt = ?, slurm_job_id = ?, nodes = ?, "
                "cancel_requested = ?, outcome = ?, reason = ?, submission = ?, updated_at = ? "
                "WHERE run_id = ?",
                (*run_values(run)[2:], now, run.run_id),
            )
            insert_transitions(
                conn, run.run_id, transition_rows(run, len(stored), self.location, operation)
            )
            insert_outgoing(conn, outgoing, self.location, operation)
            conn.executemany(_INSERT_EVENT, rows)

        await self._backend.run(operation, work, write=True)

    async def get(self, run_id: str) -> StoredRun | None:
        """The run with this id, or None."""
        operation = f"read run {run_id}"
        runs = await self._backend.run(
            operation,
            lambda c: load_runs(c, "run_id = ?", (run_id,), self.location, operation),
            write=False,
        )
        return runs[0] if runs else None

    async def find_by_job_name(self, job_name: str) -> StoredRun | None:
        """The run submitted (or to be submitted) under this Slurm job name, or None."""
        operation = f"look up job name {job_name!r}"
        runs = await self._backend.run(
            operation,
            lambda c: load_runs(c, "job_name = ?", (job_name,), self.location, operation),
            write=False,
        )
        return runs[0] if runs else None

    async def list_runs(
        self, *, active_only: bool = False, owner_uid: int | None = None
    ) -> list[StoredRun]:
        """Runs in creation order; ``active_only`` keeps those not in a final state."""
        clauses: list[str] = []
        params: list[object] = []
        if active_only:
            clauses.append(f"state NOT IN ({', '.join('?' * len(_FINAL_STATES))})")
            params.extend(_FINAL_STATES)
        if owner_uid is not None:
            clauses.append("owner_uid = ?")
            params.append(owner_uid)
        where = " AND ".join(clauses) or "TRUE"
        operation = "list runs"
        return await self._backend.run(
            operation,
            lambda c: load_runs(c, where, params, self.location, operation),
            write=False,
        )

    async def runs_changed_since(self, horizon: int = 0) -> tuple[list[StoredRun], int]:
        """The runs written since a read that returned `horizon` (0: every run), in
        creation order, and the horizon to pass next time. A run written after that read
        is always returned; one written before it may be returned again (a write that
        was still in flight then), so the caller compares. Deleted runs are not told.

        How (schema version 8): every write of a run stamps its ``changed`` column, and
        the ``journal_horizon`` view, read in the same snapshot, is a value that every
        later write's stamp reaches: SQLite's own counter + 1, or on PostgreSQL the
        oldest transaction id still running when the snapshot was taken (transactions
        commit out of id order, so the newest id seen would miss one that commits late).
        """
        operation = "list runs changed since a horizon"

        def work(conn: Db) -> tuple[list[StoredRun], int]:
            row = conn.execute("SELECT horizon FROM journal_horizon").fetchone()
            assert row is not None, "journal_horizon has one row"
            runs = load_runs(conn, "changed >= ?", (horizon,), self.location, operation)
            return runs, int(row[0])

        return await self._backend.run(operation, work, write=False)

    # --- events -----------------------------------------------------------------------------

    async def add_event(
        self, run_id: str, kind: str, fields: Mapping[str, object], at: datetime
    ) -> None:
        """Append an event to the run's event log.

        ``fields`` must be JSON-serialisable and may not use the keys ``at`` or ``kind``.
        """
        operation = f"add event {kind!r} to run {run_id}"
        row = self._event_row(run_id, NewEvent(kind, fields, at), operation)

        def work(conn: Db) -> None:
            _require_run(conn, run_id, self.location, operation)
            conn.execute(_INSERT_EVENT, row)

        await self._backend.run(operation, work, write=True)

    def _event_row(self, run_id: str, event: NewEvent, operation: str) -> tuple[str, str, str, str]:
        """The events table's row of `event` (JournalError if its fields are not JSON or
        use a reserved key)."""
        reserved = sorted(_RESERVED_EVENT_KEYS.intersection(event.fields))
        if reserved:
            raise JournalError(
                self.location, operation, f"event fields may not use the keys {reserved}"
            )
        try:
            encoded = json.dumps(dict(event.fields), allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise JournalError(
                self.location, operation, f"event fields are not JSON: {exc}"
            ) from exc
        return run_id, iso(event.at, self.location, operation), event.kind, encoded

    async def events(self, run_id: str) -> list[Mapping[str, object]]:
        """The run's events in the order they were added: ``{"at": iso, "kind": ..., **fields}``.

        The fields are what `add_event` was given, free-form per kind (and as an older
        daemon wrote them): their reader checks them (`supervision.run.records`)."""
        operation = f"read the events of run {run_id}"

        def work(conn: Db) -> list[Mapping[str, object]]:
            rows = conn.execute(
                "SELECT at, kind, fields FROM events WHERE run_id = ? ORDER BY id", (run_id,)
            ).fetchall()
            out: list[Mapping[str, object]] = []
            for at, kind, fields in rows:
                decoded = decode_json(fields, dict, self.location, operation)
                out.append({"at": at, "kind": kind, **decoded})
            return out

        return await self._backend.run(operation, work, write=False)

    async def events_of_kind(self, kind: str) -> dict[str, list[Mapping[str, object]]]:
        """Every run's events of one kind (one query for all runs), by run id (as `events`)."""
        operation = f"read the {kind!r} events"

        def work(conn: Db) -> dict[str, list[Mapping[str, object]]]:
            out: dict[str, list[Mapping[str, object]]] = {}
            for run_id, at, fields in conn.execute(
                "SELECT run_id, at, fields FROM events WHERE kind = ? ORDER BY id", (kind,)
            ):
                decoded = decode_json(fields, dict, self.location, operation)
                out.setdefault(run_id, []).append({"at": at, "kind": kind, **decoded})
            return out

        return await self._backend.run(operation, work, write=False)

    # --- node quarantine (core.run.retry_policy) -----------------------------------------------

    async def count_node_failure(
        self, failure: NodeFailure, *, forget_before: datetime, outgoing: Sequence[Outgoing] = ()
    ) -> None:
        """Count one node's failure in one attempt (once: counting the same attempt's
        failure of the node again changes nothing), forget every failure older than
        `forget_before` (of the failure's cluster), and journal the outbound events the
        count makes (its node.quarantined, `core.events.outbox.quarantine_outgoing`), in one
        transaction."""
        f = failure
        operation = f"count a failure of node {f.node} on cluster {f.cluster}"

        def work(conn: Db) -> None:
            conn.execute(  # this cluster's only: a leader writes its own cluster's rows
                "DELETE FROM node_failures WHERE cluster = ? AND at < ?",
                (f.cluster, iso(forget_before, self.location, operation)),
            )
            conn.execute(
                f"INSERT INTO node_failures ({_F_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (
                    *(f.cluster, f.node, f.owner_uid, f.run_id, f.attempt, f.evidence.value),
                    f.reason[:500],
                    iso(f.at, self.location, operation),
                ),
            )
            insert_outgoing(conn, outgoing, self.location, operation)

        await self._backend.run(operation, work, write=True)

    async def node_failures(self, cluster: str | None = None) -> list[NodeFailure]:
        """The node failures counted (old ones too, until the next count forgets them),
        oldest first."""
        operation = "read the node failures"
        where, params = ("cluster = ?", (cluster,)) if cluster is not None else ("TRUE", ())

        def work(conn: Db) -> list[NodeFailure]:
            rows = conn.execute(
                f"SELECT {_F_COLUMNS} FROM node_failures WHERE {where} ORDER BY at, id",
                params,
            ).fetchall()
            return [_failure(row, self.location, operation) for row in rows]

        return await self._backend.run(operation, work, write=False)

    async def release_node(self, cluster: str, node: str) -> bool:
        """Forget every failure of `node` on `cluster`; whether it had any."""
        operation = f"release node {node} on cluster {cluster}"

        def work(conn: Db) -> bool:
            cur = conn.execute(
                "DELETE FROM node_failures WHERE cluster = ? AND node = ?", (cluster, node)
            )
            return cur.rowcount > 0

        return await self._backend.run(operation, work, write=True)

    # --- plumbing ---------------------------------------------------------------------------

    async def write(self, operation: str, fn: Callable[[Db], _T]) -> _T:
        """Run ``fn`` in one write transaction (for the stores that share this database:
        `adapters.journal.campaign_store`, `adapters.outbox.store`); the guarantees above hold for
        it too."""
        return await self._backend.run(operation, fn, write=True)

    async def read(self, operation: str, fn: Callable[[Db], _T]) -> _T:
        """Run ``fn`` in one read transaction (one snapshot)."""
        return await self._backend.run(operation, fn, write=False)


_INSERT_EVENT = "INSERT INTO events (run_id, at, kind, fields) VALUES (?, ?, ?, ?)"


@dataclass(frozen=True)
class NewEvent:
    """An entry for a run's event log: its kind, JSON fields and time."""

    kind: str
    fields: Mapping[str, object]
    at: datetime


def _require_run(conn: Db, run_id: str, where: str, operation: str) -> None:
    if conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is None:
        raise JournalError(where, operation, f"the journal holds no run {run_id}")


# --- SQLite ------------------------------------------------------------------------------------


class _SqliteBackend:
    """One sqlite3 connection, used by one worker thread at a time. Operations queued while
    one runs go to the thread together: one transaction, a savepoint each, one commit
    (`adapters.journal.batch`)."""

    def __init__(self, path: Path, conn: sqlite3.Connection, limiter: anyio.CapacityLimiter):
        self._path = path
        self._conn: sqlite3.Connection | None = conn
        self._batches: Batches[Db] = Batches(self._execute, limiter)

    @property
    def location(self) -> str:
        return str(self._path)

    @classmethod
    async def open(cls, path: Path) -> _SqliteBackend:
        limiter = anyio.CapacityLimiter(1)
        with anyio.CancelScope(shield=True):
            conn = await anyio.to_thread.run_sync(_open_sync, path, limiter=limiter)
        return cls(path, conn, limiter)

    async def aclose(self) -> None:
        """Close the connection (idempotent), after every operation queued before."""
        await self._batches.close(lambda _db: None)

    def _close_sync(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error as exc:
                raise _error(self._path, "close the database", exc) from exc

    async def run(self, operation: str, fn: Callable[[Db], _T], *, write: bool) -> _T:
        return await self._batches.call(operation, fn, write=write)

    @property
    def fenced_refusals(self) -> int:
        return 0  # no fence: one daemon owns the file

    def set_default_writer(self, source: WriterSource | None) -> None:
        pass  # every write is the single-node writer's (core.ha.fencing.SINGLE_NODE_EPOCH)

    def _execute(self, batch: list[Op[Db]]) -> None:
        """Run a batch in the worker thread (`_run_batch`); then close if it ends so."""
        conn = self._conn
        if conn is None:  # closed: closing again is nothing, anything else an error
            for op in batch:
                if not op.close:
                    op.error = JournalError(str(self._path), op.operation, "the journal is closed")
            return
        _run_batch(conn, self._path, [op for op in batch if not op.close])
        if batch[-1].close:
            try:
                self._close_sync()
            except JournalError as exc:
                batch[-1].error = exc


# --- helpers that run in the worker thread ---------------------------------------------------


def _open_sync(path: Path) -> sqlite3.Connection:
    try:
        path.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        created = _create_file(path)
    except OSError as exc:
        raise JournalError(str(path), "create the database file", str(exc)) from exc
    try:
        conn = sqlite3.connect(
            path,
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,  # we issue BEGIN/COMMIT ourselves
            check_same_thread=False,  # one batch at a time (adapters.journal.batch)
        )
    except sqlite3.Error as exc:
        raise _error(path, "open the database", exc) from exc
    try:
        _configure(conn, path)
        if created:
            _fsync_dir(path.parent)
    except BaseException:
        conn.close()
        raise
    return conn


def _create_file(path: Path) -> bool:
    """Create the empty database file with restrictive permissions; True if it is new."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    except FileExistsError:
        if stat.S_IMODE(path.stat().st_mode) & ~_FILE_MODE:  # an older, group-readable one
            os.chmod(path, _FILE_MODE)
        return False
    os.close(fd)
    return True


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise JournalError(str(directory), "sync the state directory", str(exc)) from exc


def _configure(conn: sqlite3.Connection, path: Path) -> None:
    operation = "open the database"
    try:
        # Refuse a newer schema before changing anything in the file (even its journal mode).
        _check_version(path, _user_version(conn))
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise JournalError(
                str(path), operation, f"SQLite refused WAL mode (journal_mode is {mode!r})"
            )
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS:d}")
        _write(_migrate(path))(SqliteDb(conn))
    except sqlite3.Error as exc:
        raise _error(path, operation, exc) from exc


def _migrate(path: Path) -> Callable[[Db], None]:
    def work(db: Db) -> None:
        conn = cast(SqliteDb, db).conn
        version = _user_version(conn)  # again, under the write lock
        _check_version(path, version)
        for statements in MIGRATIONS[version:]:
            for statement in statements:
                conn.execute(statement)
        if version != SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")

    return work


def _user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _check_version(path: Path, version: int) -> None:
    decision = plan(version)
    if isinstance(decision, Refuse):
        if version > SCHEMA_VERSION:
            raise JournalSchemaTooNew(str(path), version, SCHEMA_VERSION)
        raise JournalError(str(path), "open the database", decision.why)


def _write(fn: Callable[[Db], _T]) -> Callable[[Db], _T]:
    """Wrap ``fn`` in an immediate write transaction, rolled back if anything fails."""

    def run(db: Db) -> _T:
        conn = cast(SqliteDb, db).conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(db)
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
        return result

    return run


def _run_batch(conn: sqlite3.Connection, path: Path, batch: list[Op[Db]]) -> None:
    """One transaction for the whole batch (immediate if it writes; a read-only batch is one
    snapshot, rolled back), each operation in its own savepoint: an operation that fails is
    undone alone and gets its error. If the transaction itself is lost (SQLite rolls back on
    its own after some errors, such as a full disk) or its commit fails, every operation of
    the batch gets the error: none of them was applied."""
    if not batch:
        return
    writes = any(op.write for op in batch)
    db = SqliteDb(conn)
    try:
        conn.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
    except sqlite3.Error as exc:
        _fail(batch, path, exc)
        return
    for op in batch:
        try:
            conn.execute("SAVEPOINT op")
            op.result = op.fn(db)
            conn.execute("RELEASE op")
        except Exception as exc:
            op.error = _as_journal(path, op.operation, exc)
            if not conn.in_transaction:  # gone with everything the batch did so far
                _fail(batch, path, exc)
                return
            try:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
            except sqlite3.Error as again:
                _rollback(conn)
                _fail(batch, path, again)
                return
    try:
        conn.execute("COMMIT" if writes else "ROLLBACK")
    except sqlite3.Error as exc:
        _rollback(conn)
        _fail(batch, path, exc)


def _fail(batch: list[Op[Db]], path: Path, exc: Exception) -> None:
    """Every operation of the batch ends with `exc` (none was applied)."""
    for op in batch:
        op.result = None
        op.error = _as_journal(path, op.operation, exc)


def _as_journal(path: Path, operation: str, exc: Exception) -> Exception:
    """A sqlite3 error as the JournalError of `operation` (caused by it); others as they are."""
    if not isinstance(exc, sqlite3.Error):
        return exc
    error = _error(path, operation, exc)
    error.__cause__ = exc
    return error


def _rollback(conn: sqlite3.Connection) -> None:
    # SQLite may already have rolled back on its own (e.g. SQLITE_FULL); the original
    # error is the one worth reporting.
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def _error(path: Path, operation: str, exc: sqlite3.Error) -> JournalError:
    name = getattr(exc, "sqlite_errorname", None)
    detail = f"{exc} ({name})" if name else str(exc)
    return JournalError(str(path), operation, detail)
