"""Start the real daemon (as a subprocess) against the dev cluster, and drive its CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tests.devcluster import REPO

DEMO_SPEC = REPO / "deploy" / "llm-d" / "demo.toml"
START_TIMEOUT_S = 90.0  # Daemon.start: until its socket answers
# Every daemon process a test started and has not waited for: tests/conftest.py stops them
# after each test, so a test failing half-way leaves no daemon behind.
STARTED: list[subprocess.Popen[bytes]] = []


def stop_started(grace_s: float = 30) -> list[int]:
    """SIGTERM, then SIGKILL, every daemon of STARTED still running; return their PIDs."""
    left = [p for p in STARTED if p.poll() is None]
    STARTED.clear()
    for proc in left:
        proc.terminate()
    for proc in left:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [p.pid for p in left]


def with_ports(text: str, port: int) -> str:
    """demo.toml's text with every port of its topology moved with `port`: the engine's,
    the sidecar's (+1), the router's (+2) and the router's admin port (+3)."""
    offsets = {"[engine]": 0, "[sidecar]": 1, "[router]": 2, "[[router.process]]": 3}
    table, lines = "", []
    for line in text.splitlines():
        if line.startswith("["):
            table = line.split("#")[0].strip()
        line = line.replace('"--admin-port", "9901"', f'"--admin-port", "{port + 3}"')
        if line.startswith("port = ") and table in offsets:
            line = f"port = {port + offsets[table]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def demo_spec(
    log_dir: Path,
    *,
    common: dict[str, str] | None = None,
    tables: dict[str, dict[str, str]] | None = None,
    port: int = 8300,
    grace_s: int | None = None,
    retry: dict[str, object] | None = None,
    decode_nodes: int = 2,
) -> str:
    """deploy/llm-d/demo.toml with its own log directory, port and fault knobs; `retry`
    is its [retry] table, and `decode_nodes = 1` makes it a 3-node run (one node of the
    4-node dev cluster left for a retry that excludes one)."""
    lines = []
    for line in with_ports(DEMO_SPEC.read_text(), port).splitlines():
        if line.startswith("log_dir ="):
            line = f'log_dir = "{log_dir}"'
        elif grace_s is not None and line.startswith("sigterm_grace_s ="):
            line = f"sigterm_grace_s = {grace_s}"
        elif line.startswith("decode_nodes ="):
            line = f"decode_nodes = {decode_nodes}"
        lines.append(line)
    assert lines[-2:] != [] and "[env.common]" in DEMO_SPEC.read_text()
    # [env.common] is the demo's last table: extra keys appended here land in it.
    lines += [f'{k} = "{v}"' for k, v in (common or {}).items()]
    for table, values in (tables or {}).items():
        lines.append(f"[env.{table}]")
        lines += [f'{k} = "{v}"' for k, v in values.items()]
    if retry is not None:
        lines.append("[retry]")
        lines += [f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in retry.items()]
    return "\n".join(lines) + "\n"


class Site(Protocol):
    """What a test daemon runs against: the real dev cluster (`DevCluster`), a replayed one
    (`tests.fakes.replay_world.ReplayWorld`), or none (`NoCluster`)."""

    @property
    def slurm_env(self) -> dict[str, str]:
        """The environment of the daemon and its CLI (SLURM_CONF, PATH)."""
        ...

    def daemon_config(self) -> str:
        """The daemon config's [ssh] table and the head of its one cluster, named "dev"."""
        ...


@dataclass(frozen=True)
class NoCluster:
    """No Slurm at all: for tests of the control socket, whose daemon never submits. Node
    links would go to a closed loopback port."""

    root: Path

    @property
    def slurm_env(self) -> dict[str, str]:
        return dict(os.environ)

    def daemon_config(self) -> str:
        known_hosts = self.root / "known_hosts"
        known_hosts.touch()
        return f"""
[ssh]
known_hosts = "{known_hosts}"
port = 9
connect_timeout_s = 0.5

[[clusters]]
name = "dev"
"""


