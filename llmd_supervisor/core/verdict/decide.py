"""The pure verdict: what a finished Slurm job's evidence proves (DESIGN.md section 5).

Flow: build a :class:`SlurmQuery` from each sacct / scontrol call (``sacct_query``,
``scontrol_query``, ``failed_query``), fold them into a :class:`VerdictState` with
:func:`observe`, then ask :func:`decide` with the marker reading. ``decide`` returns
``PENDING_EVIDENCE`` while it is worth asking again; the caller polls until it returns
anything else, then writes :func:`build_receipt`. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import TypedDict

from llmd_supervisor.core.results.evidence import GateJson, GateResult
from llmd_supervisor.core.slurm.parse import (
    ExitCode,
    JobState,
    ParsedState,
    SacctRow,
    accounting_disabled,
    allocation_row,
    invalid_job_id,
    job_rows,
    parse_sacct,
    parse_scontrol_job,
)
from llmd_supervisor.core.verdict.marker import MarkerReading, MarkerStatus, marker_filename
from llmd_supervisor.errors import SlurmJobNotFound, SlurmParseError

__all__ = [
    "RECEIPT_SCHEMA",
    "Belief",
    "JobRecord",
    "Outcome",
    "QueryOutcome",
    "SlurmQuery",
    "Source",
    "SourceView",
    "Verdict",
    "VerdictState",
    "believed",
    "build_receipt",
    "decide",
    "failed_query",
    "observe",
    "sacct_query",
    "scontrol_query",
]

RECEIPT_SCHEMA = "llmd-supervisor.receipt/1"


class Source(StrEnum):
    """Where a job record came from."""

    SACCT = "sacct"  # slurmdbd's accounting record (durable, may lag)
    SCONTROL = "scontrol"  # slurmctld's memory (exact, gone after MinJobAge)


class QueryOutcome(StrEnum):
    """What one query answered; only RECORD carries knowledge."""

    RECORD = "record"  # the allocation record was found and parsed
    EMPTY = "empty"  # the command worked but printed no allocation row for the job
    NOT_FOUND = "not_found"  # scontrol: "Invalid job id specified" (purged after MinJobAge)
    ERROR = "error"  # the command failed, timed out, or printed something unparsable
    ACCOUNTING_DISABLED = "accounting_disabled"  # sacct: accounting storage is disabled


class Outcome(StrEnum):
    """The verdict on a run; every value but PENDING_EVIDENCE is final."""

    SUCCEEDED = "succeeded"  # COMPLETED 0:0 believed and marker rc 0 for this job
    FAILED = "failed"  # anything that is not one of the specific outcomes below
    CANCELLED = "cancelled"  # Slurm says CANCELLED, or the supervisor's cancel ended the run
    TIMED_OUT = "timed_out"  # Slurm says TIMEOUT
    NODE_FAILED = "node_failed"  # Slurm says NODE_FAIL
    OUT_OF_MEMORY = "out_of_memory"  # Slurm says OUT_OF_MEMORY
    UNVERIFIED = "unverified"  # no believable terminal record by the deadline
    PENDING_EVIDENCE = "pending_evidence"  # not decided yet: query again later


_STATE_OUTCOMES = {
    JobState.CANCELLED: Outcome.CANCELLED,
    JobState.TIMEOUT: Outcome.TIMED_OUT,
    JobState.NODE_FAIL: Outcome.NODE_FAILED,
    JobState.OUT_OF_MEMORY: Outcome.OUT_OF_MEMORY,
}


@dataclass(frozen=True)
class JobRecord:
    """An allocation's State/ExitCode as one source reported it."""

    source: Source
    state: ParsedState
    exit_code: ExitCode
    derived_exit_code: ExitCode | None
    raw: str  # the sacct allocation line or the scontrol record

    @property
    def settled(self) -> bool:
        """Terminal, or unrecognised (which is treated as a failure, never as running)."""
        return self.state.state.is_terminal or self.state.state is JobState.UNKNOWN

    def agrees_with(self, other: JobRecord) -> bool:
        """Same normalised State and same ExitCode (DerivedExitCode does not count)."""
        return _agreement_key(self) == _agreement_key(other)

    def contradicts(self, other: JobRecord) -> bool:
        """The two records would lead to different outcomes.

        Different States, or COMPLETED with different ExitCodes. Same-State records with
        different ExitCodes do not contradict: for signal-ended jobs slurmctld and slurmdbd
        store different codes (scontrol TIMEOUT 0:15 while sacct says TIMEOUT 0:0).
        """
        mine, theirs = _agreement_key(self), _agreement_key(other)
        if mine[:2] != theirs[:2]:
            return True
        return self.state.state is JobState.COMPLETED and self.exit_code != other.exit_code

    def describe(self) -> str:
        """``State=COMPLETED ExitCode=0:0`` (raw state text when it was not exact)."""
        state = self.state.state.value if self.state.exact else self.state.raw.strip()
        return f"State={state} ExitCode={self.exit_code}"


