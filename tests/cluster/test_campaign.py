"""Campaigns on the dev cluster: deploy/llm-d/campaign-demo.toml through the daemon (its
points verified, never more jobs at once than its limit, then every point reused), and a
canary that fails for the workload blocking its topology only. The crash, QOS and many
other cases run on the replayed cluster (tests/unit/test_campaign_replay.py)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import REPO, DevCluster

CAMPAIGN_DEMO = REPO / "deploy" / "llm-d" / "campaign-demo.toml"


def _files(shared_tmp: Path, campaign: str, port: int = 8300) -> Path:
    (shared_tmp / "base.toml").write_text(demo_spec(shared_tmp / "runs", port=port))
    path = shared_tmp / "campaign.toml"
    path.write_text(campaign.replace('base = "demo.toml"', 'base = "base.toml"'))
    return path


def _json(text: str) -> dict[str, object]:
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


def _most_at_once(cluster: DevCluster, job_ids: list[str]) -> int:
    """The most of these jobs that held an allocation at one moment (sacct's times)."""
    rows = cluster.slurm(
        ["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "--format=JobIDRaw,Start,End"]
    ).stdout.split()
    spans = []
    for row in rows:
        _, start, end = row.split("|")
        spans.append((datetime.fromisoformat(start), datetime.fromisoformat(end)))
    assert len(spans) == len(job_ids), rows
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


def test_the_campaign_demo_verifies_every_point_within_its_limit_then_reuses_them(
    daemon: Daemon, cluster: DevCluster, shared_tmp: Path
) -> None:
    path = _files(shared_tmp, CAMPAIGN_DEMO.read_text())
    done = daemon.cli("campaign", "submit", str(path), "--wait", check=False, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    head, *table = done.stdout.splitlines()
    assert "finished; 12 verified" in head, done.stdout
    assert sum(" verified " in f" {ln} " for ln in table) == 12
    campaign = head.split()[1]
    rows = _json(daemon.cli("campaign", "results", campaign, "--json").stdout)["points"]
    assert isinstance(rows, list) and len(rows) == 12
    runs = sorted({str(r["run"]) for r in rows})
    assert len(runs) == 4  # one job per recipe, all its concurrencies in it
    job_ids = [str(daemon.status(run)["slurm_job_id"]) for run in runs]
    assert _most_at_once(cluster, job_ids) <= 2  # limits.max_jobs

    start = time.monotonic()
    again = daemon.cli("campaign", "submit", str(path), "--wait", check=False, timeout=60)
    took = time.monotonic() - start
    assert again.returncode == 0, again.stderr
    assert "finished; 12 reused" in again.stdout.splitlines()[0], again.stdout
    assert took < 5 + 5  # the 5 s, and a loaded 2-core machine's start-up
    assert len(json.loads(daemon.cli("list", "--json", "--all").stdout)["runs"]) == 4


def test_a_canary_failing_for_the_workload_blocks_its_topology_only(
    daemon: Daemon, shared_tmp: Path
) -> None:
    # Topology 1P: its benchmark fails at concurrency 2 (a workload failure); 2P: works.
    text = CAMPAIGN_DEMO.read_text() + (
        '"env.bench.LLMD_FAKE_BENCH_FAIL_CONCURRENCY" = ["2", "none"]\n'
    )
    path = _files(shared_tmp, text, port=8320)
    done = daemon.cli("campaign", "submit", str(path), "--wait", "--json", check=False, timeout=600)
    assert done.returncode == 10, done.stderr + daemon.log_text()[-3000:]
    final = _json(done.stdout)
    points = final["points"]
    assert isinstance(points, dict)
    # 1P: its canary's 3 points failed, its other job's 3 blocked; 2P: 6 verified.
    assert (points["failed: workload"], points["blocked"], points["verified"]) == (3, 3, 6)
    problems = final["problems"]
    assert isinstance(problems, list)
    blocked = [p for p in problems if p["state"] == "blocked"]
    assert len(blocked) == 1 and "canary" in str(blocked[0]["reason"])
    assert len(json.loads(daemon.cli("list", "--json", "--all").stdout)["runs"]) == 3
