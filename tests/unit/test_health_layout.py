"""Pure node-health decisions and the run layout."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from llmd_supervisor.core.run import health as nh
from llmd_supervisor.core.run.layout import RunLayout, batch_log_patterns
from llmd_supervisor.supervision.run.attempt import status_state

LIMITS = nh.HealthLimits(node_silent_s=10.0, log_stall_s=30.0)


def run(probes: list[tuple[float, nh.Probe]]) -> tuple[nh.NodeHealth, list[object]]:
    health = nh.NodeHealth("node1", 0, since=0.0)
    events: list[object] = []
    for now, probe in probes:
        health, new = nh.observe(health, probe, now, LIMITS)
        events.extend(new)
    return health, events


def test_a_healthy_node_reports_nothing() -> None:
    health, events = run([(t, nh.Probe(True, "ready", log_bytes=int(t))) for t in range(0, 60, 2)])
    assert events == []
    assert health.reachable and health.agent_state == "ready" and not health.stalled


def test_silence_is_reported_once_then_clears() -> None:
    probes = [(0.0, nh.Probe(True, "ready", 1))]
    probes += [
        (float(t), nh.Probe(False, error="refused", log_bytes=1 + t)) for t in range(2, 30, 2)
    ]
    health, events = run(probes)
    assert events == [nh.NodeUnreachable("node1", 0, 12.0, "refused")]
    assert not health.reachable
    health, again = nh.observe(health, nh.Probe(True, None, 99), 31.0, LIMITS)
    assert again == () and health.reachable and health.agent_state == "ready"
    health, _ = nh.observe(health, nh.Probe(False, error="x", log_bytes=100), 50.0, LIMITS)
    assert health.unreachable_reported  # silent 19 s since the last success: reported again


def test_a_node_never_reached_is_silent_since_watching_began() -> None:
    _, events = run([(float(t), nh.Probe(False, error="no route", log_bytes=t)) for t in (5, 11)])
    assert events == [nh.NodeUnreachable("node1", 0, 11.0, "no route")]


def test_a_stalled_log_is_reported_once_until_it_grows() -> None:
    probes = [(float(t), nh.Probe(True, "benchmarking", log_bytes=100)) for t in range(0, 70, 5)]
    health, events = run(probes)
    assert events == [nh.LogStalled("node1", 0, 35.0)]
    health, new = nh.observe(health, nh.Probe(True, None, 101), 71.0, LIMITS)
    assert new == () and not health.stalled


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    return RunLayout("/shared/logs/r1", "llmd-abc", tmp_path / "archive" / "abc")


def test_layout_names_what_the_job_writes(layout: RunLayout) -> None:
    assert batch_log_patterns("/shared/logs/r1") == (
        "/shared/logs/r1/%x-%j.out",
        "/shared/logs/r1/%x-%j.err",
    )
    assert layout.batch_logs("42") == {
        "llmd-abc-42.out": "/shared/logs/r1/llmd-abc-42.out",
        "llmd-abc-42.err": "/shared/logs/r1/llmd-abc-42.err",
    }
    assert layout.batch_out("42") == "/shared/logs/r1/llmd-abc-42.out"
    assert layout.job_dir("42") == "/shared/logs/r1/42"
    assert layout.status_file("42", 3) == "/shared/logs/r1/42/rank3.status.json"
    assert layout.marker("42") == "/shared/logs/r1/.bench_done.42"


def test_layout_names_the_local_copies(layout: RunLayout, tmp_path: Path) -> None:
    root = tmp_path / "archive" / "abc" / "logs"
    assert layout.logs_root == root
    assert layout.copies(2) == root / "attempt2"
    assert layout.batch_copy(1, "42") == root / "attempt1" / "llmd-abc-42.out"


@pytest.mark.parametrize(
    ("name", "rank", "expected"),
    [
        ("rank1.agent.log", 1, True),
        ("rank1.prefill.engine.log", 1, True),
        ("rank1.status.json", 1, False),
        ("rank10.agent.log", 1, False),
        ("rank10.agent.log", None, True),
        ("rank2.status.json", None, False),
        ("bench", None, False),
    ],
)
def test_rank_logs(name: str, rank: int | None, expected: bool) -> None:
    assert RunLayout.is_rank_log(name, rank) is expected


def test_a_status_file_not_rewritten_is_silence_even_when_the_node_answers() -> None:
    # shared-fs: every read succeeds (the login node reads them); the agent stopped writing.
    fresh = [(float(t), nh.Probe(True, "ready", log_bytes=t, status_age_s=1.0)) for t in (0, 2)]
    stale = [
        (float(t), nh.Probe(True, "ready", log_bytes=t, status_age_s=t - 2.0))
        for t in range(4, 20, 2)
    ]
    health, events = run(fresh + stale)
    assert events == [
        nh.NodeUnreachable("node1", 0, 12.0, "rank 0's status file was last updated 12 s ago")
    ]
    assert not health.reachable
    health, again = nh.observe(health, nh.Probe(True, "ready", 99, status_age_s=0.5), 21.0, LIMITS)
    assert again == () and health.reachable and not health.unreachable_reported


def test_no_status_age_is_no_staleness() -> None:
    # Final states and unreadable times carry no age: never stale, however old.
    _, events = run([(float(t), nh.Probe(True, "exited", log_bytes=t)) for t in range(0, 60, 2)])
    assert events == []


@pytest.mark.parametrize(
    ("status", "state", "age"),
    [
        (b'{"state": "ready", "updated_at": "2026-12-01T10:00:00.000+00:00"}', "ready", 30.0),
        (b'{"state": "exited", "updated_at": "2026-12-01T09:00:00.000+00:00"}', "exited", None),
        (b'{"state": "failed", "updated_at": "2026-12-01T09:00:00.000+00:00"}', "failed", None),
        (b'{"state": "ready", "updated_at": "yesterday"}', "ready", None),
        (b'{"state": "ready", "updated_at": 5}', "ready", None),
        (b'{"state": "ready", "updated_at": "2026-12-01T10:00:31+00:00"}', "ready", 0.0),
        (b"[1]", "unreadable", None),
        (b"{", "unreadable", None),
        (b"[" * 65536, "unreadable", None),  # nested past the parser's recursion limit
        # The job writes the file: its words are escaped and bounded (issue 3.2 item 6).
        (
            b'{"state": "ready\\u001b[2K\\u001b[1Gsucceeded"}',
            "ready\\x1b[2K\\x1b[1Gsucceeded",
            None,
        ),
        (b'{"state": "\\ud800\\u0007"}', "\\ud800\\x07", None),
        (b'{"state": "' + b"\\u001b" * 50 + b'"}', "\\x1b" * 9 + "...", None),
        (
            b'{"state": "benchmarking", "reason": "c=8 \\u001b]52;c;eA==\\u0007"}',
            "benchmarking: c=8 \\x1b]52;c;eA==\\x07",
            None,
        ),
    ],
)
def test_status_state_and_age(status: bytes, state: str, age: float | None) -> None:
    now = datetime(2026, 12, 1, 10, 0, 30, tzinfo=UTC).timestamp()
    assert status_state(status, now) == (state, age)


def test_an_overdue_stage_is_named_escaped_and_bounded() -> None:
    now = datetime(2026, 12, 1, 10, 0, 30, tzinfo=UTC)
    started = (now - timedelta(seconds=100)).isoformat()
    stage = {"state": "running", "deadline_s": 10, "started_at": started}
    late = nh.overdue_stage([{**stage, "name": "engines\x1b]0;x\x07"}], now.timestamp(), 5)
    assert late is not None and late.stage == "engines\\x1b]0;x\\x07"
    late = nh.overdue_stage([{**stage, "name": "\ud800" * 100}], now.timestamp(), 5)
    assert late is not None and len(late.stage) <= 80 and late.stage.isprintable()
