"""The outbox's rows written inside a run transition's transaction (`adapters.journal.store`
calls it; `adapters.outbox.store` says what the rows mean)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmd_supervisor.adapters.journal.db import Db
from llmd_supervisor.adapters.journal.rows import iso
from llmd_supervisor.core.events.outbox import DeliveryStatus, Outgoing

__all__ = ["insert_outgoing"]


def insert_outgoing(
    conn: Db,
    outgoing: Sequence[Outgoing],
    path: str | Path,
    operation: str,
) -> None:
    """Journal each event and its deliveries (due at once) in the caller's transaction."""
    if not outgoing:
        return
    disabled = {r[0] for r in conn.execute("SELECT destination FROM disabled_destinations")}
    for o in outgoing:
        created = iso(o.at, path, operation)
        cur = conn.execute(
            "INSERT INTO outbox_events (event_id, type, subject, seq, body, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (o.id, o.type.value, o.subject, o.seq, o.body, created),
        )
        if cur.rowcount == 0:
            continue  # journaled already, with its deliveries
        for name in o.destinations:
            off = name in disabled
            conn.execute(
                "INSERT INTO deliveries (event_id, destination, status, attempts, next_at, "
                "last_error, updated_at, payload) VALUES (?, ?, ?, 0, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (
                    o.id,
                    name,
                    (DeliveryStatus.DISABLED if off else DeliveryStatus.QUEUED).value,
                    None if off else created,
                    "the destination is disabled (it answered 410 Gone)" if off else "",
                    created,
                    o.payloads.get(name),
                ),
            )
