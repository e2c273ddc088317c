"""`results`, `report` and `status` of a finished run with no daemon: from an archive
copied to a temp directory (no socket anywhere), the same table as through the daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmd_supervisor.core.results.evidence import Point, PointEvidence, parse_result, results_table
from llmd_supervisor.core.results.gpus import RoleGpus
from llmd_supervisor.core.verdict.usage import split

DATA = Path(__file__).resolve().parents[1] / "data" / "results"
RUN = "a8c78661894a"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMD_SUPERVISOR_SOCKET": "/nonexistent/control.sock"}
    return subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A daemon's state directory holding one succeeded run's archive (and no socket)."""
    archive = tmp_path / "state" / "archive" / RUN
    archive.mkdir(parents=True)
    point = parse_result((DATA / "vllm-serve-c4.json").read_bytes(), "vllm")
    assert isinstance(point, Point)
    evidence = PointEvidence(4, "results/c4.json", 4, 4, 0, True, None, point)
    (archive / "results.json").write_text(json.dumps(results_table([evidence], RoleGpus(16, 16))))
    attempts = [{"attempt": 1, "nodes": ["node1", "node2"], "gpu_hours": 2.0, "node_hours": 0.5}]
    receipt = {
        "outcome": "succeeded",
        "reason": "State=COMPLETED ExitCode=0:0 (sacct and scontrol agree); marker rc=0",
        "job_id": "77",
        "attempt": 1,
        "attempts": attempts,
        "decided_at": "2026-12-03T08:13:58.700000+00:00",
    }
    (archive / "receipt.json").write_text(json.dumps(receipt))
    return tmp_path / "state"


def test_results_from_the_state_dir_or_the_archive_match_what_the_daemon_answers(
    state: Path,
) -> None:
    archive = state / "archive" / RUN
    by_state = cli("results", RUN, "--state-dir", str(state), "--json")
    by_root = cli("results", RUN, "--archive", str(state / "archive"), "--json")
    by_dir = cli("results", RUN, "--archive", str(archive), "--json")
    assert by_state.returncode == 0, by_state.stderr
    assert by_state.stdout == by_root.stdout == by_dir.stdout
    (got,) = json.loads(by_state.stdout)["runs"]
    table = json.loads((archive / "results.json").read_text())
    receipt = json.loads((archive / "receipt.json").read_text())
    # What the daemon's `results` op answers for the run (supervision.control.api._results).
    assert got == {
        "run": RUN,
        "state": "succeeded",
        "outcome": "succeeded",
        "reason": receipt["reason"],
        "results": table,
        "usage": split(receipt["attempts"]),
        "finished_at": receipt["decided_at"],
    }
    text = cli("results", RUN, "--state-dir", str(state))
    assert text.returncode == 0 and f"run {RUN}: succeeded\n" in text.stdout
    assert "32 GPUs (16 prefill + 16 decode)" in text.stdout


def test_status_from_the_archive_says_so_and_a_missing_run_names_where_it_looked(
    state: Path,
) -> None:
    out = cli("status", RUN, "--state-dir", str(state))
    assert out.returncode == 0, out.stderr
    assert f"run {RUN}: succeeded (from its archive; no daemon asked)" in out.stdout
    assert "slurm job 77, attempt 1" in out.stdout and "nodes node1,node2" in out.stdout
    missing = cli("status", "nope", "--state-dir", str(state))
    assert missing.returncode == 2 and "No archive of run nope in" in missing.stderr
    assert "Traceback" not in missing.stderr
    sneaky = cli("results", "../x", "--state-dir", str(state))
    assert sneaky.returncode == 2 and "is not a run id" in sneaky.stderr


