"""A local stand-in for an allocation: the real agent, engine and bench on 127.0.0.1.

Each rank is a separate agent process with fake ``SLURM_*`` variables; all ranks share
host 127.0.0.1 (``LLMD_HOSTS``) and get distinct ports through ``port_stride``. The node
files (the agent's and the stand-ins') are copied to ``<log_dir>/<job_id>/node`` exactly
where and as the batch script unpacks them, and each rank runs ``node/agent.py``.
Everything started here is stopped by PID at teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import llmd_supervisor
from llmd_supervisor.core.render.agent_config import agent_config
from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.node import NODE_FILES

PACKAGE_SRC = Path(llmd_supervisor.__file__).parent
NODE_SRC = PACKAGE_SRC / "node"
STANDINS_SRC = PACKAGE_SRC / "standins"
# Run the node code under another interpreter (e.g. a Python 3.9) with LLMD_NODE_PYTHON.
NODE_PYTHON = os.environ.get("LLMD_NODE_PYTHON", sys.executable)
JOB_ID = "4242"

SPEC_TEMPLATE = """
[run]
log_dir = "{log_dir}"
sigterm_grace_s = 5
marker_grace_s = 2
coordinator_silence_s = 3

[topology]
prefill_nodes = {p}
decode_nodes = {d}
prefill_workers = {p}
decode_workers = 1

[model]
path = "/nonexistent/model"
served_name = "stand-in/test-model"

[container]
python = "{python}"

[engine]
port = {port}
port_stride = 1
health_timeout_s = {health_timeout}
prefill_command = ["{python}", "{{node_dir}}/engine.py", "--role", "prefill", "--host",
                   "{{host}}", "--port", "{{port}}", "--served-name", "{{served_name}}"]
decode_command = ["{python}", "{{node_dir}}/engine.py", "--role", "decode", "--host",
                  "{{host}}", "--port", "{{port}}", "--served-name", "{{served_name}}"]

[benchmark]
command = ["{python}", "{{node_dir}}/bench.py", "--prefill-urls", "{{prefill_urls}}",
           "--decode-urls", "{{decode_urls}}", "--served-name", "{{served_name}}",
           "--concurrency", "{{concurrency}}", "--num-prompts", "{{num_prompts}}",
           "--input-len", "{{input_len}}", "--output-len", "{{output_len}}",
           "--request-rate", "{{request_rate}}", "--result-file", "{{result_file}}"]
concurrencies = {concurrencies}
input_len = 16
output_len = 4
prompts_multiplier = {multiplier}
point_timeout_s = 20

[standins]
enabled = true

