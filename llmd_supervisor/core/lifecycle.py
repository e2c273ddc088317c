"""The pure run state machine (DESIGN.md section 3).

``step(run, event, now) -> (run, actions)`` returns the next run record and the side
effects to perform, as data. The caller journals the returned run *before* executing the
actions, so a crash never leaves an action done whose state was not recorded. Illegal
transitions raise :class:`IllegalTransition` and leave the run untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from llmd_supervisor.core.verdict import Outcome
from llmd_supervisor.errors import IllegalTransition

__all__ = [
    "Action",
    "Archived",
    "CallSbatch",
    "CancelRequested",
    "Declare",
    "Event",
    "LeftQueue",
    "Requeued",
    "Run",
    "RunState",
    "RunVerify",
    "SendCancel",
    "StartWatchers",
    "Started",
    "StopWatchers",
    "Submit",
    "SubmitFailed",
    "Submitted",
    "Transition",
    "Verified",
    "WatchersStopped",
    "WriteArchive",
    "new_run",
    "step",
]


class RunState(StrEnum):
    """Where a run is in its life; the last seven are final."""

    ACCEPTED = "accepted"  # spec validated and journaled, nothing sent to Slurm yet
    SUBMITTING = "submitting"  # job name journaled, sbatch may be in flight
    PENDING = "pending"  # Slurm holds the job in the queue (also after a requeue)
    RUNNING = "running"  # the allocation exists; watchers tail logs and check liveness
    FINISHING = "finishing"  # the job left the queue; watchers drain the last log bytes
    VERIFYING = "verifying"  # collecting sacct/scontrol/marker evidence for the verdict
    ARCHIVING = "archiving"  # verdict known; archive being written before it is declared
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    NODE_FAILED = "node_failed"
    OUT_OF_MEMORY = "out_of_memory"
    UNVERIFIED = "unverified"

    @property
    def is_final(self) -> bool:
        """No event is accepted any more."""
        return self in _FINAL_BY_OUTCOME.values()


_FINAL_BY_OUTCOME = {
    Outcome.SUCCEEDED: RunState.SUCCEEDED,
    Outcome.FAILED: RunState.FAILED,
    Outcome.CANCELLED: RunState.CANCELLED,
    Outcome.TIMED_OUT: RunState.TIMED_OUT,
    Outcome.NODE_FAILED: RunState.NODE_FAILED,
    Outcome.OUT_OF_MEMORY: RunState.OUT_OF_MEMORY,
    Outcome.UNVERIFIED: RunState.UNVERIFIED,
}


# --- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    """Start submitting (the job name is journaled with the new state first)."""


@dataclass(frozen=True)
class Submitted:
    """sbatch returned a job id (or recovery found the job by its name)."""

    job_id: str


@dataclass(frozen=True)
class SubmitFailed:
    """sbatch failed and recovery found no job with the run's name."""

    reason: str


@dataclass(frozen=True)
class Started:
    """Slurm reports the job RUNNING on these nodes."""

    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Requeued:
    """Slurm put the job back in the queue (same job id, new attempt)."""


@dataclass(frozen=True)
class LeftQueue:
    """The job is no longer in squeue: it ended (how, the verdict will say)."""


@dataclass(frozen=True)
class WatchersStopped:
    """Log tailers and liveness watchers have drained and stopped."""


@dataclass(frozen=True)
class Verified:
    """The verdict reached a final outcome (never PENDING_EVIDENCE)."""

    outcome: Outcome
    reason: str


@dataclass(frozen=True)
class Archived:
    """The archive (receipt included) is written and fsynced."""


@dataclass(frozen=True)
class CancelRequested:
    """Someone asked to cancel the run."""


Event = (
    Submit
    | Submitted
    | SubmitFailed
    | Started
    | Requeued
    | LeftQueue
    | WatchersStopped
    | Verified
    | Archived
    | CancelRequested
)


# --- actions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallSbatch:
    """Submit the run's batch script under its unique job name."""

    job_name: str


@dataclass(frozen=True)
class SendCancel:
    """Start the cancellation sequence (TERM to the steps, grace, then plain scancel)."""

    job_id: str


@dataclass(frozen=True)
class StartWatchers:
    """Start log tailing and liveness checks on the allocated nodes."""

    job_id: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class StopWatchers:
    """Drain and stop the watchers; report WatchersStopped when done."""

    job_id: str


@dataclass(frozen=True)
class RunVerify:
    """Collect evidence and run the verdict until it is final; report Verified."""

    job_id: str
    cancel_requested: bool


@dataclass(frozen=True)
class WriteArchive:
    """Write and fsync the archive and receipt; report Archived."""

    outcome: Outcome
    reason: str


@dataclass(frozen=True)
class Declare:
    """Announce the final outcome (log line, control-socket waiters)."""

    outcome: Outcome
    reason: str


Action = CallSbatch | SendCancel | StartWatchers | StopWatchers | RunVerify | WriteArchive | Declare


# --- the run record ------------------------------------------------------------------------


@dataclass(frozen=True)
class Transition:
    """One state change, with its time and the event that caused it."""

    state: RunState
    at: datetime
    event: str


@dataclass(frozen=True)
class Run:
    """A run's journaled record; replaced, never mutated, by :func:`step`."""

    run_id: str
    job_name: str
    state: RunState
    attempt: int  # 1 for the first allocation, +1 per requeue
    slurm_job_id: str | None
    nodes: tuple[str, ...]
    cancel_requested: bool
    outcome: Outcome | None  # set when the verdict is known (from ARCHIVING on)
    reason: str
    transitions: tuple[Transition, ...]


