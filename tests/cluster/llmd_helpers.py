"""Helpers for the llm-d allocation tests on the real dev cluster.

A run is built from ``deploy/llm-d/demo.toml`` (text edits: ``log_dir`` replaced, a few
``[run]``/``[engine]``/``[benchmark]``/``[slurm]`` values overridden, fault knobs appended
as ``[env.*]`` tables), validated by ``load_spec``, rendered by ``render_sbatch`` and
submitted with ``sbatch``. Afterwards the run's files (marker, per-rank status files and
agent logs) are read back from the shared log directory.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd_supervisor.core.render.script import render_sbatch
from llmd_supervisor.core.spec.runspec import load_spec
from tests.daemon_helpers import with_ports
from tests.devcluster import REPO, DevCluster

DEMO = REPO / "deploy" / "llm-d" / "demo.toml"
NRANKS = 4  # demo.toml: 2 prefill + 2 decode nodes
COORDINATOR = 2

# An agent log line: "<iso time> llmd-agent rank=R role=X <event> k=v ..."
_LOG_RE = re.compile(r"^(\S+) llmd-agent rank=(\d+) role=(\S+) (\S+)(?: (.*))?$")


def toml_value(value: object) -> str:
    """A TOML literal for the few value types the tests override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string here
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML literal for {value!r}")


def spec_text(
    log_dir: Path,
    *,
    overrides: Mapping[str, object] | None = None,
    env: Mapping[str, Mapping[str, str]] | None = None,
) -> str:
    """demo.toml with ``log_dir`` replaced, single-line keys overridden and env appended.

    ``overrides`` maps a key that occurs exactly once in demo.toml (e.g. ``time_limit``,
    ``concurrencies``) to its new value. ``env`` maps ``common``/``prefill``/``decode``/
    ``bench`` to variables; ``common`` entries are added to the existing ``[env.common]``.
    """
    text = DEMO.read_text()
    values = {"log_dir": str(log_dir), **(overrides or {})}
    port = values.pop("port", None)
    if port is not None:  # every port of the topology moves with it
        assert isinstance(port, int)
        text = with_ports(text, port)
    for key, value in values.items():
        pattern = re.compile(rf"^{re.escape(key)}\s*=.*$", re.MULTILINE)
        text, n = pattern.subn(f"{key} = {toml_value(value)}", text)
        if n != 1:
            raise ValueError(f"{key!r} occurs {n} times in {DEMO}, expected once")
    tables = dict(env or {})
    common = tables.pop("common", {})
    if text.rstrip().rsplit("\n[", 1)[-1].split("]")[0] != "env.common":
        raise ValueError(f"{DEMO} no longer ends with its [env.common] table")
    text = text.rstrip() + "\n"
    text += "".join(f"{k} = {toml_value(v)}\n" for k, v in common.items())
    for table, variables in tables.items():
        text += f"\n[env.{table}]\n"
        text += "".join(f"{k} = {toml_value(v)}\n" for k, v in variables.items())
    return text


def make_log_dir(base: Path, name: str) -> Path:
    """A per-run log directory on the shared file system, created before sbatch (0755)."""
    path = base / name
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    return path


def submit(cluster: DevCluster, log_dir: Path, text: str, job_name: str) -> str:
    """Validate and render ``text``, write the script into ``log_dir`` and submit it."""
    script = log_dir / f"{job_name}.sbatch"
    script.write_text(render_sbatch(load_spec(text), job_name=job_name))
    return cluster.sbatch(script)


def parse_time(value: str) -> float:
    """Epoch seconds from an ISO-8601 timestamp with offset (agent and marker times)."""
    return datetime.datetime.fromisoformat(value).timestamp()


