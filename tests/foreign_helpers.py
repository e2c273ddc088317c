"""Driving jobs of a user's own launcher (`tests/cluster/launcher/`) through the CLI:
`submit --script` and `adopt` (the cluster and fault tests of issue 2.5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.daemon_helpers import Daemon
from tests.devcluster import REPO, DevCluster
from tests.fakes.replay_world import ReplayWorld
from tests.fakes.slurm_replay import ReplayJob

LAUNCHER = REPO / "tests" / "cluster" / "launcher"
WATCH = [
    "--logs",
    "slurm_job-{job_id}_rank_*.log",
    "--marker",
    ".bench_done.{job_id}",
    "--marker-format",
    "int",
    "--results",
    "results/*.json",
]


def launcher_env(rc: int = 0, lines: int = 20) -> dict[str, str]:
    """The settings the launcher takes from the submitting shell."""
    return {
        "LAUNCHER_DIR": str(LAUNCHER),
        "IX_MODEL": "test/model-0.5b",
        "IX_BENCH_RC": str(rc),
        "IX_LOG_LINES": str(lines),
    }


def cli(
    daemon: Daemon, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd or REPO,
        env={**os.environ, **daemon.cluster.slurm_env, **(env or {})},
    )


def final(daemon: Daemon, run: str) -> dict[str, object]:
    result = json.loads(daemon.cli("wait", run, "--json", check=False).stdout)
    assert isinstance(result, dict)
    return result


def assert_copies_of(final: dict[str, object], run_dir: Path) -> list[str]:
    """Every copy of the run's logs (named by its path below the log directory) is the
    job's file byte for byte; return the copies' names."""
    copies_dir = Path(str(final["archive"])) / "logs" / f"attempt{final['attempt']}"
    names = sorted(str(p.relative_to(copies_dir)) for p in copies_dir.rglob("*") if p.is_file())
    for name in names:
        assert (copies_dir / name).read_bytes() == (run_dir / name).read_bytes(), name
    return names


def submit_script(
    daemon: Daemon, run_dir: Path, rc: int = 0, *options: str
) -> subprocess.CompletedProcess[str]:
    """The launcher through `submit --script --export-env` from `run_dir`; `options`
    replace the default watch options (`WATCH`, a job name prefix, sbatch's --time)."""
    chosen = options or (
        "--job-name-prefix", "ixci", *WATCH, "--json", "--", "--time=00:04:00"
    )  # fmt: skip
    argv = ["submit", "--script", str(LAUNCHER / "job.slurm"), "--export-env",
            "--chdir", str(run_dir), "--socket", str(daemon.socket), *chosen]  # fmt: skip
    return cli(daemon, *argv, env=launcher_env(rc))


def sbatch_plain(cluster: DevCluster, run_dir: Path, *, lines: int) -> str:
    """The launcher submitted with plain sbatch (no daemon); its job id."""
    run_dir.mkdir()
    out = cluster.slurm(
        [
            "sbatch",
            "--parsable",
            f"--chdir={run_dir}",
            "--job-name=plain-sbatch",
            str(LAUNCHER / "job.slurm"),
        ],
        extra_env=launcher_env(lines=lines),
    ).stdout
    return out.strip().split(";")[0]  # fmt: skip


def launcher_finish(job: ReplayJob, run_dir: Path) -> None:
    """What the launcher's ranks leave at the end of a replayed job (tests/cluster/launcher/
    server.sh, rc 0): a log per rank, the coordinator's result files (one per concurrency
    of the job's BENCH_MAX_CONCURRENCY, default 4x8; below results/<job id>/ with
    IX_RESULTS_BY_JOB), then the int marker."""
    env = job.env or {}
    concurrencies = env.get("BENCH_MAX_CONCURRENCY", "4x8").split("x")
    for rank in (0, 1):
        lines = f"rank {rank} on replayed: serving {env.get('IX_MODEL', '')}\n"
        lines += "".join(f"rank {rank}: engine step {i}\n" for i in range(1, 21))
        if rank == 0:
            lines += f"rank 0: benchmarking concurrencies {' '.join(concurrencies)}\n"
        (run_dir / f"slurm_job-{job.job_id}_rank_{rank}.log").write_text(lines)
    sample = (LAUNCHER / "result.json").read_text()
    results = run_dir / "results" / (job.job_id if env.get("IX_RESULTS_BY_JOB") else "")
    results.mkdir(parents=True, exist_ok=True)
    for c in concurrencies:
        doc = sample.replace('"max_concurrency": 4', f'"max_concurrency": {int(c)}')
        (results / f"ix_c{c}.json").write_text(doc)
    (run_dir / f".bench_done.{job.job_id}").write_text("0\n")


def sbatch_plain_replayed(world: ReplayWorld, run_dir: Path) -> str:
    """`sbatch_plain` on a replayed cluster: the launcher's job, submitted without the daemon."""
    run_dir.mkdir()
    argv = ["sbatch", "--parsable", f"--chdir={run_dir}", "--job-name=plain-sbatch"]
    script = (LAUNCHER / "job.slurm").read_bytes()
    out = world.portal.call(lambda: world.cluster.run(argv, time_limit=10, stdin=script))
    return out.stdout.strip().split(";")[0]


def adopt(daemon: Daemon, job_id: str, run_dir: Path) -> subprocess.CompletedProcess[str]:
    return cli(
        daemon, "adopt", job_id, "--log-dir", str(run_dir), *WATCH, "--json",
        "--socket", str(daemon.socket),
    )  # fmt: skip
