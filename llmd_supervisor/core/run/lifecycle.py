"""The pure run state machine (DESIGN.md section 3).

``step(run, event, now) -> (run, actions)`` returns the next run record and what the
driver must now make sure happens, as data: ``plan(run)``, the one description of what a
record asks for. The caller journals the returned run *before* executing the actions, so a
crash never leaves an action done whose state was not recorded; after a restart (or a
supervision retry) the driver executes ``plan(run)`` of the journaled record, so every
action is idempotent: "make sure the cancel sequence runs", "make sure this attempt is
watched", "do the next step of this state". Illegal transitions raise
:class:`IllegalTransition` and leave the run untouched.

Each record asks for exactly one *step* (an action the driver awaits, which ends by
applying an event) and any number of *background* actions (kept running beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import IllegalTransition

__all__ = [
    "BACKGROUND",
    "Action",
    "Archived",
    "CallSbatch",
    "CancelRequested",
    "Declare",
    "Event",
    "FollowQueue",
    "Held",
    "HoldExpired",
    "LeftQueue",
    "Reconcile",
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
    "SupervisionFailed",
    "Transition",
    "Verified",
    "WatchersStopped",
    "WriteArchive",
    "adopted_run",
    "new_run",
    "plan",
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


@dataclass(frozen=True)
class Held:
    """An accepted run is not submitted yet, and why (e.g. too many nodes excluded)."""

    reason: str


@dataclass(frozen=True)
class SupervisionFailed:
    """The driver's step kept failing the same way (`failures.SAME_FAILURES_MAX` times in a
    row): the run ends `unverified` with the error as its reason, instead of being retried
    forever. Never while submitting: sbatch may be in flight, so a job may exist."""

    reason: str


@dataclass(frozen=True)
class HoldExpired:
    """A held run waited past its hold deadline: it fails, never submitted again."""

    reason: str


@dataclass(frozen=True)
class Retry:
    """The attempt failed because of the cluster and the retry policy tries again: a new
    job (a new submission and attempt), submitted from `accepted` as the first one was."""

    reason: str


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
    | Held
    | HoldExpired
    | SupervisionFailed
    | Retry
)


# --- actions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallSbatch:
    """Step: journal `submitting`, then submit the batch script under its unique job name."""

    job_name: str


@dataclass(frozen=True)
class Reconcile:
    """Step: `submitting` was found on entry (a crash or retry while sbatch may have been in
    flight): look the job name up and adopt the job, or submit only if it surely never was."""

    job_name: str


@dataclass(frozen=True)
class FollowQueue:
    """Step: wait for the next queue view of the job and apply what it says."""

    job_id: str


@dataclass(frozen=True)
class StartWatchers:
    """Background: this attempt's allocation is watched (links, health, tailers, marker)."""

    job_id: str
    nodes: tuple[str, ...]
    attempt: int


@dataclass(frozen=True)
class SendCancel:
    """Background: the cancellation sequence runs (TERM to the steps, grace, then scancel)."""

    job_id: str


@dataclass(frozen=True)
class StopWatchers:
    """Step: stop the attempt, complete the log copies; report WatchersStopped."""

    job_id: str


@dataclass(frozen=True)
class RunVerify:
    """Step: collect evidence and run the verdict until it is final; report Verified."""

    job_id: str
    cancel_requested: bool


@dataclass(frozen=True)
class WriteArchive:
    """Step: write and fsync the archive and receipt; report Archived."""

    outcome: Outcome
    reason: str


@dataclass(frozen=True)
class Declare:
    """Announce the final outcome (log line, control-socket waiters); a final record's plan."""

    outcome: Outcome
    reason: str


Action = (
    CallSbatch
    | Reconcile
    | FollowQueue
    | StartWatchers
    | SendCancel
    | StopWatchers
    | RunVerify
    | WriteArchive
    | Declare
)
# Kept running beside the record's step; every other action is the step itself.
BACKGROUND = (StartWatchers, SendCancel)


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
    submission: int = 1  # 1 for the first job, +1 per retry (a new job: `Retry`)

    @property
    def slurm_job_name(self) -> str:
        """The current submission's unique Slurm job name (`job_name`, then
        `job_name.2`, ... for retries), by which a restart finds its job."""
        return self.job_name if self.submission == 1 else f"{self.job_name}.{self.submission}"


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


def adopted_run(run_id: str, job_name: str, job_id: str, now: datetime) -> Run:
    """A run made of a job submitted without the daemon (`adopt`): journaled at once as
    `pending` with its job id, so no restart can ever submit it (the plan follows the
    queue, which takes it to running or, already ended, to finishing)."""
    accepted = new_run(run_id, job_name, now)
    return replace(
        accepted,
        state=RunState.PENDING,
        slurm_job_id=job_id,
        transitions=(*accepted.transitions, Transition(RunState.PENDING, now, "adopted")),
    )


def step(run: Run, event: Event, now: datetime) -> tuple[Run, tuple[Action, ...]]:
    """Apply ``event`` to ``run`` at ``now``; return the new run and ``plan`` of it.

    Transitions (anything else raises IllegalTransition):
    accepted -Submit-> submitting -Submitted-> pending -Started-> running
    -LeftQueue-> finishing -WatchersStopped-> verifying -Verified-> archiving
    -Archived-> the outcome's final state. verifying -Retry-> accepted (a new submission
    and attempt; never with a cancel requested). pending -LeftQueue-> finishing too (a job can
    end before it is seen running); submitting -SubmitFailed-> archiving (failed);
    accepted -HoldExpired-> archiving (failed: held for want of nodes past its deadline).
    Requeued (pending, running, finishing, verifying) -> pending with attempt + 1.
    SupervisionFailed in any non-final state but submitting -> archiving (unverified, the
    error as the reason); from archiving (the archive is what fails) -> unverified at once.
    CancelRequested in any non-final state sets cancel_requested: from accepted the run
    ends cancelled at once; with a job still queued the plan includes the cancel sequence
    (while sbatch is in flight, from Submitted on). Repeating it changes nothing and
    returns no actions.
    """
    after = _apply(run, event, now)
    return (after, plan(after)) if after is not run else (run, ())