def _agreement_key(record: JobRecord) -> tuple[JobState, str, ExitCode]:
    unknown_text = record.state.raw.strip() if record.state.state is JobState.UNKNOWN else ""
    return (record.state.state, unknown_text, record.exit_code)


@dataclass(frozen=True)
class SlurmQuery:
    """One sacct or scontrol call about one job, as observed."""

    source: Source
    job_id: str
    taken_at: datetime
    outcome: QueryOutcome
    record: JobRecord | None = None  # set exactly when outcome is RECORD
    rows: tuple[SacctRow, ...] = ()  # sacct: this job's allocation and step rows
    error: str = ""  # why the query failed (stderr or parse error)
    raw: str = ""  # stdout as printed


def sacct_query(
    job_id: str, *, taken_at: datetime, returncode: int, stdout: str, stderr: str
) -> SlurmQuery:
    """Classify one finished ``sacct --parsable2 --noheader --format=<SACCT_FIELDS>`` call.

    Unparsable output is an ERROR query (never a record); output without the job's
    allocation row is EMPTY (its step rows, if any, are kept for the receipt).
    """
    base = SlurmQuery(Source.SACCT, job_id, taken_at, QueryOutcome.ERROR, raw=stdout)
    if accounting_disabled(stderr):
        return replace(base, outcome=QueryOutcome.ACCOUNTING_DISABLED, error=stderr.strip())
    if returncode != 0:
        return replace(base, error=stderr.strip() or f"exit status {returncode}")
    try:
        rows = tuple(job_rows(parse_sacct(stdout), job_id))
    except SlurmParseError as exc:
        return replace(base, error=str(exc))
    row = allocation_row(rows, job_id)
    if row is None:
        return replace(base, outcome=QueryOutcome.EMPTY, rows=rows)
    if row.exit_code is None:
        return replace(base, error=f"allocation row of job {job_id} has no ExitCode", rows=rows)
    record = JobRecord(Source.SACCT, row.state, row.exit_code, row.derived_exit_code, row.raw)
    return replace(base, outcome=QueryOutcome.RECORD, record=record, rows=rows)


