"""Waiting clients survive daemon restarts (DESIGN.md section 9): `submit --wait --follow`
rides out two SIGTERM restarts of the daemon mid-run, prints the batch log byte for byte
(nothing twice, nothing lost) and exits with the run's outcome."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import DevCluster

PORT = 8740
# The demo's running phase is a few seconds; the marker delay keeps the job running long
# enough for two restarts (each about a second) while the client follows its log.
MARKER_DELAY_S = "8"


def _connected(socket_path: Path) -> int:
    """Connected stream sockets at `socket_path` (the daemon's ends of its clients)."""
    count = 0
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[7] == str(socket_path) and fields[5] == "03":
            count += 1
    return count


def _until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:g} s")
        time.sleep(0.05)


def test_submit_wait_follow_survives_two_daemon_restarts(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    daemon = Daemon(cluster, tmp_path)
    daemon.start()
    spec = tmp_path / "demo.toml"
    spec.write_text(
        demo_spec(shared_tmp, port=PORT, common={"LLMD_FAKE_MARKER_DELAY_S": MARKER_DELAY_S})
    )
    out, err = tmp_path / "client.out", tmp_path / "client.err"
    argv = [sys.executable, "-m", "llmd_supervisor", "submit", str(spec), "--wait", "--follow"]
    argv += ["--socket", str(daemon.socket), "--reconnect-s", "60"]
    with out.open("wb") as o, err.open("wb") as e:
        client = subprocess.Popen(argv, stdout=o, stderr=e, env={**os.environ, **cluster.slurm_env})
    try:
        _until("the client follows the batch log", lambda: out.stat().st_size > 0)
        run = _run(err)
        # Restart only once sacct, too, has the job running: a daemon that resumes while
        # sacct still shows the (running) job PENDING takes it for a requeue (a separate
        # supervision bug, seen as running -> pending and attempt 2 after the restart).
        job = str(daemon.status(run)["slurm_job_id"])
        _until("sacct has the job running", lambda: _sacct_state(cluster, job) == "RUNNING")
        states = []
        for _ in range(2):
            states.append(str(daemon.status(run)["state"]))
            assert daemon.stop(signal.SIGTERM) == 0
            daemon.start()
            # Both of the client's streams (wait and logs) are connected again.
            _until("the client reconnects", lambda: _connected(daemon.socket) >= 2, 30)
        rc = client.wait(timeout=180)
        final = daemon.status(run)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        daemon.stop()
    assert rc == 0, err.read_text() + daemon.log_text()[-3000:]
    assert states == ["running", "running"], "the run ended before both restarts"
    assert final["outcome"] == "succeeded", final["reason"]
    batch = Path(str(final["log_dir"])) / f"{final['job_name']}-{final['slurm_job_id']}.out"
    assert out.read_bytes() == batch.read_bytes()
    text = err.read_text()
    assert "outcome succeeded" in text
    assert "Traceback" not in text
    assert daemon.starts == 3


def _sacct_state(cluster: DevCluster, job_id: str) -> str:
    argv = ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"]
    return cluster.slurm(argv, check=False).stdout.strip()


def _run(err: Path) -> str:
    """The run id from the client's `submitted run R (NAME)` line."""
    for line in err.read_text().splitlines():
        if line.startswith("submitted run "):
            return line.split()[2]
    raise AssertionError(f"no 'submitted run' line in {err.read_text()!r}")