def test_status_from_the_archive_names_the_run_as_list_does(tmp_path: Path) -> None:
    """`[run] name` of its spec.toml; a script's file name or adopted-JOBID from its
    foreign.json; nothing for an unnamed, unreadable or odd one."""
    from llmd_supervisor.cli.offline import run_name

    archive = tmp_path / "a"
    archive.mkdir()
    assert run_name(archive) == ""
    (archive / "spec.toml").write_text('[run]\nname = "dsr1-2p1d"\nlog_dir = "/x"\n')
    assert run_name(archive) == "dsr1-2p1d"
    for text in ('[run]\nname = "a b"\n', "[run]\nname = 7\n", "[run\n", "run = 1\n"):
        (archive / "spec.toml").write_text(text)
        assert run_name(archive) == "", text
    (archive / "spec.toml").unlink()
    body = {"kind": "script", "script_name": "job\x1b.sbatch", "job_id": None}
    (archive / "foreign.json").write_text(json.dumps({"foreign": body}))
    assert run_name(archive) == "job\\x1b.sbatch"
    body = {"kind": "adopt", "script_name": "", "job_id": "4711"}
    (archive / "foreign.json").write_text(json.dumps({"foreign": body}))
    assert run_name(archive) == "adopted-4711"
    for text in ("[]", '{"foreign": {"kind": "other"}}', "{"):
        (archive / "foreign.json").write_text(text)
        assert run_name(archive) == "", text


def test_status_from_the_archive_shows_the_name(state: Path) -> None:
    (state / "archive" / RUN / "spec.toml").write_text('[run]\nname = "demo"\n')
    out = cli("status", RUN, "--state-dir", str(state))
    assert f"run {RUN} demo: succeeded (from its archive; no daemon asked)" in out.stdout


def test_report_from_the_archive_writes_the_file(state: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    got = cli("report", RUN, "--state-dir", str(state), "-o", str(out))
    assert got.returncode == 0, got.stderr
    assert out.read_text().startswith("<!DOCTYPE html>") and RUN in out.read_text()


def test_report_json_prints_the_reports_data_without_matplotlib(
    state: Path, tmp_path: Path
) -> None:
    """`report --json` (README: every client command takes --json): the report's data,
    what the HTML shows (each run's verdict and results, each chart's points and what it
    left out), on stdout; no -o needed, and no matplotlib (the charts are not drawn)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "matplotlib.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(hide), "LLMD_SUPERVISOR_SOCKET": "/nonexistent/s"}
    argv = [sys.executable, "-m", "llmd_supervisor", "report", RUN, "--state-dir", str(state)]
    got = subprocess.run(
        [*argv, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    results = json.loads(cli("results", RUN, "--state-dir", str(state), "--json").stdout)
    assert doc["runs"] == results["runs"]
    charts = {c["id"]: c for c in doc["charts"]}
    assert list(charts) == [
        "tput-vs-interactivity",
        "total-tput-vs-interactivity",
        "ttft-vs-concurrency",
        "tpot-vs-concurrency",
    ]
    (series,) = charts["tput-vs-interactivity"]["series"]
    assert series["run"] == RUN and [p["concurrency"] for p in series["points"]] == [4]
    (point,) = series["points"]
    (row,) = results["runs"][0]["results"]["points"]
    assert point["y"] == pytest.approx(row["total_token_throughput"] / 32)
    assert charts["ttft-vs-concurrency"]["x"] == "concurrency (requests in flight)"
    assert doc["left_out"] == [] and "generated_at" in doc
    # With -o too, the HTML is written as well; stdout still carries the JSON alone.
    out = tmp_path / "report.html"
    both = cli("report", RUN, "--state-dir", str(state), "--json", "-o", str(out))
    assert both.returncode == 0, both.stderr
    assert json.loads(both.stdout)["runs"] == doc["runs"] and out.read_text().startswith("<!")
    assert f"wrote {out}" in both.stderr
    neither = cli("report", RUN, "--state-dir", str(state))
    assert neither.returncode == 2
    assert neither.stderr == (
        "llmd-supervisor report: give -o FILE (the HTML report) or --json (its data on"
        " stdout), or both.\n"
    )
