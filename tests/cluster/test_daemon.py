"""The daemon end to end on the real cluster: submit, supervise over SSH, verify, archive."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, assert_copies_identical, demo_spec
from tests.devcluster import DevCluster, devcluster
from tests.fakes.replay_world import ReplayWorld


@pytest.fixture
def log_dir(shared_tmp: Path) -> Path:
    d = shared_tmp / "runs"
    return d


def _result(proc_stdout: str) -> dict[str, object]:
    data = json.loads(proc_stdout)
    assert isinstance(data, dict)
    return data


def _plant_stale_runs(cluster: DevCluster, log_dir: Path) -> list[str]:
    """What a cluster whose job ids started again at 1 leaves in a reused log directory:
    another job's finished marker (rc 0) and job directory under the ids to come."""
    log_dir.mkdir(parents=True, mode=0o755)
    probe = log_dir / "probe.sh"
    probe.write_text("#!/bin/bash\ntrue\n")
    last = int(cluster.sbatch(probe, f"--output={log_dir}/probe-%j.out"))
    ids = [str(last + i) for i in (1, 2, 3)]
    for job in ids:
        (log_dir / f".bench_done.{job}").write_text(
            json.dumps({"rc": 0, "job_id": job, "rank": 2, "reason": "an older job's"})
        )
        (log_dir / job / "bench").mkdir(parents=True)
    return ids


def test_demo_run_succeeds_with_verified_receipt_and_identical_logs(
    daemon: Daemon, log_dir: Path, cluster: DevCluster
) -> None:
    planted = _plant_stale_runs(cluster, log_dir)
    proc = daemon.submit(demo_spec(log_dir), "--wait")
    assert proc.returncode == 0, proc.stderr + daemon.log_text()[-3000:]
    result = _result(proc.stdout)
    assert result["state"] == result["outcome"] == "succeeded"
    assert "State=COMPLETED ExitCode=0:0" in str(result["reason"])
    assert "marker rc=0 from rank 2" in str(result["reason"])
    job_id = str(result["slurm_job_id"])
    archive = Path(str(result["archive"]))
    receipt = json.loads((archive / "receipt.json").read_text())
    assert receipt["outcome"] == "succeeded" and receipt["job_id"] == job_id
    for name in ("spec.toml", "job.sbatch", "events.jsonl", "marker.json"):
        assert (archive / name).is_file(), name
    names = assert_copies_identical(result)
    assert any(n.endswith(".out") for n in names)
    assert {f"rank{r}.agent.log" for r in range(4)} <= set(names)
    # exactly one job with the run's name
    rows = cluster.job_ids_named(str(result["job_name"]))
    assert rows == [job_id]
    finished = daemon.events("run.finished")
    assert [e["outcome"] for e in finished] == ["succeeded"]
    # The older job's marker under this id was set aside, never taken for this run's.
    assert job_id in planted
    assert json.loads((archive / "marker.json").read_text())["reason"] != "an older job's"
    assert len(list(log_dir.glob(f".bench_done.{job_id}.stale-*"))) == 1
    assert len(list(log_dir.glob(f"{job_id}.stale-*/bench"))) == 1


def test_failing_bench_point_fails_the_run_naming_rc_and_rank(
    daemon: Daemon, log_dir: Path
) -> None:
    spec = demo_spec(log_dir, tables={"bench": {"LLMD_FAKE_BENCH_FAIL_CONCURRENCY": "2"}})
    proc = daemon.submit(spec, "--wait")
    assert proc.returncode == 10, proc.stderr
    result = _result(proc.stdout)
    assert result["outcome"] == "failed"
    assert "rc=7" in str(result["reason"])
    assert str(result["reason"]).endswith("; cause=workload"), result["reason"]
    attempts = result["attempts"]
    assert isinstance(attempts, list) and len(attempts) == 1, attempts
    assert attempts[0]["retry"] == "no retry: cause workload", attempts