def scontrol_query(
    job_id: str, *, taken_at: datetime, returncode: int, stdout: str, stderr: str
) -> SlurmQuery:
    """Classify one finished ``scontrol show job --oneliner <job_id>`` call.

    "Invalid job id specified" is NOT_FOUND; a failed or unparsable call, or a record for
    another job id, is ERROR; blank output is EMPTY.
    """
    base = SlurmQuery(Source.SCONTROL, job_id, taken_at, QueryOutcome.ERROR, raw=stdout)
    if returncode != 0:
        if invalid_job_id(stderr) or invalid_job_id(stdout):
            return replace(base, outcome=QueryOutcome.NOT_FOUND, error=stderr.strip())
        return replace(base, error=stderr.strip() or f"exit status {returncode}")
    if not stdout.strip():
        return replace(base, outcome=QueryOutcome.EMPTY)
    try:
        job = parse_scontrol_job(stdout)
    except SlurmJobNotFound as exc:
        return replace(base, outcome=QueryOutcome.NOT_FOUND, error=str(exc))
    except SlurmParseError as exc:
        return replace(base, error=str(exc))
    if job.job_id != job_id:
        return replace(base, error=f"scontrol answered for job {job.job_id}, not {job_id}")
    record = JobRecord(Source.SCONTROL, job.state, job.exit_code, job.derived_exit_code, job.raw)
    return replace(base, outcome=QueryOutcome.RECORD, record=record)


def failed_query(source: Source, job_id: str, *, taken_at: datetime, error: str) -> SlurmQuery:
    """A query that produced no output to classify (timed out, could not start)."""
    return SlurmQuery(source, job_id, taken_at, QueryOutcome.ERROR, error=error)


@dataclass(frozen=True)
class SourceView:
    """The latest record one source gave, and how many consecutive records agreed with it."""

    record: JobRecord
    streak: int


@dataclass(frozen=True)
class VerdictState:
    """Everything learnt so far about one job's end; immutable, grown by :func:`observe`."""

    job_id: str
    started_at: datetime  # when verification began; "no record after N s" counts from here
    queries: tuple[SlurmQuery, ...] = ()
    sacct: SourceView | None = None
    scontrol: SourceView | None = None
    accounting_disabled_seen: bool = False
    scontrol_gone: bool = False  # scontrol's latest answer was "Invalid job id specified"

    def view(self, source: Source) -> SourceView | None:
        """The latest record from ``source``, if any."""
        return self.sacct if source is Source.SACCT else self.scontrol


def observe(state: VerdictState, query: SlurmQuery) -> VerdictState:
    """Fold one query into the knowledge; the stability rule lives here.

    Only a RECORD changes what a source is believed to say. EMPTY, NOT_FOUND, ERROR and
    ACCOUNTING_DISABLED answers are kept for the receipt but change no record and do not
    break a streak of agreeing reads: an empty or failed query is not a fact. A record
    that disagrees with the source's previous one replaces it and restarts its streak
    (sacct was seen to say FAILED 0:0, then FAILED 2:0, for the same job).
    Raises ValueError if the query is about another job (a caller bug).
    """
    if query.job_id != state.job_id:
        raise ValueError(f"query for job {query.job_id} folded into verdict for {state.job_id}")
    state = replace(state, queries=(*state.queries, query))
    if query.outcome is QueryOutcome.ACCOUNTING_DISABLED:
        state = replace(state, accounting_disabled_seen=True)
    if query.source is Source.SCONTROL and query.outcome in (
        QueryOutcome.RECORD,
        QueryOutcome.NOT_FOUND,
    ):
        state = replace(state, scontrol_gone=query.outcome is QueryOutcome.NOT_FOUND)
    if query.record is None:
        return state
    previous = state.view(query.source)
    streak = previous.streak + 1 if previous and previous.record.agrees_with(query.record) else 1
    view = SourceView(query.record, streak)
    if query.source is Source.SACCT:
        return replace(state, sacct=view)
    return replace(state, scontrol=view)


@dataclass(frozen=True)
class Belief:
    """A settled record the stability rule lets us believe, and why."""

    record: JobRecord
    basis: str  # e.g. "sacct, 2 agreeing reads" or "sacct and scontrol agree"


