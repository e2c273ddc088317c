"""Which verified points a campaign may reuse (issue 4.1, item 3), through a daemon process
on a replayed cluster: only a point proven by a run its submitter may see (own runs; root
and the admin group see all), and only when the archived result passes this campaign's
own validity gate, judged again from the archived bytes. The dry run says why each point
is or is not reused."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, demo_spec
from tests.fakes.bench_results import vllm_result
from tests.fakes.replay_world import ReplayWorld
from tests.fakes.slurm_replay import ReplayJob
from tests.strangers import Stranger

pytestmark = pytest.mark.timeout(240)

# One recipe, two points; the gate as each campaign asks it.
CAMPAIGN = """
name = "gate-{name}"
base = "base.toml"
[limits]
max_jobs = 1
[matrix]
"benchmark.concurrencies" = [[1, 2]]
"benchmark.validity.min_completed_fraction" = [{fraction}]
"""


def _half_done(job: ReplayJob, log_dir: Path) -> None:
    """The coordinator's end, with half of each point's requests completed (the demo asks
    4 x concurrency)."""
    bench = log_dir / job.job_id / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    for c in (1, 2):
        (bench / f"c{c}.json").write_bytes(vllm_result(c, 4 * c, completed=2 * c))
    now = datetime.now(UTC).isoformat()
    marker = {"rc": 0, "job_id": job.job_id, "rank": 2, "reason": "ok", "finished_at": now}
    (log_dir / f".bench_done.{job.job_id}").write_text(json.dumps(marker))


@pytest.fixture
def daemon(world: ReplayWorld, root_dir: Path, stranger: Stranger) -> Iterator[Daemon]:
    def half() -> None:
        world.finish = _half_done

    world.call(half)
    d = Daemon(
        world,
        root_dir,
        replay_socket=world.socket,
        daemon_keys=f'socket_group = "{stranger.name}"',
    )
    d.start()
    try:
        yield d
    finally:
        d.stop()


def _plan(text: str, base: str, name: str) -> dict[str, object]:
    return {
        "file_text": text,
        "base_text": base,
        "name": name,
        "file_path": f"{name}.toml",
        "file_dir": None,
        "cluster": None,
        "max_points": 100,
        "rerun": False,
        "export_env_json": None,
    }


def _reuse(reply: dict[str, object]) -> list[dict[str, object]]:
    """The one job's points as the dry run tells them (concurrency, run, why)."""
    result = reply.get("result")
    assert isinstance(result, dict), reply
    jobs = result["job_list"]
    assert isinstance(jobs, list) and len(jobs) == 1
    notes = jobs[0]["reuse"]
    assert isinstance(notes, list)
    return notes


