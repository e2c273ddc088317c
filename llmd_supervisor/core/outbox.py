"""Which outbound events a run's transition makes, as data (pure; DESIGN.md §13).

The driver journals a run's new record together with what `run_outgoing` returns for the
transition, in one transaction (`adapters.outbox_store`): an event is never lost (it
commits with its transition) and never made twice (its id is `core.events.event_id` of
the transition's index in the run's history; the journal inserts it once).

=====================================  ==============
transition                             event
=====================================  ==============
submitting -> pending (a job id)       run.submitted
journaled straight into pending        run.submitted  (an adopted job)
pending -> running                     run.started    (again after a requeue)
any state -> a final state             run.finished   (the outcome declared)
=====================================  ==============

Each event goes to the destinations `core.event_routing.routes` names; an event no
destination takes is not journaled at all. A webhook gets the event's body (signed when
sent); a Slack destination its message (`core.notify_formats.slack_message`) and a mail
destination its mail (`core.notify_formats.mail_message`, ``Message-ID`` from the event
id and the daemon's host name), made here from the same facts and journaled with the
delivery, so that every attempt sends the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TypedDict

from llmd_supervisor.core.event_routing import Destination, DestinationKind, routes
from llmd_supervisor.core.events import (
    Event,
    EventType,
    Links,
    PingFacts,
    RunFacts,
    RunRef,
    SlurmFacts,
    Timing,
    canonical_json,
    encode,
    make_event,
    subject,
)
from llmd_supervisor.core.lifecycle import Run, RunState
from llmd_supervisor.core.notify_formats import mail_message, slack_message

__all__ = [
    "DeliveryStatus",
    "DeliveryView",
    "EventList",
    "EventView",
    "Outgoing",
    "PingQueued",
    "Replayed",
    "ping_outgoing",
    "run_event_type",
    "run_facts",
    "run_outgoing",
]


class DeliveryStatus(StrEnum):
    """A delivery's (an event to one destination) status in the journal."""

    QUEUED = "queued"  # not attempted yet
    RETRYING = "retrying"  # attempted, failed; another attempt is due at next_at
    DELIVERED = "delivered"  # the receiver's 2xx (or sendmail's 0) is committed
    DEAD = "dead"  # no more attempts; `events replay ID` queues it again
    DISABLED = "disabled"  # its destination answered 410 Gone; replayable too


class DeliveryView(TypedDict):
    """One delivery as the control socket shows it (`events list`, `events show`)."""

    event: str
    type: str
    subject: str  # run/<id>, ...
    destination: str
    status: str  # a DeliveryStatus value
    attempts: int
    next_at: str | None  # ISO 8601: when the next attempt is due (queued, retrying)
    last_error: str  # why the last attempt did not deliver ("" before any)
    created_at: str  # the event's time
    updated_at: str


class EventList(TypedDict):
    """`events list`: deliveries, newest event first."""

    deliveries: list[DeliveryView]


class EventView(TypedDict):
    """`events show`: the event, its body as sent to webhooks, and its deliveries."""

    event: str
    type: str
    subject: str
    seq: str
    created_at: str
    body: object  # the decoded JSON body (core.events.EventBody)
    deliveries: list[DeliveryView]


class Replayed(TypedDict):
    """`events replay`: how many dead or disabled deliveries were queued again."""

    event: str
    queued: int


class PingQueued(TypedDict):
    """`events test DEST`: the test.ping event journaled for that destination alone."""

    event: str
    destination: str


@dataclass(frozen=True)
class Outgoing:
    """One event to journal, with the destinations it goes to (one delivery each)."""

    id: str
    type: EventType
    subject: str
    seq: str
    at: datetime
    body: bytes  # `core.events.encode`: what every webhook attempt sends
    destinations: tuple[str, ...]
    # What a destination gets instead of the body (Slack: its message), by name.
    payloads: Mapping[str, bytes] = field(default_factory=dict)


def run_event_type(before: Run | None, after: Run) -> EventType | None:
    """The event the change from `before` (None: the run is new) to `after` reports."""
    if before is not None and after.state is before.state:
        return None
    if after.state.is_final:
        return EventType.RUN_FINISHED
    submitted = before is None or before.state is RunState.SUBMITTING
    if after.state is RunState.PENDING and after.slurm_job_id is not None and submitted:
        return EventType.RUN_SUBMITTED
    if after.state is RunState.RUNNING and before is not None:
        return EventType.RUN_STARTED
    return None


def run_facts(run: Run, ref: RunRef, links: Links) -> RunFacts:
    """The facts of `run` as its journaled record tells them."""
    return RunFacts(
        run=ref,
        state=run.state.value,
        attempt=run.attempt,
        slurm=SlurmFacts(job_id=run.slurm_job_id, nodes=run.nodes),
        timing=_timing(run),
        outcome=run.outcome.value if run.outcome is not None else None,
        reason=run.reason,
        links=links,
    )


def _timing(run: Run) -> Timing:
    submitted = started = finished = None
    for t in run.transitions:
        if t.state is RunState.PENDING and submitted is None:
            submitted = t.at
        elif t.state is RunState.RUNNING:
            started = t.at  # the last attempt's start
        elif t.state.is_final:
            finished = t.at
    return Timing(submitted_at=submitted, started_at=started, finished_at=finished)


def run_outgoing(
    before: Run | None,
    after: Run,
    ref: RunRef,
    links: Links,
    destinations: Sequence[Destination],
    host: str = "localhost",
) -> tuple[Outgoing, ...]:
    """The events (at most one) to journal with the change from `before` to `after`;
    `host` is the daemon's host name (a mail's Message-ID, and its default From)."""
    etype = run_event_type(before, after)
    if etype is None or not destinations:
        return ()
    seq = len(after.transitions) - 1  # the index of the transition reported
    facts = run_facts(after, ref, links)
    event = make_event(etype, facts, after.transitions[-1].at, seq)
    names = routes(event, destinations)
    if not names:
        return ()
    by_name = {d.name: d for d in destinations}
    return (
        Outgoing(
            id=event.id,
            type=etype,
            subject=subject(facts),
            seq=str(seq),
            at=event.at,
            body=encode(event),
            destinations=tuple(names),
            payloads={
                n: payload
                for n in names
                if (payload := _payload(event, by_name[n], host)) is not None
            },
        ),
    )


def ping_outgoing(
    destination: Destination, requested_by: str, at: datetime, seq: str, host: str = "localhost"
) -> Outgoing:
    """The test.ping event of `events test DEST` for `destination` alone (never routed);
    `seq` tells this request from every other (the requester and the time of asking)."""
    facts = PingFacts(destination=destination.name, requested_by=requested_by)
    event = make_event(EventType.TEST_PING, facts, at, seq)
    payload = _payload(event, destination, host)
    return Outgoing(
        id=event.id,
        type=EventType.TEST_PING,
        subject=subject(facts),
        seq=seq,
        at=at,
        body=encode(event),
        destinations=(destination.name,),
        payloads={} if payload is None else {destination.name: payload},
    )


def _payload(event: Event, d: Destination, host: str) -> bytes | None:
    """What destination `d` gets instead of the event's body (None: the body itself)."""
    if d.kind is DestinationKind.SLACK:
        return canonical_json(slack_message(event))
    if d.kind is DestinationKind.MAIL:
        try:
            return _mail(event, d, host)
        except ValueError:  # a host name the Message-ID cannot carry
            return _mail(event, d, "localhost")
    return None


def _mail(event: Event, d: Destination, host: str) -> bytes:
    sender = d.sender or f"llmd-supervisor@{host}"
    return mail_message(event, sender, d.to, host).as_bytes()
