"""The measurements of the takeover trials (tests/faults/ha_trials.py), on made-up logs."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest

from tests.faults.ha_trials import (
    Interval,
    LeaseEvent,
    Trial,
    jobs_per_name,
    leader_intervals,
    parse_lease_events,
    render_report,
    sacct_argv,
    takeover_s,
    two_leaders_s,
    write_report,
)

T0 = datetime(2026, 12, 6, 7, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def line(event: str, seconds: float, cluster: str = "dev", **extra: object) -> str:
    stamp = at(seconds).isoformat().replace("+00:00", "Z")
    return json.dumps(
        {"event": event, "cluster": cluster, "timestamp": stamp, "level": "info", **extra}
    )


def ev(daemon: str, event: str, seconds: float, cluster: str = "dev") -> LeaseEvent:
    return LeaseEvent(daemon, event, cluster, at(seconds))


# ---------------------------------------------------------------- parsing


def test_parse_takes_lease_events_and_skips_everything_else() -> None:
    lines = [
        line("daemon.started", 0.0),
        line("lease.acquired", 1.5, epoch=3, holder="login1:42", expires_at=12.0),
        "Traceback (most recent call last):",
        "",
        line("lease.standby", 2.0),
        line("lease.lost", 4.25, epoch=3, reason="expired"),
        line("lease.released", 5.0, cluster="other", epoch=1),
        '{"event": "lease.acquired", "cluster": "dev", "timest',  # a partial last line
    ]
    got = parse_lease_events("login1", lines)
    assert got == [
        LeaseEvent("login1", "lease.acquired", "dev", at(1.5), 3),
        LeaseEvent("login1", "lease.lost", "dev", at(4.25), 3),
        LeaseEvent("login1", "lease.released", "other", at(5.0), 1),
    ]


def test_parse_reads_structlog_timestamps() -> None:
    # What structlog's TimeStamper(fmt="iso", utc=True) writes.
    text = '{"event": "lease.acquired", "cluster": "c", "timestamp": "2026-12-06T07:00:01.250000Z"}'
    (got,) = parse_lease_events("d", [text])
    assert got.at == at(1.25)
    assert got.epoch is None


def test_a_stop_logged_late_ends_acting_at_the_deadline() -> None:
    """A SIGSTOPped leader logs lease.lost when it wakes; it acted until its deadline."""
    text = (
        '{"event": "lease.lost", "cluster": "c", "reason": "silence", "late_s": 14.75,'
        ' "timestamp": "2026-12-06T07:00:20Z"}'
    )
    (got,) = parse_lease_events("d", [text])
    assert got.at == at(5.25)


def test_parse_refuses_a_lease_event_without_cluster() -> None:
    with pytest.raises(ValueError, match="without cluster"):
        parse_lease_events("d", ['{"event": "lease.lost", "timestamp": "2026-12-06T07:00:00Z"}'])


# ---------------------------------------------------------------- intervals

INTERVAL_CASES = [
    pytest.param(
        [ev("a", "lease.acquired", 0), ev("a", "lease.lost", 10)],
        {},
        [("a", 0, 10, "lease.lost")],
        id="acquired-then-lost",
    ),
    pytest.param(
        [ev("a", "lease.acquired", 0), ev("a", "lease.stepping_down", 3)],
        {},
        [("a", 0, 3, "lease.stepping_down")],
        id="stepping-down-ends-it",
    ),
    pytest.param(
        [ev("a", "lease.acquired", 0)],
        {"a": at(7)},
        [("a", 0, 7, "death")],
        id="open-until-death",
    ),
    pytest.param(
        [ev("a", "lease.acquired", 0)],
        {},
        [("a", 0, 100, "end")],
        id="open-until-the-end",
    ),
    pytest.param(
        [ev("a", "lease.acquired", 0)],
        {"a": at(200)},
        [("a", 0, 100, "end")],
        id="death-after-the-end-counts-as-the-end",
    ),
    pytest.param(
        [ev("a", "lease.acquired", 0), ev("a", "lease.acquired", 5), ev("a", "lease.released", 9)],
        {},
        [("a", 0, 5, "acquired"), ("a", 5, 9, "lease.released")],
        id="acquired-again-splits",
    ),
    pytest.param(
        [ev("a", "lease.lost", 2), ev("a", "lease.released", 3)],
        {},
        [],
        id="ending-without-acquired-ignored",
    ),
    pytest.param(
        # Out of order in the input (two logs concatenated): sorted per daemon.
        [ev("a", "lease.lost", 10), ev("b", "lease.acquired", 12), ev("a", "lease.acquired", 1)],
        {},
        [("a", 1, 10, "lease.lost"), ("b", 12, 100, "end")],
        id="sorted-by-time",
    ),
]


@pytest.mark.parametrize(("events", "died", "expected"), INTERVAL_CASES)
def test_leader_intervals(
    events: list[LeaseEvent],
    died: dict[str, datetime],
    expected: list[tuple[str, float, float, str]],
) -> None:
    got = leader_intervals(events, until=at(100), died=died)
    assert [(i.daemon, i.start, i.end, i.ended_by) for i in got] == [
        (d, at(s), at(e), how) for d, s, e, how in expected
    ]


def test_intervals_are_per_cluster() -> None:
    events = [
        ev("a", "lease.acquired", 0, "x"),
        ev("a", "lease.acquired", 1, "y"),
        ev("a", "lease.lost", 4, "x"),
    ]
    got = leader_intervals(events, until=at(10))
    assert [(i.cluster, i.start, i.end) for i in got] == [
        ("x", at(0), at(4)),
        ("y", at(1), at(10)),
    ]


# ---------------------------------------------------------------- two leaders, takeover


def iv(daemon: str, start: float, end: float, cluster: str = "dev", how: str = "x") -> Interval:
    return Interval(daemon, cluster, at(start), at(end), how)


TWO_LEADER_CASES = [
    pytest.param([iv("a", 0, 10), iv("b", 12, 20)], 0.0, id="disjoint"),
    pytest.param([iv("a", 0, 10), iv("b", 10, 20)], 0.0, id="touching"),
    pytest.param([iv("a", 0, 10), iv("b", 7.5, 20)], 2.5, id="overlap"),
    pytest.param([iv("a", 0, 10), iv("a", 5, 20)], 0.0, id="same-daemon-is-one-leader"),
    pytest.param([iv("a", 0, 30), iv("b", 5, 10), iv("b", 20, 25)], 10.0, id="two-stretches"),
    pytest.param([iv("a", 0, 10), iv("b", 2, 8), iv("c", 4, 12)], 8.0, id="three-daemons"),
    pytest.param([iv("a", 0, 10), iv("b", 2, 8, cluster="other")], 0.0, id="other-cluster"),
    pytest.param([], 0.0, id="nobody"),
]


@pytest.mark.parametrize(("intervals", "expected"), TWO_LEADER_CASES)
def test_two_leaders_s(intervals: list[Interval], expected: float) -> None:
    assert two_leaders_s(intervals, "dev") == pytest.approx(expected)


TAKEOVER_CASES = [
    # leader a killed at 10, b acquires at 14.5
    pytest.param([iv("a", 0, 10, how="death"), iv("b", 14.5, 30)], 10, 4.5, id="standby-takes"),
    # a's database link cut at 10; b acquires at 16 while a still believes until 18
    pytest.param([iv("a", 0, 18), iv("b", 16, 30)], 10, 6.0, id="takeover-before-old-notices"),
    # PostgreSQL restarted at 10: a loses at 10.2, acquires again at 11
    pytest.param([iv("a", 0, 10.2), iv("a", 11, 30)], 10, 1.0, id="old-leader-again"),
    # the standby's fault: the leader keeps the lease to the end
    pytest.param([iv("a", 0, 30, how="end")], 10, None, id="no-takeover-needed"),
    # leader killed, nobody takes over before the end
    pytest.param([iv("a", 0, 10, how="death")], 10, None, id="nobody-takes-over"),
    # nobody led at the fault
    pytest.param([iv("b", 3, 30)], 1, 2.0, id="leaderless-at-fault"),
    pytest.param([iv("b", 11, 30, cluster="other")], 10, None, id="other-cluster"),
]


@pytest.mark.parametrize(("intervals", "fault", "expected"), TAKEOVER_CASES)
def test_takeover_s(intervals: list[Interval], fault: float, expected: float | None) -> None:
    got = takeover_s(intervals, "dev", at(fault))
    assert got == (None if expected is None else pytest.approx(expected))


def test_from_logs_to_numbers() -> None:
    """Two daemons' logs end to end: a leads, its link is cut at 20, b takes over at 26,
    a notices at 28 and steps down; a is killed at 40 (it led nothing then)."""
    log_a = [line("lease.acquired", 1, epoch=1), line("lease.stepping_down", 28, epoch=1)]
    log_b = [line("lease.acquired", 26, epoch=2)]
    events = parse_lease_events("login1", log_a) + parse_lease_events("login2", log_b)
    intervals = leader_intervals(events, until=at(60), died={"login1": at(40)})
    assert two_leaders_s(intervals, "dev") == pytest.approx(2.0)
    assert takeover_s(intervals, "dev", at(20)) == pytest.approx(6.0)


# ---------------------------------------------------------------- sacct


def test_sacct_argv() -> None:
    argv = sacct_argv(["run-b", "run-a", "run-b"])
    assert "--name=run-a,run-b" in argv
    assert "-X" in argv and "-D" in argv and "--parsable2" in argv
    assert "--format=JobName,JobID" in argv


JOBS_CASES = [
    pytest.param("", {}, id="none"),
    pytest.param("run-a|101\nrun-b|102\n", {"run-a": 1, "run-b": 1}, id="one-each"),
    pytest.param("run-a|101\nrun-a|105\n", {"run-a": 2}, id="duplicate"),
    pytest.param("run-a|101\nrun-a|101\n", {"run-a": 1}, id="requeued-same-id-once"),
    pytest.param("run-a|101_3\nrun-a|101_4\n", {"run-a": 1}, id="array-tasks-one-job"),
    pytest.param("run-a|200+0\nrun-a|200+1\n", {"run-a": 1}, id="het-job-one-job"),
    pytest.param("\nrun-a|7\n\n", {"run-a": 1}, id="blank-lines"),
]


@pytest.mark.parametrize(("out", "expected"), JOBS_CASES)
def test_jobs_per_name(out: str, expected: dict[str, int]) -> None:
    assert jobs_per_name(out) == expected


def test_jobs_per_name_refuses_other_output() -> None:
    with pytest.raises(ValueError, match="JobName"):
        jobs_per_name("sacct: error: Problem talking to the database\n")


# ---------------------------------------------------------------- the report


TRIALS = [
    Trial("leader SIGKILL", 4.0, 0.0, {"r1": 1}),
    Trial("leader SIGKILL", 6.0, 0.0, {"r2": 1}),
    Trial("leader SIGKILL", 5.0, 0.5, {"r3": 1}),
    Trial("database link cut 30 s", 12.0, 2.0, {"r4": 2}, stale_writes_rejected=3),
    Trial("database link cut 30 s", None, 0.0, {"r5": 1}, stale_writes_committed=1, runs_lost=1),
]


def test_trial_duplicate_jobs() -> None:
    assert TRIALS[3].duplicate_jobs == {"r4": 2}
    assert TRIALS[0].duplicate_jobs == {}


def test_render_report_rows() -> None:
    text = render_report(TRIALS, title="Takeover trials")
    rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| fault")]
    assert rows == [
        "| leader SIGKILL | 3 | 3 | 6.00 | 5.00 | 0.50 | none | 0 | 0 | 0 / 0 | 0 |",
        "| database link cut 30 s | 2 | 1 | 12.00 | 12.00 | 2.00 | r4 | 3 | 1 | 0 / 0 | 1 |",
        "| **all** | 5 | 4 | 12.00 | 5.50 | 2.00 | r4 | 3 | 1 | 0 / 0 | 1 |",
    ]
    assert "## Trials with a duplicate job" in text
    assert text.startswith("# Takeover trials\n")


def test_render_report_no_takeover_at_all() -> None:
    text = render_report([Trial("standby SIGKILL", None, 0.0)], title="t")
    assert "| standby SIGKILL | 1 | 0 | - | - | 0.00 | none | 0 | 0 | 0 / 0 | 0 |" in text
    assert "## Trials with" not in text


def test_write_report(tmp_path: Path) -> None:
    path = write_report(TRIALS, day=date(2026, 12, 6), directory=tmp_path, notes="Slurm 24.11")
    assert path == tmp_path / "2026-12-06-takeover-trials.md"
    assert "Slurm 24.11" in path.read_text()
    raw = json.loads(path.with_suffix(".json").read_text())
    assert len(raw) == 5 and raw[3]["jobs_per_name"] == {"r4": 2}
