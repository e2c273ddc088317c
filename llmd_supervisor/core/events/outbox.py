"""Which outbound events a run's transition makes, as data (pure; DESIGN.md §13).

The driver journals a run's new record together with what `run_outgoing` returns for the
transition, in one transaction (`adapters.outbox.store`): an event is never lost (it
commits with its transition) and never made twice (its id is `core.events.model.event_id` of
the transition's index in the run's history; the journal inserts it once).

=====================================  ==============
transition                             event
=====================================  ==============
submitting -> pending (a job id)       run.submitted
journaled straight into pending        run.submitted  (an adopted job)
pending -> running                     run.started    (again after a requeue)
any state -> a final state             run.finished   (the outcome declared)
verifying -> anything else             run.point_finished, one per benchmark point the
                                       verdict judged (``judged``)
=====================================  ==============

A run.finished carries what the verdict's receipt, the attempts and the archived results
table say (`core.events.facts.RunDetails`: Slurm's state and exit code, the cause, the
evidence summary, GPU-hours, the best point and every point); a run.point_finished the
point's own numbers, its id from the judged job (submission and attempt) and the
concurrency (a point ends once per job; a retry's job judges its points again). A spec's
``[notify] destinations`` are the opt-in destinations it names (``named``:
`core.events.routing.routes`).

Each event goes to the destinations `core.events.routing.routes` names; an event no
destination takes is not journaled at all. A webhook gets the event's body (signed when
sent); a Slack destination its message (`core.events.formats.slack_message`) and a mail
destination its mail (`core.events.formats.mail_message`, ``Message-ID`` from the event
id and the daemon's host name), made here from the same facts and journaled with the
delivery, so that every attempt sends the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Final, TypedDict

from llmd_supervisor.core.events.facts import RunDetails
from llmd_supervisor.core.events.formats import mail_message, slack_message
from llmd_supervisor.core.events.model import (
    Event,
    EventType,
    Facts,
    Links,
    PingFacts,
    PointCounts,
    PointFacts,
    QuarantineFacts,
    RunFacts,
    RunRef,
    SlurmFacts,
    Timing,
    canonical_json,
    encode,
    make_event,
    progress_gate,
    subject,
)
from llmd_supervisor.core.events.routing import Destination, DestinationKind, routes
from llmd_supervisor.core.run.lifecycle import Run, RunState
from llmd_supervisor.core.run.retry_policy import (
    NodeFailure,
    Quarantined,
    QuarantineRules,
    quarantine,
)

__all__ = [
    "DeliveryStatus",
    "DeliveryView",
    "EventList",
    "EventView",
    "LastProgress",
    "Outgoing",
    "PingQueued",
    "ProgressStep",
    "Replayed",
    "campaign_counts",
    "event_outgoing",
    "last_progress",
    "newly_quarantined",
    "ping_outgoing",
    "progress_step",
    "quarantine_facts",
    "quarantine_outgoing",
    "quarantine_seq",
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
    body: object  # the decoded JSON body (core.events.model.EventBody)
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
    body: bytes  # `core.events.model.encode`: what every webhook attempt sends
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


def run_facts(run: Run, ref: RunRef, links: Links, details: RunDetails | None = None) -> RunFacts:
    """The facts of `run` as its journaled record tells them, with the `details` of a
    declared run (None: none known)."""
    d = details or RunDetails()
    return RunFacts(
        run=ref,
        state=run.state.value,
        attempt=run.attempt,
        slurm=SlurmFacts(
            job_id=run.slurm_job_id, state=d.slurm_state, exit_code=d.exit_code, nodes=run.nodes
        ),
        timing=_timing(run),
        outcome=run.outcome.value if run.outcome is not None else None,
        cause=d.cause,
        reason=run.reason,
        evidence=d.evidence,
        gpu_hours_useful=d.gpu_hours_useful,
        gpu_hours_lost=d.gpu_hours_lost,
        best=d.best,
        points=d.points,
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
    *,
    named: Collection[str] = (),
    details: RunDetails | None = None,
    judged: Sequence[PointFacts] = (),
) -> tuple[Outgoing, ...]:
    """The events to journal with the change from `before` to `after`: the transition's
    (at most one, with `details` when it is run.finished) and, when `after` leaves
    verifying, one run.point_finished per point of `judged` (the points the verdict
    judged). `named`: the opt-in destinations the run's spec names; `host` is the
    daemon's host name (a mail's Message-ID, and its default From)."""
    if not destinations:
        return ()
    at = after.transitions[-1].at
    out: list[Outgoing] = []
    if before is not None and before.state is RunState.VERIFYING and after.state != before.state:
        for point in judged:
            facts = replace(run_facts(after, ref, links), point=point)
            seq = f"{before.submission}.{before.attempt}:{point.concurrency}"
            event = make_event(EventType.RUN_POINT_FINISHED, facts, at, seq)
            out += _routed(event, facts, seq, destinations, named, host)
    etype = run_event_type(before, after)
    if etype is not None:
        seq_i = len(after.transitions) - 1  # the index of the transition reported
        facts = run_facts(after, ref, links, details if etype is EventType.RUN_FINISHED else None)
        event = make_event(etype, facts, at, seq_i)
        out += _routed(event, facts, str(seq_i), destinations, named, host)
    return tuple(out)


def _routed(
    event: Event,
    facts: Facts,
    seq: str,
    destinations: Sequence[Destination],
    named: Collection[str],
    host: str,
) -> tuple[Outgoing, ...]:
    """`event` as the one `Outgoing` to journal, if any destination takes it."""
    names = routes(event, destinations, named)
    if not names:
        return ()
    by_name = {d.name: d for d in destinations}
    return (
        Outgoing(
            id=event.id,
            type=event.type,
            subject=subject(facts),
            seq=seq,
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


def event_outgoing(
    etype: EventType,
    facts: Facts,
    at: datetime,
    seq: int | str,
    destinations: Sequence[Destination],
    host: str = "localhost",
    *,
    named: Collection[str] = (),
) -> tuple[Outgoing, ...]:
    """The event of `etype` for `facts` (a campaign's, a node's), routed; () when no
    destination takes it. `seq` as `core.events.model.event_id` says for its type."""
    if not destinations:
        return ()
    event = make_event(etype, facts, at, seq)
    return _routed(event, facts, str(seq), destinations, named, host)


# --- campaign.progress ----------------------------------------------------------------


@dataclass(frozen=True)
class LastProgress:
    """A campaign's last journaled campaign.progress: when, its counter, its counts."""

    at: datetime
    seq: int
    points: PointCounts


