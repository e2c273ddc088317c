"""Campaigns through a daemon process and the command line, on a replayed cluster
(tests/fakes/replay_world.py): expansion, admission, verified points, reuse, cancel.
The dev cluster's own campaign tests are tests/cluster/test_campaign.py."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd_supervisor.core.spec.runspec import load_spec
from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import REPO
from tests.fakes.replay_world import ReplayWorld, replay_world
from tests.foreign_helpers import LAUNCHER, cli, launcher_finish

CAMPAIGN = """
name = "sweep"
base = "base.toml"
[limits]
max_jobs = 2
[matrix]
"benchmark.isl_osl" = [[64, 16], [128, 32]]
"benchmark.concurrencies" = [[1, 2, 4]]
[[zip]]
"topology.prefill_nodes" = [1, 2]
"topology.prefill_workers" = [1, 2]
"""


@pytest.fixture
def daemon(world: ReplayWorld, tmp_path: Path) -> Iterator[Daemon]:
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(world, root, replay_socket=world.socket)
    d.start()
    try:
        yield d
    finally:
        d.stop()


def _files(tmp_path: Path, text: str = CAMPAIGN) -> Path:
    (tmp_path / "base.toml").write_text(demo_spec(tmp_path / "logs"))
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def _json(text: str) -> dict[str, object]:
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


def test_a_campaign_runs_every_point_once_then_reuses_them_all(
    daemon: Daemon, world: ReplayWorld, tmp_path: Path
) -> None:
    path = _files(tmp_path)
    dry = daemon.cli("campaign", "submit", str(path), "--dry-run")
    assert "12 points in 4 jobs over 2 topologies; 4 jobs to run, 0 points verified" in dry.stdout
    assert world.sbatch_names() == []  # a dry run submits nothing

    done = daemon.cli("campaign", "submit", str(path), "--wait", check=False, timeout=240)
    assert done.returncode == 0, done.stderr + daemon.log_text()[-3000:]
    assert re.search(r"finished; 12 verified", done.stdout), done.stdout
    table = [ln for ln in done.stdout.splitlines()[1:] if " verified " in f" {ln} "]
    assert len(table) == 12  # one row per point, each with its run
    assert len(world.sbatch_names()) == 4
    campaign = re.search(r"campaign ([0-9a-f]{12})", done.stdout)
    assert campaign is not None
    status = _json(daemon.cli("campaign", "status", campaign.group(1), "--json").stdout)
    assert status["state"] == "finished" and status["exit_status"] == 0
    assert status["jobs"] == {"succeeded": 4}

    # The same file again: nothing to run, every point reused from the first campaign.
    again = daemon.cli("campaign", "submit", str(path), "--wait", check=False, timeout=60)
    assert again.returncode == 0, again.stderr
    assert re.search(r"finished; 12 reused", again.stdout), again.stdout
    assert len(world.sbatch_names()) == 4
    # "sweep" names two campaigns now: the answer says so; by id it is one.
    both = daemon.cli("campaign", "results", "sweep", check=False)
    assert both.returncode == 2 and "names 2 campaigns" in both.stderr, both.stderr
    rows = _json(daemon.cli("campaign", "results", campaign.group(1), "--json").stdout)["points"]
    assert isinstance(rows, list) and len(rows) == 12
    assert {(r["state"], r["concurrency"]) for r in rows} == {("verified", c) for c in (1, 2, 4)}
    assert all(r["total_token_throughput_per_gpu"] for r in rows)
    csv_out = daemon.cli("campaign", "results", campaign.group(1), "--csv").stdout
    assert csv_out.splitlines()[0].startswith("campaign,job,recipe_id,topology,values,")
    assert len(csv_out.splitlines()) == 13
    agg = json.loads(
        daemon.cli("campaign", "results", campaign.group(1), "--format", "inferencex-agg").stdout
    )
    assert len(agg) == 12 and {a["conc"] for a in agg} == {1, 2, 4}
    # `campaign report --json`: the report's data (no -o, no matplotlib needed).
    report = _json(daemon.cli("campaign", "report", campaign.group(1), "--json").stdout)
    shown = report["campaign"]
    assert isinstance(shown, dict) and shown["campaign"] == campaign.group(1)
    assert report["points"] == rows
    charts = report["charts"]
    assert isinstance(charts, list)
    assert [c["id"] for c in charts] == [
        "tput-vs-interactivity",
        "ttft-vs-concurrency",
        "tpot-vs-concurrency",
    ]
    assert sum(len(s["points"]) for s in charts[0]["series"]) >= 4  # 2 topologies' lines
    neither = daemon.cli("campaign", "report", campaign.group(1), check=False)
    assert neither.returncode == 2 and "give -o FILE (the HTML report) or --json" in neither.stderr


def test_a_bad_campaign_file_names_the_point_and_the_field(daemon: Daemon, tmp_path: Path) -> None:
    path = _files(tmp_path, CAMPAIGN.replace("[1, 2]", "[0, 2]", 1))
    bad = daemon.cli("campaign", "submit", str(path), check=False)
    assert bad.returncode == 2
    assert "topology.prefill_nodes" in bad.stderr and "at point" in bad.stderr, bad.stderr
    unknown = _files(tmp_path, CAMPAIGN.replace('"benchmark.isl_osl"', '"benchmark.isl"'))
    bad = daemon.cli("campaign", "submit", str(unknown), check=False)
    assert bad.returncode == 2 and "benchmark.isl_osl" in bad.stderr, bad.stderr


@pytest.mark.parametrize(
    "crash_after",
    [
        "expansion",  # the file expanded, nothing journaled: the client asks again
        "accepted:2",  # the job's run id journaled and the run inserted, before its sbatch
        "sbatch:2",  # an sbatch answered, its job not yet journaled
        "pending:3",  # an sbatch answered and journaled, the campaign not yet told
        "verifying:2",  # a run being verified
    ],
)
def test_a_daemon_killed_mid_campaign_submits_no_point_twice_and_loses_none(
    world: ReplayWorld, tmp_path: Path, crash_after: str
) -> None:
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(world, root, replay_socket=world.socket, crash_after=crash_after)
    d.start()
    try:
        path = _files(tmp_path)
        first = d.cli("campaign", "submit", str(path), "--json", check=False, timeout=60)
        assert d.proc is not None
        d.proc.wait(timeout=60)  # SIGKILLed by its crash point
        assert d.proc.returncode == -9, d.log_text()[-2000:]
        d.crash_after = None
        d.start()
        if crash_after == "expansion":  # the client heard nothing, and nothing was kept
            assert first.returncode != 0, first.stdout
            assert _json(d.cli("campaign", "list", "--json").stdout)["campaigns"] == []
            first = d.cli("campaign", "submit", str(path), "--json", check=False, timeout=60)
        assert first.returncode == 0, first.stderr
        campaign = str(_json(first.stdout)["campaign"])
        done = d.cli("campaign", "wait", campaign, "--json", check=False, timeout=240)
        assert done.returncode == 0, done.stdout + d.log_text()[-3000:]
        final = _json(done.stdout)
        assert isinstance(final["points"], dict)
        assert final["points"]["verified"] == 12  # every point, once
        names = world.sbatch_names()
        assert len(names) == len(set(names)) == 4, names  # no job submitted twice
    finally:
        d.stop()


@pytest.mark.parametrize("in_sacctmgr", [True, False])
def test_a_qos_submit_limit_is_kept_or_back_pressure_never_a_failure(
    world: ReplayWorld, tmp_path: Path, in_sacctmgr: bool
) -> None:
    # One topology, four recipes, max_jobs 8; the QOS lets 2 jobs be queued at once. Read
    # from sacctmgr, the campaign keeps to it; unseen there, after the canary 3 are
    # submitted together, one is refused by sbatch, and the campaign backs off.
    def limit() -> None:
        world.cluster.max_submit = 2
        world.cluster.limit_in_sacctmgr = in_sacctmgr

    world.call(limit)
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(world, root, replay_socket=world.socket, qos_backoff_s=1.0)
    d.start()
    try:
        text = CAMPAIGN.replace("max_jobs = 2", "max_jobs = 8").replace(
            "[[64, 16], [128, 32]]", "[[64, 16], [96, 16], [128, 32], [160, 32]]"
        )
        text = text[: text.index("[[zip]]")]
        path = _files(tmp_path, text)
        done = d.cli("campaign", "submit", str(path), "--wait", "--json", check=False, timeout=240)
        assert done.returncode == 0, done.stderr + d.log_text()[-3000:]
        final = _json(done.stdout)
        assert isinstance(final["points"], dict)
        assert final["points"]["verified"] == 12
        refused = d.events("campaign.qos_refusal")
        if in_sacctmgr:
            assert refused == [] and d.events("campaign.submit_limit")[0]["limit"] == 2
        else:
            assert refused and "QOSMaxSubmitJobPerUserLimit" in str(refused[0]["limit"])
        assert len(set(world.sbatch_names())) == 4  # each job ran once in the end
    finally:
        d.stop()


# --- a campaign over a batch script ---------------------------------------------------------

SCRIPT_CAMPAIGN = """
name = "ix-sweep"
script = "job.slurm"                 # a copy of tests/cluster/launcher/job.slurm
[limits]
max_jobs = 2
[launcher]
chdir = "run"
logs = ["slurm_job-{job_id}_rank_*.log"]
marker = ".bench_done.{job_id}"
marker_format = "int"
results = ["results/{job_id}/*.json"]
job_name_prefix = "ixc"
sbatch_args = ["--time=00:04:00"]
nodes = 2
concurrency_env = "BENCH_MAX_CONCURRENCY"
concurrencies = [1, 4]
[launcher.env]
LAUNCHER_DIR = "%s"
IX_RESULTS_BY_JOB = 1
[matrix]
"env.IX_MODEL" = ["test/model-a", "test/model-b"]
"""


@pytest.fixture
def launcher_world(tmp_path: Path) -> Iterator[ReplayWorld]:
    """A replayed site whose jobs end as the launcher's (tests/cluster/launcher) do."""
    benchmark = load_spec((REPO / "deploy" / "llm-d" / "demo.toml").read_text()).benchmark
    with replay_world(tmp_path / "world", benchmark, finish=launcher_finish) as w:
        yield w