@dataclass
class BackgroundWait:
    """A `wait` client in a thread (`Daemon.wait_in_background`)."""

    timeout: float
    thread: threading.Thread | None = None
    done: list[subprocess.CompletedProcess[str]] = field(default_factory=list)

    def final(self, context: Callable[[], str] = str) -> dict[str, object]:
        """The run's final summary once the client returned (an assertion if it did not,
        or failed; `context` adds to its message)."""
        assert self.thread is not None
        self.thread.join(self.timeout)
        assert self.done, f"wait did not return within {self.timeout:g} s{context()}"
        assert self.done[0].returncode == 0, self.done[0].stderr
        result = json.loads(self.done[0].stdout)
        assert isinstance(result, dict)
        return result


@dataclass
class Daemon:
    """One daemon process with its own state directory and socket."""

    cluster: Site
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    extra_config: str = ""
    archive_dir: Path | None = None
    limits: dict[str, float] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    crash_after: str | None = None  # STATE[:N]: see tests/faults/crash_daemon.py
    daemon_keys: str = ""  # more [daemon] keys (e.g. socket_group)
    replay_socket: Path | None = None  # Slurm commands go to a replayed cluster served here
    qos_backoff_s: float | None = None  # a campaign's back-off after a QOS refusal (seam)
    # Runs the daemon under this command prefix: a login node's `nsenter` (tests/ha_net.py).
    prefix: list[str] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.root / "control.sock"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def config_path(self) -> Path:
        return self.root / "config.toml"

    def write_config(self) -> None:
        values = {"verify_timeout_s": 60.0, "heartbeat_interval_s": 1.0, **self.limits}
        limits = "\n".join(f"{k} = {v}" for k, v in values.items())
        self.config_path.write_text(
            f"""
[daemon]
state_dir = "{self.state_dir}"
socket = "{self.socket}"
log_roots = ["/tmp", "/var/tmp"]
{f'archive_dir = "{self.archive_dir}"' if self.archive_dir else ""}
log_format = "json"
{self.daemon_keys}

[limits]
{limits}
{self.cluster.daemon_config()}
{self.extra_config}
"""
        )

    def start(self) -> None:
        """Start the daemon and wait until its socket answers (or, with a crash point, until
        that point killed it: resumed work can reach it while the daemon starts)."""
        assert self.proc is None or self.proc.poll() is not None
        self.write_config()
        self.starts += 1
        log = open(self.root / f"daemon-{self.starts}.log", "wb")  # noqa: SIM115 - child's
        argv = [sys.executable, "-m", "llmd_supervisor", "daemon"]
        if (self.crash_after, self.replay_socket, self.qos_backoff_s) != (None, None, None):
            # the daemon with test seams: a crash point, a replayed cluster (tests/faults)
            argv = [sys.executable, "-m", "tests.faults.crash_daemon"]
            if self.crash_after is not None:
                argv += ["--crash-after", self.crash_after]
            if self.replay_socket is not None:
                argv += ["--replay-socket", str(self.replay_socket)]
            if self.qos_backoff_s is not None:
                argv += ["--qos-backoff-s", str(self.qos_backoff_s)]
        self.proc = subprocess.Popen(
            [*self.prefix, *argv, "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.cluster.slurm_env, **self.env},
            cwd=REPO,
        )
        STARTED.append(self.proc)
        log.close()
        # Only a hang takes this long: a start under load (a hog on both cores, other
        # passes beside it) was seen taking over 20 s to answer.
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                crashed = self.crash_after is not None and self.proc.returncode == -9
                if crashed and '"test.crash"' in self.log_text():
                    return  # the crash point fired already: the test's wait sees it
                raise RuntimeError(
                    f"daemon exited {self.proc.returncode}: {self.log_text()[-2000:]}"
                )
            if self.socket.exists() and self.cli("list", "--json", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise TimeoutError(
            f"daemon not answering after {START_TIMEOUT_S:g} s: {self.log_text()[-2000:]}"
        )

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the daemon and wait for it; return its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)

    def log_text(self) -> str:
        return "".join(
            p.read_text(errors="replace") for p in sorted(self.root.glob("daemon-*.log"))
        )

    def events(self, name: str) -> list[dict[str, object]]:
        """The daemon's JSON log lines with event == name."""
        out = []
        for line in self.log_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == name:
                out.append(record)
        return out

    def cli(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "llmd_supervisor", *args, "--socket", str(self.socket)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, **self.cluster.slurm_env},
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"llmd-supervisor {' '.join(args)} exited {proc.returncode}: {proc.stderr}"
            )
        return proc

    def wait_in_background(self, run: str, timeout: float = 240) -> BackgroundWait:
        """`wait RUN --json` in a thread: a client waiting while the test does harm."""
        waiting = BackgroundWait(timeout)

        def wait() -> None:
            waiting.done.append(self.cli("wait", run, "--json", check=False, timeout=timeout))

        waiting.thread = threading.Thread(target=wait, daemon=True)
        waiting.thread.start()
        return waiting

    def leads(self) -> bool:
        """Whether its log says it acts for a cluster now (a shared journal)."""
        acting = False
        for line in self.log_text().splitlines():
            if '"leading.acting"' in line:
                acting = True
            elif '"leading.stopped_acting"' in line:
                acting = False
        return acting

    def submit(self, spec_text: str, *extra: str) -> subprocess.CompletedProcess[str]:
        spec = self.root / f"spec-{time.monotonic_ns()}.toml"
        spec.write_text(spec_text)
        return self.cli("submit", str(spec), "--json", *extra, check=False)

    def status(self, run: str) -> dict[str, object]:
        result = json.loads(self.cli("status", run, "--json").stdout)
        assert isinstance(result, dict)
        return result

    def wait_state(self, run: str, states: set[str], timeout: float = 120) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        last: dict[str, object] = {}
        while time.monotonic() < deadline:
            last = self.status(run)
            if last["state"] in states:
                return last
            time.sleep(0.2)
        raise TimeoutError(f"run {run} not in {states} after {timeout:g} s: {last.get('state')}")


