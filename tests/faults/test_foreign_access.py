"""`adopt` by a user who may not (issue 3.2, item 8), against the real daemon on a replayed
cluster: a job another user's run already holds, and a job of another user that no run
holds, are both answered `not_found` with the same sentence, which names neither the
owner, nor the run, nor that the job is supervised."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd_supervisor.core.spec import load_spec
from tests.daemon_helpers import Daemon
from tests.devcluster import REPO
from tests.fakes.replay_world import ReplayWorld, replay_world
from tests.foreign_helpers import adopt, launcher_finish, sbatch_plain_replayed
from tests.strangers import Stranger

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def launcher_world(tmp_path: Path) -> Iterator[ReplayWorld]:
    benchmark = load_spec((REPO / "deploy" / "llm-d" / "demo.toml").read_text()).benchmark
    with replay_world(tmp_path / "world", benchmark, finish=launcher_finish) as world:
        yield world


def test_a_strangers_adopt_of_a_held_or_foreign_job_is_not_found(
    launcher_world: ReplayWorld, tmp_path: Path, root_dir: Path, stranger: Stranger
) -> None:
    daemon = Daemon(
        launcher_world,
        root_dir,
        replay_socket=launcher_world.socket,
        daemon_keys=f'socket_group = "{stranger.name}"',
    )
    daemon.start()
    try:
        held_dir, free_dir = tmp_path / "held", tmp_path / "free"
        held = sbatch_plain_replayed(launcher_world, held_dir)
        mine = adopt(daemon, held, held_dir)  # root's job, adopted by root: its run
        assert mine.returncode == 0, mine.stderr
        run = str(json.loads(mine.stdout)["run"])
        free = sbatch_plain_replayed(launcher_world, free_dir)  # root's, no run holds it

        errors = {}
        for job, log_dir in ((held, held_dir), (free, free_dir)):
            spec = {"foreign": {"kind": "adopt", "job_id": job, "log_dir": str(log_dir)}}
            reply = stranger.ask(daemon.socket, "adopt", spec_json=json.dumps(spec))
            error = reply.get("error")
            assert isinstance(error, dict), reply
            assert error["code"] == "not_found", reply
            message = str(error["message"])
            for secret in ("uid", "belongs", run, "root", "supervis"):
                assert secret not in message, message
            errors[job] = message
        # One sentence for both: which of them a run holds does not show.
        assert errors[held].replace(held, "J") == errors[free].replace(free, "J")
        assert errors[held].startswith(f"No job {held} ")

        listed = json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"]
        assert [r["run"] for r in listed] == [run]  # no run was made for the stranger
    finally:
        daemon.stop()
