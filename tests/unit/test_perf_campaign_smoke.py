"""The campaign benchmark still works: `tests/perf/run.sh --campaign --smoke` runs it once
with 20 jobs on the replayed cluster and reports every measurement with no harness error.
Its numbers are not checked (the targets are for a full run on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.devcluster import REPO
from tests.perf.campaign import TARGETS


def test_the_campaign_bench_runs_once_without_a_harness_error(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [str(REPO / "tests" / "perf" / "run.sh"), "--campaign", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["error"] is None, report["error"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    values = report["values"]
    assert (values["jobs"], values["points"]) == (20, 80)
    assert set(TARGETS) <= set(values) and report["mode"] == "smoke"
    assert set(values["slurm_calls_per_min"]) == {"one_run", "campaign"}
