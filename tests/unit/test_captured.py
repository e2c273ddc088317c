"""Parse every captured Slurm 22.05 output in tests/data/slurm (see its INDEX.md).

Job ids are read from the captures themselves, so a re-capture with new ids still passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from llmd_supervisor.core.marker import MarkerReading, read_marker
from llmd_supervisor.core.slurm_parse import (
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
T0 = datetime(2026, 11, 30, 22, 0, 0, tzinfo=UTC)


def text(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Command:
    returncode: int
    stdout: str
    stderr: str


def command(name: str) -> Command:
    """Read a capture in the ``rc=`` / ``--- stdout`` / ``--- stderr`` layout."""
    head, _, rest = text(name).partition("\n--- stdout\n")
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


ENDED = [
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


def job_id_of(case: Ended) -> str:
    job_id = parse_scontrol_job(text(f"{case.case}.scontrol.txt")).job_id
    if case.has_sbatch:
        assert parse_sbatch_parsable(text(f"{case.case}.sbatch.txt")).job_id == job_id
    return job_id


@pytest.mark.parametrize("case", ENDED, ids=[c.case for c in ENDED])
def test_scontrol_capture(case: Ended) -> None:
    job = parse_scontrol_job(text(f"{case.case}.scontrol.txt"))
    assert job.state.state is case.state
    assert job.state.exact
    assert job.exit_code == case.scontrol_exit
    assert job.restarts == case.restarts
    assert job.job_name == f"capture-{case.case.removeprefix('handwritten_')}"
    assert job.node_list.startswith("node")


@pytest.mark.parametrize("case", ENDED, ids=[c.case for c in ENDED])
def test_sacct_capture(case: Ended) -> None:
    job_id = job_id_of(case)
    rows = parse_sacct(text(f"{case.case}.sacct.txt"))
    row = allocation_row(rows, job_id)
    assert row is not None
    assert row.state.state is case.state
    assert row.exit_code == case.sacct_exit
    assert row.derived_exit_code == case.derived
    assert len(job_rows(rows, job_id)) == len(rows) >= 2
    assert all(r.is_step for r in rows if r is not row)
    sacct_x = DATA / f"{case.case}.sacct_x.txt"
    if sacct_x.exists():
        (only,) = parse_sacct(sacct_x.read_text(encoding="utf-8"))
        assert only.raw == row.raw


CAPTURED = [c for c in ENDED if c.has_sbatch]


@pytest.mark.parametrize("case", CAPTURED, ids=[c.case for c in CAPTURED])
def test_squeue_capture(case: Ended) -> None:
    """``squeue -t all`` right after the end, before the MinJobAge purge."""
    (row,) = parse_squeue(text(f"{case.case}.squeue.txt"))
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


@pytest.mark.parametrize("case", ENDED, ids=[c.case for c in ENDED])
def test_verdict_on_captures(case: Ended) -> None:
    """sacct twice plus scontrol once, as the verifier would read them, with marker rc 0."""
    job_id = job_id_of(case)
    sacct_out = text(f"{case.case}.sacct.txt")
    scontrol_out = text(f"{case.case}.scontrol.txt")
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


def test_requeued_duplicates_take_the_last_attempt() -> None:
    rows = parse_sacct(text("requeued_completed.sacct_duplicates.txt"))
    job_id = rows[0].job_id_raw
    allocations = [r for r in rows if r.job_id_raw == job_id]
    assert [r.state.state for r in allocations] == [JobState.NODE_FAIL, JobState.COMPLETED]
    row = allocation_row(rows, job_id)
    assert row is not None and row.state.state is JobState.COMPLETED


def test_requeued_pending_capture() -> None:
    job = parse_scontrol_job(text("requeued_pending.scontrol.txt"))
    assert job.state.state is JobState.PENDING
    assert job.restarts == 1
    assert job.node_list == ""
    (row,) = parse_squeue(text("requeued_pending.squeue.txt"))
    assert row.state.state is JobState.PENDING
    assert row.job_id == job.job_id


def test_running_captures() -> None:
    rows = parse_squeue(text("running.squeue.txt"))
    assert rows and all(r.state.state is JobState.RUNNING for r in rows)
    job = parse_scontrol_job(text("running.scontrol.txt"))
    assert job.state.state is JobState.RUNNING
    assert job.derived_exit_code is None
    sacct_rows = parse_sacct(text("running.sacct.txt"))
    assert all(allocation_row(sacct_rows, r.job_id) is not None for r in rows)


def test_scontrol_config_capture() -> None:
    config = parse_scontrol_config(text("scontrol_config.txt"))
    assert config.min_job_age == 30
    assert config.accounting_storage_type == "accounting_storage/slurmdbd"
    assert config.accounting_enabled


def test_invalid_job_captures() -> None:
    for name in ("scontrol_invalid_job.txt", "squeue_invalid_job.txt"):
        result = command(name)
        assert result.returncode == 1
        assert result.stdout == ""
        assert invalid_job_id(result.stderr)
    result = command("scontrol_invalid_job.txt")
    with pytest.raises(SlurmJobNotFound):
        parse_scontrol_job(result.stderr)
    query = scontrol_query(
        "1", taken_at=T0, returncode=result.returncode, stdout=result.stdout, stderr=result.stderr
    )
    assert query.outcome is QueryOutcome.NOT_FOUND


def test_squeue_finished_empty_capture() -> None:
    result = command("squeue_finished_empty.txt")
    assert result.returncode == 0
    assert parse_squeue(result.stdout) == []


def test_sacct_dbd_down_capture() -> None:
    result = command("sacct_dbd_down.txt")
    assert result.returncode == 1
    assert not accounting_disabled(result.stderr)
    query = sacct_query(
        "1", taken_at=T0, returncode=result.returncode, stdout=result.stdout, stderr=result.stderr
    )
    assert query.outcome is QueryOutcome.ERROR
    assert "Problem talking to the database" in query.error
