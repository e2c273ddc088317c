"""What a run journals about itself besides its record: the events' kinds and payloads.

Each payload is a `TypedDict` the writer builds and the reader parses back (`*_of`
functions, which check every field's type and keep what an older daemon wrote), so both
ends agree on one shape and a journal written before this module existed reads the same:
a `TypedDict` is a plain dict, its JSON is what the events held before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NotRequired, TypedDict

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


def held_submission(raw: Mapping[str, object]) -> int:
    """The submission a `HELD_EVENT` is of (1 when an older daemon did not say)."""
    return _int(raw.get("submission", 1), 0)


def of_kind(events: Iterable[JournalEvent], kind: str) -> list[JournalEvent]:
    """The events of one kind, in journal order."""
    return [e for e in events if e.get("kind") == kind]


def of_attempt(events: Iterable[JournalEvent], kind: str, attempt: int) -> list[JournalEvent]:
    """The events of one kind that an attempt's watchers journaled."""
    return [e for e in of_kind(events, kind) if e.get("attempt") == attempt]


def last_receipt(events: Sequence[JournalEvent]) -> Mapping[str, object] | None:
    """The last receipt journaled (what the archive writes), if any."""
    receipts = [e.get("receipt") for e in of_kind(events, RECEIPT_EVENT)]
    last = receipts[-1] if receipts else None
    return last if isinstance(last, Mapping) else None
