"""One judgement from all of an attempt's evidence (core.verdict.judge, issue 4.2 item 4):
it agrees with the verdict's, the cause's and the retry policy's own tables, and classifies
a node's unreachability once, typed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from llmd_supervisor.core.run.retry_policy import RetryPolicy
from llmd_supervisor.core.run.retry_policy import decide as retry_decision
from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.core.verdict.cause import Cause, diagnose
from llmd_supervisor.core.verdict.decide import Outcome, build_receipt, decide, with_benchmark
from llmd_supervisor.core.verdict.judge import (
    Evidence,
    Hang,
    NodeReport,
    Reach,
    judge,
    node_report,
)
from llmd_supervisor.core.verdict.marker import read_marker
from llmd_supervisor.errors import RemoteError
from tests.unit import test_cause, test_verdict
from tests.unit.test_verdict import DEADLINE, JOB, NO_MARKER, OK2, T0, fold, marker, sacct

ALLOC = test_cause.ALLOC


# The daemon knows accounting is disabled only from what sacct answered: the table's cases
# that set decide's flag without such an answer are decide's own, not an attempt's evidence.
VERDICT_CASES = [
    c
    for c in test_verdict.CASES
    if c.accounting_disabled <= fold(c.queries).accounting_disabled_seen
]


@pytest.mark.parametrize("case", VERDICT_CASES, ids=[c.id for c in VERDICT_CASES])
def test_judge_agrees_with_the_verdicts_truth_table(case: test_verdict.Case) -> None:
    state = fold(case.queries)
    now = DEADLINE if case.past_deadline else T0 + timedelta(seconds=len(case.queries) + 1)
    evidence = Evidence(state, case.marker, DEADLINE, cancel_reached=case.cancel)
    got = judge(evidence, now)
    assert got.verdict.outcome is case.expected, got.verdict.reason
    assert case.reason in got.reason
    plain = decide(
        state,
        case.marker,
        cancel_requested=case.cancel,
        accounting_disabled=state.accounting_disabled_seen,
        now=now,
        deadline=DEADLINE,
    )
    assert got.verdict == (with_benchmark(plain, None) if plain.final else plain)
    assert got.receipt == build_receipt(
        state,
        case.marker,
        got.verdict,
        decided_at=now,
        cancel_requested=case.cancel,
        accounting_disabled=state.accounting_disabled_seen,
    )


# The cause table's Slurm states as the sacct records a judgement believes.
_EXIT = {JobState.FAILED: "1:0", JobState.OUT_OF_MEMORY: "0:125"}


@pytest.mark.parametrize(
    ("evidence", "cause", "nodes", "observed"),
    [c[1:] for c in test_cause.CASES],
    ids=[c[0] for c in test_cause.CASES],
)
def test_judge_agrees_with_the_cause_table(
    evidence: dict[str, Any], cause: Cause, nodes: tuple[str, ...], observed: tuple[str, ...]
) -> None:
    args: dict[str, Any] = {
        "slurm_state": JobState.FAILED,
        "cancel_requested": False,
        "allocation": ALLOC,
        "ranks": test_cause.OK4,
        "unreachable": [],
        "observed": [],
        "benchmark_failed": False,
        **evidence,
    }
    if args.pop("outcome", None) is Outcome.CANCELLED:
        args["slurm_state"] = JobState.CANCELLED
    state: JobState = args["slurm_state"]
    seen = set(args["observed"])
    reports = tuple(
        NodeReport(n, Reach.NO_SSH if n in seen else Reach.SILENT) for n in args["unreachable"]
    )
    got = judge(
        Evidence(
            fold([sacct(state.value, _EXIT.get(state, "0:0"))] * 2),
            marker(7) if args["benchmark_failed"] else NO_MARKER,
            DEADLINE,
            cancel_reached=args["cancel_requested"],
            allocation=tuple(args["allocation"]),
            ranks=tuple(args["ranks"]),
            nodes=reports,
        ),
        DEADLINE,
    )
    assert got.diagnosis is not None, got.reason
    assert (got.diagnosis.cause, got.diagnosis.nodes, got.diagnosis.observed) == (
        cause,
        nodes,
        observed,
    ), got.diagnosis.why
    assert got.diagnosis == diagnose(got.verdict.outcome, **args)
    assert got.reason == f"{got.verdict.reason}; {got.diagnosis.text}"


@pytest.mark.parametrize(
    ("slurm", "done", "cancel", "retry", "why"),
    [
        ("NODE_FAIL", 0, False, True, "retry 1 of 1 without node4 after an infrastructure failure"),
        ("NODE_FAIL", 1, False, False, "no retry: retry.infrastructure = 1 used up"),
        ("NODE_FAIL", 0, True, False, "no retry: a cancel was requested"),
        ("TIMEOUT", 0, False, False, "no retry: cause workload"),
        ("FAILED", 0, False, False, "no retry: cause unknown"),
        ("CANCELLED", 0, False, False, "no retry: cause cancelled"),
        ("COMPLETED", 0, False, False, "the attempt succeeded"),
    ],
)
def test_judge_agrees_with_the_retry_table(
    slurm: str, done: int, cancel: bool, retry: bool, why: str
) -> None:
    """test_retry's table, from evidence: the cancel asked for did not reach the job."""
    got = judge(
        Evidence(
            fold([sacct(slurm)] * 2),
            marker(0),
            DEADLINE,
            cancel_requested=cancel,
            allocation=ALLOC,
            ranks=tuple(test_cause.OK4),
            nodes=(NodeReport("node4", Reach.SLURM_FAILED),) if slurm == "NODE_FAIL" else (),
            policy=RetryPolicy(),
            retries_done=done,
        ),
        DEADLINE,
    )
    assert (got.retry.retry, got.retry.why) == (retry, why)
    assert got.retry == retry_decision(
        RetryPolicy(), got.diagnosis, retries_done=done, cancel_requested=cancel
    )
    if cancel:
        assert got.reason.endswith("; the cancel did not reach the job before it ended")