@dataclass(frozen=True)
class ProgressStep:
    """Whether to journal a campaign.progress now (`seq`: its counter), or when to look
    again (`retry_at`: the counts changed inside the minute); neither: nothing changed."""

    seq: int | None = None
    retry_at: datetime | None = None


def progress_step(last: LastProgress | None, points: PointCounts, now: datetime) -> ProgressStep:
    """campaign.progress is made when a campaign's counts differ from those it last
    reported, at most once per `core.events.model.PROGRESS_INTERVAL` (`progress_gate`, from
    the last journaled one's time, so a restart keeps the limit). Changes inside the
    minute coalesce: the caller asks again at `retry_at` and reports the counts then."""
    if last is not None and last.points == points:
        return ProgressStep()
    gate = progress_gate(None if last is None else last.at, now)
    if not gate.emit:
        return ProgressStep(retry_at=gate.retry_at)
    return ProgressStep(seq=1 if last is None else last.seq + 1)


def last_progress(seq: str, at: datetime, body: bytes) -> LastProgress | None:
    """A journaled campaign.progress read back (None: not one this code wrote)."""
    try:
        data = json.loads(body)["data"]["points"]
        counts = PointCounts(**{k: int(data[k]) for k in _COUNT_KEYS})
        return LastProgress(at=at, seq=int(seq), points=counts)
    except (ValueError, KeyError, TypeError):
        return None


_COUNT_KEYS: Final = ("total", "verified", "running", "pending", "failed", "blocked")


def campaign_counts(by_state: Mapping[str, int]) -> PointCounts:
    """A campaign's point counts for its events, from `core.campaign.lifecycle.point_counts`
    (reused points count as verified; cancelled ones as failed)."""

    def n(*states: str) -> int:
        return sum(by_state.get(s, 0) for s in states)

    return PointCounts(
        total=sum(by_state.values()),
        verified=n("verified", "reused"),
        running=n("running"),
        pending=n("queued"),
        failed=sum(v for k, v in by_state.items() if k.startswith("failed")) + n("cancelled"),
        blocked=n("blocked"),
    )


# --- node.quarantined -----------------------------------------------------------------


def newly_quarantined(
    before: Sequence[Quarantined], after: Sequence[Quarantined]
) -> list[Quarantined]:
    """The quarantines active in `after` (the failures with the new one counted) that were
    not in `before`: each a node.quarantined (for everyone, or for one owner's runs)."""
    was = {(q.cluster, q.node, q.owner_uid) for q in before if q.active}
    return [q for q in after if q.active and (q.cluster, q.node, q.owner_uid) not in was]


def quarantine_facts(q: Quarantined, owner_name: str | None) -> QuarantineFacts:
    """The facts of quarantine `q`; `owner_name` the user name of its owner (None: for
    everyone, or a uid without a name)."""
    return QuarantineFacts(
        cluster=q.cluster,
        node=q.node,
        owner=owner_name,
        owner_uid=q.owner_uid,
        failures=q.failures,
        reason=q.reason,
        since=q.since,
        until=q.until,
        run=q.run_id,
    )


def quarantine_seq(q: Quarantined, run_id: str, attempt: int) -> str:
    """A node.quarantined's seq: the failure that quarantined it (run and attempt; one
    failure is counted once per node and attempt) and for whom."""
    scope = "everyone" if q.owner_uid is None else f"uid{q.owner_uid}"
    return f"{run_id}:{attempt}:{scope}"


def quarantine_outgoing(
    counted: Sequence[NodeFailure],
    failure: NodeFailure,
    *,
    rules: QuarantineRules,
    destinations: Sequence[Destination],
    name_of: Callable[[int], str | None],
    host: str = "localhost",
) -> tuple[Outgoing, ...]:
    """The node.quarantined events that counting `failure` makes, given the failures
    `counted` before it: one per quarantine (for everyone, or for one owner's runs) that
    `failure` makes active. None when the same failure was counted already (a verdict
    recorded again after a restart) or the node was kept out already. `name_of` gives a
    uid's user name."""
    if not destinations:
        return ()
    same = (failure.cluster, failure.node, failure.run_id, failure.attempt)
    if any((f.cluster, f.node, f.run_id, f.attempt) == same for f in counted):
        return ()
    now = failure.at
    node = [f for f in counted if (f.cluster, f.node) == (failure.cluster, failure.node)]
    before = quarantine(node, now=now, rules=rules)
    after = quarantine([*node, failure], now=now, rules=rules)
    out: list[Outgoing] = []
    for q in newly_quarantined(before, after):
        owner = None if q.owner_uid is None else name_of(q.owner_uid)
        facts = quarantine_facts(q, owner)
        seq = quarantine_seq(q, failure.run_id, failure.attempt)
        out += event_outgoing(EventType.NODE_QUARANTINED, facts, now, seq, destinations, host)
    return tuple(out)