def new_run(run_id: str, job_name: str, now: datetime) -> Run:
    """A freshly accepted run."""
    return Run(
        run_id=run_id,
        job_name=job_name,
        state=RunState.ACCEPTED,
        attempt=1,
        slurm_job_id=None,
        nodes=(),
        cancel_requested=False,
        outcome=None,
        reason="",
        transitions=(Transition(RunState.ACCEPTED, now, "accepted"),),
    )


def step(run: Run, event: Event, now: datetime) -> tuple[Run, tuple[Action, ...]]:
    """Apply ``event`` to ``run`` at ``now``; return the new run and the actions to perform.

    Transitions (anything else raises IllegalTransition):
    accepted -Submit-> submitting -Submitted-> pending -Started-> running
    -LeftQueue-> finishing -WatchersStopped-> verifying -Verified-> archiving
    -Archived-> the outcome's final state. pending -LeftQueue-> finishing too (a job can
    end before it is seen running); submitting -SubmitFailed-> archiving (failed).
    Requeued (pending, running, finishing, verifying) -> pending with attempt + 1.
    CancelRequested in any non-final state sets cancel_requested: from accepted the run
    ends cancelled at once; with a job id it sends the cancel (pending/running/finishing);
    while sbatch is in flight the cancel is sent when Submitted arrives. Repeating it
    changes nothing.
    """
    name = type(event).__name__
    if run.state.is_final:
        raise IllegalTransition(run.state.value, name)
    match event:
        case CancelRequested():
            return _cancel(run, now)
        case Submit() if run.state is RunState.ACCEPTED:
            return _to(run, RunState.SUBMITTING, now, name), (CallSbatch(run.job_name),)
        case Submitted(job_id) if run.state is RunState.SUBMITTING:
            moved = replace(_to(run, RunState.PENDING, now, name), slurm_job_id=job_id)
            return moved, (SendCancel(job_id),) if run.cancel_requested else ()
        case SubmitFailed(reason) if run.state is RunState.SUBMITTING:
            outcome = Outcome.CANCELLED if run.cancel_requested else Outcome.FAILED
            return _archive(run, outcome, f"submission failed: {reason}", now, name)
        case Started(nodes) if run.state is RunState.PENDING:
            moved = replace(_to(run, RunState.RUNNING, now, name), nodes=nodes)
            return moved, (StartWatchers(_job_id(run), nodes),)
        case Requeued() if run.state in _REQUEUABLE:
            moved = replace(_to(run, RunState.PENDING, now, name), attempt=run.attempt + 1)
            stop = (StopWatchers(_job_id(run)),) if run.state is RunState.RUNNING else ()
            return replace(moved, nodes=()), stop
        case LeftQueue() if run.state in (RunState.PENDING, RunState.RUNNING):
            return _to(run, RunState.FINISHING, now, name), (StopWatchers(_job_id(run)),)
        case WatchersStopped() if run.state is RunState.FINISHING:
            verify = RunVerify(_job_id(run), run.cancel_requested)
            return _to(run, RunState.VERIFYING, now, name), (verify,)
        case Verified(outcome, reason) if run.state is RunState.VERIFYING:
            if outcome is Outcome.PENDING_EVIDENCE:
                raise IllegalTransition(run.state.value, f"{name}(pending_evidence)")
            return _archive(run, outcome, reason, now, name)
        case Archived() if run.state is RunState.ARCHIVING and run.outcome is not None:
            final = _to(run, _FINAL_BY_OUTCOME[run.outcome], now, name)
            return final, (Declare(run.outcome, run.reason),)
    raise IllegalTransition(run.state.value, name)


_REQUEUABLE = frozenset(
    {RunState.PENDING, RunState.RUNNING, RunState.FINISHING, RunState.VERIFYING}
)
_CANCEL_SENDABLE = frozenset({RunState.PENDING, RunState.RUNNING, RunState.FINISHING})


def _cancel(run: Run, now: datetime) -> tuple[Run, tuple[Action, ...]]:
    if run.cancel_requested:
        return run, ()
    if run.state is RunState.ACCEPTED:
        reason = "cancelled before submission"
        done = replace(
            _to(run, RunState.CANCELLED, now, "CancelRequested"),
            cancel_requested=True,
            outcome=Outcome.CANCELLED,
            reason=reason,
        )
        return done, (Declare(Outcome.CANCELLED, reason),)
    flagged = replace(run, cancel_requested=True)
    if run.state in _CANCEL_SENDABLE:
        return flagged, (SendCancel(_job_id(run)),)
    return flagged, ()


def _archive(
    run: Run, outcome: Outcome, reason: str, now: datetime, event: str
) -> tuple[Run, tuple[Action, ...]]:
    moved = replace(_to(run, RunState.ARCHIVING, now, event), outcome=outcome, reason=reason)
    return moved, (WriteArchive(outcome, reason),)


def _to(run: Run, state: RunState, now: datetime, event: str) -> Run:
    return replace(run, state=state, transitions=(*run.transitions, Transition(state, now, event)))


def _job_id(run: Run) -> str:
    # Every state from PENDING on is entered with a job id; its absence is a bug.
    if run.slurm_job_id is None:
        raise IllegalTransition(run.state.value, "event needing a Slurm job id")
    return run.slurm_job_id
