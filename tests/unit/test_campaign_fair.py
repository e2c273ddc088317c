"""Fair room among users' campaigns (issue 4.1, item 5) through a daemon process on a
replayed cluster: root (the command line) and a stranger (its own control-socket peer)
run campaigns that compete for the room under the account's submit limit. The replayed
cluster's record of every job's submission and end shows the jobs each user held over
time: no user got a new job while it held its share and the other had work waiting, the
daemon never went over the account's limit, and ``[limits] per_user_max_jobs`` capped a
user alone. The table tests of the decision itself are tests/unit/test_campaign_share.py."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, demo_spec
from tests.fakes.replay_world import ReplayWorld
from tests.strangers import Stranger

pytestmark = pytest.mark.timeout(240)

ROOM = 4  # the account's submit limit (the QOS's MaxSubmitJobsPerUser)
PER_USER = 3  # [limits] per_user_max_jobs
SHARE = 2  # each user's share of ROOM when both have at least that much work
LONG_S = 3600.0  # a job's run time while the test holds it
SHORT_S = 1.5  # the replayed demo's

CAMPAIGN = """
name = "{name}"
base = "base.toml"
[limits]
max_jobs = 8
[matrix]
"benchmark.isl_osl" = {isl_osl}
"benchmark.concurrencies" = [[1, 2, 4]]
"""
# Distinct recipes per user: root (who sees every run) never reuses the stranger's points.
ROOT_JOBS = [[64 + 8 * i, 16] for i in range(7)]
STRANGER_JOBS = [[512 + 8 * i, 32] for i in range(5)]


@dataclass(frozen=True)
class Held:
    """One job of the replayed cluster, whose it is and when it was queued."""

    job_id: str
    uid: int
    submitted: datetime
    ended: datetime | None


@pytest.fixture
def logs() -> Iterator[Path]:
    """A log directory both users' runs may write (outside the daemon's root)."""
    d = Path(tempfile.mkdtemp(prefix="llmd-logs-", dir="/var/tmp"))
    d.chmod(0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(world: ReplayWorld, root_dir: Path, stranger: Stranger) -> Iterator[Daemon]:
    def limit() -> None:
        world.cluster.max_submit = ROOM

    world.call(limit)
    d = Daemon(
        world,
        root_dir,
        replay_socket=world.socket,
        daemon_keys=f'socket_group = "{stranger.name}"',
        limits={"per_user_max_jobs": PER_USER},
    )
    d.start()
    try:
        yield d
    finally:
        d.stop()


def _until(what: str, check: Callable[[], bool], daemon: Daemon, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout:g} s: {daemon.log_text()[-3000:]}")
        time.sleep(0.1)


def _stranger_submits(stranger: Stranger, daemon: Daemon, base: str) -> str:
    """The stranger's campaign, over its own control-socket connection: its id."""
    plan = {
        "file_text": CAMPAIGN.format(name="fair-other", isl_osl=STRANGER_JOBS),
        "base_text": base,
        "name": "fair-other",
        "file_path": "fair-other.toml",
        "file_dir": None,
        "cluster": None,
        "max_points": 100,
        "rerun": False,
        "export_env_json": None,
    }
    reply = stranger.ask(daemon.socket, "campaign_submit", dry_run=False, **plan)
    result = reply.get("result")
    assert isinstance(result, dict), reply
    return str(result["campaign"])


def _owners(daemon: Daemon) -> dict[str, int]:
    """Slurm job name -> the uid of its run's owner, for every run of the daemon."""
    runs = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
    return {str(r["job_name"]): int(r["owner_uid"]) for r in runs}


def _jobs(world: ReplayWorld, daemon: Daemon) -> list[Held]:
    """Every job the replayed cluster was given, in submission order, with its owner."""
    seen = world.call(
        lambda: [
            (j.job_id, j.name, j.submitted_at, j.ended_at) for j in world.cluster.jobs.values()
        ]
    )
    owners = _owners(daemon)
    return [Held(i, owners.get(n, -1), s, e) for i, n, s, e in seen]


