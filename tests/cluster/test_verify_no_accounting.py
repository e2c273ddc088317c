"""`verify` on a cluster started with --no-accounting: the scontrol-only path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.test_verify_live import MARKER
from tests.devcluster import DevCluster, devcluster


@pytest.fixture(scope="module")
def no_accounting(cluster: DevCluster) -> Iterator[DevCluster]:
    """The same cluster restarted without slurmdbd; restored (accounting on) afterwards."""
    devcluster("down")
    try:
        devcluster("up", "--no-accounting")
        yield DevCluster.current()
    finally:
        devcluster("down")
        devcluster("up")


@pytest.mark.slurm_contract
def test_sacct_reports_accounting_disabled(no_accounting: DevCluster) -> None:
    proc = no_accounting.slurm(["sacct", "-j", "1"], check=False)
    assert proc.returncode == 1
    assert "accounting storage is disabled" in proc.stderr


@pytest.mark.parametrize(
    ("body", "status", "outcome", "reason"),
    [
        ("srun true\n" + MARKER.format(rc=0), 0, "succeeded", "State=COMPLETED ExitCode=0:0"),
        ("srun true\n" + MARKER.format(rc=0) + "exit 3\n", 10, "failed", "ExitCode=3:0"),
    ],
)
@pytest.mark.slurm_contract
def test_verify_decides_from_scontrol_alone(
    no_accounting: DevCluster, shared_tmp: Path, body: str, status: int, outcome: str, reason: str
) -> None:
    script = shared_tmp / "job.sh"
    script.write_text(f"#!/bin/bash\nLOGDIR={shared_tmp}\n{body}")
    job = no_accounting.sbatch(script, "-N", "2", f"--output={shared_tmp}/%j.out")
    no_accounting.wait_terminal(job)
    got, receipt = no_accounting.verify(job, shared_tmp, "--timeout", "20")
    assert (got, receipt["outcome"]) == (status, outcome), receipt["reason"]
    assert reason in str(receipt["reason"])
    assert "scontrol, 2 agreeing reads" in str(receipt["reason"])
    assert receipt["accounting_disabled"] is True


@pytest.mark.slurm_contract
def test_verify_gives_up_at_once_when_scontrol_forgot_the_job(
    no_accounting: DevCluster, shared_tmp: Path
) -> None:
    got, receipt = no_accounting.verify("987654", shared_tmp, "--timeout", "60")
    assert (got, receipt["outcome"]) == (15, "unverified")
    assert "accounting is disabled" in str(receipt["reason"])