@pytest.fixture
def logs() -> Iterator[Path]:
    """A log directory both users' runs may write (outside the daemon's root)."""
    d = Path(tempfile.mkdtemp(prefix="llmd-logs-", dir="/var/tmp"))
    d.chmod(0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_point_is_reused_only_from_a_visible_run_whose_result_passes_this_gate(
    daemon: Daemon, world: ReplayWorld, tmp_path: Path, stranger: Stranger, logs: Path
) -> None:
    base = demo_spec(logs)
    (tmp_path / "base.toml").write_text(base)
    lax = tmp_path / "lax.toml"
    lax.write_text(CAMPAIGN.format(name="lax", fraction=0.01))
    strict = tmp_path / "strict.toml"
    strict.write_text(CAMPAIGN.format(name="strict", fraction=0.95))

    # Root's campaign with a lax gate verifies both points (2 of 4 requests is enough).
    done = daemon.cli("campaign", "submit", str(lax), "--wait", check=False, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr + daemon.log_text()[-3000:]
    assert "finished; 2 verified" in done.stdout, done.stdout
    assert len(world.sbatch_names()) == 1
    listed = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
    run = str(listed[0]["run"])

    # The same lax gate again, by root: both reused, and the dry run names the run.
    again = json.loads(daemon.cli("campaign", "submit", str(lax), "--dry-run", "--json").stdout)
    notes = again["job_list"][0]["reuse"]
    assert [(n["concurrency"], n["run"]) for n in notes] == [(1, run), (2, run)], notes
    assert again["reused_points"] == 2

    # A stranger asking the same lax gate may not see root's run: nothing reused, said so.
    text = CAMPAIGN.format(name="theirs", fraction=0.01)
    reply = stranger.ask(daemon.socket, "campaign_submit", dry_run=True, **_plan(text, base, "t"))
    notes = _reuse(reply)
    assert [n["run"] for n in notes] == [None, None], notes
    for n in notes:
        assert "not visible to you" in str(n["why"]), notes
        assert run in str(n["why"]), notes
    result = reply["result"]
    assert isinstance(result, dict) and result["reused_points"] == 0

    # Root (who sees every run) with the strict gate: the archived result fails it.
    dry = daemon.cli("campaign", "submit", str(strict), "--dry-run")
    assert "0 points verified" in dry.stdout, dry.stdout
    assert "4 of 8 requests completed (min 8)" in dry.stdout, dry.stdout
    strict_plan = json.loads(
        daemon.cli("campaign", "submit", str(strict), "--dry-run", "--json").stdout
    )
    assert [n["run"] for n in strict_plan["job_list"][0]["reuse"]] == [None, None]

    # Submitted, the strict campaign runs its points itself (its run fails its gate) and
    # its results show its own run, never root's lax one.
    ran = daemon.cli("campaign", "submit", str(strict), "--wait", "--json", check=False)
    assert ran.returncode == 10, ran.stdout + ran.stderr
    assert len(world.sbatch_names()) == 2
    campaign = json.loads(ran.stdout)["campaign"]
    rows = json.loads(daemon.cli("campaign", "results", campaign, "--json").stdout)["points"]
    assert rows and all(r["run"] != run for r in rows), rows


def test_a_users_own_proof_of_a_point_another_user_proved_first_is_kept_and_reused(
    daemon: Daemon, world: ReplayWorld, tmp_path: Path, stranger: Stranger, logs: Path
) -> None:
    # Root proves both points first; the stranger, who may not see root's run, runs them
    # itself. The ledger keeps both proofs: the stranger's next campaign reuses its own
    # run (nothing is paid twice), and root's reuses root's.
    base = demo_spec(logs)
    text = CAMPAIGN.format(name="shared", fraction=0.01)
    (tmp_path / "base.toml").write_text(base)
    path = tmp_path / "shared.toml"
    path.write_text(text)
    done = daemon.cli("campaign", "submit", str(path), "--wait", check=False, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr + daemon.log_text()[-3000:]
    assert len(world.sbatch_names()) == 1
    mine = str(json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"][0]["run"])

    def submit(name: str, *, dry_run: bool) -> dict[str, object]:
        reply = stranger.ask(
            daemon.socket, "campaign_submit", dry_run=dry_run, **_plan(text, base, name)
        )
        result = reply.get("result")
        assert isinstance(result, dict), reply
        return result

    def wait(campaign: str) -> list[dict[str, object]]:
        """The campaign's points once it finished (root may read any campaign's)."""
        ended = daemon.cli("campaign", "wait", campaign, "--json", check=False, timeout=180)
        assert ended.returncode == 0, ended.stdout + ended.stderr + daemon.log_text()[-3000:]
        rows = json.loads(daemon.cli("campaign", "results", campaign, "--json").stdout)
        assert isinstance(rows["points"], list)
        return rows["points"]

    first = wait(str(submit("theirs-1", dry_run=False)["campaign"]))
    assert len(world.sbatch_names()) == 2  # root's run was not the stranger's to reuse
    runs = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
    theirs = {str(r["run"]) for r in runs if r["owner_uid"] == stranger.uid}
    assert len(theirs) == 1 and mine not in theirs
    (their_run,) = theirs
    assert [(r["concurrency"], r["run"]) for r in first] == [(1, their_run), (2, their_run)]

    # The stranger's next campaign: both points reused from its own run, none run again.
    dry = submit("theirs-2", dry_run=True)
    notes = dry["job_list"]
    assert isinstance(notes, list)
    assert [(n["concurrency"], n["run"]) for n in notes[0]["reuse"]] == [
        (1, their_run),
        (2, their_run),
    ], notes
    second = wait(str(submit("theirs-2", dry_run=False)["campaign"]))
    assert len(world.sbatch_names()) == 2
    assert [(r["concurrency"], r["run"], r["state"]) for r in second] == [
        (1, their_run, "reused"),
        (2, their_run, "reused"),
    ], second

    # Root's own campaign again still reuses root's first proof.
    again = json.loads(daemon.cli("campaign", "submit", str(path), "--dry-run", "--json").stdout)
    assert [(n["concurrency"], n["run"]) for n in again["job_list"][0]["reuse"]] == [
        (1, mine),
        (2, mine),
    ]
