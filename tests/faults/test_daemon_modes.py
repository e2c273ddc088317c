"""A per-user daemon started by hand (issue 3.2, item 10): whatever umask its shell left
it (022 here), what it writes is its user's alone: its umask is 077, the control socket
is 0600 when the config names no group, and nothing under its state directory (journal,
lock, every file of a run's archive) has a group or other bit. Against a replayed
cluster (tests/fakes/replay_world.py), so the run has a whole archive. A socket mode with
group rights but no group named is kept, and said (the group is the daemon's own)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, NoCluster, demo_spec
from tests.fakes.replay_world import ReplayWorld

pytestmark = pytest.mark.timeout(180)


def _umask(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"/proc/{pid}/status has no Umask")


def test_a_daemon_started_under_umask_022_keeps_what_it_writes_private(
    world: ReplayWorld, tmp_path: Path
) -> None:
    root = tmp_path / "daemon"  # the logs may not lie inside the daemon's directory
    root.mkdir()
    daemon = Daemon(world, root, replay_socket=world.socket)
    old = os.umask(0o022)  # a login shell's
    try:
        daemon.start()
    finally:
        os.umask(old)
    try:
        assert daemon.proc is not None
        assert _umask(daemon.proc.pid) == 0o077
        assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600
        submitted = daemon.submit(demo_spec(tmp_path / "logs"))
        assert submitted.returncode == 0, submitted.stderr
        run = str(json.loads(submitted.stdout)["run"])
        final = json.loads(daemon.cli("wait", run, "--json", check=False).stdout)
        assert final["outcome"] == "succeeded", final["reason"]
    finally:
        daemon.stop()
    archive = Path(str(final["archive"]))
    assert (archive / "receipt.json").is_file() and any((archive / "logs").rglob("*.out"))
    written = [daemon.state_dir, *daemon.state_dir.rglob("*")]
    loose = [(str(p), oct(stat.S_IMODE(p.lstat().st_mode))) for p in written]
    assert [(p, m) for p, m in loose if int(m, 8) & 0o077] == []


def test_group_rights_without_a_group_are_said_at_start(tmp_path: Path) -> None:
    daemon = Daemon(NoCluster(tmp_path), tmp_path, daemon_keys='socket_mode = "0660"')
    daemon.start()
    try:
        st = daemon.socket.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, os.getgid())
    finally:
        daemon.stop()
    (warned,) = daemon.events("control.socket_group_implicit")
    assert (warned["mode"], warned["gid"]) == ("0660", os.getgid())
    assert "daemon.socket_group" in str(warned["hint"])