def assert_copies_identical(final: Mapping[str, object], *, settle_s: float = 5.0) -> list[str]:
    """Every local log copy of the run's last attempt equals the node-side file byte for
    byte (allowing `settle_s` for a file still being drained); return their names."""
    job_id = str(final["slurm_job_id"])
    log_dir = Path(str(final["log_dir"]))
    copies_dir = Path(str(final["archive"])) / "logs" / f"attempt{final['attempt']}"
    copies = sorted(p for p in copies_dir.rglob("*") if p.is_file())
    assert copies, f"no log copies under {copies_dir}"
    deadline = time.monotonic() + settle_s
    for copy in copies:
        name = copy.name
        remote = log_dir / name if name.endswith((".out", ".err")) else log_dir / job_id / name
        while copy.read_bytes() != remote.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert copy.read_bytes() == remote.read_bytes(), f"{copy} differs from {remote}"
    return [c.name for c in copies]


def run_to_end(daemon: Daemon, spec: str) -> dict[str, object]:
    """Submit `spec` and wait for its final summary."""
    proc = daemon.submit(spec)
    assert proc.returncode == 0, proc.stderr
    run = str(json.loads(proc.stdout)["run"])
    final = json.loads(daemon.cli("wait", run, "--json", check=False, timeout=300).stdout)
    assert isinstance(final, dict)
    return final


def node_addresses() -> dict[str, str]:
    """The dev cluster's node name -> IPv4, as it writes them into /etc/hosts."""
    out = {}
    for line in Path("/etc/hosts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].startswith("node"):
            out[fields[1]] = fields[0]
    return out