def _script_files(tmp_path: Path) -> Path:
    """The campaign file beside its copy of the launcher's job.slurm."""
    work = tmp_path / "ix"
    work.mkdir()
    shutil.copy(LAUNCHER / "job.slurm", work / "job.slurm")
    path = work / "sweep.toml"
    path.write_text(SCRIPT_CAMPAIGN % LAUNCHER)
    return path


def test_a_script_campaign_passes_its_values_as_environment_and_reuses_every_point(
    launcher_world: ReplayWorld, tmp_path: Path
) -> None:
    world = launcher_world
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(world, root, replay_socket=world.socket)
    d.start()
    try:
        path = _script_files(tmp_path)
        work = path.parent

        dry = d.cli("campaign", "submit", str(path), "--dry-run")
        assert "4 points in 2 jobs over 1 topologies; 2 jobs to run" in dry.stdout, dry.stdout
        assert f"every job: LAUNCHER_DIR={LAUNCHER} IX_RESULTS_BY_JOB=1" in dry.stdout
        assert re.search(
            r"job [0-9a-f]{12}: IX_MODEL=test/model-a BENCH_MAX_CONCURRENCY=1x4", dry.stdout
        )
        assert world.sbatch_names() == []

        argv = [
            "campaign",
            "submit",
            str(path),
            "--export-env",
            "--wait",
            "--socket",
            str(d.socket),
        ]
        done = cli(d, *argv, env={"IX_CLIENT_SHELL": "yes"})
        assert done.returncode == 0, done.stderr + d.log_text()[-3000:]
        assert re.search(r"finished; 4 verified", done.stdout), done.stdout
        jobs = world.call(
            lambda: [(j.name, j.env or {}, j.options) for j in world.cluster.jobs.values()]
        )
        assert len(jobs) == 2 and all(name.startswith("ixc-") for name, _, _ in jobs)
        assert sorted(env["IX_MODEL"] for _, env, _ in jobs) == ["test/model-a", "test/model-b"]
        for _, env, options in jobs:
            assert env["BENCH_MAX_CONCURRENCY"] == "1x4"
            assert env["LAUNCHER_DIR"] == str(LAUNCHER) and env["IX_RESULTS_BY_JOB"] == "1"
            assert env["IX_CLIENT_SHELL"] == "yes"  # --export-env: the client's shell under it
            assert f"--chdir={work / 'run'}" in options and "--nodes=2" in options

        # Every point from the archived results of the two runs, with its provenance.
        campaign = re.search(r"campaign ([0-9a-f]{12})", done.stdout)
        assert campaign is not None
        result = d.cli("campaign", "results", campaign.group(1), "--json")
        rows = _json(result.stdout)["points"]
        assert isinstance(rows, list)
        assert sorted((r["values"], r["concurrency"], r["state"]) for r in rows) == [
            (f'IX_MODEL="test/model-{m}"', c, "verified") for m in "ab" for c in (1, 4)
        ]
        assert len({r["run"] for r in rows}) == 2

        # The same file again (without --export-env): nothing runs, every point reused.
        again = d.cli("campaign", "submit", str(path), "--wait", check=False, timeout=60)
        assert again.returncode == 0, again.stderr
        assert re.search(r"finished; 4 reused", again.stdout), again.stdout
        assert len(world.sbatch_names()) == 2
    finally:
        d.stop()


def test_a_daemon_killed_mid_script_campaign_submits_no_job_twice(
    launcher_world: ReplayWorld, tmp_path: Path
) -> None:
    # Killed once the second job's run is journaled, before its sbatch: the restarted
    # daemon submits that run under its journaled id (as a `submit --script` run), once.
    world = launcher_world
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(world, root, replay_socket=world.socket, crash_after="accepted:2")
    d.start()
    try:
        path = _script_files(tmp_path)
        first = d.cli("campaign", "submit", str(path), "--json", check=False, timeout=60)
        assert first.returncode == 0, first.stderr
        campaign = str(_json(first.stdout)["campaign"])
        assert d.proc is not None
        d.proc.wait(timeout=60)
        assert d.proc.returncode == -9, d.log_text()[-2000:]
        d.crash_after = None
        d.start()
        done = d.cli("campaign", "wait", campaign, "--json", check=False, timeout=240)
        assert done.returncode == 0, done.stdout + d.log_text()[-3000:]
        points = _json(done.stdout)["points"]
        assert isinstance(points, dict) and points["verified"] == 4
        names = world.sbatch_names()
        assert len(names) == len(set(names)) == 2, names
    finally:
        d.stop()
