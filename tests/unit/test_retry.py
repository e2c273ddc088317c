"""Retries and quarantine, pure (`core.run.retry_policy`, `core.verdict.usage`, `lifecycle`
Retry/Held/HoldExpired). Issue 3.2 items 1 and 3: one user's job alone never keeps a node from
another user's runs; one inferred failure quarantines nothing; a retry that could only be
placed on nodes it must keep out is not retried; a hold has a deadline."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from llmd_supervisor.core.run.lifecycle import (
    CallSbatch,
    CancelRequested,
    Held,
    HoldExpired,
    LeftQueue,
    Retry,
    RunState,
    Started,
    Submit,
    Submitted,
    WatchersStopped,
    WriteArchive,
    new_run,
    plan,
    step,
)
from llmd_supervisor.core.run.retry_policy import (
    Decision,
    Evidence,
    Exclusion,
    NodeFailure,
    QuarantineRules,
    RetryPolicy,
    decide,
    exclusion,
    failures_of,
    held_reason,
    hold_expired_reason,
    placed,
    quarantine,
)
from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.core.verdict.cause import Cause, Diagnosis
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.core.verdict.usage import duration_s, split, usage
from llmd_supervisor.errors import IllegalTransition, SpecError
from tests.daemon_helpers import DEMO_SPEC

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
INFRA = Diagnosis(Cause.INFRASTRUCTURE, ("node4",), "node4 unreachable")


@pytest.mark.parametrize(
    ("diagnosis", "done", "cancel", "retry", "why"),
    [
        (INFRA, 0, False, True, "retry 1 of 1 without node4 after an infrastructure failure"),
        (INFRA, 1, False, False, "no retry: retry.infrastructure = 1 used up"),
        (INFRA, 0, True, False, "no retry: a cancel was requested"),
        (Diagnosis(Cause.WORKLOAD, (), "rc 7"), 0, False, False, "no retry: cause workload"),
        (Diagnosis(Cause.UNKNOWN, (), "?"), 0, False, False, "no retry: cause unknown"),
        (Diagnosis(Cause.CANCELLED, (), "c"), 0, False, False, "no retry: cause cancelled"),
        (None, 0, False, False, "the attempt succeeded"),
    ],
)
def test_only_infrastructure_failures_are_retried(
    diagnosis: Diagnosis | None, done: int, cancel: bool, retry: bool, why: str
) -> None:
    got = decide(RetryPolicy(), diagnosis, retries_done=done, cancel_requested=cancel)
    assert (got.retry, got.why) == (retry, why)
    assert got.exclude == (("node4",) if retry else ())


def test_exclude_nodes_false_retries_on_any_node() -> None:
    got = decide(RetryPolicy(exclude_nodes=False), INFRA, retries_done=0, cancel_requested=False)
    assert got.retry and got.exclude == ()


def test_the_retry_table_of_a_spec() -> None:
    text = DEMO_SPEC.read_text()
    assert load_spec(text).retry == RetryPolicy(1, True, 30.0, None)
    spec = load_spec(text + "\n[retry]\ninfrastructure = 2\nexclude_nodes = false\nbackoff_s = 0\n")
    assert spec.retry == RetryPolicy(2, False, 0.0)
    held = load_spec(text + "\n[retry]\nhold_timeout_s = 120\n")
    assert held.retry.hold_timeout_s == 120.0
    with pytest.raises(SpecError, match=r"retry\.hold_timeout_s"):
        load_spec(text + "\n[retry]\nhold_timeout_s = -1\n")
    with pytest.raises(SpecError, match=r"retry\.hold_timeout_s"):
        load_spec(text + '\n[retry]\nhold_timeout_s = "1h"\n')
    with pytest.raises(SpecError, match=r"retry\.infrastructure"):
        load_spec(text + "\n[retry]\ninfrastructure = 11\n")
    with pytest.raises(SpecError, match="retry"):
        load_spec(text + "\n[retry]\nworkload = 1\n")


A, B = 1001, 1002  # two users
OBS, INF = Evidence.OBSERVED, Evidence.INFERRED
RULES = QuarantineRules(ttl=timedelta(hours=6))  # 1 observed, or 2 runs (of 2 owners: all)
H = timedelta(hours=1)


def fail(
    owner: int, run: str, evidence: Evidence, at: datetime = T0, attempt: int = 1
) -> NodeFailure:
    return NodeFailure("dev", "node5", owner, run, attempt, evidence, f"{run} failed", at)


# name, failures of node5, rules, then: kept out of everyone's runs, of A's, of B's
QUARANTINE: list[tuple[str, list[NodeFailure], QuarantineRules, bool, bool, bool]] = [
    ("one inferred failure keeps the node from nobody", [fail(A, "r1", INF)], RULES,
     False, False, False),
    ("two runs of one owner: that owner's runs only", [fail(A, "r1", INF), fail(A, "r2", INF)],
     RULES, False, True, False),
    ("one run's two attempts are one run", [fail(A, "r1", INF), fail(A, "r1", INF, attempt=2)],
     RULES, False, False, False),
    ("many runs of one owner never reach everyone",
     [fail(A, f"r{i}", INF) for i in range(10)], RULES, False, True, False),
    ("two runs of two owners: everyone", [fail(A, "r1", INF), fail(B, "r2", INF, T0 + H)],
     RULES, True, True, True),
    ("one failure the daemon saw itself: everyone", [fail(A, "r1", OBS)], RULES,
     True, True, True),
    ("observed, with two required", [fail(A, "r1", OBS)],
     QuarantineRules(timedelta(hours=6), after_observed=2), False, False, False),
    ("one inferred per owner allowed by the operator",
     [fail(A, "r1", INF)], QuarantineRules(timedelta(hours=6), after_inferred=1),
     False, True, False),
    ("failures older than the TTL are forgotten",
     [fail(A, "r1", OBS, T0 - 7 * H), fail(A, "r2", INF, T0 - 7 * H), fail(B, "r3", INF)],
     RULES, False, False, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("failures", "rules", "everyone", "a", "b"),
    [c[1:] for c in QUARANTINE],
    ids=[c[0] for c in QUARANTINE],
)
def test_who_a_nodes_failures_keep_it_from(
    failures: list[NodeFailure], rules: QuarantineRules, everyone: bool, a: bool, b: bool
) -> None:
    got = quarantine(failures, now=T0 + H, rules=rules)
    assert any(q.owner_uid is None and q.active for q in got) is everyone
    assert (
        any(q.keeps_out(A) for q in got),
        any(q.keeps_out(B) for q in got),
        any(q.keeps_out(4242) for q in got),
    ) == (a, b, everyone)
    shared = [q for q in got if q.owner_uid is None]
    live = [f for f in failures if f.at > T0 + H - rules.ttl]
    assert len(shared) == (1 if live else 0)  # every node with live failures is listed
    if live:
        assert shared[0].failures == len(live)


def test_a_quarantine_lasts_while_the_failures_it_needs_are_within_the_ttl() -> None:
    a1, b2 = fail(A, "r1", INF, T0), fail(B, "r2", INF, T0 + 5 * H)
    (q,) = [q for q in quarantine([a1, b2], now=T0 + 5 * H, rules=RULES) if q.owner_uid is None]
    assert q.active and q.until == T0 + 6 * H  # a1 leaves the window then
    assert (q.since, q.failures, q.run_id, q.run_owner) == (T0, 2, "r2", B)
    later = quarantine([a1, b2], now=T0 + 6 * H, rules=RULES)
    assert [(q.owner_uid, q.active, q.until) for q in later] == [(None, False, T0 + 11 * H)]
    seen = fail(A, "r3", OBS, T0 + 2 * H)
    (q,) = quarantine([a1, seen], now=T0 + 3 * H, rules=RULES)  # A's two runs: one entry
    assert q.owner_uid is None and q.until == T0 + 8 * H  # the observed failure's TTL
    own = [q for q in quarantine([a1, seen], now=T0 + 3 * H, rules=RULES) if q.owner_uid == A]
    assert own == []  # A's two runs keep it from A until T0 + 6 h: everyone's entry is longer
    two = quarantine([fail(A, "r1", INF), fail(A, "r2", INF, T0 + H)], now=T0 + H, rules=RULES)
    assert [(q.owner_uid, q.active, q.until) for q in two] == [
        (None, False, T0 + 7 * H),
        (A, True, T0 + 6 * H),
    ]


def test_failures_count_against_the_implicated_nodes_with_their_evidence() -> None:
    d = Diagnosis(Cause.INFRASTRUCTURE, ("node3", "node4", "x/y"), "w", observed=("node4",))
    assert failures_of(d) == [("node3", INF), ("node4", OBS)]
    assert failures_of(Diagnosis(Cause.WORKLOAD, (), "rc 7")) == []


def test_exclusion_keeps_the_run_placeable_or_says_why() -> None:
    q = quarantine([fail(A, "r1", OBS)], now=T0, rules=RULES)  # node5, for everyone
    nodes = ["node1", "node2", "node3", "node5"]
    kw = {"owner_uid": B, "cluster_nodes": nodes}
    fine = exclusion(["node4", "node1"], q, needed=2, **kw)  # type: ignore[arg-type]
    assert (fine.nodes, fine.placeable) == (("node1", "node5"), True)  # node4: not the cluster's
    held = exclusion(["node1"], q, needed=3, **kw)  # type: ignore[arg-type]
    assert not held.placeable
    assert held.shortage == "the job needs 3 nodes and only 2 of 4 are not excluded (node1,node5)"
    unknown = exclusion([], q, owner_uid=B, cluster_nodes=None, needed=None)
    assert unknown.nodes == ("node5",) and unknown.placeable
    expired = quarantine([fail(A, "r1", OBS)], now=T0 + 7 * H, rules=RULES)
    assert exclusion([], expired, owner_uid=B, cluster_nodes=None, needed=None).nodes == ()


def test_one_owners_quarantine_keeps_the_node_from_that_owners_runs_only() -> None:
    q = quarantine([fail(A, "r1", INF), fail(A, "r2", INF)], now=T0, rules=RULES)
    nodes = ["node1", "node2", "node5"]
    assert exclusion([], q, owner_uid=A, cluster_nodes=nodes, needed=3).shortage == (
        "the job needs 3 nodes and only 2 of 3 are not excluded (node5)"
    )
    other = exclusion([], q, owner_uid=B, cluster_nodes=nodes, needed=3)
    assert (other.nodes, other.placeable) == ((), True)


@pytest.mark.parametrize(
    "bad", ["node[1-4]", "node1,node2", "a/b", "-x", "node 1", "--partition=x", ""]
)
def test_no_name_but_a_plain_node_name_reaches_exclude(bad: str) -> None:
    forged = NodeFailure("dev", bad, A, "r1", 1, OBS, "x", T0)
    q = quarantine([forged], now=T0, rules=RULES)
    got = exclusion([bad, "node2"], q, owner_uid=A, cluster_nodes=None, needed=None)
    assert got.nodes == ("node2",)


RETRY = Decision(True, "retry 1 of 1 without node1 after an infrastructure failure", ("node1",))
SHORT = Exclusion(
    ("node1",), False, "the job needs 4 nodes and only 3 of 4 are not excluded (node1)"
)


@pytest.mark.parametrize(
    ("decision", "where", "want"),
    [
        (RETRY, Exclusion(("node1",), True, ""), RETRY),
        (RETRY, SHORT, Decision(False, f"no retry: {SHORT.shortage}", unplaced=True)),
        (Decision(False, "no retry: cause workload"), SHORT,
         Decision(False, "no retry: cause workload")),
    ],
)  # fmt: skip
def test_a_retry_that_cannot_be_placed_is_no_retry(
    decision: Decision, where: Exclusion, want: Decision
) -> None:
    assert placed(decision, where) == want


def test_a_held_runs_reasons_say_until_when_and_then_what_it_was() -> None:
    shortage = "the job needs 4 nodes and only 2 of 4 are not excluded (node1,node2)"
    held = held_reason(shortage, T0 + H)
    assert held.startswith(f"waiting: {shortage}; held until 2026-12-01T13:00:00+00:00, then")
    assert "nodes release NODE" in held
    alone = hold_expired_reason(shortage, T0, 1800, None)
    assert alone == (
        "held for want of nodes since 2026-12-01T12:00:00+00:00, past its 1800 s hold "
        f"deadline: {shortage}"
    )
    after = hold_expired_reason(shortage, T0, 60, {"attempt": 1, "reason": "State=FAILED; x"})
    assert after.endswith("; attempt 1: State=FAILED; x")


def test_a_held_run_past_its_deadline_fails_from_accepted() -> None:
    run = new_run("r1", "llmd-r1", T0)
    held, _ = step(run, Held("waiting: x"), T0)
    failed, actions = step(held, HoldExpired("held past its deadline"), T0 + H)
    assert failed.state is RunState.ARCHIVING and failed.outcome is Outcome.FAILED
    assert failed.reason == "held past its deadline" and failed.slurm_job_id is None
    assert [t.event for t in failed.transitions][-1] == "HoldExpired"
    assert actions == (WriteArchive(Outcome.FAILED, "held past its deadline"),)
    submitting, _ = step(run, Submit(), T0)
    with pytest.raises(IllegalTransition):
        step(submitting, HoldExpired("x"), T0)  # only a run that was never submitted


def test_a_retry_is_a_new_submission_from_accepted() -> None:
    run = new_run("r1", "llmd-r1", T0)
    for event in (Submit(), Submitted("7"), Started(("node1", "node4")), LeftQueue()):
        run, _ = step(run, event, T0)
    run, _ = step(run, WatchersStopped(), T0)
    retried, actions = step(run, Retry("retry 1 of 1"), T0)
    assert retried.state is RunState.ACCEPTED
    assert (retried.attempt, retried.submission, retried.slurm_job_id) == (2, 2, None)
    assert retried.nodes == () and retried.outcome is None
    assert retried.slurm_job_name == "llmd-r1.2" and run.slurm_job_name == "llmd-r1"
    assert actions == (CallSbatch("llmd-r1.2"),)
    held, _ = step(retried, Held("waiting: too few nodes"), T0)
    assert held.reason == "waiting: too few nodes" and held.state is RunState.ACCEPTED
    assert step(held, Held("waiting: too few nodes"), T0)[0] is held
    cancelled, _ = step(run, CancelRequested(), T0)
    with pytest.raises(IllegalTransition):
        step(cancelled, Retry("no"), T0)  # a cancel requested is never retried
    assert plan(step(held, CancelRequested(), T0)[0])[0].__class__.__name__ == "Declare"


def test_usage_splits_useful_and_lost_hours() -> None:
    assert duration_s("1-02:03:04") == 93784 and duration_s("03:04") == 184
    assert duration_s("INVALID") is None
    first, last = usage(1800, 3, 8), usage(3600, 3, 8)
    assert first == {"elapsed_s": 1800, "node_hours": 1.5, "gpu_hours": 12.0}
    assert split([first, last]) == {
        "gpu_hours_useful": 24.0,
        "gpu_hours_lost": 12.0,
        "node_hours_useful": 3.0,
        "node_hours_lost": 1.5,
    }
    assert usage(None, 3, 8)["gpu_hours"] is None


def test_a_stage_past_its_deadline_is_overdue_and_classified_by_where() -> None:
    from llmd_supervisor.core.run.health import overdue_stage
    from llmd_supervisor.core.verdict.cause import hang

    started = T0.isoformat()
    stages = [
        {"name": "engines-healthy", "state": "running", "deadline_s": 10, "started_at": started}
    ]
    now = T0.timestamp()
    assert overdue_stage(stages, now + 12, 5) is None
    late = overdue_stage(stages, now + 16, 5)
    assert late is not None and (late.stage, late.deadline_s, late.over_s) == (
        "engines-healthy",
        10,
        6,
    )
    assert overdue_stage([{**stages[0], "state": "done"}], now + 99, 5) is None
    for bad in (
        None,
        [],
        ["x"],
        [{**stages[0], "deadline_s": True}],
        [{**stages[0], "started_at": "x"}],
    ):
        assert overdue_stage(bad, now + 99, 5) is None
    nodes = ("node1", "node2", "node3")
    assert hang("engines-healthy", 2, nodes).cause is Cause.INFRASTRUCTURE
    assert hang("engines-healthy", 2, nodes).nodes == ("node3",)
    assert hang("benchmark c=4", 2, nodes).cause is Cause.WORKLOAD
