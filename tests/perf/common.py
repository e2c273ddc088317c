"""Shared pieces of the benchmark harness: machine facts, statistics, sdiag, held jobs.

Nothing here asserts on timing; the harness reports numbers against targets.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.devcluster import REPO, DevCluster


def say(text: str) -> None:
    """Progress and the report on stdout (the harness's terminal output)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# --- statistics ----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, median, p95, min, max of the samples (None when there are none)."""
    return {
        "n": len(values),
        "median": percentile(values, 50),
        "p95": percentile(values, 95),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }


# --- the machine and the code under test -------------------------------------------------------


def machine() -> dict[str, object]:
    """Cores, memory and load of this machine (the report prints them)."""
    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    load = os.getloadavg()
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "memory_gb": round(mem_kb / 1024 / 1024, 1),
        "loadavg": [round(x, 2) for x in load],
        "kernel": os.uname().release,
    }


def code_under_test(package_dir: Path) -> dict[str, object]:
    """Which code was measured: HEAD, files differing from it, and the poller's hash."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()

    poller = package_dir / "supervision" / "cluster" / "poller.py"
    return {
        "head": git("rev-parse", "HEAD"),
        "head_subject": git("log", "-1", "--format=%s"),
        "uncommitted": git("status", "--porcelain", "--", "llmd_supervisor").splitlines(),
        "package_dir": str(package_dir),
        "poller_sha256": hashlib.sha256(poller.read_bytes()).hexdigest()[:16],
    }


# --- sdiag ---------------------------------------------------------------------------------------

_RPC_LINE = re.compile(r"^\s+(\S+)\s+\(\s*\d+\)\s+count:(\d+)")
# Our own sdiag calls; not load the supervisor or the baseline causes.
_OWN_TYPES = frozenset({"REQUEST_STATS_INFO"})


# The harness's own Slurm traffic runs as this user, so that sdiag's per-user counts
# separate it from the other sessions on the shared cluster (they all run as root).
RPC_USER = "nobody"
RPC_UID = 65534
AS_RPC_USER = ("setpriv", f"--reuid={RPC_UID}", f"--regid={RPC_UID}", "--clear-groups", "--")


@dataclass
class Sdiag:
    """RPC counts since the last reset, by message type (all users) and by user."""

    by_type: dict[str, int]
    by_user: dict[str, int]


def sdiag_counts(cluster: DevCluster) -> Sdiag:
    """Parse sdiag's RPC sections (sdiag's own REQUEST_STATS_INFO left out of by_type)."""
    out = _sdiag(cluster).stdout
    found = Sdiag({}, {})
    section: dict[str, int] | None = None
    for line in out.splitlines():
        if line.startswith("Remote Procedure Call statistics by message type"):
            section = found.by_type
            continue
        if line.startswith("Remote Procedure Call statistics by user"):
            section = found.by_user
            continue
        if section is None:
            continue
        m = _RPC_LINE.match(line)
        if m is None:
            if line.strip():
                section = None
            continue
        if m.group(1) not in _OWN_TYPES:
            section[m.group(1)] = int(m.group(2))
    return found


def sdiag_reset(cluster: DevCluster) -> None:
    _sdiag(cluster, "--reset")


class SlurmctldSwamped(RuntimeError):
    """sdiag went unanswered three times: slurmctld is swamped (by the naive baseline's
    hundreds of squeue loops on this 2-core machine, say): a finding, not a harness bug."""


def _sdiag(cluster: DevCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """sdiag, asked up to three times: a slurmctld busy with hundreds of held jobs can let
    one call time out (seen on 24.11 in quick mode: "Socket timed out on send/recv")."""
    for attempt in range(3):
        if attempt:
            time.sleep(5)
        proc = cluster.slurm(["sdiag", *args], check=False, timeout=60)
        if proc.returncode == 0:
            return proc
    raise SlurmctldSwamped(
        f"`sdiag {' '.join(args)}` failed three times (exit {proc.returncode}): "
        f"{proc.stderr.strip()[-300:]}"
    )


@dataclass
class RpcWindow:
    """RPCs counted by sdiag over one window, read every `step_s`."""

    seconds: float
    total: int  # every user's RPCs (other sessions included)
    mine: int  # RPCs by RPC_USER: the traffic of what the harness runs
    by_type: dict[str, int]
    step_rates: list[float]  # RPC_USER's RPCs/min of each sub-interval
    reset_by_someone_else: bool = False

    @property
    def per_min(self) -> float:
        return self.mine * 60 / self.seconds if self.seconds else 0.0

    @property
    def all_users_per_min(self) -> float:
        return self.total * 60 / self.seconds if self.seconds else 0.0


def measure_rpcs(cluster: DevCluster, seconds: float, step_s: float = 10.0) -> RpcWindow:
    """sdiag --reset, then read sdiag every `step_s` for `seconds`."""
    sdiag_reset(cluster)
    t0 = time.monotonic()
    first = prev = sdiag_counts(cluster)
    prev_t = t0
    rates: list[float] = []
    broken = False
    end = t0 + seconds
    while True:
        now = time.monotonic()
        if now >= end:
            break
        time.sleep(min(step_s, end - now))
        counts = sdiag_counts(cluster)
        t = time.monotonic()
        delta = counts.by_user.get(RPC_USER, 0) - prev.by_user.get(RPC_USER, 0)
        if sum(counts.by_type.values()) < sum(prev.by_type.values()) or delta < 0:
            broken = True  # another session reset the counters under us
        else:
            rates.append(delta * 60 / (t - prev_t))
        prev, prev_t = counts, t
    by_type = {
        k: v - first.by_type.get(k, 0)
        for k, v in prev.by_type.items()
        if v - first.by_type.get(k, 0) > 0
    }
    mine = prev.by_user.get(RPC_USER, 0) - first.by_user.get(RPC_USER, 0)
    return RpcWindow(prev_t - t0, sum(by_type.values()), mine, by_type, rates, broken)


# --- held jobs -------------------------------------------------------------------------------


def submit_held(cluster: DevCluster, count: int, prefix: str) -> list[str]:
    """Submit `count` held 1-node `sleep` jobs as RPC_USER (they stay PENDING); their ids."""

    def one(i: int) -> str:
        out = cluster.slurm(
            [
                *AS_RPC_USER,
                "sbatch",
                "--chdir=/tmp",
                "--parsable",
                "--hold",
                f"--job-name={prefix}{i}",
                "--output=/dev/null",
                "--time=5",
                "--wrap=sleep 1",
            ]
        ).stdout
        return out.strip().split(";")[0]

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, range(count)))


def scancel(cluster: DevCluster, job_ids: Iterable[str]) -> None:
    """Cancel these jobs by id; errors for already-gone jobs are ignored.

    Chunks of 50 with two minutes each: scancel asks slurmctld once per id, and 200 ids
    of running jobs took longer than the 30 s the harness gave them (measured, 24.11)."""
    ids = list(job_ids)
    for i in range(0, len(ids), 50):
        cluster.slurm(["scancel", "--quiet", *ids[i : i + 50]], check=False, timeout=120)


# Runs that must stay PENDING ask for this reservation, which starts in a week: Slurm keeps
# them waiting for it (`--hold` is not among the sbatch options a run spec may pass).
HOLD_RESERVATION = "llmd-perf-hold"


@contextmanager
def hold_reservation(cluster: DevCluster) -> Iterator[str]:
    """The reservation that keeps `held_spec` runs pending, for the harness's lifetime."""
    cluster.slurm(["scontrol", "delete", f"ReservationName={HOLD_RESERVATION}"], check=False)
    cluster.slurm(
        [
            "scontrol",
            "create",
            "reservation",
            f"ReservationName={HOLD_RESERVATION}",
            "StartTime=now+7days",
            "Duration=60",
            "Users=root",
            "Nodes=ALL",
        ]
    )
    try:
        yield HOLD_RESERVATION
    finally:
        cluster.slurm(["scontrol", "delete", f"ReservationName={HOLD_RESERVATION}"], check=False)