def _holding(world: ReplayWorld, daemon: Daemon, uid: int) -> list[str]:
    """The ids of `uid`'s jobs pending or running now."""
    return [h.job_id for h in _jobs(world, daemon) if h.uid == uid and h.ended is None]


def _set_running_s(world: ReplayWorld, seconds: float) -> None:
    def set_it() -> None:
        world.running_s = seconds

    world.call(set_it)


def _scripted(world: ReplayWorld, count: int) -> bool:
    """Whether the world gave its timeline to each of the first `count` jobs."""

    def look() -> bool:
        jobs = list(world.cluster.jobs.values())
        return len(jobs) >= count and all(
            j.steps_left or j.state.is_terminal or j.nodes for j in jobs[:count]
        )

    return world.call(look)


def _release(world: ReplayWorld, job_id: str) -> bool:
    """Let a held job finish now (False: it has not come to its long wait yet)."""

    def release() -> bool:
        steps = world.cluster.jobs[job_id].steps_left
        if not any(s.after >= LONG_S for s in steps):
            return True  # not held (scripted after the hold, or done)
        if steps[0].after < LONG_S:
            return False  # still starting
        world.cluster.step(job_id)  # the coordinator's results and marker; its end follows
        return True

    return world.call(release)


def _campaign_jobs(daemon: Daemon, campaign: str) -> dict[str, int]:
    status = json.loads(daemon.cli("campaign", "status", campaign, "--json").stdout)
    jobs = status["jobs"]
    assert isinstance(jobs, dict)
    return {str(k): int(v) for k, v in jobs.items()}


def _at(h: Held, t: datetime, order: int, index: dict[str, int]) -> bool:
    """Whether job `h` was queued when the job at position `order` was submitted at `t`."""
    return index[h.job_id] < order and (h.ended is None or h.ended > t)


