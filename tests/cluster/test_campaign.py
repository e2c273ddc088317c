"""Campaigns on the dev cluster: deploy/llm-d/campaign-demo.toml through the daemon (its
points verified, never more jobs at once than its limit, then every point reused), a
canary that fails for the workload blocking its topology only, a QOS submit limit kept
with no point failing, two users' campaigns sharing the account's submit limit in turns,
and a daemon SIGKILLed at three moments of one campaign. Each
crash point alone, and many other cases, run on the replayed cluster too
(tests/unit/test_campaign_replay.py)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import REPO, DevCluster, devcluster
from tests.strangers import Stranger

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


def _holding(d: Daemon, campaign: str) -> int:
    """The campaign's jobs submitted or running, as its status says."""
    jobs = _json(d.cli("campaign", "status", campaign, "--json").stdout)["jobs"]
    assert isinstance(jobs, dict)
    return int(jobs.get("submitted", 0)) + int(jobs.get("running", 0))


def _most_at_once(cluster: DevCluster, job_ids: list[str], since: str = "Start") -> int:
    """The most of these jobs that held an allocation (since="Submit": that were queued
    or running) at one moment, by sacct's times."""
    rows = cluster.slurm(
        ["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), f"--format=JobIDRaw,{since},End"]
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


def _killed(d: Daemon) -> None:
    assert d.proc is not None
    d.proc.wait(timeout=180)  # SIGKILLed by its crash point (tests/faults/crash_daemon.py)
    assert d.proc.returncode == -9, d.log_text()[-3000:]


def test_a_daemon_killed_three_times_mid_campaign_submits_no_point_twice_and_loses_none(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    path = _files(shared_tmp, CAMPAIGN_DEMO.read_text(), port=8340)
    # 1. Killed once the file is expanded: nothing journaled, the client asks again.
    d = Daemon(cluster, tmp_path, crash_after="expansion")
    try:
        d.start()
        lost = d.cli("campaign", "submit", str(path), "--json", check=False, timeout=60)
        _killed(d)
        assert lost.returncode != 0, lost.stdout
        # 2. Killed right after the second canary's sbatch answered, before the journal
        # knew its job: the restarted daemon finds that job by its name.
        d.crash_after = "sbatch:2"
        d.start()
        assert _json(d.cli("campaign", "list", "--json").stdout)["campaigns"] == []
        first = d.cli("campaign", "submit", str(path), "--json", check=False, timeout=60)
        assert first.returncode == 0, first.stderr
        campaign = str(_json(first.stdout)["campaign"])
        _killed(d)
        # 3. Killed while the first run is being verified.
        d.crash_after = "verifying"
        d.start()
        _killed(d)
        d.crash_after = None
        d.start()
        done = d.cli("campaign", "wait", campaign, "--json", check=False, timeout=600)
        assert done.returncode == 0, done.stdout + d.log_text()[-3000:]
        points = _json(done.stdout)["points"]
        assert isinstance(points, dict) and points["verified"] == 12, points  # none lost
        runs = json.loads(d.cli("list", "--json", "--all").stdout)["runs"]
        assert len(runs) == 4, runs
        for run in runs:  # one Slurm job per run: none submitted twice
            got = d.status(str(run["run"]))
            assert cluster.job_ids_named(str(got["job_name"])) == [str(got["slurm_job_id"])]
    finally:
        d.stop()


QOS = "llmd-test-submit2"


@pytest.mark.slurm_contract
def test_a_qos_submit_limit_below_max_jobs_is_kept_and_no_point_fails(
    daemon: Daemon, cluster: DevCluster, shared_tmp: Path
) -> None:
    # One topology, four recipes, max_jobs 8; root's default QOS lets 2 jobs be queued or
    # running at once, and Slurm enforces it (sbatch would refuse a third).
    text = CAMPAIGN_DEMO.read_text().replace("max_jobs = 2", "max_jobs = 8")
    text = text.replace("[[64, 16], [128, 32]]", "[[64, 16], [96, 16], [128, 32], [160, 32]]")
    path = _files(shared_tmp, text[: text.index("[[zip]]")], port=8360)

    def sacctmgr(*args: str) -> None:
        cluster.slurm(["sacctmgr", "-i", *args])

    sacctmgr("add", "qos", QOS, "MaxSubmitJobsPerUser=2")
    try:
        sacctmgr("modify", "user", "where", "name=root", "set", f"qos+={QOS}", f"defaultqos={QOS}")
        devcluster("limits", "enforce")
        done = daemon.cli("campaign", "submit", str(path), "--wait", "--json", timeout=600)
    finally:
        devcluster("limits", "relax")
        sacctmgr("modify", "user", "where", "name=root", "set", f"qos-={QOS}", "defaultqos=-1")
        sacctmgr("delete", "qos", QOS)
    final = _json(done.stdout)
    assert isinstance(final["points"], dict) and final["points"]["verified"] == 12, final
    assert daemon.events("campaign.submit_limit")[0]["limit"] == 2
    runs = json.loads(daemon.cli("list", "--json", "--all").stdout)["runs"]
    job_ids = [str(daemon.status(str(r["run"]))["slurm_job_id"]) for r in runs]
    assert len(job_ids) == 4
    assert _most_at_once(cluster, job_ids, since="Submit") <= 2


FAIR_QOS = "llmd-test-fair2"
FAIR_ROOM = 2  # the account's submit limit: one job of share for each of two users
FAIR = """
name = "{name}"
base = "base.toml"
[limits]
max_jobs = 8
[matrix]
"topology.decode_nodes" = [1]
"topology.prefill_nodes" = [1]
"topology.prefill_workers" = [1]
"benchmark.isl_osl" = {isl_osl}
"benchmark.concurrencies" = [[1]]
"slurm.extra_args" = [["--exclusive"]]
"""


def test_two_users_campaigns_share_the_accounts_submit_limit_in_turns(
    cluster: DevCluster, root_dir: Path, shared_tmp: Path, stranger: Stranger
) -> None:
    # Root's default QOS lets the daemon's account have 2 jobs queued or running; root's
    # campaign (6 jobs) takes both before the stranger's (3 jobs, over its own control
    # socket connection) comes. From then on each user's share is 1: neither gets a new
    # job while it holds its share and the other has work waiting, and the stranger's
    # jobs run while root's campaign still has work, not after it.
    logs = shared_tmp / "runs"
    logs.mkdir(mode=0o777)
    logs.chmod(0o777)
    base = demo_spec(logs, port=8380)
    (shared_tmp / "base.toml").write_text(base)
    mine = shared_tmp / "mine.toml"
    mine.write_text(FAIR.format(name="fair-root", isl_osl=[[64 + 8 * i, 16] for i in range(6)]))
    theirs = FAIR.format(name="fair-other", isl_osl=[[512 + 8 * i, 32] for i in range(3)])
    d = Daemon(cluster, root_dir, daemon_keys=f'socket_group = "{stranger.name}"')

    def sacctmgr(*args: str) -> None:
        cluster.slurm(["sacctmgr", "-i", *args])

    sacctmgr("add", "qos", FAIR_QOS, f"MaxSubmitJobsPerUser={FAIR_ROOM}")
    try:
        sacctmgr("modify", "user", "where", "name=root", "set", f"qos+={FAIR_QOS}")
        sacctmgr("modify", "user", "where", "name=root", "set", f"defaultqos={FAIR_QOS}")
        devcluster("limits", "enforce")
        d.start()
        sub = d.cli("campaign", "submit", str(mine), "--json")
        root_campaign = str(_json(sub.stdout)["campaign"])
        deadline = time.monotonic() + 120
        while _holding(d, root_campaign) < FAIR_ROOM:  # its canary done, the room its
            assert time.monotonic() < deadline, d.log_text()[-3000:]
            time.sleep(0.2)
        plan = {
            "file_text": theirs,
            "base_text": base,
            "name": "fair-other",
            "file_path": "fair-other.toml",
            "file_dir": None,
            "cluster": None,
            "max_points": 100,
            "rerun": False,
            "export_env_json": None,
        }
        reply = stranger.ask(d.socket, "campaign_submit", dry_run=False, **plan)
        result = reply.get("result")
        assert isinstance(result, dict), reply
        other_campaign = str(result["campaign"])
        for campaign in (root_campaign, other_campaign):
            done = d.cli("campaign", "wait", campaign, "--json", check=False, timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr + d.log_text()[-3000:]
            assert _json(done.stdout)["state"] == "finished", done.stdout
        runs = json.loads(d.cli("list", "--json", "--all").stdout)["runs"]
        owners = {str(r["slurm_job_id"]): int(r["owner_uid"]) for r in runs}
    finally:
        d.stop()
        devcluster("limits", "relax")
        sacctmgr("modify", "user", "where", "name=root", "set", f"qos-={FAIR_QOS}", "defaultqos=-1")
        sacctmgr("delete", "qos", FAIR_QOS)
    assert d.events("campaign.submit_limit")[0]["limit"] == FAIR_ROOM
    assert d.events("campaign.qos_refusal") == []  # never over the account's limit

    # Every job as Slurm's accounting saw it, in submission order, with its run's owner.
    rows = cluster.slurm(
        ["sacct", "-X", "-n", "-P", "-j", ",".join(owners), "--format=JobIDRaw,Submit,End"]
    ).stdout.split()
    jobs = sorted(
        (datetime.fromisoformat(s), int(i), datetime.fromisoformat(e), owners[i])
        for i, s, e in (r.split("|") for r in rows)
    )
    total = {0: 6, stranger.uid: 3}
    assert sorted(u for *_, u in jobs) == sorted([0] * 6 + [stranger.uid] * 3)
    for n, (t, job_id, _, uid) in enumerate(jobs):
        # Queued at its submission: submitted before it and not ended (sacct's times have
        # 1 s resolution: a job that ended in the same second counts as ended).
        held = {u: sum(1 for s, _, e, w in jobs[:n] if w == u and e > t) for u in total}
        submitted = {u: sum(1 for *_, w in jobs[:n] if w == u) for u in total}
        assert sum(held.values()) < FAIR_ROOM, (job_id, held)
        other = stranger.uid if uid == 0 else 0
        waiting = held[other] + total[other] - submitted[other]
        if submitted[other] >= 2 and waiting >= 1:  # the other past its canary, with work
            assert held[uid] < 1, f"job {job_id} of uid {uid} came while it held {held}"
    # The stranger's jobs did not wait for root's campaign to end: its second job came
    # before root's last one.
    order = [u for *_, u in jobs]
    last_root = len(order) - 1 - order[::-1].index(0)
    assert [n for n, u in enumerate(order) if u == stranger.uid][1] < last_root, order
