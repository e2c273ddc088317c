"""Truth table for the verdict: Slurm records x marker states x cancel x deadline."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from llmd_supervisor.core.results.evidence import GateResult, Validity, gate, parse_result
from llmd_supervisor.core.verdict.decide import (
    RECEIPT_SCHEMA,
    Outcome,
    QueryOutcome,
    SlurmQuery,
    Source,
    VerdictState,
    believed,
    build_receipt,
    decide,
    failed_query,
    observe,
    sacct_query,
    scontrol_query,
    with_benchmark,
)
from llmd_supervisor.core.verdict.marker import MarkerReading, read_marker
from tests.fakes.bench_results import vllm_result

JOB = "42"
T0 = datetime(2026, 11, 30, 22, 0, 0, tzinfo=UTC)
DEADLINE = T0 + timedelta(seconds=120)
BEFORE = T0 + timedelta(seconds=30)

# Query builders take the time the query was made.
Q = Callable[[datetime], SlurmQuery]


def sacct(state: str, exit_code: str = "0:0", derived: str = "0:0") -> Q:
    """sacct output in SACCT_FIELDS order: allocation row plus batch and srun steps."""
    times = "2026-11-30T21:58:00|2026-11-30T21:58:01|2026-11-30T21:59:01|00:01:00"
    stdout = (
        f"{JOB}|{JOB}|{state}|{exit_code}|{derived}|None|node[1-3]|{times}|llmd-run-abc\n"
        f"{JOB}.batch|{JOB}.batch|{state}|{exit_code}||None|node1|{times}|batch\n"
        f"{JOB}.0|{JOB}.0|{state}|{exit_code}||None|node[1-3]|{times}|python3\n"
    )
    return lambda at: sacct_query(JOB, taken_at=at, returncode=0, stdout=stdout, stderr="")


def sacct_empty() -> Q:
    return lambda at: sacct_query(JOB, taken_at=at, returncode=0, stdout="", stderr="")


def sacct_down() -> Q:
    err = "sacct: error: Problem talking to the database: Connection refused\n"
    return lambda at: sacct_query(JOB, taken_at=at, returncode=1, stdout="", stderr=err)


def sacct_disabled() -> Q:
    err = "Slurm accounting storage is disabled\n"
    return lambda at: sacct_query(JOB, taken_at=at, returncode=1, stdout="", stderr=err)


def scontrol(state: str, exit_code: str = "0:0") -> Q:
    stdout = (
        f"JobId={JOB} JobName=llmd-run-abc UserId=root(0) GroupId=root(0) MCS_label=N/A "
        f"Priority=1 Nice=0 Account=root QOS=normal JobState={state} Reason=None "
        f"Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode={exit_code} "
        "RunTime=00:01:00 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-11-30T21:58:00 "
        "StartTime=2026-11-30T21:58:01 EndTime=2026-11-30T21:59:01 Partition=debug "
        "NodeList=node[1-3] BatchHost=node1 NumNodes=3 Command=/var/tmp/run/job.sh "
        "WorkDir=/work StdErr=/var/tmp/run/job.out StdIn=/dev/null "
        "StdOut=/var/tmp/run/job.out Power= \n"
    )
    return lambda at: scontrol_query(JOB, taken_at=at, returncode=0, stdout=stdout, stderr="")


def scontrol_gone() -> Q:
    err = "slurm_load_jobs error: Invalid job id specified\n"
    return lambda at: scontrol_query(JOB, taken_at=at, returncode=1, stdout="", stderr=err)


def scontrol_timeout() -> Q:
    return lambda at: failed_query(Source.SCONTROL, JOB, taken_at=at, error="timed out after 30 s")


def marker(rc: object = 0, rank: int = 2, job_id: str = JOB) -> MarkerReading:
    body = {
        "rc": rc,
        "job_id": job_id,
        "rank": rank,
        "reason": "sweep done",
        "finished_at": "2026-11-30T21:59:00.123+00:00",
    }
    return read_marker(json.dumps(body).encode(), JOB)


NO_MARKER = read_marker(None, JOB)
TRUNCATED = read_marker(b'{"rc": 0, "job_id": "42", "ra', JOB)
GARBAGE = read_marker(b"done\n", JOB)


@dataclass(frozen=True)
class Case:
    id: str
    queries: Sequence[Q]
    marker: MarkerReading
    expected: Outcome
    reason: str  # a substring the reason must contain
    cancel: bool = False
    accounting_disabled: bool = False
    past_deadline: bool = False


def fold(queries: Sequence[Q]) -> VerdictState:
    state = VerdictState(JOB, T0)
    for i, make in enumerate(queries):
        state = observe(state, make(T0 + timedelta(seconds=i + 1)))
    return state


OK2 = [sacct("COMPLETED"), sacct("COMPLETED")]

CASES = [
    Case(
        "completed-0:0-marker-rc0",
        OK2,
        marker(0),
        Outcome.SUCCEEDED,
        "State=COMPLETED ExitCode=0:0 (sacct, 2 agreeing reads); marker rc=0 from rank 2",
    ),
    Case("completed-one-read-only", [sacct("COMPLETED")], marker(0), Outcome.PENDING_EVIDENCE,
         "read once, unconfirmed"),
    Case("completed-no-marker-waits", OK2, NO_MARKER, Outcome.PENDING_EVIDENCE,
         "waiting for the marker: marker .bench_done.42 missing"),
    Case("completed-no-marker-at-deadline", OK2, NO_MARKER, Outcome.FAILED,
         "marker .bench_done.42 missing; Slurm says COMPLETED 0:0 (sacct, 2 agreeing reads)",
         past_deadline=True),
    Case("completed-marker-rc7", OK2, marker(7), Outcome.FAILED,
         "marker rc=7 from rank 2: sweep done; Slurm says COMPLETED 0:0 (sacct, 2 agreeing"
         " reads)"),
    Case("completed-marker-truncated-waits", OK2, TRUNCATED, Outcome.PENDING_EVIDENCE,
         "marker .bench_done.42 truncated"),
    Case("completed-marker-truncated-at-deadline", OK2, TRUNCATED, Outcome.FAILED,
         "marker .bench_done.42 truncated", past_deadline=True),
    Case("completed-marker-not-json-fails-at-once", OK2, GARBAGE, Outcome.FAILED,
         "marker .bench_done.42 not json"),
    Case("completed-marker-wrong-job", OK2, marker(0, job_id="41"), Outcome.FAILED,
         "wrong job id"),
    Case("completed-marker-rc-true", OK2, marker(True), Outcome.FAILED, "rc not integer"),
    Case("completed-derived-1:0-does-not-gate", [sacct("COMPLETED", "0:0", "1:0")] * 2,
         marker(0), Outcome.SUCCEEDED, "State=COMPLETED ExitCode=0:0"),
    Case("completed-nonzero-exit", [sacct("COMPLETED", "1:0")] * 2, marker(0), Outcome.FAILED,
         "State=COMPLETED ExitCode=1:0"),
    Case("completed-lowercase-not-exact", [sacct("completed")] * 2, marker(0), Outcome.FAILED,
         "State=completed ExitCode=0:0"),
    Case("failed-1:0-marker-rc0", [sacct("FAILED", "1:0")] * 2, marker(0), Outcome.FAILED,
         "State=FAILED ExitCode=1:0 (sacct, 2 agreeing reads); marker rc=0 from rank 2"),
    Case("failed-batch-sigkill-0:9", [sacct("FAILED", "0:9")] * 2, NO_MARKER, Outcome.FAILED,
         "State=FAILED ExitCode=0:9"),
    Case("timeout-0:0", [sacct("TIMEOUT")] * 2, NO_MARKER, Outcome.TIMED_OUT,
         "State=TIMEOUT ExitCode=0:0 (sacct, 2 agreeing reads)"),
    Case("timeout-0:0-even-with-marker-rc0", [sacct("TIMEOUT")] * 2, marker(0),
         Outcome.TIMED_OUT, "State=TIMEOUT ExitCode=0:0"),
    Case("node-fail-0:0", [sacct("NODE_FAIL")] * 2, NO_MARKER, Outcome.NODE_FAILED,
         "State=NODE_FAIL ExitCode=0:0"),
    Case("out-of-memory", [sacct("OUT_OF_MEMORY", "0:125")] * 2, NO_MARKER,
         Outcome.OUT_OF_MEMORY, "State=OUT_OF_MEMORY ExitCode=0:125"),
    Case("cancelled-by-uid", [sacct("CANCELLED by 1000")] * 2, NO_MARKER, Outcome.CANCELLED,
         "State=CANCELLED by 1000 ExitCode=0:0"),
    Case("boot-fail", [sacct("BOOT_FAIL")] * 2, NO_MARKER, Outcome.FAILED, "State=BOOT_FAIL"),
    Case("preempted", [sacct("PREEMPTED")] * 2, NO_MARKER, Outcome.FAILED, "State=PREEMPTED"),
    Case("unknown-state-fails", [sacct("EXPLODED")] * 2, marker(0), Outcome.FAILED,
         "unrecognised State=EXPLODED"),
    Case("sacct-empty-then-completed", [sacct_empty(), *OK2], marker(0), Outcome.SUCCEEDED,
         "(sacct, 2 agreeing reads)"),
    Case("sacct-empty-between-reads-keeps-streak",
         [sacct("COMPLETED"), sacct_empty(), sacct_down(), sacct("COMPLETED")],
         marker(0), Outcome.SUCCEEDED, "(sacct, 2 agreeing reads)"),
    Case("sacct-failed-0:0-then-2:0-unconfirmed", [sacct("FAILED"), sacct("FAILED", "2:0")],
         NO_MARKER, Outcome.PENDING_EVIDENCE, "State=FAILED ExitCode=2:0 (sacct) read once"),
    Case("sacct-failed-0:0-then-2:0-twice",
         [sacct("FAILED"), sacct("FAILED", "2:0"), sacct("FAILED", "2:0")],
         NO_MARKER, Outcome.FAILED, "State=FAILED ExitCode=2:0 (sacct, 2 agreeing reads)"),
    Case("sacct-error-scontrol-completed-twice",
         [sacct_down(), scontrol("COMPLETED"), sacct_down(), scontrol("COMPLETED")],
         marker(0), Outcome.SUCCEEDED,
         "State=COMPLETED ExitCode=0:0 (scontrol, 2 agreeing reads); marker rc=0 from rank 2"),
    Case("sacct-error-scontrol-completed-once", [sacct_down(), scontrol("COMPLETED")],
         marker(0), Outcome.PENDING_EVIDENCE, "(scontrol) read once"),
    Case("sacct-and-scontrol-agree", [sacct("COMPLETED"), scontrol("COMPLETED")], marker(0),
         Outcome.SUCCEEDED, "(sacct and scontrol agree)"),
    Case("sacct-and-scontrol-disagree", [*OK2, scontrol("FAILED", "1:0")], marker(0),
         Outcome.PENDING_EVIDENCE,
         "sacct says State=COMPLETED ExitCode=0:0 but scontrol says State=FAILED ExitCode=1:0"),
    Case("sacct-and-scontrol-disagree-at-deadline", [*OK2, scontrol("FAILED", "1:0")],
         marker(0), Outcome.UNVERIFIED, "but scontrol says", past_deadline=True),
    # slurmctld and slurmdbd store different ExitCodes for signal-ended jobs.
    Case("timeout-sacct-0:0-scontrol-0:15", [*[sacct("TIMEOUT")] * 2, scontrol("TIMEOUT", "0:15")],
         NO_MARKER, Outcome.TIMED_OUT, "State=TIMEOUT ExitCode=0:0 (sacct, 2 agreeing reads)"),
    Case("cancelled-sacct-once-scontrol-once",
         [sacct("CANCELLED by 0"), scontrol("CANCELLED", "0:15")], NO_MARKER,
         Outcome.PENDING_EVIDENCE, "(scontrol) read once, unconfirmed"),
    Case("completed-exit-codes-contradict", [*OK2, scontrol("COMPLETED", "1:0")], marker(0),
         Outcome.UNVERIFIED, "but scontrol says State=COMPLETED ExitCode=1:0", past_deadline=True),
    # Both commands failing is said with what they said (munge, slurmdbd, slurmctld down).
    Case("both-silent-before-deadline", [sacct_down(), scontrol_timeout()], marker(0),
         Outcome.PENDING_EVIDENCE,
         "no record, every Slurm query failed (sacct failed: sacct: error: Problem talking to"
         " the database: Connection refused; scontrol failed: timed out after 30 s) after 3 s;"
         " asking again"),
    Case("both-silent-past-deadline", [sacct_down(), scontrol_timeout()] * 3, marker(0),
         Outcome.UNVERIFIED, "every Slurm query failed (sacct failed: sacct: error: Problem",
         past_deadline=True),
    Case("running-past-deadline", [sacct("RUNNING")] * 2, marker(0), Outcome.UNVERIFIED,
         "no terminal record; last read State=RUNNING ExitCode=0:0 (sacct) after 120 s",
         past_deadline=True),
    Case("completing-is-not-terminal", [scontrol("COMPLETING")] * 2, marker(0),
         Outcome.PENDING_EVIDENCE, "last read State=COMPLETING"),
    Case("completed-then-requeued-pending", [*OK2, sacct("PENDING")], marker(0),
         Outcome.PENDING_EVIDENCE, "last read State=PENDING"),
    Case("accounting-disabled-scontrol-twice",
         [sacct_disabled(), scontrol("COMPLETED"), scontrol("COMPLETED")], marker(0),
         Outcome.SUCCEEDED, "(scontrol, 2 agreeing reads)"),
    Case("accounting-disabled-scontrol-purged", [sacct_disabled(), scontrol_gone()], marker(0),
         Outcome.UNVERIFIED, "scontrol no longer knows the job and accounting is disabled"),
    Case("accounting-disabled-flag-no-record-at-deadline", [scontrol_timeout()], marker(0),
         Outcome.UNVERIFIED, "(scontrol failed: timed out after 30 s) after 120 s",
         accounting_disabled=True, past_deadline=True),
    Case("accounting-disabled-flag-scontrol-empty-at-deadline", [scontrol_gone()], marker(0),
         Outcome.UNVERIFIED, "scontrol no longer knows the job and accounting is disabled",
         accounting_disabled=True, past_deadline=True),
    Case("scontrol-purged-with-accounting-waits-for-sacct", [sacct_empty(), scontrol_gone()],
         marker(0), Outcome.PENDING_EVIDENCE, "no accounting record"),
    # The supervisor asked for the cancel.
    Case("cancel-then-cancelled", [sacct("CANCELLED by 0")] * 2, NO_MARKER, Outcome.CANCELLED,
         "cancel requested by the supervisor", cancel=True),
    Case("cancel-but-completed-with-marker-rc0", OK2, marker(0), Outcome.SUCCEEDED,
         "marker rc=0 from rank 2", cancel=True),
    Case("cancel-then-failed-143", [sacct("FAILED", "143:0")] * 2, marker(143),
         Outcome.CANCELLED, "State=FAILED ExitCode=143:0", cancel=True),
    Case("cancel-completed-no-marker-at-deadline", OK2, NO_MARKER, Outcome.CANCELLED,
         "marker .bench_done.42 missing", cancel=True, past_deadline=True),
    Case("cancel-but-timeout-keeps-cause", [sacct("TIMEOUT")] * 2, NO_MARKER, Outcome.TIMED_OUT,
         "State=TIMEOUT", cancel=True),
    Case("failed-143-without-our-cancel", [sacct("FAILED", "143:0")] * 2, NO_MARKER,
         Outcome.FAILED, "State=FAILED ExitCode=143:0"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_truth_table(case: Case) -> None:
    state = fold(case.queries)
    now = DEADLINE if case.past_deadline else T0 + timedelta(seconds=len(case.queries) + 1)
    verdict = decide(
        state,
        case.marker,
        cancel_requested=case.cancel,
        accounting_disabled=case.accounting_disabled,
        now=now,
        deadline=DEADLINE,
    )
    assert verdict.outcome is case.expected, verdict.reason
    assert case.reason in verdict.reason
    assert "\n" not in verdict.reason
    assert verdict.final is (case.expected is not Outcome.PENDING_EVIDENCE)


def test_truth_table_is_large_enough() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_success_never_without_exact_evidence(case: Case) -> None:
    """Whatever the case, SUCCEEDED implies COMPLETED 0:0 believed and marker rc 0."""
    state = fold(case.queries)
    for now in (BEFORE, DEADLINE):
        verdict = decide(
            state, case.marker, cancel_requested=case.cancel,
            accounting_disabled=case.accounting_disabled, now=now, deadline=DEADLINE,
        )  # fmt: skip
        if verdict.outcome is Outcome.SUCCEEDED:
            belief = believed(state)
            assert belief is not None
            assert belief.record.state.raw.strip() == "COMPLETED"
            assert str(belief.record.exit_code) == "0:0"
            assert case.marker.marker is not None and case.marker.marker.rc == 0


def test_failed_query_never_changes_knowledge() -> None:
    state = fold([sacct("COMPLETED")])
    for noise in (sacct_empty(), sacct_down(), sacct_disabled(), scontrol_timeout()):
        after = observe(state, noise(BEFORE))
        assert after.sacct == state.sacct
        assert after.scontrol == state.scontrol
        assert len(after.queries) == len(state.queries) + 1


def test_disagreeing_read_restarts_streak() -> None:
    state = fold([sacct("FAILED"), sacct("FAILED")])
    assert state.sacct is not None and state.sacct.streak == 2
    state = observe(state, sacct("FAILED", "2:0")(BEFORE))
    assert state.sacct is not None and state.sacct.streak == 1
    assert str(state.sacct.record.exit_code) == "2:0"
    assert believed(state) is None


def test_observe_refuses_another_jobs_query() -> None:
    other = sacct_query("43", taken_at=T0, returncode=0, stdout="", stderr="")
    with pytest.raises(ValueError, match="43"):
        observe(VerdictState(JOB, T0), other)


# --- query classification --------------------------------------------------------------


def test_sacct_query_classifies() -> None:
    assert sacct("COMPLETED")(T0).outcome is QueryOutcome.RECORD
    assert sacct_empty()(T0).outcome is QueryOutcome.EMPTY
    assert sacct_down()(T0).outcome is QueryOutcome.ERROR
    assert "Connection refused" in sacct_down()(T0).error
    assert sacct_disabled()(T0).outcome is QueryOutcome.ACCOUNTING_DISABLED
    garbage = sacct_query(JOB, taken_at=T0, returncode=0, stdout="oops\n", stderr="")
    assert garbage.outcome is QueryOutcome.ERROR
    assert garbage.record is None


def test_sacct_query_ignores_array_and_het_rows_sharing_the_id() -> None:
    stdout = (
        f"{JOB}|{JOB}_3|COMPLETED|0:0|0:0|None|node1|a|b|c|00:00:01|arr\n"
        f"{JOB}|{JOB}+0|COMPLETED|0:0|0:0|None|node1|a|b|c|00:00:01|het\n"
        f"{JOB}.batch|{JOB}.batch|COMPLETED|0:0||None|node1|a|b|c|00:00:01|batch\n"
        "7|7|COMPLETED|0:0|0:0|None|node1|a|b|c|00:00:01|other\n"
    )
    query = sacct_query(JOB, taken_at=T0, returncode=0, stdout=stdout, stderr="")
    assert query.outcome is QueryOutcome.EMPTY
    assert [r.job_id for r in query.rows] == [f"{JOB}_3", f"{JOB}+0", f"{JOB}.batch"]


def test_sacct_query_allocation_without_exit_code_is_an_error() -> None:
    stdout = f"{JOB}|{JOB}|COMPLETED|||None|node1|a|b|c|00:00:01|x\n"
    query = sacct_query(JOB, taken_at=T0, returncode=0, stdout=stdout, stderr="")
    assert query.outcome is QueryOutcome.ERROR
    assert "no ExitCode" in query.error


def test_sacct_query_keeps_steps_and_picks_allocation() -> None:
    query = sacct("FAILED", "4:0", "4:0")(T0)
    assert query.record is not None
    assert query.record.raw.startswith(f"{JOB}|{JOB}|FAILED|")
    assert [r.job_id_raw for r in query.rows] == [JOB, f"{JOB}.batch", f"{JOB}.0"]


def test_scontrol_query_classifies() -> None:
    assert scontrol("COMPLETED")(T0).outcome is QueryOutcome.RECORD
    assert scontrol_gone()(T0).outcome is QueryOutcome.NOT_FOUND
    other = scontrol_query(
        "43", taken_at=T0, returncode=0, stdout=scontrol("COMPLETED")(T0).raw, stderr=""
    )
    assert other.outcome is QueryOutcome.ERROR
    assert "not 43" in other.error
    blank = scontrol_query(JOB, taken_at=T0, returncode=0, stdout="\n", stderr="")
    assert blank.outcome is QueryOutcome.EMPTY
    broken = scontrol_query(JOB, taken_at=T0, returncode=1, stdout="", stderr="")
    assert broken.outcome is QueryOutcome.ERROR
    assert broken.error == "exit status 1"


# --- receipt ---------------------------------------------------------------------------


def test_receipt_is_json_and_complete() -> None:
    state = fold([sacct_down(), sacct("COMPLETED", "0:0", "1:0"), scontrol("COMPLETED")])
    reading = marker(0)
    verdict = decide(
        state, reading, cancel_requested=False, accounting_disabled=False,
        now=BEFORE, deadline=DEADLINE,
    )  # fmt: skip
    receipt = build_receipt(
        state,
        reading,
        verdict,
        decided_at=BEFORE,
        cancel_requested=False,
        accounting_disabled=False,
    )
    back = json.loads(json.dumps(receipt))
    assert back["schema"] == RECEIPT_SCHEMA
    assert back["job_id"] == JOB
    assert back["outcome"] == "succeeded"
    assert back["reason"] == verdict.reason
    assert back["derived_exit_code"] == "1:0"
    assert back["believed"]["basis"] == "sacct and scontrol agree"
    assert len(back["sacct_rows"]) == 3
    assert back["sacct_rows"][0].startswith(f"{JOB}|{JOB}|COMPLETED|0:0|1:0|")
    assert back["scontrol_record"].startswith(f"JobId={JOB} ")
    assert back["marker"]["status"] == "ok"
    assert back["marker"]["parsed"]["rank"] == 2
    assert '"rc": 0' in back["marker"]["raw_text"]
    assert [q["source"] for q in back["queries"]] == ["sacct", "sacct", "scontrol"]
    assert back["queries"][0]["outcome"] == "error"
    assert back["queries"][0]["taken_at"] == "2026-11-30T22:00:01+00:00"


def test_receipt_without_any_record() -> None:
    state = fold([sacct_down()])
    verdict = decide(
        state, NO_MARKER, cancel_requested=False, accounting_disabled=False,
        now=DEADLINE, deadline=DEADLINE,
    )  # fmt: skip
    receipt = build_receipt(
        state,
        NO_MARKER,
        verdict,
        decided_at=DEADLINE,
        cancel_requested=False,
        accounting_disabled=False,
    )
    back = json.loads(json.dumps(receipt))
    assert back["outcome"] == "unverified"
    assert back["believed"] is None
    assert back["sacct_rows"] == []
    assert back["scontrol_record"] is None
    assert back["marker"]["status"] == "missing"
    assert back["marker"]["raw_text"] is None


def test_decide_refuses_a_marker_read_for_another_job() -> None:
    other = read_marker(b"{}", "41")
    with pytest.raises(ValueError, match="41"):
        decide(
            fold(OK2), other, cancel_requested=False, accounting_disabled=False,
            now=BEFORE, deadline=DEADLINE,
        )  # fmt: skip


# --- the benchmark's validity gate on top of Slurm and the marker ----------------------

POINTS = {1: 4, 2: 8}  # concurrency -> prompts requested


def _gate(**broken: bytes | None) -> GateResult:
    """The gate on the demo's points: each valid, unless `broken` names c<N> -> bytes."""
    raw: dict[int, bytes | None] = {c: vllm_result(c, n) for c, n in POINTS.items()}
    raw.update({int(k[1:]): v for k, v in broken.items()})
    parsed = {c: parse_result(data, "vllm") for c, data in raw.items()}
    return gate(parsed, POINTS, Validity(), {})