@pytest.mark.slurm_contract
def test_cancel_mid_run_terms_every_rank_and_ends_cancelled(daemon: Daemon, log_dir: Path) -> None:
    spec = demo_spec(log_dir, grace_s=8, tables={"bench": {"LLMD_FAKE_BENCH_HANG": "1"}})
    proc = daemon.submit(spec)
    run = str(_result(proc.stdout)["run"])
    status = daemon.wait_state(run, {"running"})
    job_id = str(status["slurm_job_id"])
    deadline = time.monotonic() + 60
    while not (log_dir / job_id / "bench").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    t0 = time.monotonic()
    daemon.cli("cancel", run)
    final = _result(daemon.cli("wait", run, "--json", check=False).stdout)
    assert final["outcome"] == "cancelled", final["reason"]
    for rank in range(4):
        diag = log_dir / job_id / f"rank{rank}.diag.txt"
        assert diag.is_file(), f"rank {rank} wrote no SIGTERM diagnostic"
    assert time.monotonic() - t0 < 60


@pytest.mark.slurm_contract
def test_worker_crash_ends_the_run_promptly(daemon: Daemon, log_dir: Path) -> None:
    spec = demo_spec(
        log_dir,
        tables={
            "prefill": {"LLMD_FAKE_FAULT_RANKS": "1", "LLMD_FAKE_ENGINE_CRASH_AFTER_S": "3"},
            "bench": {"LLMD_FAKE_BENCH_HANG": "1"},
        },
        retry={"infrastructure": 0},  # how fast one attempt ends (retries: tests/faults)
    )
    t0 = time.monotonic()
    proc = daemon.submit(spec, "--wait")
    assert proc.returncode == 10, proc.stderr
    result = _result(proc.stdout)
    assert result["outcome"] == "failed"
    assert time.monotonic() - t0 < 120  # far below the 5-minute time limit


# pending and verifying: tests/faults/test_crash_points.py (every transition replayed, and
# verifying on this cluster too) covers them; running is the one it has only replayed.
@pytest.mark.parametrize("state", ["running"])
def test_daemon_sigkilled_then_restarted_resumes_the_same_job(
    daemon: Daemon, log_dir: Path, cluster: DevCluster, state: str
) -> None:
    spec = demo_spec(log_dir, common={"LLMD_FAKE_MARKER_DELAY_S": "3"})
    proc = daemon.submit(spec)
    run = str(_result(proc.stdout)["run"])
    daemon.wait_state(run, {state, "running", "finishing", "verifying", "archiving", "succeeded"})
    daemon.stop(signal.SIGKILL)
    daemon.start()
    final = _result(daemon.cli("wait", run, "--json", check=False).stdout)
    assert final["outcome"] == "succeeded", final["reason"]
    job_id = str(final["slurm_job_id"])
    rows = cluster.job_ids_named(str(final["job_name"]))
    assert rows == [job_id]
    assert_copies_identical(final)


def test_daemon_sigterm_never_cancels_the_job(
    daemon: Daemon, log_dir: Path, cluster: DevCluster
) -> None:
    proc = daemon.submit(demo_spec(log_dir, common={"LLMD_FAKE_MARKER_DELAY_S": "3"}))
    run = str(_result(proc.stdout)["run"])
    status = daemon.wait_state(run, {"running"})
    assert daemon.stop(signal.SIGTERM) == 0
    state = cluster.slurm(
        ["squeue", "-h", "-t", "all", "-j", str(status["slurm_job_id"]), "-o", "%T"]
    )
    assert state.stdout.strip() in {"RUNNING", "COMPLETING", "COMPLETED"}
    daemon.start()
    final = _result(daemon.cli("wait", run, "--json", check=False).stdout)
    assert final["outcome"] == "succeeded", final["reason"]


