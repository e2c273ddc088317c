"""The daemon as a service on the real cluster: sd_notify, metrics, several clusters.

The machine has no systemd as PID 1, so each test plays systemd's part with a real
NOTIFY_SOCKET datagram socket, or scrapes the metrics endpoint like Prometheus would.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmd_supervisor.adapters.nodes.remote import NodeLink, SshSettings
from llmd_supervisor.adapters.slurm.runner import SlurmClient
from llmd_supervisor.adapters.slurm.ssh import SshRunner
from llmd_supervisor.errors import FileRefused
from llmd_supervisor.supervision.cluster.clusters import ThroughLoginHost
from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import DevCluster


@dataclass
class FakeSystemd:
    """A NOTIFY_SOCKET listener that timestamps every datagram and, at READY=1,
    immediately checks that the control socket answers (as a client started by
    `After=llmd-supervisor.service` would)."""

    control_socket: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="llmd-sd-")))
    messages: list[tuple[float, str]] = field(default_factory=list)
    ping_at_ready: dict[str, object] | str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def path(self) -> str:
        return str(self.root / "notify.sock")

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            text = data.decode()
            self.messages.append((time.monotonic(), text))
            if "READY=1" in text.split("\n"):
                self.ping_at_ready = self._ping()

    def _ping(self) -> dict[str, object] | str:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(5)
                c.connect(str(self.control_socket))
                c.sendall(b'{"v": 1, "id": 1, "op": "ping"}\n')
                reply = c.makefile("rb").readline()
            result = json.loads(reply)
            assert isinstance(result, dict)
            return result
        except (OSError, ValueError) as exc:
            return f"control socket did not answer at READY=1: {exc!r}"

    def lines(self, prefix: str) -> list[tuple[float, str]]:
        return [
            (t, line) for t, m in self.messages for line in m.split("\n") if line.startswith(prefix)
        ]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)
        self.sock.close()
        for p in self.root.iterdir():
            p.unlink()
        self.root.rmdir()


@pytest.fixture
def log_dir(shared_tmp: Path) -> Path:
    return shared_tmp / "runs"


@pytest.fixture
def daemon(cluster: DevCluster, tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(cluster, tmp_path)
    yield d
    if d.proc is not None:
        d.stop()


def _json(text: str) -> dict[str, object]:
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


def test_notify_protocol_ready_status_watchdog_stopping_and_the_job_keeps_running(
    daemon: Daemon, log_dir: Path, cluster: DevCluster
) -> None:
    sd = FakeSystemd(daemon.socket)
    try:
        daemon.env = {"NOTIFY_SOCKET": sd.path, "WATCHDOG_USEC": "2000000"}  # ping every 1 s
        t_start = time.monotonic()
        daemon.start()
        deadline = time.monotonic() + 10
        while not sd.lines("READY=1") and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = sd.lines("READY=1")
        assert len(ready) == 1, sd.messages
        assert sd.ping_at_ready == {"v": 1, "id": 1, "ok": True, "result": {"pong": True}}
        assert sd.lines("STATUS=")[0][1] == "STATUS=0 runs in flight; 0 finished"

        proc = daemon.submit(
            demo_spec(log_dir, port=8611, common={"LLMD_FAKE_MARKER_DELAY_S": "3"})
        )
        run = str(_json(proc.stdout)["run"])
        status = daemon.wait_state(run, {"running"})
        job_id = str(status["slurm_job_id"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any("(1 running)" in line for _, line in sd.lines("STATUS=")):
                break
            time.sleep(0.2)
        statuses = [line for _, line in sd.lines("STATUS=")]
        assert "STATUS=1 runs in flight (1 running); 0 finished" in statuses, statuses

        assert daemon.stop(signal.SIGTERM) == 0
        t_stop = time.monotonic()
        stopping = sd.lines("STOPPING=1")
        assert len(stopping) == 1
        # The watchdog was fed from the start, every ~1 s, until the daemon stopped.
        pings = [t for t, _ in sd.lines("WATCHDOG=1")]
        assert pings and pings[0] < ready[0][0] + 0.5
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert len(pings) >= (t_stop - t_start) / 1.0 - 3, (len(pings), t_stop - t_start)
        assert max(gaps) < 2.0, gaps  # never as late as WatchdogSec
        assert ready[0][0] < stopping[0][0]

        # Stopping the service left the job alone: it runs to COMPLETED 0:0.
        state = cluster.slurm(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"])
        assert state.stdout.strip() in {"RUNNING", "COMPLETING", "COMPLETED"}
        assert cluster.wait_terminal(job_id, timeout=120).startswith("COMPLETED|0:0")
    finally:
        sd.close()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_scraped_after_a_demo_run(daemon: Daemon, log_dir: Path) -> None:
    port = _free_port()
    daemon.extra_config = f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
    daemon.start()
    before = _scrape(port)
    assert before[("llmd_supervisor_runs", (("state", "running"),))] == 0
    proc = daemon.submit(demo_spec(log_dir, port=8621), "--wait")
    assert proc.returncode == 0, proc.stderr + daemon.log_text()[-2000:]
    final = _json(proc.stdout)
    s = _scrape(port)
    assert s[("llmd_supervisor_runs", (("state", "succeeded"),))] == 1
    assert s[("llmd_supervisor_runs_by_outcome", (("outcome", "succeeded"),))] == 1

    def cmd(name: str, metric: str = "duration_seconds_count") -> float:
        key = (f"llmd_supervisor_slurm_command_{metric}", (("cluster", "dev"), ("command", name)))
        return s.get(key, 0.0)

    assert cmd("sbatch") == 1 and cmd("mkdir") == 1
    assert cmd("squeue") >= 1 and cmd("sacct") >= 1 and cmd("scontrol") >= 1
    assert cmd("sbatch", "duration_seconds_sum") > 0
    assert not any(
        k[0] == "llmd_supervisor_slurm_command_errors_total" and ("command", "sbatch") in k[1]
        for k in s
    )
    assert s[("llmd_supervisor_ssh_connects_total", ())] >= 4  # one link per node
    assert s[("llmd_supervisor_ssh_connect_failures_total", ())] == 0
    copies = Path(str(final["archive"])) / "logs"
    copied = sum(p.stat().st_size for p in copies.rglob("*") if p.is_file())
    assert s[("llmd_supervisor_tail_bytes_total", (("cluster", "dev"),))] == copied > 0
    assert s[("llmd_supervisor_verify_duration_seconds_count", (("outcome", "succeeded"),))] == 1
    assert s[("llmd_supervisor_loop_lag_seconds_count", ())] >= 1
    assert s[("llmd_supervisor_loop_lag_last_seconds", ())] < 0.5


def test_two_clusters_one_local_one_via_login_host_both_succeed(
    daemon: Daemon, log_dir: Path, cluster: DevCluster
) -> None:
    port = _free_port()
    daemon.extra_config = f"""