def test_a_hang_ends_the_attempt_as_a_failure_naming_the_ranks_node() -> None:
    overdue = {"node": "node2", "rank": 1, "stage": "engines-healthy", "deadline_s": 600,
               "over_s": 75.5, "attempt": 1, "kind": "stage.overdue"}  # fmt: skip
    hung = Hang("node2", 1, "engines-healthy", 600, 75.5, overdue)
    evidence = Evidence(fold([sacct("CANCELLED")] * 2), NO_MARKER, DEADLINE, hang=hung,
                        allocation=ALLOC)  # fmt: skip
    got = judge(evidence, DEADLINE)
    assert got.outcome is Outcome.FAILED and got.verdict.outcome is Outcome.CANCELLED
    assert got.reason.startswith(
        "rank 1 on node2 hung in stage 'engines-healthy', 75.5 s past its 600 s deadline: "
        "the attempt was ended early; State=CANCELLED"
    )
    assert got.reason.endswith("; cause=infrastructure node=node2")
    assert got.hang is hung and got.hang.journaled is overdue
    # a cancel that reached the job first: the hang is not what ended it
    reached = judge(
        Evidence(evidence.state, NO_MARKER, DEADLINE, hang=hung, cancel_reached=True), DEADLINE
    )
    assert reached.outcome is Outcome.CANCELLED and reached.hang is None


@pytest.mark.parametrize(
    ("error", "reach"),
    [
        (str(RemoteError("node3", "connecting", "Connection refused")), Reach.NO_SSH),
        (str(RemoteError("node3", "reading /x/rank0.status.json", "no answer")), Reach.SILENT),
        ("rank 2's status file was last updated 75 s ago", Reach.SILENT),
        (str(RemoteError("node4", "connecting", "refused")), Reach.SILENT),  # another node
        (None, Reach.SILENT),
    ],
)
def test_a_node_report_is_typed_once_from_the_journaled_words(error: object, reach: Reach) -> None:
    report = node_report("node3", error)
    assert (report.node, report.reach) == ("node3", reach)
    assert report.reach.observed is (reach is Reach.NO_SSH)
    assert Reach.SLURM_FAILED.observed and not Reach.SILENT.observed


def test_a_judgement_is_for_its_jobs_marker_only() -> None:
    with pytest.raises(ValueError, match=f"marker read for job 41, verdict is for {JOB}"):
        judge(Evidence(fold(OK2), read_marker(None, "41"), DEADLINE), DEADLINE)
