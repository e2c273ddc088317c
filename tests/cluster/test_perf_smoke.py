"""The benchmark harness still works: `tests/perf/run.sh --smoke` runs every bench once at
its smallest on the dev cluster and reports each with no harness error. Its numbers are
not checked (the benchmarks' targets are for `tests/perf/run.sh`, on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.devcluster import REPO, DevCluster
from tests.perf.bench import MEASUREMENTS


def test_every_bench_runs_once_without_a_harness_error(cluster: DevCluster, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [str(REPO / "tests" / "perf" / "run.sh"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        env=cluster.slurm_env,
    )
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["errors"] == {}, (report["errors"], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(report["measurements"]) == sorted(MEASUREMENTS)
    assert report["mode"] == "smoke"
