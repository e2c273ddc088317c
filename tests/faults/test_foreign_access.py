"""`adopt` by a user who may not (issue 3.2, item 8), against the real daemon on a replayed
cluster: a job another user's run already holds, and a job of another user that no run
holds, are both answered `not_found` with the same sentence, which names neither the
owner, nor the run, nor that the job is supervised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon
from tests.fakes.replay_world import ReplayWorld
from tests.foreign_helpers import adopt, sbatch_plain_replayed
from tests.strangers import Stranger

pytestmark = pytest.mark.timeout(120)


def test_a_strangers_adopt_of_a_held_or_foreign_job_is_not_found(
    world: ReplayWorld, tmp_path: Path, root_dir: Path, stranger: Stranger
) -> None:
    daemon = Daemon(
        world,
        root_dir,
        replay_socket=world.socket,
        daemon_keys=f'socket_group = "{stranger.name}"',
    )
    daemon.start()
    try:
        held_dir, free_dir = tmp_path / "held", tmp_path / "free"
        held = sbatch_plain_replayed(world, held_dir)
        mine = adopt(daemon, held, held_dir)  # root's job, adopted by root: its run
        assert mine.returncode == 0, mine.stderr
        run = str(json.loads(mine.stdout)["run"])
        free = sbatch_plain_replayed(world, free_dir)  # root's, no run holds it

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
