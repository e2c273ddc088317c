"""What a campaign request may cost the shared daemon (issue 4.1, items 1 and 7), through a
daemon process on a replayed cluster (tests/fakes/replay_world.py) and its command line or
control socket: the daemon's own bound on points (`[limits] campaign_max_points`), which a
client's `--max-points` may lower but never raise; an expansion that stops when its client
goes away; and the one filter of `SBATCH_*` variables for `--export-env`, the matrix and
`[launcher.env]`."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd_supervisor.core.spec.runspec import load_spec
from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import REPO
from tests.fakes.replay_world import ReplayWorld, replay_world
from tests.foreign_helpers import LAUNCHER, WATCH, cli, launcher_env, launcher_finish
from tests.waiting import wait_until

# 2 x 2 combinations of 3 concurrencies: 12 points.
CAMPAIGN = """
name = "sweep"
base = "base.toml"
[matrix]
"benchmark.isl_osl" = [[64, 16], [128, 32]]
"benchmark.concurrencies" = [[1, 2, 4]]
[[zip]]
"topology.prefill_nodes" = [1, 2]
"topology.prefill_workers" = [1, 2]
"""

# SBATCH_* input variables sbatch reads as its own options: a client's shell may hold any.
SBATCH_INPUT = {
    "SBATCH_CLUSTERS": "elsewhere",
    "SBATCH_TIMELIMIT": "1",
    "SBATCH_OUTPUT": "/tmp/stolen-%j.out",
    "SBATCH_PARTITION": "gpu-priority",
}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "daemon"
    path.mkdir()
    return path


def _files(tmp_path: Path, text: str = CAMPAIGN) -> Path:
    (tmp_path / "base.toml").write_text(demo_spec(tmp_path / "logs"))
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_the_daemons_campaign_max_points_bounds_what_a_client_may_ask_for(
    world: ReplayWorld, root: Path, tmp_path: Path
) -> None:
    d = Daemon(world, root, replay_socket=world.socket, limits={"campaign_max_points": 10})
    d.start()
    try:
        path = _files(tmp_path)
        # A client asking for a billion points gets the daemon's 10: the 12 are refused.
        huge = d.cli(
            "campaign", "submit", str(path), "--dry-run", "--max-points", "1000000000", check=False
        )
        assert huge.returncode == 2, huge.stdout
        assert (
            "the campaign expands to at least 12 points, more than this daemon allows"
            " ([limits] campaign_max_points = 10;" in huge.stderr
        ), huge.stderr
        assert "split the campaign" in huge.stderr and "Traceback" not in huge.stderr
        # Without --max-points the daemon's bound is the bound.
        plain = d.cli("campaign", "submit", str(path), "--dry-run", check=False)
        assert plain.returncode == 2 and "campaign_max_points = 10;" in plain.stderr, plain.stderr
        # A client may ask for less: its own bound is named, with the daemon's.
        less = d.cli("campaign", "submit", str(path), "--dry-run", "--max-points", "4", check=False)
        assert less.returncode == 2, less.stdout
        assert "more than --max-points allows (4;" in less.stderr, less.stderr
        assert "this daemon allows up to 10" in less.stderr, less.stderr
        # Counted before anything is built: 10^12 combinations from a file of a few lines.
        axes = "\n".join(f'"env.common.X{i}" = {list(range(10))}' for i in range(12))
        vast = _files(tmp_path, f'name = "vast"\nbase = "base.toml"\n[matrix]\n{axes}\n')
        refused = d.cli(
            "campaign", "submit", str(vast), "--dry-run", "--max-points", "1000000000", check=False
        )
        assert refused.returncode == 2, refused.stdout
        assert "the campaign matrix has 1000000000000 combinations" in refused.stderr
        assert "campaign_max_points = 10;" in refused.stderr, refused.stderr
        # 8 points fit.
        fits = _files(tmp_path, CAMPAIGN.replace("[[1, 2, 4]]", "[[1, 2]]"))
        ok = d.cli("campaign", "submit", str(fits), "--dry-run", "--max-points", "1000000000")
        assert "8 points in 4 jobs" in ok.stdout, ok.stdout
    finally:
        d.stop()


def test_config_show_says_the_campaign_max_points(world: ReplayWorld, root: Path) -> None:
    d = Daemon(world, root, limits={"campaign_max_points": 250})
    d.write_config()
    shown = cli(d, "config", "show", "--config", str(d.config_path))
    assert shown.returncode == 0, shown.stderr
    assert "campaign_max_points = 250" in shown.stdout, shown.stdout
    d.limits["campaign_max_points"] = 1_000_000_000
    d.write_config()
    bad = cli(d, "config", "check", "--config", str(d.config_path))
    assert bad.returncode == 2 and "limits.campaign_max_points" in bad.stderr, bad.stderr


def _request(d: Daemon, path: Path) -> bytes:
    """A `campaign_submit --dry-run` request line of the campaign at `path`."""
    args = {
        "file_text": path.read_text(),
        "base_text": (path.parent / "base.toml").read_text(),
        "file_path": str(path),
        "file_dir": str(path.parent),
        "name": path.stem,
        "dry_run": True,
    }
    line = {"v": 1, "id": 1, "op": "campaign_submit", "args": args}
    return json.dumps(line).encode() + b"\n"


def test_a_client_that_goes_away_stops_its_campaigns_expansion(
    world: ReplayWorld, root: Path, tmp_path: Path
) -> None:
    # 100 x 100 combinations of one concurrency: the daemon's default bound, 10,000 points,
    # each a run spec built and validated (seconds of CPU).
    axes = (
        f'"engine.port" = {list(range(9000, 9100))}\n'
        f'"benchmark.input_len" = {list(range(1, 101))}\n'
        '"benchmark.concurrencies" = [[1]]\n'
    )
    path = _files(tmp_path, f'name = "big"\nbase = "base.toml"\n[matrix]\n{axes}')
    d = Daemon(world, root, replay_socket=world.socket)
    d.start()
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(d.socket))
        client.sendall(_request(d, path))
        wait_until(
            lambda: bool(d.events("campaign.expansion_started")), 120, "the expansion's start"
        )
        client.close()  # the client goes away mid-expansion
        wait_until(
            lambda: bool(d.events("campaign.expansion_stopped")), 120, "the expansion's stop"
        )
        (started,) = d.events("campaign.expansion_started")
        (stopped,) = d.events("campaign.expansion_stopped")
        assert started["combinations"] == 10_000 and started["max_points"] == 10_000
        assert stopped["ended"] is True  # its worker thread ended, not only abandoned
        built = stopped["built"]
        assert isinstance(built, int) and built < 10_000, stopped
        assert d.events("campaign.expanded") == []
        assert d.cli("campaign", "list", "--json").returncode == 0  # the daemon is fine
    finally:
        d.stop()


# --- SBATCH_* in an exported environment ----------------------------------------------------

SCRIPT_CAMPAIGN = """
name = "ix-env"
script = "job.slurm"                 # a copy of tests/cluster/launcher/job.slurm
[launcher]
chdir = "run"
logs = ["slurm_job-{job_id}_rank_*.log"]
marker = ".bench_done.{job_id}"
marker_format = "int"
results = ["results/{job_id}/*.json"]
job_name_prefix = "ixe"
sbatch_args = ["--time=00:04:00"]
nodes = 2
concurrency_env = "BENCH_MAX_CONCURRENCY"
concurrencies = [1, 4]
[launcher.env]
LAUNCHER_DIR = "%s"
IX_RESULTS_BY_JOB = 1
IX_MODEL = "test/model-a"
"""


@pytest.fixture
def launcher_world(tmp_path: Path) -> Iterator[ReplayWorld]:
    """A replayed site whose jobs end as the launcher's (tests/cluster/launcher) do."""
    benchmark = load_spec((REPO / "deploy" / "llm-d" / "demo.toml").read_text()).benchmark
    with replay_world(tmp_path / "world", benchmark, finish=launcher_finish) as w:
        yield w


