"""What a run journals about itself besides its record: the events' kinds and payloads.

Each payload is a `TypedDict` the writer builds, and read back through one parser,
`parse_event(kind, payload) -> RunEvent` (`parsed` for a run's journaled events): a tagged
union of typed events, each field's type checked and what an older daemon wrote kept; a
kind it does not know is `Unknown` (never an error: an old or newer journal reads). Both
ends agree on one shape and a journal written before this module existed reads the same:
a `TypedDict` is a plain dict, its JSON is what the events held before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final, NotRequired, TypedDict, TypeVar

from llmd_supervisor.core.protocol.runs import UsageView
from llmd_supervisor.core.verdict.cause import CauseJson
from llmd_supervisor.core.verdict.decide import VerdictReceipt
from llmd_supervisor.core.verdict.judge import Hang, NodeReport, node_report
from llmd_supervisor.core.verdict.usage import AttemptUsage

RECEIPT_EVENT: Final = "verify.receipt"  # ReceiptEvent
ATTEMPT_EVENT: Final = "attempt.ended"  # AttemptEntry
HELD_EVENT: Final = "run.held"  # HeldEvent
JOB_FILES_EVENT: Final = "job.files"  # JobFiles
TERM_EVENT: Final = "cancel.term_sent"  # CancelTerm
KILL_EVENT: Final = "cancel.kill_sent"  # CancelKill
TRANSITION_EVENT: Final = "run.transition"  # Transition
LOG_REFUSED_EVENT: Final = "log.refused"  # LogRefusedEvent
LOG_CAPPED_EVENT: Final = "log.capped"  # LogCappedEvent
STAGE_OVERDUE_EVENT: Final = "stage.overdue"  # written by `attempt`

# An event a phase returns for the driver to journal with the transition it applies:
# (kind, fields), as `RunContext.emit` takes them.
ToJournal = tuple[str, Mapping[str, object]]
NODE_UNREACHABLE_EVENT: Final = "node.unreachable"  # written by `attempt`

# A journaled event as the journal returns it: ``{"at": iso, "kind": ..., **fields}``.
JournalEvent = Mapping[str, object]


class AttemptEntry(TypedDict):
    """An attempt's end (`retries`): the mark that it was handled, and its history entry.
    An older daemon wrote no `retried`/`unplaced` (nor, older still, the usage); one read
    back from the journal also holds the event's `at` and `kind`."""

    attempt: int
    submission: int
    slurm_job_id: str | None
    job_name: str
    nodes: list[str]
    outcome: str
    reason: str
    cause: str | None
    implicated: list[str]
    exclude: list[str]
    retry: str
    retried: NotRequired[bool]
    unplaced: NotRequired[bool]
    elapsed_s: NotRequired[float | None]
    node_hours: NotRequired[float | None]
    gpu_hours: NotRequired[float | None]
    at: NotRequired[str]
    kind: NotRequired[str]


class JobFiles(TypedDict):
    """A foreign job's batch logs (inside its log directory), submit time and owner."""

    batch_logs: list[str]
    submit_time: str | None
    user_id: int | None


class LogRefusedEvent(TypedDict):
    """A job's file that is not copied (or read): its path and why, escaped (the job
    named it)."""

    path: str
    reason: str


class LogCappedEvent(TypedDict):
    """A log copy that stopped growing at the copy cap."""

    copy: str
    size: int


class HeldEvent(TypedDict):
    """A submission held for want of nodes: why, which, until when (ISO)."""

    reason: str
    submission: int
    until: str


# "for" is a keyword, hence the functional form; `for`: "cancel" or "hang"
CancelTerm = TypedDict(
    "CancelTerm", {"slurm_job_id": str, "grace_s": int, "delivered": bool, "for": str}
)
CancelKill = TypedDict("CancelKill", {"slurm_job_id": str, "for": str})
Transition = TypedDict("Transition", {"from": str, "to": str, "event": str})


class HeldJson(TypedDict):
    """What a receipt says of a hold."""

    submission: int
    reason: str


class HeldReceipt(TypedDict):
    """The receipt of a run whose hold passed its deadline (no job was judged)."""

    outcome: str
    reason: str
    attempt: int
    slurm_job_name: str
    held: HeldJson
    attempts: list[AttemptEntry]
    usage_total: UsageView


class SupervisionFailedDetail(TypedDict):
    state: str
    error: str
    failures: int


class GivenUpReceipt(TypedDict):
    """The receipt of a run whose supervision kept failing the same way (`failures`)."""

    outcome: str
    reason: str
    attempt: int
    slurm_job_name: str
    supervision_failed: SupervisionFailedDetail
    attempts: list[AttemptEntry]


class RunPart(TypedDict):
    """What the run adds to the verdict's receipt. `usage` is missing when the attempt's
    end was recorded before a restart; `hung` (its `stage.overdue` event) when no agent
    hung."""

    cause: CauseJson | None
    cancel_reached: bool
    attempt: int
    slurm_job_name: str
    hung: NotRequired[JournalEvent]
    usage: NotRequired[AttemptUsage]


