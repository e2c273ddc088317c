"""deploy/steps.sh, the quickstart's progress lines (issue 4.7): a setup step prints one
line and keeps its output (hundreds of apt lines) in a log; a failed step shows where.
The quickstart itself needs the dev cluster, so the helper is run here on its own."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.devcluster import REPO

STEPS = REPO / "deploy" / "steps.sh"


def _step(log: Path, label: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", 'set -euo pipefail; . "$0"; step "$1" "$2" bash -c "$3"; echo after',
         str(STEPS), str(log), label, script],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


def test_a_step_prints_one_line_and_logs_everything(tmp_path: Path) -> None:
    log = tmp_path / "setup.log"
    apt = 'for i in $(seq 550); do echo "Setting up package$i ..."; done; echo warn >&2'
    out = _step(log, "installing what is missing", apt)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(
        r"quickstart: installing what is missing \.\.\. done \(\d+ s\)\n", out.stderr
    )
    assert out.stdout == "after\n"  # nothing of the step's own output on the terminal
    text = log.read_text()
    assert "Setting up package1 ...\n" in text and "Setting up package550 ...\n" in text
    assert "warn\n" in text


def test_a_failed_step_names_the_log_shows_its_end_and_stops_the_script(tmp_path: Path) -> None:
    log = tmp_path / "setup.log"
    out = _step(
        log, "starting the dev cluster", "seq 100; echo 'slurmctld did not start' >&2; exit 7"
    )
    assert out.returncode == 7 and out.stdout == ""  # set -e: the quickstart stops there
    first, *rest = out.stderr.splitlines()
    assert first.startswith("quickstart: starting the dev cluster ... failed (exit status 7")
    assert f"all of its output is in {log}" in first
    assert rest[-1] == "  slurmctld did not start" and len(rest) == 20
    assert "1\n" in log.read_text()  # the whole output is kept


def test_the_quickstart_runs_its_setup_through_steps() -> None:
    text = (REPO / "deploy" / "quickstart.sh").read_text()
    assert ". deploy/steps.sh" in text
    assert 'step "$SETUP_LOG" "installing what is missing (deploy/install-dev.sh)"' in text
    assert re.search(r"^deploy/install-dev.sh", text, re.M) is None  # not printed raw
    subprocess.run(["bash", "-n", str(REPO / "deploy" / "quickstart.sh")], check=True)