def _kill_ssh_sessions(node: str) -> int:
    """SIGKILL every sshd process (listener and sessions) in the node's namespace."""
    pids = subprocess.run(
        ["ip", "netns", "pids", f"llmd-{node}"], capture_output=True, text=True, check=True
    ).stdout.split()
    killed = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if Path(f"/proc/{pid}/comm").read_text().strip() in {"sshd", "sshd-session"}:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
    return killed


def test_ssh_drop_mid_tail_loses_and_duplicates_nothing(
    daemon: Daemon, log_dir: Path, cluster: DevCluster
) -> None:
    """Kill node1's sshd (sessions too) while a rank log grows, restart it, compare bytes."""
    proc = daemon.submit(demo_spec(log_dir, common={"LLMD_FAKE_MARKER_DELAY_S": "20"}))
    run = str(_result(proc.stdout)["run"])
    status = daemon.wait_state(run, {"running"})
    job_id = str(status["slurm_job_id"])
    extra = log_dir / job_id / "rank0.extra.log"
    down = False
    try:
        with extra.open("ab") as f:
            for n in range(1200):
                f.write(f"line {n} {'x' * (n % 97)}\n".encode())
                f.flush()
                if n == 200:
                    devcluster("sshd", "node1", "stop")
                    down = True
                    assert _kill_ssh_sessions("node1") >= 1
                elif n == 600:
                    devcluster("sshd", "node1", "start")
                    down = False
                time.sleep(0.01)
    finally:
        if down:
            devcluster("sshd", "node1", "start")
    final = _result(daemon.cli("wait", run, "--json", check=False).stdout)
    assert final["outcome"] == "succeeded", final["reason"]
    names = assert_copies_identical(final)
    assert "rank0.extra.log" in names
    assert daemon.events("ssh.reconnect"), "the link was never re-established"


def _all_verified(daemon: Daemon, log_root: Path, n: int) -> None:
    runs = []
    for i in range(n):
        spec = demo_spec(log_root / f"r{i}", port=8300 + 10 * i)
        proc = daemon.submit(spec)
        assert proc.returncode == 0, proc.stderr
        runs.append(str(_result(proc.stdout)["run"]))
    outcomes = {}
    for run in runs:
        final = _result(daemon.cli("wait", run, "--json", check=False, timeout=600).stdout)
        outcomes[run] = (final["outcome"], final["reason"])
    assert {o for o, _ in outcomes.values()} == {"succeeded"}, outcomes
    assert len(daemon.events("run.finished")) == n


def test_four_queued_runs_all_verified(daemon: Daemon, shared_tmp: Path) -> None:
    # Each demo run takes the dev cluster's 4 nodes: Slurm queues them one after another.
    _all_verified(daemon, shared_tmp, 4)


def test_twenty_concurrent_runs_all_verified_replayed(world: ReplayWorld, tmp_path: Path) -> None:
    # Twenty at once on a replayed cluster (its jobs share one node, so none waits).
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(world, root, replay_socket=world.socket)
    d.start()
    try:
        _all_verified(d, tmp_path / "logs", 20)
    finally:
        d.stop()


def test_logs_follow_prints_the_batch_log(daemon: Daemon, log_dir: Path) -> None:
    proc = daemon.submit(demo_spec(log_dir, common={"LLMD_FAKE_MARKER_DELAY_S": "3"}))
    run = str(_result(proc.stdout)["run"])
    followed = daemon.cli("logs", run, "--follow", timeout=120)
    final = daemon.status(run)
    assert final["outcome"] == "succeeded"
    out = log_dir / f"{final['job_name']}-{final['slurm_job_id']}.out"
    assert followed.stdout == out.read_text()
    rank2 = daemon.cli("logs", run, "--rank", "2").stdout
    assert "publish" in rank2 or "marker" in rank2


@pytest.fixture
def open_daemon(cluster: DevCluster) -> Iterator[Daemon]:
    """A daemon whose socket directory other uids can traverse (tmp_path is 0700)."""
    with tempfile.TemporaryDirectory(prefix="llmd-daemon-", dir="/tmp") as root:
        Path(root).chmod(0o711)
        d = Daemon(cluster, Path(root))
        d.start()
        try:
            yield d
        finally:
            d.stop()