def believed(state: VerdictState) -> Belief | None:
    """The settled (terminal or unrecognised) record that may be believed, if any.

    Believed: sacct's and scontrol's latest records agree (same State and ExitCode), or
    one source's last two or more records agree (sacct preferred when both qualify).
    Never believed while the two sources' latest settled records contradict each other
    (see :meth:`JobRecord.contradicts`). A non-terminal latest read from the other source
    does not block (sacct was seen to say RUNNING after the job had left the queue).
    """
    settled = [v for v in (state.sacct, state.scontrol) if v is not None and v.record.settled]
    if len(settled) == 2:
        sacct, scontrol = settled
        if sacct.record.contradicts(scontrol.record):
            return None
        if sacct.record.agrees_with(scontrol.record):
            return Belief(sacct.record, "sacct and scontrol agree")
    for view in settled:
        if view.streak >= 2:
            basis = f"{view.record.source.value}, {view.streak} agreeing reads"
            return Belief(view.record, basis)
    return None


@dataclass(frozen=True)
class Verdict:
    """An outcome, the one-line reason naming its evidence, and the believed record."""

    outcome: Outcome
    reason: str
    belief: Belief | None

    @property
    def final(self) -> bool:
        """Anything but PENDING_EVIDENCE: stop querying and archive."""
        return self.outcome is not Outcome.PENDING_EVIDENCE


def decide(
    state: VerdictState,
    marker: MarkerReading,
    *,
    cancel_requested: bool,
    accounting_disabled: bool,
    now: datetime,
    deadline: datetime,
) -> Verdict:
    """Decide what the evidence proves; SUCCEEDED only on positive, exact evidence.

    - SUCCEEDED only if the believed record (see :func:`believed`) has State exactly
      COMPLETED and ExitCode exactly 0:0, and the marker is OK with rc 0 for this job.
      DerivedExitCode never gates; it is in the receipt.
    - Believed TIMEOUT / NODE_FAIL / OUT_OF_MEMORY / CANCELLED map to their outcomes;
      FAILED, COMPLETED with a nonzero ExitCode, any other terminal state and any
      unrecognised state are FAILED.
    - COMPLETED 0:0 with the marker missing, empty or truncated waits (PENDING_EVIDENCE)
      until ``deadline`` for shared-filesystem lag, then is FAILED naming the marker. A
      marker that is present but bad (rc != 0, wrong job, not JSON, ...) fails at once.
    - cancel_requested (the supervisor sent the cancel): evidence of success still wins
      (COMPLETED 0:0 + marker rc 0 is SUCCEEDED). Otherwise an end our cancel explains —
      CANCELLED, FAILED with any ExitCode (143:0 after TERM), or COMPLETED without a good
      marker — is CANCELLED; TIMEOUT, NODE_FAIL, OUT_OF_MEMORY and the other terminal
      states keep their own outcome, because Slurm names a cause that is not our cancel.
    - No believed record: PENDING_EVIDENCE before ``deadline``, UNVERIFIED from it on.
      With accounting disabled and scontrol no longer knowing the job, no evidence can
      arrive any more: UNVERIFIED at once.

    Raises ValueError if ``marker`` was read for another job id (a caller bug).
    """
    if marker.expected_job_id != state.job_id:
        raise ValueError(
            f"marker read for job {marker.expected_job_id}, verdict is for {state.job_id}"
        )
    belief = believed(state)
    past_deadline = now >= deadline
    if belief is None:
        return _without_belief(state, accounting_disabled, past_deadline, now)
    record = belief.record
    slurm = f"{record.describe()} ({belief.basis})"
    job_state = record.state.state
    cancel_note = "; cancel requested by the supervisor" if cancel_requested else ""
    completed_ok = (
        job_state is JobState.COMPLETED and record.state.exact and record.exit_code.is_zero
    )
    if completed_ok:
        ended = f"Slurm says COMPLETED 0:0 ({belief.basis})"
        if (
            marker.marker is not None and marker.marker.rc == 0
        ) or marker.status is MarkerStatus.NOT_USED:
            return Verdict(Outcome.SUCCEEDED, f"{slurm}; {marker.describe()}", belief)
        if marker.marker is None and marker.status.may_still_arrive and not past_deadline:
            reason = f"{slurm}; waiting for the marker: {marker.describe()}"
            return Verdict(Outcome.PENDING_EVIDENCE, reason, belief)
        outcome = Outcome.CANCELLED if cancel_requested else Outcome.FAILED
        return Verdict(outcome, f"{marker.describe()}; {ended}{cancel_note}", belief)
    outcome = _STATE_OUTCOMES.get(job_state, Outcome.FAILED)
    if cancel_requested and job_state in (JobState.FAILED, JobState.COMPLETED):
        outcome = Outcome.CANCELLED
    if job_state is JobState.UNKNOWN:
        slurm = f"unrecognised {slurm}"
    return Verdict(outcome, f"{slurm}; {marker.describe()}{cancel_note}", belief)


