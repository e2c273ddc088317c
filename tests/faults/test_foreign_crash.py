"""Exactly once for the users' own jobs (issue 2.5): SIGKILL the daemon right after a
transition of a `submit --script` run or an adopted job is journaled, restart it, and
check: one Slurm job per script, one run per adopted job, the right outcome, log copies
byte-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon
from tests.devcluster import DevCluster
from tests.foreign_helpers import adopt, assert_copies_of, final, sbatch_plain, submit_script

# (how the run came, the state journaled just before the kill)
CRASH_POINTS = [
    ("script", "submitting"),
    ("script", "pending"),
    ("script", "verifying"),
    ("adopt", "pending"),  # the adopted run's first record: before the client heard back
    ("adopt", "running"),
    ("adopt", "archiving"),
]


@pytest.mark.parametrize(("how", "state"), CRASH_POINTS, ids=[f"{h}-{s}" for h, s in CRASH_POINTS])
def test_sigkill_after_transition_then_restart(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path, how: str, state: str
) -> None:
    daemon = Daemon(cluster, tmp_path, crash_after=state)
    daemon.start()
    run_dir = shared_tmp / "ix"
    if how == "script":
        run_dir.mkdir()
        submit_script(daemon, run_dir)  # may fail once the daemon has killed itself
    else:
        job_id = sbatch_plain(cluster, run_dir, lines=30)
        adopt(daemon, job_id, run_dir)
    assert daemon.proc is not None
    daemon.proc.wait(timeout=120)
    assert daemon.proc.returncode == -9, daemon.log_text()[-2000:]

    daemon.crash_after = None
    daemon.start()
    runs = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
    if how == "adopt":
        again = adopt(daemon, job_id, run_dir)  # the client did not hear back: it asks again
        assert again.returncode == 0, again.stderr
        runs = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
        assert [r["run"] for r in runs] == [json.loads(again.stdout)["run"]]
    assert len(runs) == 1, runs
    got = final(daemon, str(runs[0]["run"]))
    assert got["outcome"] == "succeeded", got["reason"]
    if how == "script":
        ids = cluster.job_ids_named(str(got["job_name"]))
        assert ids == [str(got["slurm_job_id"])], f"{got['job_name']}: Slurm jobs {ids}"
    assert assert_copies_of(got, run_dir)
    receipt = json.loads((Path(str(got["archive"])) / "receipt.json").read_text())
    assert receipt["outcome"] == "succeeded"
    daemon.stop()
