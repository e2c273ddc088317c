"""Exactly once for the users' own jobs (issue 2.5): SIGKILL the daemon right after a
transition of a `submit --script` run or an adopted job is journaled, restart it, and
check: one Slurm job per script, one run per adopted job, the right outcome, log copies
byte-identical.

They run against a replayed cluster and the in-process SSH server (tests/fakes/
replay_world.py), whose jobs leave what the launcher leaves; one (a crash before the
script's sbatch answered) runs on the real dev cluster too."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmd_supervisor.core.spec.runspec import load_spec
from tests.daemon_helpers import Daemon
from tests.devcluster import REPO, DevCluster
from tests.fakes.replay_world import ReplayWorld, replay_world
from tests.foreign_helpers import (
    adopt,
    assert_copies_of,
    final,
    launcher_finish,
    sbatch_plain,
    sbatch_plain_replayed,
    submit_script,
)

# (how the run came, the state journaled just before the kill)
CRASH_POINTS = [
    ("script", "submitting"),
    ("script", "pending"),
    ("script", "verifying"),
    ("adopt", "pending"),  # the adopted run's first record: before the client heard back
    ("adopt", "running"),
    ("adopt", "archiving"),
]


@pytest.fixture
def launcher_world(tmp_path: Path) -> Iterator[ReplayWorld]:
    """A replayed site whose jobs end as the launcher's do."""
    benchmark = load_spec((REPO / "deploy" / "llm-d" / "demo.toml").read_text()).benchmark
    with replay_world(tmp_path / "world", benchmark, finish=launcher_finish) as world:
        yield world


def crash_then_restart(
    daemon: Daemon,
    run_dir: Path,
    how: str,
    sbatch: Callable[[Path], str],
    job_ids_named: Callable[[str], list[str]],
) -> None:
    """Bring a run of the launcher (`how`: script or adopt) to the daemon, which kills
    itself at its crash point; restart it and check the run as the module says."""
    daemon.start()
    if how == "script":
        run_dir.mkdir()
        submit_script(daemon, run_dir)  # may fail once the daemon has killed itself
    else:
        job_id = sbatch(run_dir)
        adopt(daemon, job_id, run_dir)
    assert daemon.proc is not None
    daemon.proc.wait(timeout=120)
    assert daemon.proc.returncode == -9, daemon.log_text()[-2000:]

    daemon.crash_after = None
    daemon.start()
    runs = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
    if how == "adopt":
        again = adopt(daemon, job_id, run_dir)  # the client did not hear back: it asks again
        assert again.returncode == 0, again.stderr
        runs = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
        assert [r["run"] for r in runs] == [json.loads(again.stdout)["run"]]
    assert len(runs) == 1, runs
    got = final(daemon, str(runs[0]["run"]))
    assert got["outcome"] == "succeeded", got["reason"]
    if how == "script":
        ids = job_ids_named(str(got["job_name"]))
        assert ids == [str(got["slurm_job_id"])], f"{got['job_name']}: Slurm jobs {ids}"
    assert assert_copies_of(got, run_dir)
    receipt = json.loads((Path(str(got["archive"])) / "receipt.json").read_text())
    assert receipt["outcome"] == "succeeded"
    daemon.stop()


@pytest.mark.parametrize(("how", "state"), CRASH_POINTS, ids=[f"{h}-{s}" for h, s in CRASH_POINTS])
def test_sigkill_after_transition_then_restart_replayed(
    launcher_world: ReplayWorld, tmp_path: Path, how: str, state: str
) -> None:
    root = tmp_path / "daemon"  # the logs may not lie inside the daemon's directory
    root.mkdir()
    daemon = Daemon(launcher_world, root, crash_after=state, replay_socket=launcher_world.socket)
    crash_then_restart(
        daemon,
        tmp_path / "ix",
        how,
        lambda run_dir: sbatch_plain_replayed(launcher_world, run_dir),
        launcher_world.job_ids_named,
    )


def test_sigkill_before_the_scripts_sbatch_answered_then_restart(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    # The real cluster's share: the restarted daemon finds the script's job by its name in
    # what Slurm lists, and never submits it again.
    daemon = Daemon(cluster, tmp_path, crash_after="submitting")
    crash_then_restart(
        daemon,
        shared_tmp / "ix",
        "script",
        lambda run_dir: sbatch_plain(cluster, run_dir, lines=30),
        cluster.job_ids_named,
    )
