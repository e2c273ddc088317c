"""Outbound events: what the daemon tells people, as data (pure; DESIGN.md §13).

An `Event` is one transition worth telling: its `EventType`, a stable id, the time of the
transition and the typed facts it reports (`RunFacts`, `CampaignFacts`,
`QuarantineFacts`, `PingFacts`; the facts have no field for logs, environment or
secrets, so none can be sent). `encode` turns it into the body every destination gets
(webhooks verbatim; Slack and mail format the same facts in `core.events.formats`); its
shape is the TypedDict `EventBody`, its ``data`` one of `EventData` (`RunData`,
`CampaignData`, `QuarantineData`, `PingData`) or, trimmed to identifiers, `SubjectData`::

    {"schema": "llmd-supervisor.event/1", "type": "run.finished", "id": "evt_...",
     "timestamp": "2025-06-01T12:00:00.000Z", "data": {...}, "trimmed": []}

- **Canonical JSON**: keys sorted, no spaces, UTF-8, no NaN or infinity (a non-finite
  number is null). The bytes are what is signed and sent; the same event always encodes
  to the same bytes.
- **Hostile text**: every string a job could have influenced (names, reasons, evidence,
  problems, node names) goes through `core.run.jobtext.job_text` and a length cap, so control
  characters and lone surrogates are escaped and the body is always valid UTF-8.
- **Size**: a body is at most `MAX_BODY_BYTES`. A larger one is trimmed, in this order,
  until it fits: the per-point detail (``points`` of a run, ``problems`` of a campaign)
  is cut to its first half, then the first half of that, down to none (a run's points
  are in concurrency order, so the lowest concurrencies stay; the best point, and a
  finished point's own numbers, always stay); long texts are cut; long lists are cut;
  last, ``data`` keeps only the subject's identifiers. What was done is named in
  ``trimmed``: ``"points"`` (per-point detail cut or dropped), ``"text"`` (a
  text cut, ending in ``...``), ``"lists"`` (a list cut), ``"data"`` (identifiers only);
  it is ``[]`` for an untrimmed body.
- **Ids** (`event_id`): ``evt_`` and 26 base32 characters of the SHA-256 of (schema,
  type, subject, seq). The subject is what the event is about (``run/<id>``,
  ``campaign/<id>``, ``node/<cluster>/<node>``, ``ping/<destination>``) and `seq` the
  position, in that subject's journaled history, of the transition the event reports:

  * run.submitted, run.started, run.finished: the index of the run's journaled
    transition (its row in the run's transition history);
  * run.point_finished: ``"<submission>.<attempt>:<concurrency>"`` of the judged job (a
    point ends once per job; a retry is a new submission, a requeue a new attempt);
  * campaign.progress: the campaign's progress counter, journaled with the event;
  * campaign.finished: the campaign's final state (a campaign ends once);
  * node.quarantined: ``"<run>:<attempt>:<scope>"``, the journaled failure that made the
    quarantine (one per node and attempt) and for whom (``everyone`` or ``uid<N>``);
  * test.ping: the id of the journaled ping request.

  Deriving the event again from the journal after a crash gives the same id, so a
  receiver's dedupe by ``webhook-id`` holds across restarts; two transitions never share
  one. The id has only ``[a-z0-9_]`` (Standard Webhooks forbids a ``.`` in it).
- **campaign.progress** is throttled to one per minute per campaign (`progress_gate`):
  a change inside the minute waits for its end and then reports the campaign as it is by
  then (changes coalesce, none is queued); ``campaign.finished`` is never throttled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Final, Literal, TypedDict, TypeVar, cast

from llmd_supervisor.core.run.jobtext import job_text

__all__ = [
    "MAX_BODY_BYTES",
    "PROGRESS_INTERVAL",
    "SCHEMA",
    "BestOf",
    "BestOfData",
    "CampaignData",
    "CampaignFacts",
    "CampaignIds",
    "CampaignProblem",
    "CampaignRefData",
    "Event",
    "EventBody",
    "EventData",
    "EventType",
    "Facts",
    "GpuHoursData",
    "IdName",
    "Links",
    "LinksData",
    "Owner",
    "PingData",
    "PingFacts",
    "PingIds",
    "PointCounts",
    "PointCountsData",
    "PointData",
    "PointFacts",
    "ProblemData",
    "ProgressGate",
    "QuarantineData",
    "QuarantineFacts",
    "QuarantineIds",
    "RunData",
    "RunFacts",
    "RunIds",
    "RunRef",
    "RunRefData",
    "SlurmData",
    "SlurmFacts",
    "SpecData",
    "SubjectData",
    "Timing",
    "TimingData",
    "Trim",
    "canonical_json",
    "describe",
    "encode",
    "event_id",
    "iso",
    "make_event",
    "progress_gate",
]

SCHEMA: Final = "llmd-supervisor.event/1"
# Standard Webhooks recommends payloads under 20 kB; this is the hard cap of a body.
MAX_BODY_BYTES: Final = 20_000
PROGRESS_INTERVAL: Final = timedelta(minutes=1)

# Characters kept of each kind of text when an event is built (before any trimming).
NAME_MAX: Final = 256  # ids, names, owners, clusters, nodes, states
TEXT_MAX: Final = 1024  # a reason
LINE_MAX: Final = 512  # one evidence line, a point's problem
LINK_MAX: Final = 1024  # a path or URL
EVIDENCE_MAX_LINES: Final = 32


class EventType(StrEnum):
    """What happened; the ``type`` of a body and of a destination's ``types`` filter."""

    RUN_SUBMITTED = "run.submitted"  # Slurm accepted the job (a job id exists)
    RUN_STARTED = "run.started"  # the allocation runs
    RUN_POINT_FINISHED = "run.point_finished"  # one benchmark point's numbers are in
    RUN_FINISHED = "run.finished"  # the outcome is declared (verified and archived)
    CAMPAIGN_PROGRESS = "campaign.progress"  # point counts changed (at most 1/min)
    CAMPAIGN_FINISHED = "campaign.finished"  # every point is verified, failed or blocked
    NODE_QUARANTINED = "node.quarantined"  # a node is kept out of submissions
    TEST_PING = "test.ping"  # `events test DEST`: only ever sent to that destination