[slurm]
time_limit = "10"
"""


# Ports for the node tests' services: below Linux's ephemeral range (32768-60999 by default,
# where every outgoing connection's local port comes from, so a port picked there can be
# taken by a client before the service binds it), a range of its own per pytest-xdist
# worker, handed out round robin within the process.
_PORTS_LO, _PORTS_PER_WORKER = 20000, 3000
_next_port: dict[str, int] = {}


def _worker_range() -> tuple[int, int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    lo = _PORTS_LO + (index % 4) * _PORTS_PER_WORKER
    return lo, lo + _PORTS_PER_WORKER


def free_port_block(n: int) -> int:
    """A base port such that base .. base+n-1 are all free on 127.0.0.1 right now (and not
    handed out before by this process)."""
    lo, hi = _worker_range()
    for _ in range(200):
        base = _next_port.get("next", lo)
        if base + n >= hi:
            base = lo
        _next_port["next"] = base + n
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port block")


def copy_node_files(node_dir: Path) -> None:
    """Lay the node files out in `node_dir` as the batch script does (``NODE_FILES``)."""
    for dest, src in NODE_FILES.items():
        (node_dir / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PACKAGE_SRC / src, node_dir / dest)


def _is_our_process(pid: int, needle: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return needle.encode() in cmd


@dataclass
class LocalRun:
    """One simulated allocation: P+D agent processes on 127.0.0.1."""

    tmp: Path
    prefill: int = 2
    decode: int = 2
    concurrencies: tuple[int, ...] = (1, 2)
    multiplier: int = 2
    health_timeout: float = 10.0
    config_overrides: dict[str, Any] = field(default_factory=dict)
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    exit_times: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.log_dir = self.tmp / "logs"
        self.log_dir.mkdir()
        self.port = free_port_block(self.prefill + self.decode)
        text = SPEC_TEMPLATE.format(
            log_dir=self.log_dir,
            p=self.prefill,
            d=self.decode,
            python=NODE_PYTHON,
            port=self.port,
            health_timeout=self.health_timeout,
            concurrencies=list(self.concurrencies),
            multiplier=self.multiplier,
        )
        # a JSON object the tests change freely (any key, any value)
        cfg: dict[str, Any] = dict(agent_config(load_spec(text)))
        cfg["heartbeat_s"] = 0.3
        cfg.update(self.config_overrides)
        for role, values in self.env.items():
            env_cfg = cfg["env"]
            assert isinstance(env_cfg, dict)
            env_cfg[role].update(values)
        self.config = cfg
        self.job_dir = self.log_dir / JOB_ID
        node_dir = self.job_dir / "node"
        node_dir.mkdir(parents=True)
        copy_node_files(node_dir)
        self.config_path = node_dir / "config.json"
        self.write_config()

    def write_config(self) -> None:
        """(Re)write the agents' config.json from `config` (before `start`)."""
        self.config_path.write_text(json.dumps(self.config))

    @property
    def nranks(self) -> int:
        return self.prefill + self.decode

    @property
    def coordinator(self) -> int:
        return self.prefill

    @property
    def marker_path(self) -> Path:
        return self.log_dir / f".bench_done.{JOB_ID}"

    def port_of(self, rank: int) -> int:
        return self.port + rank

    def start(
        self, ranks: list[int] | None = None, agent_env: dict[str, str] | None = None
    ) -> None:
        for rank in range(self.nranks) if ranks is None else ranks:
            env = dict(os.environ)
            env.update(
                {
                    "SLURM_PROCID": str(rank),
                    "SLURM_JOB_ID": JOB_ID,
                    "SLURM_NNODES": str(self.nranks),
                    "SLURM_JOB_NODELIST": f"node[1-{self.nranks}]",
                    "LLMD_HOSTS": ",".join(["127.0.0.1"] * self.nranks),
                }
            )
            env.update(agent_env or {})
            out = open(self.tmp / f"agent{rank}.out", "wb")  # noqa: SIM115 - owned by the child
            self.procs[rank] = subprocess.Popen(
                [
                    NODE_PYTHON,
                    str(self.job_dir / "node" / "agent.py"),
                    "--config",
                    str(self.config_path),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            out.close()

    def wait(self, timeout: float) -> dict[int, int]:
        """Wait for every started agent; return rank -> exit status. Fails on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rank, p in self.procs.items():
                if rank not in self.exit_times and p.poll() is not None:
                    self.exit_times[rank] = time.time()
            if len(self.exit_times) == len(self.procs):
                return {r: int(p.returncode) for r, p in self.procs.items()}
            time.sleep(0.05)
        running = [r for r, p in self.procs.items() if p.poll() is None]
        pytest.fail(f"ranks {running} still running after {timeout} s\n{self.describe()}")

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        pytest.fail(f"timed out after {timeout} s waiting for {what}\n{self.describe()}")

    def status(self, rank: int) -> dict[str, Any]:
        try:
            value = json.loads((self.job_dir / f"rank{rank}.status.json").read_text())
        except (OSError, ValueError):
            return {}
        assert isinstance(value, dict)
        return value

    def marker(self) -> dict[str, Any] | None:
        try:
            value = json.loads(self.marker_path.read_text())
        except FileNotFoundError:
            return None
        assert isinstance(value, dict)
        return value

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.procs[rank].pid, sig)

    def engine_pids(self, key: str = "engine_pid") -> list[int]:
        pids = []
        for rank in range(self.nranks):
            pid = self.status(rank).get(key)
            if isinstance(pid, int):
                pids.append(pid)
        return pids

    def live_children(self) -> list[int]:
        """Engines and bench clients of this run that are still running."""
        return self.live_engines() + [
            p for p in self.engine_pids("bench_pid") if _is_our_process(p, "bench.py")
        ]

    def live_engines(self) -> list[int]:
        return [p for p in self.engine_pids() if _is_our_process(p, "engine.py")]

    def describe(self) -> str:
        parts = []
        for path in sorted(self.tmp.glob("agent*.out")) + sorted(self.job_dir.glob("*.log")):
            text = path.read_text(errors="replace")[-3000:]
            parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    def stop_all(self) -> None:
        """Teardown: SIGKILL what is still running, by PID (agents, then engines)."""
        children = [(p, "engine.py") for p in self.engine_pids()]
        children += [(p, "bench.py") for p in self.engine_pids("bench_pid")]
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        for pid, needle in children:
            if _is_our_process(pid, needle):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def local_run(tmp_path: Path) -> Iterator[Callable[..., LocalRun]]:
    runs: list[LocalRun] = []

    def make(**kwargs: Any) -> LocalRun:
        root = tmp_path / f"run{len(runs)}"
        root.mkdir()
        run = LocalRun(root, **kwargs)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.stop_all()
