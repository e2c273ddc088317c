"""Jobs of the users' own launchers on the real cluster (issue 2.5, parts 1 and 2): an
InferenceX-style launcher (`tests/cluster/launcher/`: `slurm_job-%j.out`, per-rank logs,
an integer marker, result JSON files) submitted with `submit --script --export-env`, and
jobs submitted with plain sbatch, adopted while they run or after they ended."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon
from tests.devcluster import DevCluster
from tests.foreign_helpers import (
    LAUNCHER,
    adopt,
    assert_copies_of,
    final,
    sbatch_plain,
    submit_script,
)
from tests.strangers import Stranger


@pytest.mark.parametrize("rc", [0, 7])
@pytest.mark.slurm_contract
def test_an_inferencex_style_launcher_runs_as_it_is(
    cluster: DevCluster, daemon: Daemon, shared_tmp: Path, rc: int
) -> None:
    run_dir = shared_tmp / "ix"
    run_dir.mkdir()
    proc = submit_script(daemon, run_dir, rc)
    assert proc.returncode == 0, proc.stderr
    run = str(json.loads(proc.stdout)["run"])
    got = final(daemon, run)
    job_id, job_name = str(got["slurm_job_id"]), str(got["job_name"])
    assert job_name == f"ixci-{run}"
    assert cluster.job_ids_named(job_name) == [job_id]
    if rc == 0:
        assert got["outcome"] == "succeeded", got["reason"]
        assert "marker rc=0 (plain integer)" in str(got["reason"])
    else:
        assert got["outcome"] == "failed", got["reason"]
        assert "marker rc=7 (plain integer)" in str(got["reason"]), got["reason"]
    names = assert_copies_of(got, run_dir)
    assert {f"slurm_job-{job_id}.out", f"slurm_job-{job_id}.err"} <= set(names)
    assert {f"slurm_job-{job_id}_rank_{r}.log" for r in (0, 1)} <= set(names)
    rank0 = (run_dir / f"slurm_job-{job_id}_rank_0.log").read_text()
    assert "serving test/model-0.5b" in rank0  # the submitting shell's setting reached it
    archive = Path(str(got["archive"]))
    assert (archive / "job.sbatch").read_bytes() == (LAUNCHER / "job.slurm").read_bytes()
    kept = json.loads((archive / "foreign.json").read_text())["foreign"]
    assert "IX_MODEL" in kept["env"] and "test/model-0.5b" not in json.dumps(kept)
    for c in (4, 8):
        name = f"results/ix_c{c}.json"
        assert (archive / "results" / name).read_bytes() == (run_dir / name).read_bytes()
    table = json.loads((archive / "results.json").read_text())
    assert sorted(p["concurrency"] for p in table["points"]) == [4, 8]
    receipt = json.loads((archive / "receipt.json").read_text())
    assert receipt["marker"]["file"] == f".bench_done.{job_id}"


def test_a_script_without_a_marker_protocol_says_so(daemon: Daemon, shared_tmp: Path) -> None:
    run_dir = shared_tmp / "plain"
    run_dir.mkdir()
    proc = submit_script(daemon, run_dir, 0, "--wait", "--json")
    got = json.loads(proc.stdout)
    assert proc.returncode == 0, (proc.stderr, got.get("reason"))
    assert got["outcome"] == "succeeded"
    assert str(got["reason"]).endswith("; no marker protocol"), got["reason"]
    assert "State=COMPLETED ExitCode=0:0 (sacct" in str(got["reason"])


@pytest.mark.slurm_contract
def test_adopt_a_running_job_and_a_finished_one_but_not_another_users(
    cluster: DevCluster, root_dir: Path, shared_tmp: Path, stranger: Stranger
) -> None:
    daemon = Daemon(cluster, root_dir, daemon_keys=f'socket_group = "{stranger.name}"')
    daemon.start()

    running_dir, ended_dir = shared_tmp / "running", shared_tmp / "ended"
    running = sbatch_plain(cluster, running_dir, lines=80)
    deadline = time.monotonic() + 60
    while not (running_dir / f"slurm_job-{running}_rank_0.log").exists():
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.2)
    first = adopt(daemon, running, running_dir)
    assert first.returncode == 0, first.stderr
    run = json.loads(first.stdout)["run"]
    again = adopt(daemon, running, running_dir)
    assert again.returncode == 0 and json.loads(again.stdout)["run"] == run  # the same run

    ended = sbatch_plain(cluster, ended_dir, lines=1)
    assert cluster.wait_terminal(ended).startswith("COMPLETED")
    late = adopt(daemon, ended, ended_dir)  # ended, still known to scontrol (MinJobAge)
    assert late.returncode == 0, late.stderr
    late_run = json.loads(late.stdout)["run"]

    for run_id, run_dir in ((run, running_dir), (late_run, ended_dir)):
        got = final(daemon, run_id)
        assert got["outcome"] == "succeeded", got["reason"]
        assert str(got["job_name"]).startswith("adopted-")
        names = assert_copies_of(got, run_dir)  # tailed from byte 0
        job_id = got["slurm_job_id"]
        assert f"slurm_job-{job_id}.out" in names and f"slurm_job-{job_id}_rank_1.log" in names
        archive = Path(str(got["archive"]))
        assert (archive / "results" / "results" / "ix_c8.json").is_file()
        assert not (archive / "job.sbatch").exists()  # not submitted by the daemon

    # A job of root's, adopted by another user: not found (whose it is does not show), and
    # no run is made.
    other = sbatch_plain(cluster, shared_tmp / "other", lines=1)
    spec = json.dumps(
        {"foreign": {"kind": "adopt", "job_id": other, "log_dir": str(shared_tmp / "other")}}
    )
    reply = stranger.ask(daemon.socket, "adopt", spec_json=spec)
    error = reply["error"]
    assert isinstance(error, dict) and error["code"] == "not_found", reply
    assert str(error["message"]).startswith(f"No job {other} that you may adopt"), reply
    assert "uid" not in str(error["message"]), reply
    listed = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
    assert other not in {r["slurm_job_id"] for r in listed}
    cluster.wait_terminal(other)
    daemon.stop()
