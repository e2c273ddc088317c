"""The run state machine: legal paths, the plan of each record, and every illegal transition."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from llmd_supervisor.core.run.lifecycle import (
    Action,
    Archived,
    CallSbatch,
    CancelRequested,
    Declare,
    Event,
    FollowQueue,
    LeftQueue,
    Reconcile,
    Requeued,
    Run,
    RunState,
    RunVerify,
    SendCancel,
    Started,
    StartWatchers,
    StopWatchers,
    Submit,
    SubmitFailed,
    Submitted,
    SupervisionFailed,
    Verified,
    WatchersStopped,
    WriteArchive,
    new_run,
    plan,
    step,
)
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import IllegalTransition

T0 = datetime(2026, 11, 30, 22, 0, 0, tzinfo=UTC)
NODES = ("node1", "node2", "node3")


def drive(events: Sequence[Event], run: Run | None = None) -> tuple[Run, list[Action]]:
    run = run or new_run("run-1", "llmd-run-1", T0)
    actions: list[Action] = []
    for i, event in enumerate(events):
        run, new = step(run, event, T0 + timedelta(seconds=i + 1))
        actions.extend(new)
    return run, actions


HAPPY: list[Event] = [
    Submit(),
    Submitted("42"),
    Started(NODES),
    LeftQueue(),
    WatchersStopped(),
    Verified(Outcome.SUCCEEDED, "State=COMPLETED ExitCode=0:0 (sacct, 2 agreeing reads)"),
    Archived(),
]


def test_happy_path() -> None:
    run, actions = drive(HAPPY)
    assert run.state is RunState.SUCCEEDED
    assert run.state.is_final
    assert run.slurm_job_id == "42"
    assert run.nodes == NODES
    assert run.outcome is Outcome.SUCCEEDED
    assert run.attempt == 1
    reason = "State=COMPLETED ExitCode=0:0 (sacct, 2 agreeing reads)"
    assert actions == [
        Reconcile("llmd-run-1"),
        FollowQueue("42"),
        FollowQueue("42"),
        StartWatchers("42", NODES, 1),
        StopWatchers("42"),
        RunVerify("42", cancel_requested=False),
        WriteArchive(Outcome.SUCCEEDED, reason),
        Declare(Outcome.SUCCEEDED, reason),
    ]
    assert [t.state for t in run.transitions] == [
        RunState.ACCEPTED,
        RunState.SUBMITTING,
        RunState.PENDING,
        RunState.RUNNING,
        RunState.FINISHING,
        RunState.VERIFYING,
        RunState.ARCHIVING,
        RunState.SUCCEEDED,
    ]
    assert [t.at for t in run.transitions] == [T0 + timedelta(seconds=i) for i in range(8)]
    assert run.transitions[2].event == "Submitted"


@pytest.mark.parametrize(
    ("outcome", "final"),
    [
        (Outcome.FAILED, RunState.FAILED),
        (Outcome.CANCELLED, RunState.CANCELLED),
        (Outcome.TIMED_OUT, RunState.TIMED_OUT),
        (Outcome.NODE_FAILED, RunState.NODE_FAILED),
        (Outcome.OUT_OF_MEMORY, RunState.OUT_OF_MEMORY),
        (Outcome.UNVERIFIED, RunState.UNVERIFIED),
    ],
)
def test_each_outcome_has_its_final_state(outcome: Outcome, final: RunState) -> None:
    run, actions = drive([*HAPPY[:5], Verified(outcome, "why"), Archived()])
    assert run.state is final
    assert actions[-1] == Declare(outcome, "why")


def test_pending_evidence_is_not_a_verdict() -> None:
    run, _ = drive(HAPPY[:5])
    with pytest.raises(IllegalTransition):
        step(run, Verified(Outcome.PENDING_EVIDENCE, "later"), T0)


def test_job_can_end_before_seen_running() -> None:
    run, actions = drive([Submit(), Submitted("42"), LeftQueue()])
    assert run.state is RunState.FINISHING
    assert actions[-1] == StopWatchers("42")


def test_submit_failure_is_archived_then_failed() -> None:
    run, actions = drive([Submit(), SubmitFailed("sbatch: error: invalid partition")])
    assert run.state is RunState.ARCHIVING
    assert actions[-1] == WriteArchive(
        Outcome.FAILED, "submission failed: sbatch: error: invalid partition"
    )
    run, done = step(run, Archived(), T0)
    assert run.state is RunState.FAILED
    assert done == (Declare(Outcome.FAILED, "submission failed: sbatch: error: invalid partition"),)


def test_requeue_keeps_the_run() -> None:
    run, actions = drive([Submit(), Submitted("42"), Started(NODES), Requeued()])
    assert run.state is RunState.PENDING
    assert run.attempt == 2
    assert run.slurm_job_id == "42"
    assert run.nodes == ()
    assert actions[-1] == FollowQueue("42")  # the old attempt's watchers are no longer asked for
    run, actions = drive([Started(("node4",)), Requeued(), Started(NODES)], run)
    assert run.attempt == 3
    assert run.state is RunState.RUNNING


def test_requeue_during_verification() -> None:
    run, actions = drive([*HAPPY[:5], Requeued()])
    assert run.state is RunState.PENDING
    assert run.attempt == 2
    assert actions[-1] == FollowQueue("42")


def test_cancel_from_accepted_ends_at_once() -> None:
    run, actions = drive([CancelRequested()])
    assert run.state is RunState.CANCELLED
    assert run.cancel_requested
    assert run.outcome is Outcome.CANCELLED
    assert actions == [Declare(Outcome.CANCELLED, "cancelled before submission")]


def test_cancel_while_submitting_is_sent_once_the_job_exists() -> None:
    run, actions = drive([Submit(), CancelRequested()])
    assert run.state is RunState.SUBMITTING
    assert run.cancel_requested
    assert actions == [Reconcile("llmd-run-1"), Reconcile("llmd-run-1")]
    run, actions = drive([Submitted("42")], run)
    assert run.state is RunState.PENDING
    assert actions == [FollowQueue("42"), SendCancel("42")]


def test_cancel_while_submitting_and_submit_fails() -> None:
    run, _ = drive([Submit(), CancelRequested(), SubmitFailed("timeout")])
    assert run.state is RunState.ARCHIVING
    assert run.outcome is Outcome.CANCELLED


@pytest.mark.parametrize("prefix", [HAPPY[:2], HAPPY[:3]])
def test_cancel_sends_cancel_with_a_job(prefix: list[Event]) -> None:
    run, _ = drive(prefix)
    state = run.state
    run, actions = step(run, CancelRequested(), T0)
    assert run.state is state
    assert run.cancel_requested
    assert actions[-1] == SendCancel("42")
    assert actions[0] == FollowQueue("42")
    again, actions = step(run, CancelRequested(), T0)
    assert again == run
    assert actions == ()


def test_cancel_flag_reaches_verification() -> None:
    _, actions = drive([*HAPPY[:3], CancelRequested(), LeftQueue(), WatchersStopped()])
    assert actions[-1] == RunVerify("42", cancel_requested=True)


@pytest.mark.parametrize("prefix", [HAPPY[:4], HAPPY[:5], HAPPY[:6]])
def test_cancel_after_the_job_left_only_flags(prefix: list[Event]) -> None:
    run, _ = drive(prefix)
    run, actions = step(run, CancelRequested(), T0)
    assert run.cancel_requested
    assert not any(isinstance(a, SendCancel) for a in actions)


ALL_EVENTS: list[Event] = [
    Submit(),
    Submitted("42"),
    SubmitFailed("x"),
    Started(NODES),
    Requeued(),
    LeftQueue(),
    WatchersStopped(),
    Verified(Outcome.FAILED, "x"),
    Archived(),
    CancelRequested(),
    SupervisionFailed("x"),
]

LEGAL: dict[RunState, set[str]] = {
    RunState.ACCEPTED: {"Submit", "CancelRequested", "SupervisionFailed"},
    RunState.SUBMITTING: {"Submitted", "SubmitFailed", "CancelRequested"},
    RunState.PENDING: {"Started", "Requeued", "LeftQueue", "CancelRequested", "SupervisionFailed"},
    RunState.RUNNING: {"Requeued", "LeftQueue", "CancelRequested", "SupervisionFailed"},
    RunState.FINISHING: {"WatchersStopped", "Requeued", "CancelRequested", "SupervisionFailed"},
    RunState.VERIFYING: {"Verified", "Requeued", "CancelRequested", "SupervisionFailed"},
    RunState.ARCHIVING: {"Archived", "CancelRequested", "SupervisionFailed"},
}

REACH: dict[RunState, list[Event]] = {
    RunState.ACCEPTED: [],
    RunState.SUBMITTING: HAPPY[:1],
    RunState.PENDING: HAPPY[:2],
    RunState.RUNNING: HAPPY[:3],
    RunState.FINISHING: HAPPY[:4],
    RunState.VERIFYING: HAPPY[:5],
    RunState.ARCHIVING: HAPPY[:6],
    RunState.SUCCEEDED: HAPPY,
}


@pytest.mark.parametrize("state", list(REACH), ids=[s.value for s in REACH])
@pytest.mark.parametrize("event", ALL_EVENTS, ids=[type(e).__name__ for e in ALL_EVENTS])
def test_transition_table(state: RunState, event: Event) -> None:
    run, _ = drive(REACH[state])
    assert run.state is state
    name = type(event).__name__
    if name in LEGAL.get(state, set()):
        new, _ = step(run, event, T0)
        assert new != run
    else:
        with pytest.raises(IllegalTransition) as info:
            step(run, event, T0)
        assert info.value.state == state.value
        assert info.value.event == name


def test_step_never_mutates() -> None:
    run, _ = drive(HAPPY[:3])
    before = run
    step(run, LeftQueue(), T0)
    assert run == before
    assert run.state is RunState.RUNNING


def test_plan_of_a_journaled_record_is_what_entering_it_asked_for() -> None:
    """After a restart the driver executes plan(record): the same actions step gave."""
    run = new_run("run-1", "llmd-run-1", T0)
    assert plan(run) == (CallSbatch("llmd-run-1"),)
    for i, event in enumerate(HAPPY):
        run, actions = step(run, event, T0 + timedelta(seconds=i + 1))
        assert plan(run) == actions


def test_a_cancel_flag_keeps_asking_for_the_cancel_sequence_while_the_job_is_queued() -> None:
    """A cancel accepted and then interrupted (crash, supervision retry) is not dropped:
    every later plan of the record still contains it while the job can be cancelled."""
    run, _ = drive([*HAPPY[:3], CancelRequested()])
    assert SendCancel("42") in plan(run)
    requeued, _ = step(run, Requeued(), T0)
    assert plan(requeued) == (FollowQueue("42"), SendCancel("42"))
    left, _ = step(run, LeftQueue(), T0)
    assert plan(left) == (StopWatchers("42"),)


@pytest.mark.parametrize(
    "state", [s for s in REACH if not s.is_final and s is not RunState.SUBMITTING]
)
def test_supervision_that_keeps_failing_ends_the_run_unverified(state: RunState) -> None:
    run, _ = drive(REACH[state])
    run, actions = step(run, SupervisionFailed("supervision failed 8 times: E: x"), T0)
    if state is RunState.ARCHIVING:  # the archive is what fails: declared at once
        assert run.state is RunState.UNVERIFIED
        assert actions == (Declare(Outcome.UNVERIFIED, "supervision failed 8 times: E: x"),)
    else:
        assert run.state is RunState.ARCHIVING
        assert actions == (WriteArchive(Outcome.UNVERIFIED, "supervision failed 8 times: E: x"),)
    assert run.outcome is Outcome.UNVERIFIED


def test_supervision_failing_while_sbatch_may_be_in_flight_is_never_given_up() -> None:
    run, _ = drive(REACH[RunState.SUBMITTING])
    with pytest.raises(IllegalTransition):
        step(run, SupervisionFailed("x"), T0)
