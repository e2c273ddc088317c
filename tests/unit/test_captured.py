"""Parse every captured Slurm output: 22.05 in tests/data/slurm, 24.11 in tests/data/slurm/24.11
(see their INDEX.md; the differences are in deploy/devcluster/SLURM-VERSIONS.md).

Job ids are read from the captures themselves, so a re-capture with new ids still passes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from llmd_supervisor.core.slurm.parse import (
    _KNOWN_JOB_KEYS,
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    ExitCode,
    JobState,
    accounting_disabled,
    allocation_row,
    invalid_job_id,
    job_rows,
    parse_sacct,
    parse_sacct_batch,
    parse_sbatch_parsable,
    parse_scontrol_config,
    parse_scontrol_job,
    parse_squeue,
    parse_squeue_batch,
)
from llmd_supervisor.core.verdict.decide import (
    Outcome,
    QueryOutcome,
    VerdictState,
    decide,
    observe,
    sacct_query,
    scontrol_query,
)
from llmd_supervisor.core.verdict.marker import MarkerReading, read_marker
from llmd_supervisor.errors import SlurmJobNotFound
from tests.fakes.slurm_replay import Captures

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"
# Every Slurm version captured, and where (22.05's were the first, at the top).
VERSIONS = {"22.05": DATA, "24.11": DATA / "24.11"}
T0 = datetime(2026, 11, 30, 22, 0, 0, tzinfo=UTC)


def text(version: str, name: str) -> str:
    return (VERSIONS[version] / name).read_text(encoding="utf-8")


def squeue_format(version: str) -> str:
    """The squeue format a version was captured with (INDEX.md): before issue 3.2 the
    captures had the name last, after it they are in the client's SQUEUE_FORMAT."""
    found = re.search(
        r"squeue format: `squeue --noheader --format=([^`]+)`", text(version, "INDEX.md")
    )
    assert found is not None
    return found.group(1)


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
    (row,) = parse_squeue(
        text(case.version, f"{case.case}.squeue.txt"), squeue_format(case.version)
    )
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
    (row,) = parse_squeue(text(version, "requeued_pending.squeue.txt"), squeue_format(version))
    assert row.state.state is JobState.PENDING
    assert row.job_id == job.job_id


@pytest.mark.parametrize("version", VERSIONS)
def test_running_captures(version: str) -> None:
    rows = parse_squeue(text(version, "running.squeue.txt"), squeue_format(version))
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
    assert parse_squeue(result.stdout, squeue_format(version)) == []


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


# --- names a job chose (issue 3.2, item 4) ----------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_capture_holds_the_clients_formats(version: str) -> None:
    """The client asks for a subset of what was captured (or for exactly it)."""
    caps = Captures(VERSIONS[version])
    assert set(SQUEUE_FORMAT.split("|")) <= set(caps.squeue_tokens)
    assert set(SACCT_FIELDS) <= set(caps.sacct_fields)


@pytest.mark.parametrize("version", VERSIONS)
def test_names_beside_captured_jobs_spoil_their_own_record_only(version: str) -> None:
    """Every ended case's captured rows in one batch, as the poller asks for them. Printed
    with names (as the formats before issue 3.2 asked), one job named with a newline and
    one with '|' spoil only the newline job's records; printed in the client's formats
    (no names) nothing is rejected. Every other job reads as it was captured."""
    caps = Captures(VERSIONS[version])
    cases = [c for c in CAPTURED if c.version == version]
    hostile = {cases[0].case: "x\ny", cases[1].case: "a|b|COMPLETED|0:0"}
    spoiled = job_id_of(cases[0])
    sacct_named, sacct_plain, squeue_named, squeue_plain = "", "", "", ""
    for case in cases:
        name = hostile.get(case.case, "capture")
        for row in caps.sacct_rows(f"{case.case}.sacct.txt"):
            sacct_plain += "|".join(row[f] for f in SACCT_FIELDS) + "\n"
            sacct_named += "|".join([*(row[f] for f in SACCT_FIELDS), name]) + "\n"
        for cells in caps.squeue_cells(f"{case.case}.squeue.txt"):
            line = dict(zip(caps.squeue_tokens, cells, strict=True))
            squeue_plain += "|".join(line[t] for t in SQUEUE_FORMAT.split("|")) + "\n"
            squeue_named += "|".join([line["%i"], line["%T"], line["%N"], line["%r"], name])
            squeue_named += "\n"
    for sacct, squeue, rejected in (
        (sacct_plain, parse_squeue_batch(squeue_plain), frozenset[str]()),
        (
            sacct_named,
            parse_squeue_batch(squeue_named, SQUEUE_FORMAT + "|%j"),
            frozenset({spoiled}),
        ),
    ):
        batch = parse_sacct_batch(sacct)
        assert (batch.rejected_jobs, squeue.rejected_jobs) == (rejected, rejected)
        assert not batch.stray and not squeue.stray
        squeue_rows = {r.job_id: r for r in squeue.rows}
        for case in cases:
            job_id = job_id_of(case)
            if job_id in rejected:
                continue
            alloc = allocation_row(batch.rows, job_id)
            assert alloc is not None, (case.case, sacct)
            assert (alloc.state.state, alloc.exit_code) == (case.state, case.sacct_exit)
            assert squeue_rows[job_id].state.state is case.state


@pytest.mark.parametrize("version", VERSIONS)
def test_hostile_names_capture(version: str) -> None:
    """What Slurm printed for a job and a step named with a newline and with '|' beside an
    ordinary job (deploy/devcluster/capture-slurm-outputs, `hostile_names`): in the
    client's formats every job's record parses; printed with names, only the newline
    job's records may be spoiled, and the ordinary job reads COMPLETED all the same. The
    script takes these in the client's formats whatever the rest was captured with."""
    directory = VERSIONS[version]
    if not (directory / "hostile_names.jobs.json").exists():
        # Captured before issue 3.2: the capture script has the case since (to be re-run).
        assert "hostile_names" not in text(version, "INDEX.md")
        return
    jobs = json.loads(text(version, "hostile_names.jobs.json"))["jobs"]
    sacct = parse_sacct_batch(text(version, "hostile_names.sacct.txt"))
    squeue = parse_squeue_batch(text(version, "hostile_names.squeue.txt"))
    assert not sacct.rejected and not squeue.rejected
    assert {r.job_id for r in squeue.rows} == set(jobs.values())
    for job_id in jobs.values():
        row = allocation_row(sacct.rows, job_id)
        assert row is not None and row.state.state.is_terminal, job_id
    named = parse_sacct_batch(text(version, "hostile_names.sacct_named.txt"))
    squeue_named = parse_squeue_batch(
        text(version, "hostile_names.squeue_named.txt"), SQUEUE_FORMAT + "|%j"
    )
    assert named.rejected_jobs <= {jobs["newline"]} and not named.stray
    assert squeue_named.rejected_jobs <= {jobs["newline"]} and not squeue_named.stray
    normal = allocation_row(named.rows, jobs["normal"])
    assert normal is not None and normal.state.state is JobState.COMPLETED
