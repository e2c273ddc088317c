"""SIGKILL the daemon right after each state transition is journaled, restart it, and
check: no double submission, no lost run, the right outcome, log copies byte-identical.

Every crash point runs against a replayed Slurm cluster and the in-process SSH server
(tests/fakes/replay_world.py: both outlive the killed daemon, as slurmctld and sshd do);
two representative ones run on the real dev cluster too: one before sbatch has answered
(`submitting`) and one in `verifying`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, assert_copies_identical, demo_spec
from tests.devcluster import DevCluster
from tests.fakes.replay_world import ReplayWorld

RUNS = 3
# (state journaled just before the kill, which entry into it)
CRASH_POINTS = [
    ("submitting", 1),
    ("submitting", RUNS),
    ("pending", RUNS),
    ("running", 2),
    ("finishing", 2),
    ("verifying", 2),
    ("archiving", 2),
    ("succeeded", 1),
]
# The real cluster's share: a crash before sbatch answered, and one in verifying.
ON_THE_CLUSTER = [("submitting", 1), ("verifying", 2)]
# Crash points reached while the runs are still being submitted: the rest come after,
# so their jobs are held until every submit was answered (no submit races the crash).
DURING_SUBMITS = {"submitting", "pending"}


def _ids(points: list[tuple[str, int]]) -> list[str]:
    return [f"{s}-{n}" for s, n in points]


def crash_then_restart(
    daemon: Daemon,
    log_root: Path,
    nth: int,
    job_ids_named: Callable[[str], list[str]],
    *,
    hold: Callable[[bool], None] | None = None,
) -> None:
    """Submit RUNS runs to a daemon that kills itself at (state, nth), restart it, and check
    every run: succeeded once, on one Slurm job, with byte-identical log copies."""
    daemon.start()
    accepted = 0
    if hold is not None:
        hold(True)
    for i in range(RUNS):
        spec = demo_spec(log_root / f"r{i}", port=8400 + 10 * i)
        # may fail once the daemon has killed itself: that is the point
        accepted += daemon.submit(spec).returncode == 0
    if hold is not None:
        assert accepted == RUNS, daemon.log_text()[-2000:]
        hold(False)
    assert daemon.proc is not None
    daemon.proc.wait(timeout=120)
    assert daemon.proc.returncode == -9, daemon.log_text()[-2000:]
    assert daemon.events("test.crash")

    daemon.crash_after = None
    daemon.start()
    runs = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
    # nothing accepted is lost, nothing is doubled; a submit racing the crash may or may
    # not have been journaled before the daemon died
    assert max(accepted, nth) <= len(runs) <= RUNS, (accepted, runs)
    for r in runs:
        final = json.loads(daemon.cli("wait", str(r["run"]), "--json", check=False).stdout)
        assert final["outcome"] == "succeeded", (r["run"], final["reason"])
        job_id = str(final["slurm_job_id"])
        ids = job_ids_named(str(final["job_name"]))
        assert ids == [job_id], f"{final['job_name']}: Slurm jobs {ids}"
        assert_copies_identical(final)
        receipt = json.loads((Path(str(final["archive"])) / "receipt.json").read_text())
        assert receipt["outcome"] == "succeeded"
    daemon.stop()


@pytest.mark.parametrize(("state", "nth"), CRASH_POINTS, ids=_ids(CRASH_POINTS))
def test_sigkill_after_transition_then_restart_replayed(
    world: ReplayWorld, tmp_path: Path, state: str, nth: int
) -> None:
    root = tmp_path / "daemon"  # the logs may not lie inside the daemon's directory
    root.mkdir()
    daemon = Daemon(world, root, crash_after=f"{state}:{nth}", replay_socket=world.socket)
    hold = None if state in DURING_SUBMITS else world.pause
    crash_then_restart(daemon, tmp_path / "logs", nth, world.job_ids_named, hold=hold)
    names = world.sbatch_names()
    assert len(names) == len(set(names)), f"a job name was submitted twice: {names}"


@pytest.mark.parametrize(("state", "nth"), ON_THE_CLUSTER, ids=_ids(ON_THE_CLUSTER))
def test_sigkill_after_transition_then_restart(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path, state: str, nth: int
) -> None:
    daemon = Daemon(cluster, tmp_path, crash_after=f"{state}:{nth}")
    crash_then_restart(daemon, shared_tmp, nth, cluster.job_ids_named)


def test_a_copy_left_short_before_a_crash_in_verifying_is_completed_after_the_restart(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    # Whether the copies were complete is not journaled: a copy cut short (as a failed
    # local write leaves it) when the daemon dies after `verifying` is completed anyway.
    daemon = Daemon(cluster, tmp_path, crash_after="verifying:1")
    daemon.start()
    assert daemon.submit(demo_spec(shared_tmp, port=8470)).returncode in (0, 1, 3)
    assert daemon.proc is not None
    daemon.proc.wait(timeout=120)
    assert daemon.proc.returncode == -9, daemon.log_text()[-2000:]
    copies = sorted((daemon.state_dir / "archive").glob("*/logs/attempt1/*.out"))
    assert copies, "no batch log copy before the crash"
    data = copies[0].read_bytes()
    copies[0].write_bytes(data[: len(data) // 2])
    daemon.crash_after = None
    daemon.start()
    (run,) = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
    final = json.loads(daemon.cli("wait", str(run["run"]), "--json", check=False).stdout)
    daemon.stop()
    assert final["outcome"] == "succeeded", final["reason"]
    assert_copies_identical(final)
