"""Parse every captured Slurm output: 22.05 in tests/data/slurm, 24.11 in tests/data/slurm/24.11
(see their INDEX.md; the differences are in deploy/devcluster/SLURM-VERSIONS.md).

Job ids are read from the captures themselves, so a re-capture with new ids still passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from llmd_supervisor.core.marker import MarkerReading, read_marker
from llmd_supervisor.core.slurm_parse import (
    _KNOWN_JOB_KEYS,
    ExitCode,
    JobState,
    accounting_disabled,
    allocation_row,
    invalid_job_id,
    job_rows,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_config,
    parse_scontrol_job,
    parse_squeue,
)
from llmd_supervisor.core.verdict import (
    Outcome,
    QueryOutcome,
    VerdictState,
    decide,
    observe,
    sacct_query,
    scontrol_query,
)
from llmd_supervisor.errors import SlurmJobNotFound

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"
# Every Slurm version captured, and where (22.05's were the first, at the top).
VERSIONS = {"22.05": DATA, "24.11": DATA / "24.11"}
T0 = datetime(2026, 11, 30, 22, 0, 0, tzinfo=UTC)


def text(version: str, name: str) -> str:
    return (VERSIONS[version] / name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Command:
    returncode: int
    stdout: str
    stderr: str


def command(version: str, name: str) -> Command:
    """Read a capture in the ``rc=`` / ``--- stdout`` / ``--- stderr`` layout."""
    head, _, rest = text(version, name).partition("\n--- stdout\n")
    stdout, _, stderr = rest.partition("--- stderr\n")
    assert head.startswith("rc=")
    return Command(int(head.removeprefix("rc=")), stdout, stderr)


@dataclass(frozen=True)
class Ended:
    case: str
    state: JobState
    sacct_exit: ExitCode
    derived: ExitCode
    scontrol_exit: ExitCode
    restarts: int
    outcome: Outcome  # with a marker rc 0 for the job
    has_sbatch: bool = True
    version: str = "22.05"


ENDED_22_05 = [
    Ended("completed", JobState.COMPLETED, ExitCode(0, 0), ExitCode(0, 0), ExitCode(0, 0), 0,
          Outcome.SUCCEEDED),
    Ended("failed_batch_exit1", JobState.FAILED, ExitCode(1, 0), ExitCode(0, 0), ExitCode(1, 0),
          0, Outcome.FAILED),
    Ended("failed_srun_tasks", JobState.FAILED, ExitCode(4, 0), ExitCode(4, 0), ExitCode(4, 0),
          0, Outcome.FAILED),
    Ended("cancelled", JobState.CANCELLED, ExitCode(0, 0), ExitCode(0, 0), ExitCode(0, 15), 0,
          Outcome.CANCELLED),
    Ended("timeout", JobState.TIMEOUT, ExitCode(0, 0), ExitCode(0, 0), ExitCode(0, 15), 0,
          Outcome.TIMED_OUT),
    Ended("node_fail", JobState.NODE_FAIL, ExitCode(0, 0), ExitCode(0, 0), ExitCode(0, 0), 0,
          Outcome.NODE_FAILED),
    Ended("requeued_completed", JobState.COMPLETED, ExitCode(0, 0), ExitCode(0, 0),
          ExitCode(0, 0), 1, Outcome.SUCCEEDED),
    # Written by hand: the dev cluster has no cgroup memory limits.
    Ended("handwritten_out_of_memory", JobState.OUT_OF_MEMORY, ExitCode(0, 125), ExitCode(0, 0),
          ExitCode(0, 125), 0, Outcome.OUT_OF_MEMORY, has_sbatch=False),
]  # fmt: skip

# What Slurm 24.11 records differently for the same jobs; everything else is the same.
DIFFERS_24_11: dict[str, dict[str, ExitCode]] = {
    # DerivedExitCode now carries the signal that ended the job.
    "cancelled": {"derived": ExitCode(0, 15)},
    # scontrol: the batch shell's 143 (it exits on srun's TERM) instead of signal 15.
    "timeout": {"derived": ExitCode(0, 15), "scontrol_exit": ExitCode(143, 0)},
    # A node failure is no longer 0:0: sacct 1:0, scontrol 0:1.
    "node_fail": {"sacct_exit": ExitCode(1, 0), "scontrol_exit": ExitCode(0, 1)},
}
ENDED_24_11 = [
    replace(c, version="24.11", **DIFFERS_24_11.get(c.case, {}))  # type: ignore[arg-type]
    for c in ENDED_22_05
    if c.has_sbatch  # the handwritten ones are 22.05 text
] + [
    # `scancel --signal=TERM` (the tasks exit 143) and with --full (srun kills them); the
    # same on 22.05 (whose capture has only their output: tests/fakes cannot replay a
    # scontrol ExitCode that differs from sacct's for a FAILED job yet).
    Ended("signal_term", JobState.FAILED, ExitCode(15, 0), ExitCode(143, 0),
          ExitCode(143, 0), 0, Outcome.FAILED, version="24.11"),
    Ended("signal_term_full", JobState.FAILED, ExitCode(9, 0), ExitCode(0, 9),
          ExitCode(137, 0), 0, Outcome.FAILED, version="24.11"),
]  # fmt: skip
ENDED = ENDED_22_05 + ENDED_24_11


def case_id(case: Ended) -> str:
    return f"{case.version}-{case.case}"


def job_id_of(case: Ended) -> str:
    job_id = parse_scontrol_job(text(case.version, f"{case.case}.scontrol.txt")).job_id
    if case.has_sbatch:
        sbatch = text(case.version, f"{case.case}.sbatch.txt")
        assert parse_sbatch_parsable(sbatch).job_id == job_id
    return job_id


def test_every_version_and_case_is_captured() -> None:
    """A re-capture that drops a case, or a version without its captures, fails here."""
    for version, directory in VERSIONS.items():
        assert (directory / "INDEX.md").read_text().startswith(f"# Captured Slurm {version}.")
        for case in ENDED_22_05:
            if case.has_sbatch:
                assert (directory / f"{case.case}.sacct.txt").exists(), (version, case.case)


@pytest.mark.parametrize("case", ENDED, ids=case_id)
def test_scontrol_capture(case: Ended) -> None:
    job = parse_scontrol_job(text(case.version, f"{case.case}.scontrol.txt"))
    assert job.state.state is case.state
    assert job.state.exact
    assert job.exit_code == case.scontrol_exit
    assert job.restarts == case.restarts
    assert job.job_name == f"capture-{case.case.removeprefix('handwritten_')}"
    assert job.node_list.startswith("node")


@pytest.mark.parametrize("case", ENDED, ids=case_id)
def test_sacct_capture(case: Ended) -> None:
    job_id = job_id_of(case)
    rows = parse_sacct(text(case.version, f"{case.case}.sacct.txt"))
    row = allocation_row(rows, job_id)
    assert row is not None
    assert row.state.state is case.state
    assert row.exit_code == case.sacct_exit
    assert row.derived_exit_code == case.derived
    assert len(job_rows(rows, job_id)) == len(rows) >= 2
    assert all(r.is_step for r in rows if r is not row)
    sacct_x = VERSIONS[case.version] / f"{case.case}.sacct_x.txt"
    if sacct_x.exists():
        (only,) = parse_sacct(sacct_x.read_text(encoding="utf-8"))
        assert only.raw == row.raw


CAPTURED = [c for c in ENDED if c.has_sbatch]


@pytest.mark.parametrize("case", CAPTURED, ids=case_id)
def test_squeue_capture(case: Ended) -> None:
    """``squeue -t all`` right after the end, before the MinJobAge purge."""
    (row,) = parse_squeue(text(case.version, f"{case.case}.squeue.txt"))
    assert row.job_id == job_id_of(case)
    assert row.state.state is case.state


def ok_marker(job_id: str) -> MarkerReading:
    body = {
        "rc": 0,
        "job_id": job_id,
        "rank": 1,
        "reason": "",
        "finished_at": "2026-11-30T22:09:30+00:00",
    }
    return read_marker(json.dumps(body).encode(), job_id)


@pytest.mark.parametrize("case", ENDED, ids=case_id)
def test_verdict_on_captures(case: Ended) -> None:
    """sacct twice plus scontrol once, as the verifier would read them, with marker rc 0."""
    job_id = job_id_of(case)
    sacct_out = text(case.version, f"{case.case}.sacct.txt")
    scontrol_out = text(case.version, f"{case.case}.scontrol.txt")
    state = VerdictState(job_id, T0)
    for i in range(2):
        at = T0 + timedelta(seconds=i)
        state = observe(
            state, sacct_query(job_id, taken_at=at, returncode=0, stdout=sacct_out, stderr="")
        )
    state = observe(
        state,
        scontrol_query(job_id, taken_at=T0, returncode=0, stdout=scontrol_out, stderr=""),
    )
    verdict = decide(
        state,
        ok_marker(job_id),
        cancel_requested=False,
        accounting_disabled=False,
        now=T0 + timedelta(seconds=5),
        deadline=T0 + timedelta(seconds=120),
    )
    assert verdict.outcome is case.outcome, verdict.reason
    assert f"State={case.state.value}" in verdict.reason


@pytest.mark.parametrize("version", VERSIONS)
def test_requeued_duplicates_take_the_last_attempt(version: str) -> None:
    rows = parse_sacct(text(version, "requeued_completed.sacct_duplicates.txt"))
    job_id = rows[0].job_id_raw
    allocations = [r for r in rows if r.job_id_raw == job_id]
    assert [r.state.state for r in allocations] == [JobState.NODE_FAIL, JobState.COMPLETED]
    row = allocation_row(rows, job_id)
    assert row is not None and row.state.state is JobState.COMPLETED


@pytest.mark.parametrize("version", VERSIONS)
def test_requeued_pending_capture(version: str) -> None:
    job = parse_scontrol_job(text(version, "requeued_pending.scontrol.txt"))
    assert job.state.state is JobState.PENDING
    assert job.restarts == 1
    assert job.node_list == ""
    (row,) = parse_squeue(text(version, "requeued_pending.squeue.txt"))
    assert row.state.state is JobState.PENDING
    assert row.job_id == job.job_id


@pytest.mark.parametrize("version", VERSIONS)
def test_running_captures(version: str) -> None:
    rows = parse_squeue(text(version, "running.squeue.txt"))
    assert rows and all(r.state.state is JobState.RUNNING for r in rows)
    job = parse_scontrol_job(text(version, "running.scontrol.txt"))
    assert job.state.state is JobState.RUNNING
    assert job.derived_exit_code is None
    sacct_rows = parse_sacct(text(version, "running.sacct.txt"))
    assert all(allocation_row(sacct_rows, r.job_id) is not None for r in rows)


@pytest.mark.parametrize("version", VERSIONS)
def test_scontrol_config_capture(version: str) -> None:
    config = parse_scontrol_config(text(version, "scontrol_config.txt"))
    assert config.min_job_age == 30
    assert config.accounting_storage_type == "accounting_storage/slurmdbd"
    assert config.accounting_enabled


@pytest.mark.parametrize("version", VERSIONS)
def test_invalid_job_captures(version: str) -> None:
    for name in ("scontrol_invalid_job.txt", "squeue_invalid_job.txt"):
        result = command(version, name)
        assert result.returncode == 1
        assert result.stdout == ""
        assert invalid_job_id(result.stderr)
    result = command(version, "scontrol_invalid_job.txt")
    with pytest.raises(SlurmJobNotFound):
        parse_scontrol_job(result.stderr)
    query = scontrol_query(
        "1", taken_at=T0, returncode=result.returncode, stdout=result.stdout, stderr=result.stderr
    )
    assert query.outcome is QueryOutcome.NOT_FOUND


@pytest.mark.parametrize("version", VERSIONS)
def test_squeue_finished_empty_capture(version: str) -> None:
    result = command(version, "squeue_finished_empty.txt")
    assert result.returncode == 0
    assert parse_squeue(result.stdout) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_sacct_dbd_down_capture(version: str) -> None:
    result = command(version, "sacct_dbd_down.txt")
    assert result.returncode == 1
    assert not accounting_disabled(result.stderr)
    query = sacct_query(
        "1", taken_at=T0, returncode=result.returncode, stdout=result.stdout, stderr=result.stderr
    )
    assert query.outcome is QueryOutcome.ERROR
    assert "Problem talking to the database" in query.error


@pytest.mark.parametrize("version", VERSIONS)
def test_every_scontrol_key_is_known(version: str) -> None:
    """A key Slurm prints that the parser does not know would be swallowed into a
    free-text value before it (a new version's keys must be added to the list)."""
    for path in sorted(VERSIONS[version].glob("*.scontrol.txt")):
        record = path.read_text(encoding="utf-8").strip()
        keys = {word.split("=", 1)[0] for word in record.split() if "=" in word}
        printed = {k for k in keys if k and k[0].isupper() and k.replace(":", "").isalnum()}
        assert printed - _KNOWN_JOB_KEYS == set(), path


@pytest.mark.parametrize("version", VERSIONS)
def test_scancel_signal_term_reaches_the_tasks_not_the_batch_shell(version: str) -> None:
    """What render.py relies on: plain ``scancel --signal=TERM`` signals every task of
    every step and leaves the batch shell alone; with ``--full`` the batch shell gets it
    too and srun kills its tasks (no graceful stop)."""
    out = text(version, "signal_term.out.txt")
    assert out.count(": got TERM") == 2 and "batch shell: got TERM" not in out
    assert "batch shell: srun exited with rc 143" in out
    full = text(version, "signal_term_full.out.txt")
    assert "batch shell: got TERM" in full and "task 0 on node1: got TERM" not in full
    assert full.count(": Killed") == 2 and "batch shell: srun exited with rc 137" in full