def plan(run: Run) -> tuple[Action, ...]:
    """What this record asks of the driver: its step first, then background actions."""
    match run.state:
        case RunState.ACCEPTED:
            return (CallSbatch(run.slurm_job_name),)
        case RunState.SUBMITTING:
            return (Reconcile(run.slurm_job_name),)
        case RunState.PENDING | RunState.RUNNING:
            job_id = _job_id(run)
            actions: list[Action] = [FollowQueue(job_id)]
            if run.state is RunState.RUNNING:
                actions.append(StartWatchers(job_id, run.nodes, run.attempt))
            if run.cancel_requested:
                actions.append(SendCancel(job_id))
            return tuple(actions)
        case RunState.FINISHING:
            return (StopWatchers(_job_id(run)),)
        case RunState.VERIFYING:
            return (RunVerify(_job_id(run), run.cancel_requested),)
        case RunState.ARCHIVING:
            assert run.outcome is not None  # entered only with a verdict
            return (WriteArchive(run.outcome, run.reason),)
    assert run.outcome is not None  # a final state
    return (Declare(run.outcome, run.reason),)


def _apply(run: Run, event: Event, now: datetime) -> Run:
    name = type(event).__name__
    if run.state.is_final:
        raise IllegalTransition(run.state.value, name)
    match event:
        case CancelRequested():
            return _cancel(run, now)
        case Submit() if run.state is RunState.ACCEPTED:
            return _to(run, RunState.SUBMITTING, now, name)
        case Submitted(job_id) if run.state is RunState.SUBMITTING:
            return replace(_to(run, RunState.PENDING, now, name), slurm_job_id=job_id)
        case SubmitFailed(reason) if run.state is RunState.SUBMITTING:
            outcome = Outcome.CANCELLED if run.cancel_requested else Outcome.FAILED
            return _archive(run, outcome, f"submission failed: {reason}", now, name)
        case Started(nodes) if run.state is RunState.PENDING:
            return replace(_to(run, RunState.RUNNING, now, name), nodes=nodes)
        case Requeued() if run.state in _REQUEUABLE:
            moved = replace(_to(run, RunState.PENDING, now, name), attempt=run.attempt + 1)
            return replace(moved, nodes=())
        case LeftQueue() if run.state in (RunState.PENDING, RunState.RUNNING):
            return _to(run, RunState.FINISHING, now, name)
        case WatchersStopped() if run.state is RunState.FINISHING:
            return _to(run, RunState.VERIFYING, now, name)
        case Held(reason) if run.state is RunState.ACCEPTED:
            return run if reason == run.reason else replace(run, reason=reason)
        case HoldExpired(reason) if run.state is RunState.ACCEPTED:
            return _archive(run, Outcome.FAILED, reason, now, name)
        case SupervisionFailed(reason) if run.state is RunState.ARCHIVING:
            gave_up = _to(run, RunState.UNVERIFIED, now, name)
            return replace(gave_up, outcome=Outcome.UNVERIFIED, reason=reason)
        case SupervisionFailed(reason) if run.state is not RunState.SUBMITTING:
            return _archive(run, Outcome.UNVERIFIED, reason, now, name)
        case Retry(reason) if run.state is RunState.VERIFYING and not run.cancel_requested:
            return replace(
                _to(run, RunState.ACCEPTED, now, name),
                attempt=run.attempt + 1,
                submission=run.submission + 1,
                slurm_job_id=None,
                nodes=(),
                reason=reason,
            )
        case Verified(outcome, reason) if run.state is RunState.VERIFYING:
            if outcome is Outcome.PENDING_EVIDENCE:
                raise IllegalTransition(run.state.value, f"{name}(pending_evidence)")
            return _archive(run, outcome, reason, now, name)
        case Archived() if run.state is RunState.ARCHIVING and run.outcome is not None:
            return _to(run, _FINAL_BY_OUTCOME[run.outcome], now, name)
    raise IllegalTransition(run.state.value, name)


_REQUEUABLE = frozenset(
    {RunState.PENDING, RunState.RUNNING, RunState.FINISHING, RunState.VERIFYING}
)


def _cancel(run: Run, now: datetime) -> Run:
    if run.cancel_requested:
        return run
    if run.state is RunState.ACCEPTED:
        return replace(
            _to(run, RunState.CANCELLED, now, "CancelRequested"),
            cancel_requested=True,
            outcome=Outcome.CANCELLED,
            reason="cancelled before submission",
        )
    return replace(run, cancel_requested=True)


def _archive(run: Run, outcome: Outcome, reason: str, now: datetime, event: str) -> Run:
    return replace(_to(run, RunState.ARCHIVING, now, event), outcome=outcome, reason=reason)


def _to(run: Run, state: RunState, now: datetime, event: str) -> Run:
    return replace(run, state=state, transitions=(*run.transitions, Transition(state, now, event)))


def _job_id(run: Run) -> str:
    # Every state from PENDING on is entered with a job id; its absence is a bug.
    if run.slurm_job_id is None:
        raise IllegalTransition(run.state.value, "event needing a Slurm job id")
    return run.slurm_job_id