def with_benchmark(verdict: Verdict, gate: GateResult | None) -> Verdict:
    """Success additionally requires the benchmark's results to pass the validity gate
    (every configured point parsed, enough requests completed, output produced): a run
    that Slurm and the marker call a success but whose numbers are missing, short or
    empty is FAILED, the reason naming the point. Other outcomes stand as they are."""
    if verdict.outcome is not Outcome.SUCCEEDED or gate is None or gate.ok:
        return verdict
    return Verdict(Outcome.FAILED, f"{gate.reason}; {verdict.reason}", verdict.belief)


def _without_belief(
    state: VerdictState, accounting_off: bool, past_deadline: bool, now: datetime
) -> Verdict:
    """PENDING_EVIDENCE or UNVERIFIED, with a reason saying what is (not) known."""
    elapsed = max(0, int((now - state.started_at).total_seconds()))
    accounting_off = accounting_off or state.accounting_disabled_seen
    views = [v for v in (state.sacct, state.scontrol) if v is not None]
    settled = [v for v in views if v.record.settled]
    if len(settled) == 2 and settled[0].record.contradicts(settled[1].record):
        known = (
            f"sacct says {settled[0].record.describe()} "
            f"but scontrol says {settled[1].record.describe()}"
        )
    elif settled:
        known = "; ".join(
            f"{v.record.describe()} ({v.record.source.value}) read once, unconfirmed"
            for v in settled
        )
    elif views:
        latest = max(views, key=lambda v: _last_record_time(state, v.record.source))
        record = latest.record
        known = f"no terminal record; last read {record.describe()} ({record.source.value})"
    elif failing := _failing_commands(state):
        known = failing
    elif accounting_off:
        known = "no scontrol record (accounting disabled)"
    else:
        known = "no accounting record"
    if accounting_off and state.scontrol_gone:
        reason = f"{known}; scontrol no longer knows the job and accounting is disabled"
        return Verdict(Outcome.UNVERIFIED, reason, None)
    if past_deadline:
        return Verdict(Outcome.UNVERIFIED, f"{known} after {elapsed} s", None)
    return Verdict(Outcome.PENDING_EVIDENCE, f"{known} after {elapsed} s; asking again", None)


def _failing_commands(state: VerdictState) -> str:
    """When every source's latest query failed (munge refused, slurmctld or slurmdbd
    unreachable): which command failed and its first error line; "" otherwise."""
    latest: dict[Source, SlurmQuery] = {}
    for q in state.queries:
        latest[q.source] = q
    if not latest or any(q.outcome is not QueryOutcome.ERROR for q in latest.values()):
        return ""
    said = [
        f"{q.source.value} failed: {(q.error.strip().splitlines() or ['no output'])[0][:200]}"
        for q in latest.values()
    ]
    return "no record, every Slurm query failed (" + "; ".join(said) + ")"


def _last_record_time(state: VerdictState, source: Source) -> datetime:
    return max(q.taken_at for q in state.queries if q.source is source and q.record is not None)


class BelievedJson(TypedDict):
    basis: str
    source: str
    state: str
    state_raw: str
    exit_code: str
    derived_exit_code: str | None
    raw: str