@dataclass
class RankLog:
    """One rank's agent log: events in order with their times and fields."""

    rank: int
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (t, event, rest)

    def first(self, event: str) -> tuple[float, str] | None:
        for t, ev, rest in self.events:
            if ev == event:
                return t, rest
        return None

    def exit_rc(self) -> int | None:
        found = self.first("exit")
        if found is None:
            return None
        m = re.search(r"\brc=(-?\d+)", found[1])
        return int(m.group(1)) if m else None


@dataclass
class Run:
    """The files of a finished (or running) run in its log directory."""

    log_dir: Path
    job_id: str

    @property
    def job_dir(self) -> Path:
        return self.log_dir / self.job_id

    @property
    def marker_path(self) -> Path:
        return self.log_dir / f".bench_done.{self.job_id}"

    def marker(self) -> dict[str, Any] | None:
        try:
            value = json.loads(self.marker_path.read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def status(self, rank: int) -> dict[str, Any] | None:
        try:
            value = json.loads((self.job_dir / f"rank{rank}.status.json").read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def agent_log(self, rank: int) -> RankLog:
        log = RankLog(rank)
        path = self.job_dir / f"rank{rank}.agent.log"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return log
        for line in lines:
            m = _LOG_RE.match(line)
            if m and int(m.group(2)) == rank:
                log.events.append((parse_time(m.group(1)), m.group(4), m.group(5) or ""))
        return log

    def diag(self, rank: int) -> str | None:
        try:
            return (self.job_dir / f"rank{rank}.diag.txt").read_text()
        except OSError:
            return None

    def slurm_output(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')}"
            for p in sorted(self.log_dir.glob(f"*-{self.job_id}.*"))
            if p.suffix in (".out", ".err")
        )

    def describe(self) -> str:
        """Everything useful for an assertion message."""
        parts = [f"job {self.job_id} marker: {self.marker()}"]
        for r in range(NRANKS):
            parts.append(f"rank{r} status: {self.status(r)}")
            path = self.job_dir / f"rank{r}.agent.log"
            if path.exists():
                parts.append(f"--- rank{r}.agent.log\n{path.read_text()[-3000:]}")
        parts.append(self.slurm_output()[-3000:])
        return "\n".join(parts)


def sacct_fields(cluster: DevCluster, job_id: str, fmt: str) -> list[str]:
    """One ``sacct -X`` row of the job, split (e.g. fmt ``State,ExitCode,Start,End``)."""
    out = cluster.slurm(
        ["sacct", "-X", "--parsable2", "--noheader", "-j", job_id, f"--format={fmt}"]
    ).stdout.strip()
    return out.splitlines()[0].split("|") if out else []


def sacct_times(cluster: DevCluster, job_id: str) -> tuple[float, float]:
    """(Start, End) of the job in epoch seconds (1 s resolution, local time)."""
    start, end = sacct_fields(cluster, job_id, "Start,End")
    return (
        datetime.datetime.fromisoformat(start).timestamp(),
        datetime.datetime.fromisoformat(end).timestamp(),
    )


def wait_state(
    cluster: DevCluster, job_id: str, want: str = "RUNNING", timeout: float = 120
) -> None:
    """Wait until squeue shows the job in state ``want`` (queued behind others is fine)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        last = cluster.slurm(
            ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], check=False
        ).stdout.strip()
        if last == want:
            return
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} not {want} after {timeout:g} s (last {last!r})")


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate()`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not after {timeout:g} s")


def verify(
    cluster: DevCluster, job_id: str, log_dir: Path, *extra: str
) -> tuple[int, dict[str, Any]]:
    """Run the real ``llmd-supervisor verify --json``; return its status and receipt."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmd_supervisor",
            "verify",
            job_id,
            "--log-dir",
            str(log_dir),
            "--json",
            "--interval",
            "0.3",
            "--timeout",
            "20",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cluster.slurm_env,
        check=False,
    )
    assert proc.stdout, proc.stderr
    receipt = json.loads(proc.stdout)
    assert isinstance(receipt, dict)
    return proc.returncode, receipt
