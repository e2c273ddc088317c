"""Test-side handle on the real dev cluster (deploy/devcluster/devcluster)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEVCLUSTER = REPO / "deploy" / "devcluster" / "devcluster"
SLURM_VERSIONS = ("22.05", "24.11")
DEFAULT_SLURM = "22.05"
TERMINAL = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


def devcluster(
    *args: str, check: bool = True, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run the devcluster script; raise with its stderr when it fails and `check` is set."""
    proc = subprocess.run(
        [str(DEVCLUSTER), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"`devcluster {' '.join(args)}` exited with status {proc.returncode}: "
            f"{proc.stderr.strip()}"
        )
    return proc


def with_slurm_bin(path: str, slurm_bin: str) -> str:
    """`path` with `slurm_bin` first (once); unchanged when `slurm_bin` is empty."""
    if not slurm_bin:
        return path
    rest = [d for d in path.split(":") if d and d != slurm_bin]
    return ":".join([slurm_bin, *rest])


def parse_env(text: str) -> dict[str, str]:
    """Turn `export K='v'` lines into a dict."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, value = words[1].split("=", 1)
            env[key] = value
    return env


@dataclass
class DevCluster:
    """The running cluster as `devcluster env` describes it."""

    env: dict[str, str]
    nodes: list[str] = field(default_factory=list)
    addrs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def current(cls) -> DevCluster:
        env = parse_env(devcluster("env").stdout)
        addrs = dict(pair.split("=", 1) for pair in env["DEVCLUSTER_NODE_ADDRS"].split())
        return cls(env=env, nodes=env["DEVCLUSTER_NODES"].split(), addrs=addrs)

    @property
    def slurm_version(self) -> str:
        """The series the cluster runs (``22.05``, ``24.11``), as `devcluster up --slurm`."""
        return self.env.get("DEVCLUSTER_SLURM", DEFAULT_SLURM)

    @property
    def slurm_bin(self) -> str:
        """The directory of this version's client commands ('' for the host's, 22.05)."""
        return self.env.get("DEVCLUSTER_SLURM_BIN", "")

    @property
    def slurm_env(self) -> dict[str, str]:
        """This process's environment for the cluster's client commands: SLURM_CONF, and
        the cluster's own clients first on PATH (a 22.05 client cannot talk to 24.11)."""
        env = {**os.environ, "SLURM_CONF": self.env["SLURM_CONF"]}
        env["PATH"] = with_slurm_bin(env.get("PATH", ""), self.slurm_bin)
        return env

    def daemon_config(self) -> str:
        """A test daemon's [ssh] table and cluster head for this cluster (as root)."""
        return f"""
[ssh]
user = "root"
identity_files = ["{self.ssh_key}"]
known_hosts = "{self.known_hosts}"

[[clusters]]
name = "dev"
slurm_conf = "{self.env["SLURM_CONF"]}"
"""

    @property
    def ssh_key(self) -> str:
        return self.env["DEVCLUSTER_SSH_KEY"]

    @property
    def known_hosts(self) -> str:
        return self.env["DEVCLUSTER_KNOWN_HOSTS"]

    @property
    def accounting(self) -> bool:
        return self.env["DEVCLUSTER_ACCOUNTING"] == "1"

    def slurm(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 30,
        extra_env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**self.slurm_env, **(extra_env or {})},
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()}"
            )
        return proc

    def sbatch(self, script: Path, *options: str) -> str:
        """Submit a batch script and return its job id."""
        out = self.slurm(["sbatch", "--parsable", *options, str(script)]).stdout
        return out.strip().split(";")[0]

    def wait_running(self, job_id: str, timeout: float = 30) -> None:
        """Wait until squeue shows the job RUNNING."""
        deadline = time.monotonic() + timeout
        argv = ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"]
        while self.slurm(argv).stdout.strip() != "RUNNING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not RUNNING after {timeout:g} s")
            time.sleep(0.2)

    def wait_terminal(self, job_id: str, timeout: float = 120) -> str:
        """Wait until sacct (squeue without accounting) shows the job terminal; return its line."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.accounting:
                out = self.slurm(
                    [
                        "sacct",
                        "-X",
                        "--parsable2",
                        "--noheader",
                        "-j",
                        job_id,
                        "--format=State,ExitCode",
                    ],
                    check=False,
                ).stdout.strip()
                state = out.split("|")[0].split(" ")[0] if out else ""
            else:
                out = self.slurm(
                    ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], check=False
                ).stdout.strip()
                state = out
            if state in TERMINAL:
                return out
            last = out
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not terminal after {timeout:g} s (last {last!r})")

    def ssh(
        self, node: str, command: str, *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a command on a node with the OpenSSH client."""
        proc = subprocess.run(
            [
                "ssh",
                "-F",
                self.env["DEVCLUSTER_SSH_CONFIG"],
                "-o",
                "ConnectTimeout=3",
                f"root@{node}",
                command,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"ssh {node} {command!r} exited {proc.returncode}: {proc.stderr}")
        return proc

    def verify_argv(self, job: str, log_dir: Path, *extra: str) -> list[str]:
        """The real `llmd-supervisor verify` command line for a job of this cluster."""
        return [
            sys.executable,
            "-m",
            "llmd_supervisor",
            "verify",
            job,
            "--log-dir",
            str(log_dir),
            "--json",
            "--interval",
            "0.3",
            *extra,
        ]

    def verify(self, job: str, log_dir: Path, *extra: str) -> tuple[int, dict[str, object]]:
        """Run the real CLI; return its exit status and the receipt it printed."""
        proc = subprocess.run(
            self.verify_argv(job, log_dir, *extra),
            capture_output=True,
            text=True,
            timeout=180,
            env=self.slurm_env,
            check=False,
        )
        assert proc.stdout, proc.stderr
        receipt = json.loads(proc.stdout)
        assert isinstance(receipt, dict)
        return proc.returncode, receipt

    def job_ids_named(self, name: str, *, settle_s: float = 15.0) -> list[str]:
        """Allocation ids sacct knows under `name` (retried: sacct's first record of a
        job can carry a placeholder name for a few seconds)."""
        deadline = time.monotonic() + settle_s
        while True:
            ids = self.slurm(
                [
                    "sacct",
                    "-X",
                    "-n",
                    "-P",
                    f"--name={name}",
                    "--format=JobIDRaw",
                    "--starttime=now-1days",
                ]
            ).stdout.split()
            if ids or time.monotonic() > deadline:
                return ids
            time.sleep(0.5)