RUN_TYPES: Final = frozenset(
    {
        EventType.RUN_SUBMITTED,
        EventType.RUN_STARTED,
        EventType.RUN_POINT_FINISHED,
        EventType.RUN_FINISHED,
    }
)
CAMPAIGN_TYPES: Final = frozenset({EventType.CAMPAIGN_PROGRESS, EventType.CAMPAIGN_FINISHED})


@dataclass(frozen=True)
class Owner:
    """Whose run (or campaign, or quarantine) an event is about, for routing."""

    uid: int
    name: str  # the user name ("" when the uid has none)


@dataclass(frozen=True)
class RunRef:
    """Which run: its id and name, its owner, its cluster and its spec."""

    id: str
    name: str
    owner: str  # user name ("" when the uid has none)
    owner_uid: int
    cluster: str
    spec_name: str
    spec_sha256: str


@dataclass(frozen=True)
class SlurmFacts:
    """What Slurm says of the run's current job (None: not known yet)."""

    job_id: str | None = None
    state: str | None = None  # normalised JobState value, e.g. "COMPLETED"
    exit_code: str | None = None  # "0:0"
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Timing:
    """When the run was submitted, started and finished (UTC-aware; None: not yet)."""

    submitted_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True)
class PointFacts:
    """One benchmark point's headline numbers (None: not measured)."""

    concurrency: int
    valid: bool  # passed the validity gate
    completed: int | None = None
    num_prompts: int | None = None
    total_token_throughput: float | None = None  # tokens/s
    output_throughput: float | None = None  # tokens/s
    ttft_ms_median: float | None = None
    tpot_ms_median: float | None = None
    problem: str | None = None  # why it is not valid


@dataclass(frozen=True)
class Links:
    """Where to look further: archive and report paths, the dashboard's page."""

    archive: str | None = None
    report: str | None = None
    dashboard: str | None = None


@dataclass(frozen=True)
class RunFacts:
    """A run at one of its transitions (run.* events). `point` is the point that just
    finished (run.point_finished only); `points` every point known so far."""

    run: RunRef
    state: str  # RunState value after the transition
    attempt: int = 1
    slurm: SlurmFacts = field(default_factory=SlurmFacts)
    timing: Timing = field(default_factory=Timing)
    outcome: str | None = None  # Outcome value, once declared
    cause: str | None = None  # Cause value of a failure
    reason: str = ""  # the verdict's one-line reason
    evidence: tuple[str, ...] = ()  # the evidence summary, one line each
    gpu_hours_useful: float | None = None
    gpu_hours_lost: float | None = None
    best: PointFacts | None = None
    points: tuple[PointFacts, ...] = ()
    point: PointFacts | None = None
    links: Links = field(default_factory=Links)


