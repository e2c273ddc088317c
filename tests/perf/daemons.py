"""Driving the real daemon for the benchmarks: default config, control calls, run specs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import anyio

from llmd_supervisor.adapters.control.client import ControlClient, list_all
from llmd_supervisor.core.run.lifecycle import RunState
from tests.daemon_helpers import Daemon, demo_spec
from tests.perf.common import HOLD_RESERVATION

ANY_STATES = {str(s) for s in RunState}
FINAL_STATES = {str(s) for s in RunState if s.is_final}

# Engine ports reserved for the benchmarks (other sessions use 8200-8699).
PORT_LO, PORT_HI = 8700, 8799


class Ports:
    """Hands out engine ports from 8700-8799, 10 apart, round robin: a demo job uses its
    port and the next three (sidecar, router, router admin), and jobs share nodes."""

    def __init__(self) -> None:
        self._next = PORT_LO

    def take(self) -> int:
        port = self._next
        self._next = PORT_LO + (self._next + 10 - PORT_LO) % (PORT_HI - PORT_LO + 1)
        return port


def short_spec(log_dir: Path, port: int) -> str:
    """The demo run with one benchmark point: ends by itself ~1-2 s after it starts."""
    text = demo_spec(log_dir, port=port)
    return _replace_once(text, "concurrencies = [1, 2, 4]", "concurrencies = [1]")


HANG_RANKS = 2  # a hang_spec job's nodes


def hang_spec(log_dir: Path, port: int, grace_s: int = 5) -> str:
    """The demo run whose benchmark hangs: RUNNING until cancelled (or its 5 min limit).
    One prefill and one decode node, so that two of them run at once on the 4-node dev
    cluster (the cancel bench runs the project's and the baseline's side by side)."""
    text = demo_spec(
        log_dir,
        port=port,
        grace_s=grace_s,
        decode_nodes=1,
        tables={"bench": {"LLMD_FAKE_BENCH_HANG": "1"}},
    )
    text = _replace_once(text, "prefill_nodes = 2", "prefill_nodes = 1")
    return _replace_once(text, "prefill_workers = 2", "prefill_workers = 1")


def held_spec(log_dir: Path, port: int) -> str:
    """The demo run in the reservation that starts in a week (`common.hold_reservation`):
    PENDING until cancelled."""
    text = demo_spec(log_dir, port=port)
    held = f'requeue = false\nextra_args = ["--reservation={HOLD_RESERVATION}"]'
    return _replace_once(text, "requeue = false", held)


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise ValueError(f"{old!r} does not occur exactly once in the demo spec")
    return text.replace(old, new)


@dataclass
class PerfDaemon(Daemon):
    """The daemon with the shipped defaults (no test overrides of [limits] or [poll])."""

    def write_config(self) -> None:
        self.config_path.write_text(
            f"""
[daemon]
state_dir = "{self.state_dir}"
socket = "{self.socket}"
log_format = "json"
log_roots = ["/var/tmp"]
{self.cluster.daemon_config()}"""
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def ctl(self, op: str, args: dict[str, object] | None = None) -> Mapping[str, object]:
        """One control call, answered in-process (no CLI start-up cost)."""

        async def go() -> Mapping[str, object]:
            with anyio.fail_after(120):
                async with ControlClient(self.socket) as c:
                    return await c.call(op, args or {})

        return anyio.run(go)

    def submit_many(self, specs: Sequence[str], concurrency: int = 8) -> list[Mapping[str, object]]:
        """Submit specs over the control socket, `concurrency` at a time; the run summaries."""
        results: list[Mapping[str, object]] = [{} for _ in specs]

        async def one(i: int, limiter: anyio.CapacityLimiter) -> None:
            async with limiter:
                with anyio.fail_after(300):
                    async with ControlClient(self.socket) as c:
                        results[i] = await c.call(
                            "submit", {"spec_toml": specs[i], "spec_path": f"perf-{i}.toml"}
                        )

        async def go() -> None:
            limiter = anyio.CapacityLimiter(concurrency)
            async with anyio.create_task_group() as tg:
                for i in range(len(specs)):
                    tg.start_soon(one, i, limiter)

        anyio.run(go)
        return results

    def runs(self) -> list[dict[str, object]]:
        async def go() -> Mapping[str, object]:
            with anyio.fail_after(120):
                async with ControlClient(self.socket) as c:
                    return await list_all(c, all_runs=True)

        value = anyio.run(go).get("runs", [])
        assert isinstance(value, list)
        return [r for r in value if isinstance(r, dict)]

    def wait_runs(
        self, run_ids: Iterable[str], states: set[str], timeout: float
    ) -> dict[str, dict[str, object]]:
        """Wait until every run is in one of `states`; their summaries."""
        wanted = set(run_ids)
        deadline = time.monotonic() + timeout
        last: dict[str, dict[str, object]] = {}
        while time.monotonic() < deadline:
            last = {str(r["run"]): r for r in self.runs() if r["run"] in wanted}
            if len(last) == len(wanted) and all(r["state"] in states for r in last.values()):
                return last
            time.sleep(0.3)
        behind = {k: v.get("state") for k, v in last.items() if v.get("state") not in states}
        raise TimeoutError(f"runs not in {sorted(states)} after {timeout:g} s: {behind}")

    def job_ids(self) -> list[str]:
        """Every Slurm job id this daemon's log says it submitted or reconciled."""
        ids = [str(e["slurm_job_id"]) for e in self.events("run.submitted")]
        ids += [str(e["slurm_job_id"]) for e in self.events("run.reconciled")]
        return ids

    def records(self, start: int | None = None) -> list[dict[str, object]]:
        """The JSON log records, of one start (1-based) or of all."""
        paths = (
            [self.root / f"daemon-{start}.log"]
            if start is not None
            else sorted(self.root.glob("daemon-*.log"))
        )
        out: list[dict[str, object]] = []
        for path in paths:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    out.append(record)
        return out


def log_time(record: dict[str, object]) -> float:
    """Epoch seconds of a daemon JSON log record."""
    return datetime.fromisoformat(str(record["timestamp"])).timestamp()
