"""`llmd-supervisor verify` against real jobs on the dev cluster, one per producible end.

All jobs are submitted together, first in the pass, then each is verified through the real
command line. The TIMEOUT one needs Slurm's 1-minute minimum: tests/conftest.py runs its
check after the other tests/cluster tests, so that its minute overlaps them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.devcluster import DevCluster, devcluster

# A batch-script line publishing the marker the way the node agent does (temp + rename).
MARKER = (
    'printf \'{{"rc": {rc}, "job_id": "%s", "rank": 1, "reason": "test", "finished_at": "%s"}}\' '
    '"$SLURM_JOB_ID" "$(date -Iseconds)" > "$LOGDIR/.tmp.$SLURM_JOB_ID" && '
    'mv "$LOGDIR/.tmp.$SLURM_JOB_ID" "$LOGDIR/.bench_done.$SLURM_JOB_ID"\n'
)


@dataclass(frozen=True)
class Case:
    body: str
    options: tuple[str, ...]
    exit_status: int
    outcome: str
    reason: str  # a substring the verdict's reason must contain


CASES = {
    "completed_marker_ok": Case(
        "srun true\n" + MARKER.format(rc=0),
        ("-N", "2"),
        0,
        "succeeded",
        "State=COMPLETED ExitCode=0:0",
    ),
    "completed_no_marker": Case("srun true\n", ("-N", "1"), 10, "failed", "missing"),
    "completed_marker_rc7": Case(
        "srun true\n" + MARKER.format(rc=7), ("-N", "1"), 10, "failed", "marker rc=7 from rank 1"
    ),
    # InferenceX's launcher writes the rc alone, a plain integer and a newline.
    "completed_int_marker_0": Case(
        'srun true\necho 0 > "$LOGDIR/.bench_done.$SLURM_JOB_ID"\n',
        ("-N", "1"),
        0,
        "succeeded",
        "marker rc=0 (plain integer)",
    ),
    "completed_int_marker_7": Case(
        'srun true\necho 7 > "$LOGDIR/.bench_done.$SLURM_JOB_ID"\n',
        ("-N", "1"),
        10,
        "failed",
        "marker rc=7 (plain integer)",
    ),
    "completed_int_marker_empty": Case(
        'srun true\n: > "$LOGDIR/.bench_done.$SLURM_JOB_ID"\n',
        ("-N", "1"),
        10,
        "failed",
        "empty",
    ),
    "batch_exit1_marker_ok": Case(
        MARKER.format(rc=0) + "exit 1\n", ("-N", "1"), 10, "failed", "State=FAILED ExitCode=1:0"
    ),
    "srun_tasks_3_and_4": Case(
        "srun bash -c 'exit $((SLURM_PROCID + 3))'\n",
        ("-N", "2"),
        10,
        "failed",
        "State=FAILED ExitCode=4:0",
    ),
    "cancelled": Case("srun sleep 300\n", ("-N", "1"), 11, "cancelled", "State=CANCELLED"),
    "node_fail": Case(
        "srun sleep 300\n",
        ("-N", "1", "-w", "node4", "--no-requeue"),
        13,
        "node_failed",
        "State=NODE_FAIL ExitCode=",  # 0:0 on 22.05, 1:0 on 24.11
    ),
    "timeout": Case(
        "srun sleep 300\n",
        ("-N", "1", "--time=1", "--exclude=node4"),  # node4 goes down for node_fail
        12,
        "timed_out",
        "State=TIMEOUT ExitCode=0:0",
    ),
}


@pytest.fixture(scope="session")
def ended_jobs(
    cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, dict[str, str]]]:
    log_dir = Path(tmp_path_factory.mktemp("verify", numbered=True))
    log_dir.chmod(0o755)
    jobs = {}
    for name, case in CASES.items():
        script = log_dir / f"{name}.sh"
        script.write_text(f"#!/bin/bash\nLOGDIR={log_dir}\n{case.body}")
        jobs[name] = cluster.sbatch(
            script, f"--job-name=verify-{name}", f"--output={log_dir}/%x-%j.out", *case.options
        )
    for name in ("cancelled", "node_fail"):
        cluster.wait_running(jobs[name])
    cluster.slurm(["scancel", jobs["cancelled"]])
    devcluster("node", "node4", "down", "--reason=test node_fail")
    try:
        for name, job in jobs.items():
            if name != "timeout":  # waited for by its own test, later in the pass
                cluster.wait_terminal(job)
    finally:
        devcluster("node", "node4", "resume")
    yield log_dir, jobs


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slurm_contract
def test_verify_reports_each_real_end(
    cluster: DevCluster, ended_jobs: tuple[Path, dict[str, str]], name: str
) -> None:
    log_dir, jobs = ended_jobs
    case = CASES[name]
    cluster.wait_terminal(jobs[name], timeout=150)
    status, receipt = cluster.verify(jobs[name], log_dir, "--timeout", "8")
    assert (status, receipt["outcome"]) == (case.exit_status, case.outcome), receipt["reason"]
    assert case.reason in str(receipt["reason"])
    assert receipt["schema"] == "llmd-supervisor.receipt/1"
    assert receipt["job_id"] == jobs[name]
    rows = receipt["sacct_rows"]
    assert isinstance(rows, list) and rows[0].startswith(f"{jobs[name]}|")


def test_verify_writes_the_receipt_atomically(
    cluster: DevCluster, ended_jobs: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    log_dir, jobs = ended_jobs
    receipt_path = tmp_path / "receipt.json"
    status, printed = cluster.verify(
        jobs["completed_marker_ok"], log_dir, "--receipt", str(receipt_path)
    )
    assert status == 0
    written = json.loads(receipt_path.read_text())
    assert written["outcome"] == printed["outcome"] == "succeeded"
    assert [p.name for p in tmp_path.iterdir()] == ["receipt.json"]


@pytest.mark.slurm_contract
def test_verify_uses_scontrol_while_slurmdbd_is_down(cluster: DevCluster, shared_tmp: Path) -> None:
    devcluster("slurmdbd", "stop")
    try:
        script = shared_tmp / "ok.sh"
        script.write_text(f"#!/bin/bash\nLOGDIR={shared_tmp}\nsrun true\n" + MARKER.format(rc=0))
        job = cluster.sbatch(script, "-N", "2", f"--output={shared_tmp}/%j.out")
        status, receipt = cluster.verify(job, shared_tmp, "--timeout", "20")
        assert status == 0, receipt["reason"]
        assert "scontrol, 2 agreeing reads" in str(receipt["reason"])
        queries = receipt["queries"]
        assert isinstance(queries, list)
        assert any(q["source"] == "sacct" and q["outcome"] == "error" for q in queries)
    finally:
        devcluster("slurmdbd", "start")


@pytest.mark.slurm_contract
def test_verify_says_unverified_when_slurm_never_knew_the_job(
    cluster: DevCluster, shared_tmp: Path
) -> None:
    status, receipt = cluster.verify("987654", shared_tmp, "--timeout", "3")
    assert (status, receipt["outcome"]) == (15, "unverified")
    assert "after 3 s" in str(receipt["reason"])