[[clusters]]
name = "login"
login_host = "node1"
slurm_conf = "{cluster.env["SLURM_CONF"]}"

[metrics]
listen = "127.0.0.1:{port}"
"""
    daemon.start()
    bad = daemon.submit(demo_spec(log_dir, port=8631), "--cluster", "nosuch")
    assert bad.returncode == 2 and "'nosuch' is not configured" in bad.stderr
    assert "dev, login" in bad.stderr

    specs = {
        "dev": daemon.root / "spec-dev.toml",
        "login": daemon.root / "spec-login.toml",
    }
    specs["dev"].write_text(demo_spec(log_dir / "dev", port=8632))
    # (both jobs may share the nodes: their topologies get ports 10 apart)
    specs["login"].write_text(demo_spec(log_dir / "login", port=8642))
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmd_supervisor",
                "submit",
                str(path),
                "--wait",
                "--json",
                "--cluster",
                name,
                "--socket",
                str(daemon.socket),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cluster.slurm_env,
        )
        for name, path in specs.items()
    }
    answers = {name: p.communicate(timeout=280) for name, p in procs.items()}  # all, first
    results = {}
    for name, (out, err) in answers.items():
        assert procs[name].returncode == 0, f"{name}: {err}\n{daemon.log_text()[-3000:]}"
        results[name] = _json(out)
    for name, final in results.items():
        assert final["outcome"] == "succeeded", final["reason"]
        assert final["cluster"] == name
    # The login cluster's sbatch ran on node1 over SSH (WorkDir: root's home there), the
    # local one here (WorkDir: the daemon's cwd); both went to the same Slurm.
    workdir = {
        name: (Path(str(final["archive"])) / "scontrol-show-job.txt").read_text()
        for name, final in results.items()
    }
    assert f"WorkDir={os.getcwd()} " in workdir["dev"]
    assert "WorkDir=/root " in workdir["login"] and os.getcwd() != "/root"
    # Every Slurm command of the login cluster, and its marker read (node/safe_read.py run
    # by python3), went through its own runner; the local cluster's marker was read here.
    s = _scrape(port)

    def count(cluster_name: str, command: str) -> float:
        key = (
            "llmd_supervisor_slurm_command_duration_seconds_count",
            (("cluster", cluster_name), ("command", command)),
        )
        return s.get(key, 0.0)

    assert count("login", "sbatch") == count("dev", "sbatch") == 1
    assert count("login", "squeue") >= 1 and count("login", "python3") >= 1
    assert count("dev", "python3") == 0
    assert s[("llmd_supervisor_runs", (("state", "succeeded"),))] == 2


@pytest.mark.asyncio
async def test_ssh_runner_feeds_stdin_and_sets_slurm_conf_on_the_login_host(
    cluster: DevCluster,
) -> None:
    settings = SshSettings(
        username="root", client_keys=(cluster.ssh_key,), known_hosts=cluster.known_hosts
    )
    link = NodeLink("node1", settings)
    try:
        payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
        result = await link.run(["sha256sum"], time_limit=30, stdin=payload)
        assert result.stdout.split()[0].decode() == hashlib.sha256(payload).hexdigest()
        runner = SshRunner(link, {"SLURM_CONF": cluster.env["SLURM_CONF"]})
        conf = await runner.run(["sh", "-c", 'echo "$SLURM_CONF"'], time_limit=30)
        assert conf.stdout.strip() == cluster.env["SLURM_CONF"]
        client = SlurmClient(runner, timeout=30)
        assert "MinJobAge" in (await client.scontrol_config()).stdout
        files = ThroughLoginHost(client, "node1", "python3")
        assert await files.read("/nonexistent", "/nonexistent/marker") is None
        assert await files.read("/etc", "/etc/hostname") is not None
        with pytest.raises(FileRefused, match="symbolic link"):
            await files.read("/etc", "/etc/mtab")  # -> /proc/self/mounts
    finally:
        await link.aclose()
