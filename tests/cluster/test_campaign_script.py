"""A campaign over a user's own batch script on the dev cluster (issue 3.5): the
InferenceX-style stand-in launcher (tests/cluster/launcher/job.slurm) with its settings as
environment variables of the script, two jobs of different node counts, every point
verified from the runs' archived results, and the values seen by the jobs themselves. The
crash-free reuse of every point and --export-env run on the replayed cluster
(tests/unit/test_campaign_replay.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.daemon_helpers import Daemon
from tests.foreign_helpers import LAUNCHER

CAMPAIGN = """
name = "ix-cluster"
script = "job.slurm"
[limits]
max_jobs = 2
[launcher]
chdir = "run"
logs = ["slurm_job-{job_id}_rank_*.log"]
marker = ".bench_done.{job_id}"
marker_format = "int"
results = ["results/{job_id}/*.json"]
job_name_prefix = "ixcamp"
sbatch_args = ["--time=00:04:00"]
nodes = 2
concurrency_env = "BENCH_MAX_CONCURRENCY"
concurrencies = [2, 16]
[launcher.env]
LAUNCHER_DIR = "%s"
IX_RESULTS_BY_JOB = 1
IX_LOG_LINES = 10
[[zip]]
"env.IX_MODEL" = ["test/model-a", "test/model-b"]
"launcher.nodes" = [1, 2]
"""


def _json(text: str) -> dict[str, object]:
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


def test_a_script_campaign_runs_the_launcher_with_its_values_as_environment(
    daemon: Daemon, shared_tmp: Path
) -> None:
    work = shared_tmp / "ix"
    work.mkdir()
    shutil.copy(LAUNCHER / "job.slurm", work / "job.slurm")
    path = work / "campaign.toml"
    path.write_text(CAMPAIGN % LAUNCHER)

    done = daemon.cli("campaign", "submit", str(path), "--wait", check=False, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr + daemon.log_text()[-3000:]
    head = done.stdout.splitlines()[0]
    assert "finished; 4 verified" in head, done.stdout
    rows = _json(daemon.cli("campaign", "results", head.split()[1], "--json").stdout)["points"]
    assert isinstance(rows, list)
    # The varying matrix values in file order: the zip's env.IX_MODEL, launcher.nodes.
    assert sorted((r["values"], r["concurrency"], r["state"]) for r in rows) == [
        (f'IX_MODEL="test/model-{m}" nodes={n}', c, "verified")
        for m, n in (("a", 1), ("b", 2))
        for c in (2, 16)
    ]
    run_of = {str(r["values"]).split()[-1]: str(r["run"]) for r in rows}
    assert len(set(run_of.values())) == 2  # one job per recipe, both concurrencies in it

    for nodes, model in ((1, "a"), (2, "b")):
        final = _json(daemon.cli("wait", run_of[f"nodes={nodes}"], "--json").stdout)
        assert final["outcome"] == "succeeded", final["reason"]
        assert "marker rc=0 (plain integer)" in str(final["reason"])
        job_id = str(final["slurm_job_id"])
        assert str(final["job_name"]).startswith("ixcamp-")
        held = final["nodes"]
        assert isinstance(held, list) and len(held) == nodes  # launcher.nodes reached sbatch
        # The values reached the job: the model its ranks serve, the concurrencies its
        # coordinator ran (BENCH_MAX_CONCURRENCY = "2x16"), one rank log per node.
        run_dir = work / "run"
        rank0 = (run_dir / f"slurm_job-{job_id}_rank_0.log").read_text()
        assert f"serving test/model-{model}" in rank0, rank0
        assert "benchmarking concurrencies 2 16" in rank0, rank0
        assert (run_dir / f"slurm_job-{job_id}_rank_1.log").exists() == (nodes == 2)
        archive = Path(str(final["archive"]))
        for c in (2, 16):
            name = f"results/{job_id}/ix_c{c}.json"
            assert (archive / "results" / name).read_bytes() == (run_dir / name).read_bytes()
        kept = _json((archive / "foreign.json").read_text())["foreign"]
        assert isinstance(kept, dict)
        assert {"IX_MODEL", "BENCH_MAX_CONCURRENCY", "LAUNCHER_DIR"} <= set(kept["env"])
        assert f"test/model-{model}" not in json.dumps(kept)  # names only in the archive