@dataclass(frozen=True)
class PointCounts:
    """A campaign's points by state."""

    total: int
    verified: int = 0
    running: int = 0
    pending: int = 0
    failed: int = 0
    blocked: int = 0


@dataclass(frozen=True)
class CampaignProblem:
    """One failed or blocked point of a campaign, with its reason."""

    recipe: str
    concurrency: int
    state: str  # "failed" | "blocked"
    reason: str


@dataclass(frozen=True)
class BestOf:
    """Where a campaign's best point comes from: the run that verified it, its recipe and
    its topology (the campaign's job that holds it)."""

    run: str
    recipe: str
    topology: str


@dataclass(frozen=True)
class CampaignFacts:
    """A campaign's progress (campaign.progress) or its end (campaign.finished)."""

    id: str
    name: str
    owner: str
    owner_uid: int
    cluster: str | None
    points: PointCounts
    outcome: str | None = None  # campaign.finished: its final CampaignState value
    reason: str = ""
    gpu_hours_useful: float | None = None
    gpu_hours_lost: float | None = None
    best: PointFacts | None = None
    best_of: BestOf | None = None  # where `best` comes from
    problems: tuple[CampaignProblem, ...] = ()
    links: Links = field(default_factory=Links)


@dataclass(frozen=True)
class QuarantineFacts:
    """A node kept out of submissions: for everyone (`owner_uid` None) or one owner."""

    cluster: str
    node: str
    owner: str | None
    owner_uid: int | None
    failures: int
    reason: str
    since: datetime
    until: datetime
    run: str | None = None  # the run whose failure was counted last


@dataclass(frozen=True)
class PingFacts:
    """`events test DEST`: who asked, to test which destination."""

    destination: str
    requested_by: str


Facts = RunFacts | CampaignFacts | QuarantineFacts | PingFacts

_FACTS_OF: Final[Mapping[EventType, type]] = {
    **{t: RunFacts for t in RUN_TYPES},
    **{t: CampaignFacts for t in CAMPAIGN_TYPES},
    EventType.NODE_QUARANTINED: QuarantineFacts,
    EventType.TEST_PING: PingFacts,
}


@dataclass(frozen=True)
class Event:
    """One event: made by `make_event`, which checks the facts against the type."""

    type: EventType
    id: str
    at: datetime  # when the transition happened (UTC-aware)
    facts: Facts

    @property
    def owner(self) -> Owner | None:
        """Whose it is, for routing (None: nobody's, e.g. a quarantine for everyone)."""
        f = self.facts
        if isinstance(f, RunFacts):
            return Owner(f.run.owner_uid, f.run.owner)
        if isinstance(f, CampaignFacts):
            return Owner(f.owner_uid, f.owner)
        if isinstance(f, QuarantineFacts) and f.owner_uid is not None:
            return Owner(f.owner_uid, f.owner or "")
        return None


def subject(facts: Facts) -> str:
    """What the facts are about, as it goes into an event id."""
    if isinstance(facts, RunFacts):
        return f"run/{facts.run.id}"
    if isinstance(facts, CampaignFacts):
        return f"campaign/{facts.id}"
    if isinstance(facts, QuarantineFacts):
        return f"node/{facts.cluster}/{facts.node}"
    return f"ping/{facts.destination}"


def event_id(etype: EventType, subject: str, seq: int | str) -> str:
    """The stable id of the event of type `etype` reporting transition `seq` of `subject`
    (the rule is in the module docstring)."""
    key = json.dumps([SCHEMA, etype.value, subject, str(seq)], separators=(",", ":"))
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return "evt_" + base64.b32encode(digest).decode("ascii").lower()[:26]


def make_event(etype: EventType, facts: Facts, at: datetime, seq: int | str) -> Event:
    """The event of type `etype` for `facts` at `at`, reporting transition `seq` of its
    subject.

    ValueError when the facts are not those of the type (a campaign's for a run event, a
    run.point_finished without its point) or `at` has no time zone.
    """
    expected = _FACTS_OF[etype]
    if not isinstance(facts, expected):
        raise ValueError(f"{etype.value} reports {expected.__name__}, not {type(facts).__name__}")
    if etype is EventType.RUN_POINT_FINISHED and isinstance(facts, RunFacts) and not facts.point:
        raise ValueError("run.point_finished needs the point that finished (RunFacts.point)")
    iso(at)  # checks the time zone
    return Event(type=etype, id=event_id(etype, subject(facts), seq), at=at, facts=facts)