def test_control_socket_survives_bad_input_and_guards_other_uids(
    open_daemon: Daemon, log_dir: Path
) -> None:
    daemon = open_daemon
    import socket as socketlib
    import subprocess
    import sys

    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as s:
        s.connect(str(daemon.socket))
        s.settimeout(10)
        reader = s.makefile("rb")
        for line in (
            b"not json\n",
            b"[1,2]\n",
            b'{"v":1,"id":1,"op":"frobnicate","args":{}}\n',
            b'{"v":1,"id":2,"op":"status","args":{"run":7}}\n',
        ):
            s.sendall(line)
            reply = json.loads(reader.readline())
            assert reply["ok"] is False, reply
        # The daemon answers too_large and hangs up while the rest is still arriving.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(b"x" * (2 << 20) + b"\n")
        assert json.loads(reader.readline())["error"]["code"] == "too_large"
        reader.close()
    assert daemon.cli("list", "--json").returncode == 0  # still alive

    proc = daemon.submit(demo_spec(log_dir))
    run = str(_result(proc.stdout)["run"])
    daemon.socket.chmod(0o666)  # let uid 65534 connect at all; ownership is the daemon's check
    # The interpreter lives under /root (mode 0700): import as root, then drop to 65534.
    drop = (
        "import os, shutil, sys, anyio._backends._asyncio, "
        "llmd_supervisor.adapters.control.client, llmd_supervisor.cli.main as cli; "
        "cli.build_parser(); "
        "os.setgroups([]); os.setgid(65534); os.setuid(65534); "
        "sys.exit(cli.main(sys.argv[1:]))"
    )
    for op in ("status", "cancel"):
        other = subprocess.run(
            [sys.executable, "-c", drop, op, run, "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert other.returncode == 2, other.stderr
        # a stranger learns nothing, not even that the run exists
        assert f'No run "{run}" is known to this daemon.' in other.stderr
    final = _result(daemon.cli("wait", run, "--json", check=False).stdout)
    assert final["outcome"] == "succeeded"


def test_a_log_that_stops_growing_raises_a_stalled_event(
    cluster: DevCluster, tmp_path: Path, log_dir: Path
) -> None:
    d = Daemon(cluster, tmp_path, limits={"log_stall_s": 2.0})
    d.start()
    try:
        proc = d.submit(demo_spec(log_dir, common={"LLMD_FAKE_MARKER_DELAY_S": "8"}))
        final = _result(d.cli("wait", str(_result(proc.stdout)["run"]), "--json").stdout)
    finally:
        d.stop()
    assert final["outcome"] == "succeeded"
    stalled = d.events("run.stalled")
    assert stalled and {"node", "rank", "quiet_s"} <= set(stalled[0])
    events = (Path(str(final["archive"])) / "events.jsonl").read_text()
    assert '"kind": "log.stalled"' in events


def test_sigint_to_a_waiting_client_cancels_its_run(daemon: Daemon, log_dir: Path) -> None:
    spec = daemon.root / "hang.toml"
    spec.write_text(demo_spec(log_dir, grace_s=5, tables={"bench": {"LLMD_FAKE_BENCH_HANG": "1"}}))
    client = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmd_supervisor",
            "submit",
            str(spec),
            "--wait",
            "--json",
            "--socket",
            str(daemon.socket),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **daemon.cluster.slurm_env},
    )
    try:
        deadline = time.monotonic() + 60
        runs: list[dict[str, object]] = []
        while time.monotonic() < deadline and not any(r["state"] == "running" for r in runs):
            runs = json.loads(daemon.cli("list", "--json").stdout)["runs"]
            time.sleep(0.3)
        time.sleep(2)
        client.send_signal(signal.SIGINT)
        out, err = client.communicate(timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 11, err
    assert "cancelling run" in err
    assert json.loads(out)["outcome"] == "cancelled"
