"""SIGKILL the daemon right after each state transition is journaled, restart it, and
check: no double submission, no lost run, the right outcome, log copies byte-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, assert_copies_identical, demo_spec
from tests.devcluster import DevCluster

pytestmark = pytest.mark.cluster

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


@pytest.mark.parametrize(("state", "nth"), CRASH_POINTS, ids=[f"{s}-{n}" for s, n in CRASH_POINTS])
def test_sigkill_after_transition_then_restart(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path, state: str, nth: int
) -> None:
    daemon = Daemon(cluster, tmp_path, crash_after=f"{state}:{nth}")
    daemon.start()
    accepted = 0
    for i in range(RUNS):
        spec = demo_spec(shared_tmp / f"r{i}", port=8400 + 10 * i)
        # may fail once the daemon has killed itself: that is the point
        accepted += daemon.submit(spec).returncode == 0
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
        ids = cluster.job_ids_named(str(final["job_name"]))
        assert ids == [job_id], f"{final['job_name']}: Slurm jobs {ids}"
        assert_copies_identical(final)
        receipt = json.loads((Path(str(final["archive"])) / "receipt.json").read_text())
        assert receipt["outcome"] == "succeeded"
    daemon.stop()


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
