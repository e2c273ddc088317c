"""Retries and quarantine, pure (`core.retry`, `core.usage`, `lifecycle` Retry/Held)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from llmd_supervisor.core.cause import Cause, Diagnosis
from llmd_supervisor.core.lifecycle import (
    CallSbatch,
    CancelRequested,
    Held,
    LeftQueue,
    Retry,
    RunState,
    Started,
    Submit,
    Submitted,
    WatchersStopped,
    new_run,
    plan,
    step,
)
from llmd_supervisor.core.retry import (
    Quarantined,
    RetryPolicy,
    count_failure,
    decide,
    exclusion,
)
from llmd_supervisor.core.spec import load_spec
from llmd_supervisor.core.usage import duration_s, split, usage
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
    assert load_spec(text).retry == RetryPolicy(1, True, 30.0)
    spec = load_spec(text + "\n[retry]\ninfrastructure = 2\nexclude_nodes = false\nbackoff_s = 0\n")
    assert spec.retry == RetryPolicy(2, False, 0.0)
    with pytest.raises(SpecError, match=r"retry\.infrastructure"):
        load_spec(text + "\n[retry]\ninfrastructure = 11\n")
    with pytest.raises(SpecError, match="retry"):
        load_spec(text + "\n[retry]\nworkload = 1\n")


def test_a_node_is_quarantined_after_k_failures_within_the_ttl() -> None:
    ttl = timedelta(hours=6)
    one = count_failure(None, cluster="c", node="n", run_id="r1", reason="x", now=T0, ttl=ttl)
    assert one.failures == 1 and one.active(T0, 1) and not one.active(T0, 2)
    two = count_failure(one, cluster="c", node="n", run_id="r2", reason="y", now=T0, ttl=ttl)
    assert (two.failures, two.run_id, two.since) == (2, "r2", T0) and two.active(T0, 2)
    assert not two.active(T0 + ttl, 1)  # expired
    later = T0 + ttl + timedelta(seconds=1)
    again = count_failure(two, cluster="c", node="n", run_id="r3", reason="z", now=later, ttl=ttl)
    assert again.failures == 1 and again.since == later  # an expired record starts again


def test_exclusion_keeps_the_run_placeable_or_says_why() -> None:
    q = [Quarantined("c", "node2", 1, "x", "r", T0, T0 + timedelta(hours=1))]
    nodes = ["node1", "node2", "node3", "node4"]
    kw = {"now": T0, "after_failures": 1, "cluster_nodes": nodes}
    fine = exclusion(["node4"], q, needed=2, **kw)  # type: ignore[arg-type]
    assert (fine.nodes, fine.placeable) == (("node2", "node4"), True)
    held = exclusion(["node4"], q, needed=3, **kw)  # type: ignore[arg-type]
    assert not held.placeable
    assert "needs 3 nodes and only 2 of 4 are not excluded (node2,node4)" in held.why
    assert "nodes release NODE" in held.why
    gone = exclusion(["node9"], [], needed=4, **kw)  # type: ignore[arg-type]
    assert gone.nodes == () and gone.placeable  # a node the cluster no longer has
    expired = exclusion([], q, now=T0 + timedelta(hours=2), after_failures=1,
                        cluster_nodes=None, needed=None)  # fmt: skip
    assert expired.nodes == ()


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
    from llmd_supervisor.core.cause import hang
    from llmd_supervisor.core.health import overdue_stage

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
    assert hang("engines-healthy", "node3", 2).cause is Cause.INFRASTRUCTURE
    assert hang("engines-healthy", "node3", 2).nodes == ("node3",)
    assert hang("benchmark c=4", "node3", 2).cause is Cause.WORKLOAD
