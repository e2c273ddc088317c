"""The outbox in the run journal: outbound events and their deliveries (DESIGN.md §13).

Shares the journal's database and its guarantees (one transaction per call, JournalError
naming the database and the operation; `adapters.journal.store`).

- `adapters.outbox.rows.insert_outgoing` runs inside the transaction of the run's
  transition (`Journal.save`, `Journal.insert_run`): the event row and one delivery row
  per destination commit with the transition or not at all. ``INSERT OR IGNORE``: the
  same event journaled again (a retried save, a replayed transition) changes nothing,
  its deliveries included.
- A delivery to a destination disabled by a 410 Gone answer is journaled ``disabled``.
- `Outbox.finish_attempt` journals an attempt's outcome: a delivery is ``delivered`` only
  once that write has committed, so a crash between the receiver's 2xx and the commit
  sends the event again, with the same ``webhook-id`` (at least once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from llmd_supervisor.adapters.journal.db import Db
from llmd_supervisor.adapters.journal.rows import iso, parse_time
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.adapters.outbox.rows import insert_outgoing
from llmd_supervisor.core.events.outbox import DeliveryStatus, Outgoing
from llmd_supervisor.errors import JournalError

__all__ = ["Delivery", "Outbox", "StoredEvent"]

LAST_ERROR_MAX: Final = 500
_D_COLUMNS: Final = (
    "d.event_id, d.destination, d.status, d.attempts, d.next_at, d.last_error, d.updated_at, "
    "e.type, e.subject, e.created_at"
)
_REPLAYABLE: Final = (DeliveryStatus.DEAD.value, DeliveryStatus.DISABLED.value)


@dataclass(frozen=True)
class Delivery:
    """One event to one destination, as journaled."""

    event_id: str
    destination: str
    status: DeliveryStatus
    attempts: int
    next_at: datetime | None
    last_error: str
    updated_at: datetime
    type: str  # the event's
    subject: str
    created_at: datetime  # the event's


@dataclass(frozen=True)
class StoredEvent:
    """An event with its body and its deliveries."""

    event_id: str
    type: str
    subject: str
    seq: str
    body: bytes
    created_at: datetime
    deliveries: tuple[Delivery, ...]


class Outbox:
    """The outbox's reads and the sender's writes, on the journal's connection."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    @property
    def _path(self) -> str:
        return self._journal.location

    async def add(self, outgoing: Outgoing) -> None:
        """Journal an event of no run transition (`events test`) with its deliveries."""
        operation = f"journal event {outgoing.id}"
        await self._journal.write(
            operation, lambda conn: insert_outgoing(conn, [outgoing], self._path, operation)
        )

    async def due(self, now: datetime, per_destination: int = 8) -> list[tuple[Delivery, bytes]]:
        """Queued and retrying deliveries due by `now`: the `per_destination` due first of
        each destination (so a destination with a backlog never hides another's), oldest
        due first, each with what it sends (the event's body, or the destination's own
        payload: Slack, mail)."""
        operation = "read the due deliveries"
        when = iso(now, self._path, operation)

        def work(conn: Db) -> list[tuple[Delivery, bytes]]:
            rows = conn.execute(
                f"SELECT {_D_COLUMNS}, COALESCE(d.payload, e.body) FROM ("
                "  SELECT *, ROW_NUMBER() OVER ("
                "    PARTITION BY destination ORDER BY next_at, event_id) AS n"
                "  FROM deliveries"
                "  WHERE status IN ('queued', 'retrying') AND next_at <= ?"
                ") AS d JOIN outbox_events AS e ON e.event_id = d.event_id "
                "WHERE d.n <= ? ORDER BY d.next_at, d.event_id, d.destination",
                (when, per_destination),
            ).fetchall()
            return [(self._delivery(r[:-1], operation), bytes(r[-1])) for r in rows]

        return await self._journal.read(operation, work)

    async def next_due(self) -> datetime | None:
        """When the earliest queued or retrying delivery is due (None: none is)."""
        operation = "read the next due delivery"

        def work(conn: Db) -> str | None:
            row = conn.execute(
                "SELECT MIN(next_at) FROM deliveries WHERE status IN ('queued', 'retrying')"
            ).fetchone()
            return None if row is None or row[0] is None else str(row[0])

        text = await self._journal.read(operation, work)
        return None if text is None else parse_time(text, self._path, operation)

    async def finish_attempt(
        self,
        event_id: str,
        destination: str,
        *,
        status: DeliveryStatus,
        attempts: int,
        next_at: datetime | None,
        error: str,
        now: datetime,
        disable: bool = False,
    ) -> None:
        """Journal an attempt's outcome. With `disable` (410 Gone) the destination is
        disabled too, and its other queued and retrying deliveries with it."""
        operation = f"record delivery of {event_id} to {destination}"
        stamp = iso(now, self._path, operation)
        due = None if next_at is None else iso(next_at, self._path, operation)

        def work(conn: Db) -> None:
            conn.execute(
                "UPDATE deliveries SET status = ?, attempts = ?, next_at = ?, last_error = ?, "
                "updated_at = ? WHERE event_id = ? AND destination = ?",
                (status.value, attempts, due, error[:LAST_ERROR_MAX], stamp, event_id, destination),
            )
            if disable:
                conn.execute(
                    "INSERT INTO disabled_destinations (destination, reason, since) "
                    "VALUES (?, ?, ?) ON CONFLICT (destination) DO UPDATE "
                    "SET reason = excluded.reason, since = excluded.since",
                    (destination, error[:LAST_ERROR_MAX], stamp),
                )
                conn.execute(
                    "UPDATE deliveries SET status = 'disabled', next_at = NULL, "
                    "last_error = ?, updated_at = ? "
                    "WHERE destination = ? AND status IN ('queued', 'retrying')",
                    (f"destination disabled: {error}"[:LAST_ERROR_MAX], stamp, destination),
                )

        await self._journal.write(operation, work)

    async def counts(self) -> dict[tuple[str, str], int]:
        """How many deliveries each (destination, status) has."""

        def work(conn: Db) -> dict[tuple[str, str], int]:
            rows = conn.execute(
                "SELECT destination, status, count(*) FROM deliveries GROUP BY destination, status"
            )
            return {(str(d), str(s)): int(n) for d, s, n in rows}

        return await self._journal.read("count the deliveries", work)

    async def disabled(self) -> dict[str, str]:
        """The destinations disabled by a 410 answer, with the reason."""

        def work(conn: Db) -> dict[str, str]:
            rows = conn.execute("SELECT destination, reason FROM disabled_destinations")
            return {str(d): str(r) for d, r in rows}

        return await self._journal.read("read the disabled destinations", work)

    async def deliveries(
        self,
        *,
        run_id: str | None = None,
        status: DeliveryStatus | None = None,
        owner_uid: int | None = None,
        limit: int = 200,
    ) -> list[Delivery]:
        """Deliveries, newest event first; of one run's events, in one status, and of the
        runs and campaigns of one owner (`owner_uid`: filtered here, before the limit)."""
        operation = "list the deliveries"
        clauses: list[str] = []
        params: list[object] = []
        if run_id is not None:
            clauses.append("e.subject = ?")
            params.append(f"run/{run_id}")
        if owner_uid is not None:
            clauses.append(
                "(e.subject IN (SELECT 'run/' || run_id FROM runs WHERE owner_uid = ?)"
                " OR e.subject IN"
                " (SELECT 'campaign/' || campaign_id FROM campaigns WHERE owner_uid = ?))"
            )
            params += [owner_uid, owner_uid]
        if status is not None:
            clauses.append("d.status = ?")
            params.append(status.value)
        where = " AND ".join(clauses) or "TRUE"

        def work(conn: Db) -> list[Delivery]:
            rows = conn.execute(
                f"SELECT {_D_COLUMNS} FROM deliveries AS d "
                "JOIN outbox_events AS e ON e.event_id = d.event_id "
                f"WHERE {where} ORDER BY e.created_at DESC, d.event_id, d.destination LIMIT ?",
                (*params, limit),
            ).fetchall()
            return [self._delivery(r, operation) for r in rows]

        return await self._journal.read(operation, work)

    async def event(self, event_id: str) -> StoredEvent | None:
        """The event with this id, its body and its deliveries; None if there is none."""
        operation = f"read event {event_id}"

        def work(conn: Db) -> StoredEvent | None:
            row = conn.execute(
                "SELECT event_id, type, subject, seq, body, created_at FROM outbox_events "
                "WHERE event_id = ?",
                (event_id,),
            ).fetchone()
            if row is None:
                return None
            rows = conn.execute(
                f"SELECT {_D_COLUMNS} FROM deliveries AS d "
                "JOIN outbox_events AS e ON e.event_id = d.event_id "
                "WHERE d.event_id = ? ORDER BY d.destination",
                (event_id,),
            ).fetchall()
            return StoredEvent(
                event_id=str(row[0]),
                type=str(row[1]),
                subject=str(row[2]),
                seq=str(row[3]),
                body=bytes(row[4]),
                created_at=parse_time(str(row[5]), self._path, operation),
                deliveries=tuple(self._delivery(r, operation) for r in rows),
            )

        return await self._journal.read(operation, work)

    async def campaign_owner(self, campaign_id: str) -> int | None:
        """The owner of a campaign (None: no such campaign)."""
        operation = f"read the owner of campaign {campaign_id}"

        def work(conn: Db) -> int | None:
            row = conn.execute(
                "SELECT owner_uid FROM campaigns WHERE campaign_id = ?", (campaign_id,)
            ).fetchone()
            return None if row is None else int(row[0])

        return await self._journal.read(operation, work)

    async def last_event(self, subject: str, etype: str) -> tuple[str, datetime, bytes] | None:
        """The newest event of type `etype` about `subject` (its seq, time and body);
        None when there is none (a campaign's last campaign.progress)."""
        operation = f"read the last {etype} of {subject}"

        def work(conn: Db) -> tuple[str, str, bytes] | None:
            row = conn.execute(
                "SELECT seq, created_at, body FROM outbox_events WHERE subject = ? AND type = ? "
                "ORDER BY created_at DESC, event_id LIMIT 1",
                (subject, etype),
            ).fetchone()
            return None if row is None else (str(row[0]), str(row[1]), bytes(row[2]))

        found = await self._journal.read(operation, work)
        if found is None:
            return None
        return found[0], parse_time(found[1], self._path, operation), found[2]

    async def replay(self, event_id: str, now: datetime, destination: str | None = None) -> int:
        """Queue the event's dead (and disabled) deliveries again, due now, with a new
        series of attempts; enable again a destination replayed by name. How many were
        queued."""
        operation = f"replay event {event_id}"
        stamp = iso(now, self._path, operation)
        only = "" if destination is None else " AND destination = ?"
        extra: tuple[str, ...] = () if destination is None else (destination,)

        def work(conn: Db) -> int:
            names = [
                str(r[0])
                for r in conn.execute(
                    "SELECT destination FROM deliveries WHERE event_id = ? "
                    f"AND status IN (?, ?){only}",
                    (event_id, *_REPLAYABLE, *extra),
                )
            ]
            for name in names:
                conn.execute("DELETE FROM disabled_destinations WHERE destination = ?", (name,))
            cur = conn.execute(
                "UPDATE deliveries SET status = 'queued', attempts = 0, next_at = ?, "
                "last_error = '', updated_at = ? "
                f"WHERE event_id = ? AND status IN (?, ?){only}",
                (stamp, stamp, event_id, *_REPLAYABLE, *extra),
            )
            return cur.rowcount

        return await self._journal.write(operation, work)

    def _delivery(self, row: Sequence[object], operation: str) -> Delivery:
        event_id, dest, status, attempts, next_at, error, updated, etype, subj, created = row
        try:
            state = DeliveryStatus(str(status))
        except ValueError:
            raise JournalError(self._path, operation, f"a delivery has status {status!r}") from None
        return Delivery(
            event_id=str(event_id),
            destination=str(dest),
            status=state,
            attempts=int(str(attempts)),
            next_at=None if next_at is None else parse_time(str(next_at), self._path, operation),
            last_error=str(error),
            updated_at=parse_time(str(updated), self._path, operation),
            type=str(etype),
            subject=str(subj),
            created_at=parse_time(str(created), self._path, operation),
        )