# --- processes -------------------------------------------------------------------------------

_CLK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int, *, children: bool = True) -> float | None:
    """utime+stime (and reaped children's, when asked) of `pid`, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the ")": state is field 3, utime 14, stime 15, cutime 16, cstime 17 (1-based).
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _CLK


def proc_mem_kb(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (from status) and Pss (from smaps_rollup) in kB; {} if gone."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1])
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                out["Pss"] = int(line.split()[1])
    except OSError:
        return {}
    return out


def session_pids(sids: set[int]) -> list[int]:
    """Every live process whose session id is one of `sids`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sids:  # field 6 (1-based): session
            pids.append(int(entry.name))
    return pids


@dataclass
class LineReader:
    """Reads a child's stdout in a thread and stamps each line with its arrival time."""

    proc: subprocess.Popen[bytes]
    lines: list[tuple[float, bytes]] = field(default_factory=list)
    nbytes: int = 0
    byte_times: list[tuple[float, int]] = field(default_factory=list)  # (t, total) per read
    _thread: threading.Thread | None = None
    by_lines: bool = True

    def start(self) -> LineReader:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        out: IO[bytes] | None = self.proc.stdout
        assert out is not None
        if self.by_lines:
            for line in out:
                self.lines.append((time.time(), line))
                self.nbytes += len(line)
        else:
            while True:
                chunk = os.read(out.fileno(), 1 << 20)
                if not chunk:
                    break
                self.nbytes += len(chunk)
                self.byte_times.append((time.time(), self.nbytes))

    def wait_for(self, needle: bytes, timeout: float) -> float | None:
        """Arrival time of the first line containing `needle`, waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if needle in line:
                    return t
            time.sleep(0.02)
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=5)


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll `predicate` until it is truthy; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"{what}: not after {timeout:g} s")