# --- the body's shape -------------------------------------------------------------------
# Every key is always present (null when not known), so none of these is total=False.

Trim = Literal["points", "text", "lists", "data"]  # an entry of a body's ``trimmed``


class PointData(TypedDict):
    """One benchmark point's headline numbers (``best_point``, ``point``, ``points``)."""

    concurrency: int
    valid: bool
    completed: int | None
    num_prompts: int | None
    total_token_throughput: float | None  # tokens/s; null also when not finite
    output_throughput: float | None
    ttft_ms_median: float | None
    tpot_ms_median: float | None
    problem: str | None


class LinksData(TypedDict):
    archive: str | None
    report: str | None
    dashboard: str | None


class GpuHoursData(TypedDict):
    useful: float | None
    lost: float | None


class SpecData(TypedDict):
    name: str
    sha256: str


class RunRefData(TypedDict):
    id: str
    name: str
    owner: str
    owner_uid: int
    cluster: str
    spec: SpecData


class SlurmData(TypedDict):
    job_id: str | None
    state: str | None
    exit_code: str | None
    nodes: list[str]


class TimingData(TypedDict):
    submitted_at: str | None  # ISO 8601, UTC (`iso`)
    started_at: str | None
    finished_at: str | None
    queued_s: float | None  # submitted -> started
    ran_s: float | None  # started -> finished


class RunData(TypedDict):
    """``data`` of a run.* event."""

    run: RunRefData
    state: str
    attempt: int
    slurm: SlurmData
    outcome: str | None
    cause: str | None
    reason: str
    evidence: list[str]
    timing: TimingData
    gpu_hours: GpuHoursData
    best_point: PointData | None
    point: PointData | None  # run.point_finished: the point that finished
    points: list[PointData]  # per-point detail: dropped first when the body is too large
    links: LinksData


class CampaignRefData(TypedDict):
    id: str
    name: str
    owner: str
    owner_uid: int
    cluster: str | None


class PointCountsData(TypedDict):
    total: int
    verified: int
    running: int
    pending: int
    failed: int
    blocked: int


class ProblemData(TypedDict):
    """One failed or blocked point of a campaign."""

    recipe: str
    concurrency: int
    state: str
    reason: str


class BestOfData(TypedDict):
    """Where a campaign's ``best_point`` comes from."""

    run: str
    recipe: str
    topology: str


class CampaignData(TypedDict):
    """``data`` of a campaign.* event."""

    campaign: CampaignRefData
    points: PointCountsData
    outcome: str | None
    reason: str
    gpu_hours: GpuHoursData
    best_point: PointData | None
    best_point_of: BestOfData | None
    problems: list[ProblemData]  # per-point detail: dropped first when too large
    links: LinksData


class QuarantineIds(TypedDict):
    """``data`` of a node.quarantined event cut to its identifiers."""

    cluster: str
    node: str


class QuarantineData(QuarantineIds):
    """``data`` of a node.quarantined event."""

    owner: str | None
    owner_uid: int | None
    scope: Literal["everyone", "owner"]
    failures: int
    reason: str
    since: str
    until: str
    run: str | None


class PingIds(TypedDict):
    """``data`` of a test.ping event cut to its identifiers."""

    destination: str


class PingData(PingIds):
    """``data`` of a test.ping event."""

    requested_by: str


class IdName(TypedDict):
    id: str
    name: str


class RunIds(TypedDict):
    """``data`` of a run.* event cut to its identifiers."""

    run: IdName
    state: str
    outcome: str | None


class CampaignIds(TypedDict):
    """``data`` of a campaign.* event cut to its identifiers."""

    campaign: IdName


EventData = RunData | CampaignData | QuarantineData | PingData
# What ``data`` keeps at the last step of trimming (``trimmed`` ends in ``"data"``).
SubjectData = RunIds | CampaignIds | QuarantineIds | PingIds


class EventBody(TypedDict):
    """The body every destination gets, before it is encoded (`encode`)."""

    schema: str  # SCHEMA
    type: str  # an EventType value
    id: str
    timestamp: str  # ISO 8601, UTC
    data: EventData | SubjectData
    trimmed: list[Trim]