class JudgedReceipt(VerdictReceipt, RunPart):
    """A judged attempt's receipt: the verdict's (`core.verdict.decide`), with the run's outcome
    and reason (what an agent's hang, the diagnosis and an unreached cancel said) and its
    `RunPart`, built at once when the verdict is made."""


class AttemptReceipt(JudgedReceipt):
    """A retried attempt's own receipt (``attempt<N>/receipt.json``)."""

    retry: str


class Receipt(JudgedReceipt):
    """The run's receipt (``receipt.json``): the last attempt's, with every attempt."""

    attempts: list[AttemptEntry]
    usage_total: UsageView


class ReceiptEvent(TypedDict):
    receipt: Receipt | HeldReceipt | GivenUpReceipt


# --- readers -----------------------------------------------------------------------------


def _str_list(value: object) -> list[str] | None:
    return [str(v) for v in value] if isinstance(value, list) else None


def _number(value: object) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def attempt_entry_of(raw: Mapping[str, object]) -> AttemptEntry:
    """An `ATTEMPT_EVENT` as journaled (by this daemon or an older one)."""
    job_id, cause = raw.get("slurm_job_id"), raw.get("cause")
    entry = AttemptEntry(
        attempt=_int(raw.get("attempt"), 0),
        submission=_int(raw.get("submission"), 0),
        slurm_job_id=None if job_id is None else str(job_id),
        job_name=str(raw.get("job_name", "")),
        nodes=_str_list(raw.get("nodes")) or [],
        outcome=str(raw.get("outcome", "")),
        reason=str(raw.get("reason", "")),
        cause=None if cause is None else str(cause),
        implicated=_str_list(raw.get("implicated")) or [],
        exclude=_str_list(raw.get("exclude")) or [],
        retry=str(raw.get("retry", "")),
    )
    if "elapsed_s" in raw:
        entry["elapsed_s"] = _number(raw["elapsed_s"])
    if "node_hours" in raw:
        entry["node_hours"] = _number(raw["node_hours"])
    if "gpu_hours" in raw:
        entry["gpu_hours"] = _number(raw["gpu_hours"])
    if isinstance(retried := raw.get("retried"), bool):
        entry["retried"] = retried
    if isinstance(unplaced := raw.get("unplaced"), bool):
        entry["unplaced"] = unplaced
    if isinstance(at := raw.get("at"), str):
        entry["at"] = at
    if isinstance(kind := raw.get("kind"), str):
        entry["kind"] = kind
    return entry


def stage_overdue_of(raw: Mapping[str, object]) -> Hang:
    """A `STAGE_OVERDUE_EVENT` as journaled (a field of another type reads as missing);
    the event itself is kept for the receipt."""
    node, rank, stage = raw.get("node"), raw.get("rank"), raw.get("stage")
    return Hang(
        node if isinstance(node, str) else None,
        rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        stage if isinstance(stage, str) else None,
        _number(raw.get("deadline_s")),
        _number(raw.get("over_s")),
        raw,
    )


def node_unreachable_of(raw: Mapping[str, object]) -> NodeReport:
    """A `NODE_UNREACHABLE_EVENT` as journaled: the node and why (`core.verdict.judge`
    classifies the error's words: the journal holds no more)."""
    return node_report(raw.get("node"), raw.get("error"))


def job_files_of(raw: Mapping[str, object]) -> JobFiles:
    """A `JOB_FILES_EVENT` as journaled."""
    submitted, uid = raw.get("submit_time"), raw.get("user_id")
    return JobFiles(
        batch_logs=_str_list(raw.get("batch_logs")) or [],
        submit_time=submitted if isinstance(submitted, str) else None,
        user_id=uid if isinstance(uid, int) and not isinstance(uid, bool) else None,
    )


def last_receipt(events: Sequence[JournalEvent]) -> Mapping[str, object] | None:
    """The last receipt journaled (what the archive writes), if any."""
    receipts = of_type(parsed(events), ReceiptNoted)
    return receipts[-1].receipt if receipts else None


# --- the events, typed -------------------------------------------------------------------


@dataclass(frozen=True)
class AttemptEnded:
    """`ATTEMPT_EVENT`: an attempt's end (its history entry)."""

    entry: AttemptEntry


@dataclass(frozen=True)
class ReceiptNoted:
    """`RECEIPT_EVENT`: a verdict's receipt (None: not an object)."""

    receipt: Mapping[str, object] | None


@dataclass(frozen=True)
class RunHeld:
    """`HELD_EVENT`: a submission held for want of nodes (`at`: when it was journaled,
    None when unreadable; `submission` 1 when an older daemon did not say)."""

    submission: int
    reason: str
    until: str | None
    at: datetime | None


@dataclass(frozen=True)
class JobFilesNoted:
    """`JOB_FILES_EVENT`: a foreign job's files."""

    files: JobFiles


