"""The naive baseline: the launcher loop bash users write, one per job.

Per job: `tail -F` of its log into a local copy, then `squeue -j ID` every 10 s until
the job is no longer listed ("done when it left the queue"). Each loop is a real bash
process in its own session (as a launcher would be), so its Slurm traffic, detection
delay and footprint are the real thing. The loop records each squeue call and the time
it noticed the end in files under its work directory.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.perf.common import proc_cpu_s, proc_mem_kb, session_pids

# $1 job id, $2 log to follow, $3 state prefix, $4 initial delay (launchers start at
# different times), $5 poll period.
LOOP = r"""
set -u
sleep "$4"
tail -F -n +1 "$2" >>"$3.copy" 2>/dev/null &
T=$!
while :; do
    echo x >>"$3.calls"
    out=$(squeue -h -j "$1" -o %i 2>/dev/null)
    [ -n "$out" ] || break
    sleep "$5"
done
date +%s.%N >"$3.done"
sleep 1
kill "$T" 2>/dev/null
wait
"""


@dataclass
class NaiveLoop:
    job_id: str
    state: Path
    proc: subprocess.Popen[bytes]


@dataclass
class NaiveLauncher:
    """Starts and stops per-job loops; reads what they recorded."""

    workdir: Path
    env: dict[str, str]
    period_s: float = 10.0
    argv_prefix: tuple[str, ...] = ()  # e.g. run the loops as another user
    loops: dict[str, NaiveLoop] = field(default_factory=dict)

    def track(self, job_id: str, log_path: str, *, stagger_s: float | None = None) -> None:
        """Start the loop for `job_id` (after a random delay in [0, stagger_s) if given)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(0o777)  # the loops may run as another user
        state = self.workdir / f"job{job_id}"
        delay = random.uniform(0, stagger_s) if stagger_s else 0.0
        proc = subprocess.Popen(
            [
                *self.argv_prefix,
                "bash",
                "-c",
                LOOP,
                "naive-loop",
                job_id,
                log_path,
                str(state),
                f"{delay:.3f}",
                f"{self.period_s:g}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.env,
            cwd="/tmp",
            start_new_session=True,
        )
        self.loops[job_id] = NaiveLoop(job_id, state, proc)

    def noticed_at(self, job_id: str) -> float | None:
        """Epoch time the loop decided the job was done, or None yet."""
        try:
            return float((self.loops[job_id].state.with_suffix(".done")).read_text())
        except (OSError, ValueError):
            return None

    def calls(self) -> int:
        total = 0
        for loop in self.loops.values():
            with contextlib.suppress(OSError):
                total += len(loop.state.with_suffix(".calls").read_bytes())
        return total // 2  # "x\n" per call

    def pids(self) -> list[int]:
        """Every live process of every loop (bash, tail, sleep, a running squeue)."""
        return session_pids({loop.proc.pid for loop in self.loops.values()})

    def footprint(self) -> dict[str, float]:
        """Summed RSS and PSS (MB) and CPU seconds (incl. reaped children) of all loops."""
        rss = pss = 0
        cpu = 0.0
        pids = self.pids()
        for pid in pids:
            mem = proc_mem_kb(pid)
            rss += mem.get("VmRSS", 0)
            pss += mem.get("Pss", 0)
            cpu += proc_cpu_s(pid, children=True) or 0.0
        return {"processes": len(pids), "rss_mb": rss / 1024, "pss_mb": pss / 1024, "cpu_s": cpu}

    def stop(self) -> None:
        """Stop every loop: SIGTERM to each loop's own process group (its id), then reap."""
        for loop in self.loops.values():
            if loop.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(loop.proc.pid, signal.SIGTERM)
        for loop in self.loops.values():
            try:
                loop.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(loop.proc.pid, signal.SIGKILL)
                loop.proc.wait(timeout=10)
        self.loops.clear()