@pytest.mark.parametrize(
    ("slurm_marker", "results", "expected", "reason"),
    [
        ((OK2, marker(0)), _gate(), Outcome.SUCCEEDED, "marker rc=0"),
        ((OK2, marker(0)), _gate(c2=None), Outcome.FAILED, "benchmark c=2: no result file"),
        (
            (OK2, marker(0)),
            _gate(c1=vllm_result(1, 4, completed=0)),
            Outcome.FAILED,
            "benchmark c=1: 0 of 4 requests completed (min 4); results/c1.json; State=COMPLETED",
        ),
        ((OK2, marker(0)), _gate(c2=b"{not json"), Outcome.FAILED, "benchmark c=2: unparsable"),
        ((OK2, marker(0)), _gate(c2=vllm_result(4, 8)), Outcome.FAILED, "wrong concurrency"),
        ((OK2, marker(7)), _gate(), Outcome.FAILED, "marker rc=7 from rank 2"),
        (([sacct("TIMEOUT")] * 2, NO_MARKER), _gate(c1=None), Outcome.TIMED_OUT, "TIMEOUT"),
        ((OK2, marker(0)), None, Outcome.SUCCEEDED, "marker rc=0"),  # no results looked for
    ],
)
def test_success_also_needs_the_benchmark_results(
    slurm_marker: tuple[list[Q], MarkerReading],
    results: GateResult | None,
    expected: Outcome,
    reason: str,
) -> None:
    queries, reading = slurm_marker
    now = T0 + timedelta(seconds=len(queries) + 1)
    state = fold(queries)
    plain = decide(
        state,
        reading,
        cancel_requested=False,
        accounting_disabled=False,
        now=now,
        deadline=DEADLINE,
    )
    verdict = with_benchmark(plain, results)
    assert verdict.outcome is expected, verdict.reason
    assert reason in verdict.reason and "\n" not in verdict.reason
    receipt = build_receipt(
        state,
        reading,
        verdict,
        decided_at=now,
        cancel_requested=False,
        accounting_disabled=False,
        benchmark=results,
    )
    assert receipt["outcome"] == expected.value
    if results is not None:
        evidence = receipt["benchmark"]
        assert isinstance(evidence, dict)
        assert [p["concurrency"] for p in evidence["points"]] == sorted(POINTS)