class ParsedMarkerJson(TypedDict):
    format: str
    rc: int
    job_id: str
    rank: int | None
    reason: str
    finished_at: str | None


class MarkerJson(TypedDict):
    file: str | None
    status: str
    detail: str
    raw_text: str | None
    parsed: ParsedMarkerJson | None


class QueryJson(TypedDict):
    source: str
    taken_at: str
    outcome: str
    error: str
    raw: str


class VerdictReceipt(TypedDict):
    """A verdict's receipt (schema ``llmd-supervisor.receipt/1``): `build_receipt`."""

    schema: str
    job_id: str
    outcome: str
    reason: str
    decided_at: str
    verification_started_at: str
    cancel_requested: bool
    accounting_disabled: bool
    believed: BelievedJson | None
    derived_exit_code: str | None
    sacct_rows: list[str]
    scontrol_record: str | None
    marker: MarkerJson
    benchmark: GateJson | None
    queries: list[QueryJson]


def build_receipt(
    state: VerdictState,
    marker: MarkerReading,
    verdict: Verdict,
    *,
    decided_at: datetime,
    cancel_requested: bool,
    accounting_disabled: bool,
    benchmark: GateResult | None = None,
) -> VerdictReceipt:
    """The JSON-serialisable receipt of a verdict (schema ``llmd-supervisor.receipt/1``).

    Holds the job id, outcome and reason, the believed record with its DerivedExitCode,
    the raw sacct rows (allocation and steps) and raw scontrol record last seen, the
    marker (raw text and parsed fields), the benchmark's validity gate with each point's
    evidence (when results were looked for), and every query with its ISO timestamp.
    """
    belief = verdict.belief
    sacct_rows = next((q.rows for q in reversed(state.queries) if q.rows), ())
    scontrol_raw = next(
        (
            q.raw
            for q in reversed(state.queries)
            if q.source is Source.SCONTROL and q.outcome is QueryOutcome.RECORD
        ),
        None,
    )
    derived = belief.record.derived_exit_code if belief else None
    return {
        "schema": RECEIPT_SCHEMA,
        "job_id": state.job_id,
        "outcome": verdict.outcome.value,
        "reason": verdict.reason,
        "decided_at": decided_at.isoformat(),
        "verification_started_at": state.started_at.isoformat(),
        "cancel_requested": cancel_requested,
        "accounting_disabled": accounting_disabled or state.accounting_disabled_seen,
        "believed": None
        if belief is None
        else {
            "basis": belief.basis,
            "source": belief.record.source.value,
            "state": belief.record.state.state.value,
            "state_raw": belief.record.state.raw,
            "exit_code": str(belief.record.exit_code),
            "derived_exit_code": None if derived is None else str(derived),
            "raw": belief.record.raw,
        },
        "derived_exit_code": None if derived is None else str(derived),
        "sacct_rows": [row.raw for row in sacct_rows],
        "scontrol_record": scontrol_raw,
        "marker": _marker_json(marker),
        "benchmark": None if benchmark is None else benchmark.as_dict(),
        "queries": [
            {
                "source": q.source.value,
                "taken_at": q.taken_at.isoformat(),
                "outcome": q.outcome.value,
                "error": q.error,
                "raw": q.raw,
            }
            for q in state.queries
        ],
    }


def _marker_json(marker: MarkerReading) -> MarkerJson:
    parsed = marker.marker
    return {
        "file": None
        if marker.status is MarkerStatus.NOT_USED
        else marker.name or marker_filename(marker.expected_job_id),
        "status": marker.status.value,
        "detail": marker.detail,
        "raw_text": marker.raw_text,
        "parsed": None
        if parsed is None
        else {
            "format": parsed.format,
            "rc": parsed.rc,
            "job_id": parsed.job_id,
            "rank": parsed.rank,
            "reason": parsed.reason,
            "finished_at": None if parsed.finished_at is None else parsed.finished_at.isoformat(),
        },
    }
