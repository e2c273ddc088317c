"""The team-journal benchmark still works: `tests/perf/run.sh --team --smoke` runs it once
with 300 runs on a real PostgreSQL server and a replayed cluster, and reports every
measurement with no harness error. Its numbers are not checked (the targets are for
100,000 runs on a quiet machine), except that the standby saw the leader's last write."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.devcluster import REPO
from tests.perf.team_journal import TARGETS


def test_the_team_journal_bench_runs_once_without_a_harness_error(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [str(REPO / "tests" / "perf" / "run.sh"), "--team", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["error"] is None, report["error"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    values = report["values"]
    assert values["runs"] == values["runs_read"] == 300 and report["mode"] == "smoke"
    assert set(TARGETS) <= set(values)
    assert values["standby_saw_last_write"] is True
    assert values["leader_writes"] >= 2
    assert out.with_suffix(".md").read_text().startswith("# Team journal at scale (smoke")
