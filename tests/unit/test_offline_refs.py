"""Offline `status|results|report` find a run by any of the references the help names
(run id, Slurm job name, Slurm job id) and read either directory the user has at hand:
the daemon's state directory or its archive root (issue 4.7)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.unit.test_offline import RUN, cli, state

__all__ = ["state"]  # the fixture, shared with test_offline

OTHER = "0123456789ab"


def _second_run(state: Path, job_id: str) -> None:
    """Another archived run whose first attempt was Slurm job `job_id` (retried as 91)."""
    archive = state / "archive" / OTHER
    archive.mkdir()
    attempts = [
        {"attempt": 1, "slurm_job_id": job_id, "job_name": f"llmd-{OTHER}", "nodes": []},
        {"attempt": 2, "slurm_job_id": "91", "job_name": f"llmd-{OTHER}", "nodes": []},
    ]
    receipt = {"outcome": "failed", "reason": "State=FAILED", "job_id": "91", "attempts": attempts}
    (archive / "receipt.json").write_text(json.dumps(receipt))


def test_a_run_is_found_by_its_id_job_name_or_slurm_job_id_in_either_directory(
    state: Path,
) -> None:
    _second_run(state, "90")
    for where in (["--state-dir", str(state)], ["--state-dir", str(state / "archive")],
                  ["--archive", str(state)], ["--archive", str(state / "archive")]):  # fmt: skip
        for ref in (RUN, f"llmd-{RUN}", "77", f"myprefix-{RUN}"):
            out = cli("status", ref, *where)
            assert out.returncode == 0, (ref, where, out.stderr)
            assert f"run {RUN}: succeeded (from its archive; no daemon asked)" in out.stdout
        for ref in ("90", "91", f"llmd-{OTHER}"):  # any attempt's job
            out = cli("results", ref, *where, "--json")
            assert out.returncode == 0, (ref, where, out.stderr)
            assert json.loads(out.stdout)["runs"][0]["run"] == OTHER


def test_a_job_id_of_two_runs_is_refused_naming_them(state: Path) -> None:
    _second_run(state, "77")  # the same job id as RUN's (another cluster's, say)
    out = cli("status", "77", "--state-dir", str(state))
    assert out.returncode == 2
    assert f"77 names 2 archived runs ({OTHER}, {RUN}); give the run id." in out.stderr
    missing = cli("status", "4711", "--state-dir", str(state))
    assert missing.returncode == 2 and "no archived run has that job name or Slurm job id" in (
        missing.stderr
    )
    assert "archive/archive" not in missing.stderr