def _job_envs(world: ReplayWorld) -> list[dict[str, str]]:
    return world.call(lambda: [dict(j.env or {}) for j in world.cluster.jobs.values()])


def test_export_env_never_hands_sbatch_its_own_input_variables(
    launcher_world: ReplayWorld, root: Path, tmp_path: Path
) -> None:
    world = launcher_world
    d = Daemon(world, root, replay_socket=world.socket)
    d.start()
    try:
        shell = {**launcher_env(), **SBATCH_INPUT, "IX_CLIENT_SHELL": "yes"}
        named = ", ".join(sorted(SBATCH_INPUT))
        # submit --script --export-env
        run_dir = tmp_path / "ix"
        run_dir.mkdir()
        argv = ["submit", "--script", str(LAUNCHER / "job.slurm"), "--export-env",
                "--chdir", str(run_dir), "--socket", str(d.socket), "--job-name-prefix",
                "ixs", *WATCH, "--json", "--", "--time=00:04:00"]  # fmt: skip
        submitted = cli(d, *argv, env=shell)
        assert submitted.returncode == 0, submitted.stderr
        assert named in submitted.stderr, submitted.stderr  # said once, by name
        wait_until(lambda: len(_job_envs(world)) == 1, 120, "the script's sbatch")

        # campaign submit --export-env (a script campaign)
        work = tmp_path / "camp"
        work.mkdir()
        shutil.copy(LAUNCHER / "job.slurm", work / "job.slurm")
        path = work / "ix-env.toml"
        path.write_text(SCRIPT_CAMPAIGN % LAUNCHER)
        argv = ["campaign", "submit", str(path), "--export-env", "--socket", str(d.socket)]
        campaign = cli(d, *argv, env=shell)
        assert campaign.returncode == 0, campaign.stderr + d.log_text()[-3000:]
        assert named in campaign.stderr, campaign.stderr
        wait_until(lambda: len(_job_envs(world)) == 2, 120, "the campaign's sbatch")

        envs = _job_envs(world)
        for env in envs:
            assert env["IX_CLIENT_SHELL"] == "yes"  # the client's shell, less SBATCH_*
            assert not {k for k in env if k.startswith("SBATCH_")}, sorted(env)
    finally:
        d.stop()
