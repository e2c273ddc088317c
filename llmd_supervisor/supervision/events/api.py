"""The control socket's ``events_*`` ops: the outbox's deliveries, one event, a replay.

Access follows the runs' rule (`supervision.control.access`): a peer sees the events of its own
runs and campaigns; root and the admin group see every event (a node's too). An event
the peer may not see is answered exactly like one that does not exist (``not_found``).
Replaying (``events_replay``) is for whoever may see the event: it only ever sends to
destinations the operator configured. A test.ping to a destination (``events_test``) is
for root and the admin group.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Final, Protocol

from llmd_supervisor.adapters.control.protocol import Peer, Send, show
from llmd_supervisor.adapters.control.requests import (
    EventsListRequest,
    EventsReplayRequest,
    EventsShowRequest,
    EventsTestRequest,
)
from llmd_supervisor.adapters.outbox.store import Delivery, Outbox
from llmd_supervisor.core.events.outbox import (
    DeliveryStatus,
    DeliveryView,
    EventList,
    EventView,
    PingQueued,
    Replayed,
    ping_outgoing,
)
from llmd_supervisor.core.events.routing import EventsConfig
from llmd_supervisor.errors import ConfigError, ControlError
from llmd_supervisor.supervision.control.access import sees_all, user_name

__all__ = ["EventOps"]

LIST_MAX: Final = 200  # deliveries `events list` returns at most (newest first)
_RUN_PREFIX: Final = "run/"
_CAMPAIGN_PREFIX: Final = "campaign/"


class RunOwners(Protocol):
    """What the events ops need of the supervisor: a run by its ref, and its owner."""

    def owner_of(self, run_id: str) -> int | None: ...
    def run_id_of(self, ref: str) -> str | None: ...


class EventOps:
    """Answers ``events_list``, ``events_show`` and ``events_replay``."""

    def __init__(
        self,
        outbox: Outbox,
        runs: RunOwners,
        *,
        admin_group: str | None,
        clock: Callable[[], datetime],
        wake: Callable[[], None] = lambda: None,
        events: EventsConfig | None = None,
        host: str = "localhost",
    ) -> None:
        self._outbox = outbox
        self._events = events or EventsConfig()
        self._host = host
        self._runs = runs
        self._admin_group = admin_group
        self._clock = clock
        self._wake = wake  # the sender looks for due deliveries at once

    async def _sees(self, peer: Peer, subject: str) -> bool:
        if sees_all(peer, self._admin_group):
            return True
        if subject.startswith(_RUN_PREFIX):
            return self._runs.owner_of(subject[len(_RUN_PREFIX) :]) == peer.uid
        if subject.startswith(_CAMPAIGN_PREFIX):
            owner = await self._outbox.campaign_owner(subject[len(_CAMPAIGN_PREFIX) :])
            return owner == peer.uid
        return False  # a node's events: root and the admin group

    # The ops' handlers as they take a request's arguments (the typed calls below).

    async def list(self, args: Mapping[str, object], peer: Peer, send: Send) -> EventList:
        return await self.deliveries(
            peer, EventsListRequest(_opt(args, "run"), _opt(args, "status"))
        )

    async def show(self, args: Mapping[str, object], peer: Peer, send: Send) -> EventView:
        return await self.event(peer, EventsShowRequest(str(args["event"])))

    async def replay(self, args: Mapping[str, object], peer: Peer, send: Send) -> Replayed:
        request = EventsReplayRequest(str(args["event"]), _opt(args, "destination"))
        return await self.queue_again(peer, request)

    async def test(self, args: Mapping[str, object], peer: Peer, send: Send) -> PingQueued:
        return await self.ping(peer, EventsTestRequest(str(args["destination"])))

    # The typed calls.

    async def deliveries(self, peer: Peer, req: EventsListRequest) -> EventList:
        """The newest deliveries (LIST_MAX) the peer may see, of one run and in one status."""
        run_id = None
        ref = req.run
        if ref is not None:
            run_id = self._runs.run_id_of(ref)
            if run_id is None or not await self._sees(peer, _RUN_PREFIX + run_id):
                raise ControlError("not_found", f"No run {show(ref)} is known to this daemon.")
        status = None
        if req.status is not None:
            try:
                status = DeliveryStatus(req.status)
            except ValueError:
                choices = ", ".join(s.value for s in DeliveryStatus)
                raise ControlError(
                    "bad_request",
                    f"Status {show(req.status)} is not a delivery status; use one of {choices}.",
                ) from None
        # A peer who does not see all sees its own runs' and campaigns' events: filtered
        # in the query, so that the newest LIST_MAX are the peer's own, not LIST_MAX of
        # everyone's.
        owner = None if sees_all(peer, self._admin_group) else peer.uid
        found = await self._outbox.deliveries(
            run_id=run_id, status=status, owner_uid=owner, limit=LIST_MAX
        )
        return {"deliveries": [_view(d) for d in found]}

    async def event(self, peer: Peer, req: EventsShowRequest) -> EventView:
        """One event the peer may see, with its deliveries."""
        event_id = req.event
        stored = await self._outbox.event(event_id)
        if stored is None or not await self._sees(peer, stored.subject):
            raise ControlError("not_found", f"No event {show(event_id)} is in the journal.")
        return {
            "event": stored.event_id,
            "type": stored.type,
            "subject": stored.subject,
            "seq": stored.seq,
            "created_at": stored.created_at.isoformat(),
            "body": json.loads(stored.body),
            "deliveries": [_view(d) for d in stored.deliveries],
        }

    async def queue_again(self, peer: Peer, req: EventsReplayRequest) -> Replayed:
        """Queue the event's dead or disabled deliveries (to `destination`) again."""
        event = await self.event(peer, EventsShowRequest(req.event))
        destination = req.destination
        names = [d["destination"] for d in event["deliveries"]]
        if destination is not None and destination not in names:
            raise ControlError(
                "not_found",
                f"Event {event['event']} has no delivery to {show(destination)} "
                f"(it has: {', '.join(names) or 'none'}).",
            )
        queued = await self._outbox.replay(event["event"], self._clock(), destination)
        if queued == 0:
            raise ControlError(
                "bad_request",
                f"Event {event['event']} has no dead or disabled delivery"
                + ("" if destination is None else f" to {show(destination)}")
                + " to replay; `events show` lists its deliveries.",
            )
        self._wake()
        return {"event": event["event"], "queued": queued}

    async def ping(self, peer: Peer, req: EventsTestRequest) -> PingQueued:
        """Queue a test.ping to one configured destination (root and the admin group)."""
        if not sees_all(peer, self._admin_group):
            raise ControlError(
                "forbidden",
                "Only root or a member of the daemon's admin group may test a destination.",
            )
        try:
            destination = self._events.destination(req.destination)
        except ConfigError as exc:
            raise ControlError(
                "not_found", f"No destination {show(req.destination)}: {exc.hint}."
            ) from None
        now = self._clock()
        who = user_name(peer.uid) or f"uid {peer.uid}"
        # A request of its own each time (never re-derived: a ping is journaled at once).
        seq = f"{peer.uid}/{now.isoformat()}/{uuid.uuid4().hex}"
        outgoing = ping_outgoing(destination, who, now, seq, self._host)
        await self._outbox.add(outgoing)
        self._wake()
        return {"event": outgoing.id, "destination": destination.name}


def _opt(args: Mapping[str, object], name: str) -> str | None:
    value = args.get(name)
    return None if value is None else str(value)


def _view(d: Delivery) -> DeliveryView:
    return {
        "event": d.event_id,
        "type": d.type,
        "subject": d.subject,
        "destination": d.destination,
        "status": d.status.value,
        "attempts": d.attempts,
        "next_at": None if d.next_at is None else d.next_at.isoformat(),
        "last_error": d.last_error,
        "created_at": d.created_at.isoformat(),
        "updated_at": d.updated_at.isoformat(),
    }