def test_two_users_share_the_account_room_and_neither_gets_a_job_over_its_share(
    daemon: Daemon, world: ReplayWorld, tmp_path: Path, stranger: Stranger, logs: Path
) -> None:
    base = demo_spec(logs)
    (tmp_path / "base.toml").write_text(base)
    mine = tmp_path / "mine.toml"
    mine.write_text(CAMPAIGN.format(name="fair-root", isl_osl=ROOT_JOBS))

    # Root alone: its canary runs as the demo's do; every later job is held until the
    # test lets it go. With the room at 4, root holds 3: its per_user_max_jobs.
    sub = daemon.cli("campaign", "submit", str(mine), "--json")
    root_campaign = str(json.loads(sub.stdout)["campaign"])
    _until("root's canary scripted", lambda: _scripted(world, 1), daemon)
    _set_running_s(world, LONG_S)
    _until("root holding 3", lambda: len(_holding(world, daemon, 0)) == PER_USER, daemon)

    # The stranger's campaign, through its own control-socket connection. Its canary takes
    # the one job of room left and runs as the demo's; its later jobs are held too.
    _set_running_s(world, SHORT_S)
    other_campaign = _stranger_submits(stranger, daemon, base)
    _until("the stranger's canary scripted", lambda: _scripted(world, PER_USER + 2), daemon)
    _set_running_s(world, LONG_S)
    uid = stranger.uid
    _until(
        "the stranger's canary verified",
        lambda: _campaign_jobs(daemon, other_campaign).get("succeeded") == 1,
        daemon,
    )
    # Root holds 3, over its share of 2: the stranger gets the one free job at once...
    _until("the stranger holding 1", lambda: len(_holding(world, daemon, uid)) == 1, daemon)
    # ... and the job root frees (root then holds its share): root gets none of it.
    first = _holding(world, daemon, 0)[0]
    _until("a root job released", lambda: _release(world, first), daemon)
    _until("the stranger holding 2", lambda: len(_holding(world, daemon, uid)) == SHARE, daemon)
    # The stranger frees one: it is the stranger's turn again, root holds its share.
    theirs = _holding(world, daemon, uid)[0]
    _until("a stranger's job released", lambda: _release(world, theirs), daemon)
    _until(
        "the stranger holding 2 again",
        lambda: (
            len(_holding(world, daemon, uid)) == SHARE
            and theirs not in _holding(world, daemon, uid)
        ),
        daemon,
    )

    # Then every job runs as the demo's do, both campaigns to their end.
    _set_running_s(world, SHORT_S)
    for job_id in [h.job_id for h in _jobs(world, daemon) if h.ended is None]:
        _until(f"job {job_id} released", functools.partial(_release, world, job_id), daemon)
    for campaign in (root_campaign, other_campaign):
        done = daemon.cli("campaign", "wait", campaign, "--json", check=False, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr + daemon.log_text()[-3000:]
        assert json.loads(done.stdout)["state"] == "finished"

    # The whole history, as the replayed cluster saw it.
    jobs = _jobs(world, daemon)
    total = {0: len(ROOT_JOBS), uid: len(STRANGER_JOBS)}
    assert sorted(h.uid for h in jobs) == sorted([0] * total[0] + [uid] * total[uid])
    assert daemon.events("campaign.qos_refusal") == []  # never over the account's limit
    index = {h.job_id: n for n, h in enumerate(jobs)}
    most = {0: 0, uid: 0}
    for n, new in enumerate(jobs):
        t = new.submitted
        held = {u: sum(1 for h in jobs if h.uid == u and _at(h, t, n, index)) for u in total}
        submitted = {u: sum(1 for h in jobs[:n] if h.uid == u) for u in total}
        assert sum(held.values()) < ROOM, f"job {new.job_id} went over the room: {held}"
        assert held[new.uid] < PER_USER, f"job {new.job_id} went over per_user_max_jobs"
        most[new.uid] = max(most[new.uid], held[new.uid] + 1)
        other = uid if new.uid == 0 else 0
        # The other user's work: what it holds and has still to submit (the daemon saw at
        # least this much), once past its canary (its second job submitted).
        waiting = held[other] + total[other] - submitted[other]
        if submitted[other] >= 2 and waiting >= SHARE:
            assert held[new.uid] < SHARE, (
                f"job {new.job_id} of uid {new.uid} was submitted while it held {held}, its"
                f" share being {SHARE} and uid {other} having {waiting} jobs of work"
            )
    assert most[0] == PER_USER and most[uid] >= SHARE, most


def test_room_a_campaign_cannot_use_goes_to_the_other_user(
    daemon: Daemon, world: ReplayWorld, tmp_path: Path, stranger: Stranger, logs: Path
) -> None:
    # Root's campaign may hold 1 job at once (its max_jobs): root wants 1 of the room, not
    # its 3 jobs, so the stranger's campaign gets the other 3 (its per_user_max_jobs).
    base = demo_spec(logs)
    (tmp_path / "base.toml").write_text(base)
    mine = tmp_path / "mine.toml"
    text = CAMPAIGN.format(name="fair-root", isl_osl=ROOT_JOBS[:3])
    mine.write_text(text.replace("max_jobs = 8", "max_jobs = 1"))
    _set_running_s(world, LONG_S)
    sub = daemon.cli("campaign", "submit", str(mine), "--json")
    root_campaign = str(json.loads(sub.stdout)["campaign"])
    _until("root's canary scripted", lambda: _scripted(world, 1), daemon)
    _set_running_s(world, SHORT_S)
    other_campaign = _stranger_submits(stranger, daemon, base)
    _until("the stranger's canary scripted", lambda: _scripted(world, 2), daemon)
    _set_running_s(world, LONG_S)
    uid = stranger.uid
    _until("the stranger holding 3", lambda: len(_holding(world, daemon, uid)) == 3, daemon)
    assert len(_holding(world, daemon, 0)) == 1

    _set_running_s(world, SHORT_S)
    for job_id in [h.job_id for h in _jobs(world, daemon) if h.ended is None]:
        _until(f"job {job_id} released", functools.partial(_release, world, job_id), daemon)
    for campaign in (root_campaign, other_campaign):
        done = daemon.cli("campaign", "wait", campaign, "--json", check=False, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr + daemon.log_text()[-3000:]
        assert json.loads(done.stdout)["state"] == "finished"
    assert daemon.events("campaign.qos_refusal") == []