# --- the body -------------------------------------------------------------------------


def canonical_json(value: object) -> bytes:
    """`value` as canonical JSON: sorted keys, no spaces, UTF-8, no NaN (ValueError)."""
    text = json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return text.encode("utf-8")


def encode(event: Event, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The event's body: canonical JSON of at most `max_bytes`, trimmed as the module
    docstring says when it would be larger."""
    data = _data(event.facts)
    body = _body(event, data, [])
    if len(body) <= max_bytes:
        return body
    dropped: list[Trim] = []
    for lighter in _less_detail(event.facts):
        dropped = ["points"]
        data = _data(lighter)
        body = _body(event, data, dropped)
        if len(body) <= max_bytes:
            return body
    for text_limit, list_limit in _SHRINK_STEPS:
        cut = _Cut()
        shrunk = _shrunk(data, text_limit, list_limit, cut)
        body = _body(event, shrunk, dropped + cut.marks())
        if len(body) <= max_bytes:
            return body
    cut = _Cut()
    minimal = _shrunk(_minimal(event.facts), 64, None, cut)
    body = _body(event, minimal, [*dropped, *cut.marks(), "data"])
    if len(body) > max_bytes:
        raise ValueError(f"max_bytes {max_bytes} cannot hold even the event's identifiers")
    return body


# (characters per string, items per list); None: lists are kept whole.
_SHRINK_STEPS: Final[tuple[tuple[int, int | None], ...]] = (
    (256, None),
    (64, None),
    (64, 16),
    (16, 4),
)


def _body(event: Event, data: EventData | SubjectData, trimmed: list[Trim]) -> bytes:
    value: EventBody = {
        "schema": SCHEMA,
        "type": event.type.value,
        "id": event.id,
        "timestamp": iso(event.at),
        "data": data,
        "trimmed": trimmed,
    }
    return canonical_json(value)


def _less_detail(facts: Facts) -> Iterator[Facts]:
    """The facts with less and less per-point detail (``points`` of a run, ``problems`` of
    a campaign): the first half of the list (a run's points are in concurrency order),
    then the first half of that, ..., then none; nothing when there is none to cut."""
    if isinstance(facts, RunFacts):
        n = len(facts.points)
        while n:
            n //= 2
            yield replace(facts, points=facts.points[:n])
    elif isinstance(facts, CampaignFacts):
        n = len(facts.problems)
        while n:
            n //= 2
            yield replace(facts, problems=facts.problems[:n])


@dataclass
class _Cut:
    """What one shrinking pass cut (for the body's ``trimmed``)."""

    text: bool = False
    lists: bool = False

    def marks(self) -> list[Trim]:
        marks: list[Trim] = []
        if self.text:
            marks.append("text")
        if self.lists:
            marks.append("lists")
        return marks


_D = TypeVar("_D", bound=EventData | SubjectData)


def _shrunk(data: _D, text_limit: int, list_limit: int | None, cut: _Cut) -> _D:
    """`data` with every string cut to `text_limit` characters and every list to
    `list_limit` items: the same keys holding the same types, so it is still a `_D`."""
    return cast("_D", _shrink(data, text_limit, list_limit, cut))


def _shrink(value: object, text_limit: int, list_limit: int | None, cut: _Cut) -> object:
    # One walk for every part of every kind of data: each is a JSON value here (a TypedDict
    # is a Mapping[str, object]); `_shrunk` gives the result its type back.
    if isinstance(value, str):
        if len(value) <= text_limit:
            return value
        cut.text = True
        return value[: max(text_limit - 3, 1)] + "..."
    if isinstance(value, Mapping):
        return {k: _shrink(v, text_limit, list_limit, cut) for k, v in value.items()}
    if isinstance(value, list):
        kept = value if list_limit is None else value[:list_limit]
        cut.lists = cut.lists or len(kept) < len(value)
        return [_shrink(v, text_limit, list_limit, cut) for v in kept]
    return value


def _minimal(facts: Facts) -> SubjectData:
    """Only what says which subject the event is about."""
    if isinstance(facts, RunFacts):
        return {
            "run": {"id": _name(facts.run.id), "name": _name(facts.run.name)},
            "state": _name(facts.state),
            "outcome": _opt(facts.outcome, NAME_MAX),
        }
    if isinstance(facts, CampaignFacts):
        return {"campaign": {"id": _name(facts.id), "name": _name(facts.name)}}
    if isinstance(facts, QuarantineFacts):
        return {"cluster": _name(facts.cluster), "node": _name(facts.node)}
    return {"destination": _name(facts.destination)}


def _data(facts: Facts) -> EventData:
    if isinstance(facts, RunFacts):
        return _run_data(facts)
    if isinstance(facts, CampaignFacts):
        return _campaign_data(facts)
    if isinstance(facts, QuarantineFacts):
        return _quarantine_data(facts)
    return {
        "destination": _name(facts.destination),
        "requested_by": _name(facts.requested_by),
    }


def _run_data(f: RunFacts) -> RunData:
    t = f.timing
    return {
        "run": {
            "id": _name(f.run.id),
            "name": _name(f.run.name),
            "owner": _name(f.run.owner),
            "owner_uid": f.run.owner_uid,
            "cluster": _name(f.run.cluster),
            "spec": {"name": _name(f.run.spec_name), "sha256": _name(f.run.spec_sha256)},
        },
        "state": _name(f.state),
        "attempt": f.attempt,
        "slurm": {
            "job_id": _opt(f.slurm.job_id, NAME_MAX),
            "state": _opt(f.slurm.state, NAME_MAX),
            "exit_code": _opt(f.slurm.exit_code, NAME_MAX),
            "nodes": [_name(n) for n in f.slurm.nodes],
        },
        "outcome": _opt(f.outcome, NAME_MAX),
        "cause": _opt(f.cause, NAME_MAX),
        "reason": _text(f.reason, TEXT_MAX),
        "evidence": [_text(line, LINE_MAX) for line in f.evidence[:EVIDENCE_MAX_LINES]],
        "timing": {
            "submitted_at": _opt_iso(t.submitted_at),
            "started_at": _opt_iso(t.started_at),
            "finished_at": _opt_iso(t.finished_at),
            "queued_s": _seconds(t.submitted_at, t.started_at),
            "ran_s": _seconds(t.started_at, t.finished_at),
        },
        "gpu_hours": {"useful": _num(f.gpu_hours_useful), "lost": _num(f.gpu_hours_lost)},
        "best_point": _opt_point(f.best),
        "point": _opt_point(f.point),
        "points": [_point(p) for p in f.points],
        "links": _links(f.links),
    }


def _campaign_data(f: CampaignFacts) -> CampaignData:
    c = f.points
    return {
        "campaign": {
            "id": _name(f.id),
            "name": _name(f.name),
            "owner": _name(f.owner),
            "owner_uid": f.owner_uid,
            "cluster": _opt(f.cluster, NAME_MAX),
        },
        "points": {
            "total": c.total,
            "verified": c.verified,
            "running": c.running,
            "pending": c.pending,
            "failed": c.failed,
            "blocked": c.blocked,
        },
        "outcome": _opt(f.outcome, NAME_MAX),
        "reason": _text(f.reason, TEXT_MAX),
        "gpu_hours": {"useful": _num(f.gpu_hours_useful), "lost": _num(f.gpu_hours_lost)},
        "best_point": _opt_point(f.best),
        "best_point_of": None
        if f.best_of is None
        else {
            "run": _name(f.best_of.run),
            "recipe": _name(f.best_of.recipe),
            "topology": _name(f.best_of.topology),
        },
        "problems": [
            {
                "recipe": _name(p.recipe),
                "concurrency": p.concurrency,
                "state": _name(p.state),
                "reason": _text(p.reason, LINE_MAX),
            }
            for p in f.problems
        ],
        "links": _links(f.links),
    }


def _quarantine_data(f: QuarantineFacts) -> QuarantineData:
    return {
        "cluster": _name(f.cluster),
        "node": _name(f.node),
        "owner": _opt(f.owner, NAME_MAX),
        "owner_uid": f.owner_uid,
        "scope": "everyone" if f.owner_uid is None else "owner",
        "failures": f.failures,
        "reason": _text(f.reason, TEXT_MAX),
        "since": iso(f.since),
        "until": iso(f.until),
        "run": _opt(f.run, NAME_MAX),
    }


def _point(p: PointFacts) -> PointData:
    return {
        "concurrency": p.concurrency,
        "valid": p.valid,
        "completed": p.completed,
        "num_prompts": p.num_prompts,
        "total_token_throughput": _num(p.total_token_throughput),
        "output_throughput": _num(p.output_throughput),
        "ttft_ms_median": _num(p.ttft_ms_median),
        "tpot_ms_median": _num(p.tpot_ms_median),
        "problem": _opt(p.problem, LINE_MAX),
    }


def _opt_point(p: PointFacts | None) -> PointData | None:
    return None if p is None else _point(p)


def _links(links: Links) -> LinksData:
    return {
        "archive": _opt(links.archive, LINK_MAX),
        "report": _opt(links.report, LINK_MAX),
        "dashboard": _opt(links.dashboard, LINK_MAX),
    }


def _text(value: str, limit: int) -> str:
    return job_text(value, limit)


def _name(value: str) -> str:
    return job_text(value, NAME_MAX)


def _opt(value: str | None, limit: int) -> str | None:
    return None if value is None else job_text(value, limit)


def _num(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 3)


def iso(at: datetime) -> str:
    """`at` in UTC as ISO 8601 with milliseconds and ``Z``; ValueError when it is naive."""
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(f"{at!r} has no time zone; events carry UTC times")
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _opt_iso(at: datetime | None) -> str | None:
    return None if at is None else iso(at)


# --- campaign.progress throttle ---------------------------------------------------------


@dataclass(frozen=True)
class ProgressGate:
    """Whether a campaign.progress event may be made now; if not, when to ask again."""

    emit: bool
    retry_at: datetime | None  # set when emit is False: the end of the current minute


def progress_gate(last_emitted: datetime | None, now: datetime) -> ProgressGate:
    """At most one campaign.progress per `PROGRESS_INTERVAL` per campaign.

    `last_emitted` is when the campaign's previous progress event was made (journaled;
    None: never). A clock that went back (`now` before it) lets the event go: the gate
    spares receivers a flood, and must not silence a campaign for as long as the jump.
    """
    if last_emitted is None or now < last_emitted or now - last_emitted >= PROGRESS_INTERVAL:
        return ProgressGate(emit=True, retry_at=None)
    return ProgressGate(emit=False, retry_at=last_emitted + PROGRESS_INTERVAL)


def describe(event: Event) -> str:
    """One line saying what happened (a notification's fallback text and mail subject).

    Names come from jobs and specs: the caller escapes them for its medium.
    """
    f = event.facts
    if isinstance(f, RunFacts):
        what = _RUN_VERBS[event.type](f)
        owner = _name(f.run.owner) or f"uid {f.run.owner_uid}"
        return f"run {_name(f.run.name)} ({_name(f.run.id)}) of {owner} {what}"
    if isinstance(f, CampaignFacts):
        c = f.points
        counts = f"{c.verified}/{c.total} points verified"
        if event.type is EventType.CAMPAIGN_FINISHED:  # finished, stopped or cancelled
            return f"campaign {_name(f.name)} {_opt(f.outcome, NAME_MAX) or 'finished'}: {counts}"
        return f"campaign {_name(f.name)}: {counts}, {c.running} running, {c.failed} failed"
    if isinstance(f, QuarantineFacts):
        whose = _name(f.owner) if f.owner else f"uid {f.owner_uid}"
        scope = "everyone" if f.owner_uid is None else f"runs of {whose}"
        return f"node {_name(f.node)} on {_name(f.cluster)} quarantined for {scope}"
    return f"test event for destination {_name(f.destination)}, asked by {_name(f.requested_by)}"


def _job(f: RunFacts) -> str:
    return _opt(f.slurm.job_id, NAME_MAX) or "not known yet"


def _finished(f: RunFacts) -> str:
    outcome = _opt(f.outcome, NAME_MAX) or "finished"
    return f"{outcome}: {_text(f.reason, TEXT_MAX)}" if f.reason else outcome


def _point_done(f: RunFacts) -> str:
    p = f.point
    assert p is not None  # make_event checks it
    return f"finished benchmark point c={p.concurrency}" + ("" if p.valid else " (not valid)")


_RUN_VERBS: Final[Mapping[EventType, Callable[[RunFacts], str]]] = {
    EventType.RUN_SUBMITTED: lambda f: f"submitted as job {_job(f)}",
    EventType.RUN_STARTED: lambda f: f"started (job {_job(f)})",
    EventType.RUN_POINT_FINISHED: _point_done,
    EventType.RUN_FINISHED: _finished,
}
