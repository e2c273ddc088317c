"""Campaigns through a daemon process and the command line, on a replayed cluster
(tests/fakes/replay_world.py): expansion, admission, verified points, reuse, cancel.
The dev cluster's own campaign tests are tests/cluster/test_campaign.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, demo_spec
from tests.fakes.replay_world import ReplayWorld

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