@dataclass(frozen=True)
class StageOverdue:
    """`STAGE_OVERDUE_EVENT`: an agent hung in a stage during attempt `attempt`."""

    hang: Hang
    attempt: int | None


@dataclass(frozen=True)
class NodeUnreachable:
    """`NODE_UNREACHABLE_EVENT`: a node attempt `attempt` could not reach, and why."""

    report: NodeReport
    attempt: int | None


@dataclass(frozen=True)
class CancelSent:
    """`TERM_EVENT` or `KILL_EVENT` (`kind`): a signal sent to a job, for a cancel or a
    hang (`reason`: the event's ``for``); `delivered` is True when an older daemon did not
    say."""

    kind: str
    slurm_job_id: str | None
    reason: str | None
    delivered: bool


@dataclass(frozen=True)
class Transitioned:
    """`TRANSITION_EVENT`: a state change the driver applied."""

    source: str
    target: str
    event: str


@dataclass(frozen=True)
class LogRefused:
    """`LOG_REFUSED_EVENT`."""

    fields: LogRefusedEvent


@dataclass(frozen=True)
class LogCapped:
    """`LOG_CAPPED_EVENT`."""

    fields: LogCappedEvent


@dataclass(frozen=True)
class Unknown:
    """An event of a kind this daemon does not read (or another module's), as journaled."""

    kind: str
    payload: Mapping[str, object]


RunEvent = (
    AttemptEnded
    | ReceiptNoted
    | RunHeld
    | JobFilesNoted
    | StageOverdue
    | NodeUnreachable
    | CancelSent
    | Transitioned
    | LogRefused
    | LogCapped
    | Unknown
)
E = TypeVar("E", bound=RunEvent)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _attempt(raw: Mapping[str, object]) -> int | None:
    value = raw.get("attempt")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _held(raw: Mapping[str, object]) -> RunHeld:
    at = _str(raw.get("at"))
    try:
        when = None if at is None else datetime.fromisoformat(at)
    except ValueError:
        when = None
    return RunHeld(
        _int(raw.get("submission", 1), 0), str(raw.get("reason", "")), _str(raw.get("until")), when
    )


def _cancel_sent(kind: str, raw: Mapping[str, object]) -> CancelSent:
    job_id = raw.get("slurm_job_id")
    return CancelSent(
        kind,
        None if job_id is None else str(job_id),
        _str(raw.get("for")),
        bool(raw.get("delivered", True)),
    )


def _receipt(raw: Mapping[str, object]) -> ReceiptNoted:
    receipt = raw.get("receipt")
    return ReceiptNoted(receipt if isinstance(receipt, Mapping) else None)


def _log_capped(raw: Mapping[str, object]) -> LogCapped:
    return LogCapped(LogCappedEvent(copy=str(raw.get("copy", "")), size=_int(raw.get("size"), 0)))


_PARSERS: Final[Mapping[str, Callable[[Mapping[str, object]], RunEvent]]] = {
    ATTEMPT_EVENT: lambda raw: AttemptEnded(attempt_entry_of(raw)),
    RECEIPT_EVENT: _receipt,
    HELD_EVENT: _held,
    JOB_FILES_EVENT: lambda raw: JobFilesNoted(job_files_of(raw)),
    STAGE_OVERDUE_EVENT: lambda raw: StageOverdue(stage_overdue_of(raw), _attempt(raw)),
    NODE_UNREACHABLE_EVENT: lambda raw: NodeUnreachable(node_unreachable_of(raw), _attempt(raw)),
    TERM_EVENT: lambda raw: _cancel_sent(TERM_EVENT, raw),
    KILL_EVENT: lambda raw: _cancel_sent(KILL_EVENT, raw),
    TRANSITION_EVENT: lambda raw: Transitioned(
        str(raw.get("from", "")), str(raw.get("to", "")), str(raw.get("event", ""))
    ),
    LOG_REFUSED_EVENT: lambda raw: LogRefused(
        LogRefusedEvent(path=str(raw.get("path", "")), reason=str(raw.get("reason", "")))
    ),
    LOG_CAPPED_EVENT: _log_capped,
}


def parse_event(kind: str, payload: Mapping[str, object]) -> RunEvent:
    """One journaled event, typed: the single reader of the run's event payloads. A kind
    not in the union is `Unknown`; a field of the wrong type reads as an older daemon's
    missing one. Never raises for what a journal holds."""
    parser = _PARSERS.get(kind)
    return Unknown(kind, payload) if parser is None else parser(payload)


def parsed(events: Iterable[JournalEvent]) -> list[RunEvent]:
    """A run's journaled events (``{"at", "kind", **fields}``), typed, in journal order."""
    return [parse_event(str(e.get("kind", "")), e) for e in events]


def of_type(events: Iterable[RunEvent], kind: type[E]) -> list[E]:
    """The typed events of one member of the union, in journal order."""
    return [e for e in events if isinstance(e, kind)]
