"""The daemon root (`supervision.daemon.serve`) in process, on a replayed Slurm cluster.

Fast, in addition to the real-cluster daemon tests: it serves the control socket, drives a
run to its verified outcome, and on SIGTERM stops without touching the job, which the next
start resumes to the end.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.control.client import ControlClient
from llmd_supervisor.core.config import ClusterConfig, Config, Limits, PollConfig, SshConfig
from llmd_supervisor.core.journal.url import SqliteJournal
from llmd_supervisor.core.protocol.runs import RunSummary, read
from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.supervision.daemon import serve
from llmd_supervisor.supervision.run.driver import Hooks
from tests.devcluster import REPO
from tests.fakes.bench_results import finish_job
from tests.fakes.slurm_replay import End, ReplayCluster, Start
from tests.postgres import JournalTarget


def _config(tmp: Path) -> Config:
    (tmp / "known_hosts").write_text("")
    (tmp / "run").mkdir(exist_ok=True)  # as systemd's RuntimeDirectory would
    with socket.socket() as s:  # node links go to a closed loopback port
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    return Config(
        state_dir=tmp / "state",
        log_roots=(str(tmp),),
        socket_path=tmp / "run" / "control.sock",  # its directory is the daemon's own
        ssh=SshConfig(known_hosts=str(tmp / "known_hosts"), port=port, connect_timeout_s=0.5),
        poll=PollConfig(min_interval_s=0.05, max_interval_s=0.2),
        limits=Limits(verify_timeout_s=10, finish_drain_s=1, heartbeat_interval_s=0.2),
        clusters=(ClusterConfig("dev"),),
    )


def _spec(log_dir: Path) -> str:
    text = (REPO / "deploy" / "llm-d" / "demo.toml").read_text()
    return "\n".join(
        f'log_dir = "{log_dir}"' if line.startswith("log_dir =") else line
        for line in text.splitlines()
    )


class Daemon:
    """serve() in this process, stopped by a real SIGTERM as systemd would."""

    def __init__(self, config: Config, replay: ReplayCluster) -> None:
        self.config, self.replay = config, replay
        self.ready = anyio.Event()
        self.messages: list[str] = []

    def notify(self, message: str) -> None:
        self.messages.append(message)
        if message.startswith("READY=1"):
            self.ready.set()

    async def run(self) -> None:
        await serve(self.config, notify=self.notify, hooks=Hooks(runner=self.replay))

    async def call(self, op: str, **args: object) -> Mapping[str, object]:
        async with ControlClient(self.config.socket_path) as client:
            return await client.call(op, args)

    async def status(self, run: str) -> RunSummary:
        return read(RunSummary, await self.call("status", run=run))

    async def until_state(self, run: str, *states: str) -> RunSummary:
        """Follow the `wait` stream (one summary per change) until the run is in a state."""
        with anyio.fail_after(20):
            async with ControlClient(self.config.socket_path) as client:
                async for item in client.stream("wait", {"run": run}):
                    summary = read(RunSummary, item.get("final", item))
                    if summary["state"] in states:
                        return summary
        raise AssertionError(f"run {run} ended {summary['state']}, not in {states}")


async def _started(daemon: Daemon, tg: anyio.abc.TaskGroup) -> None:
    tg.start_soon(daemon.run)
    with anyio.fail_after(10):
        await daemon.ready.wait()


def _publish_marker(summary: RunSummary, log_dir: Path) -> None:
    finish_job(log_dir, str(summary["slurm_job_id"]), load_spec(_spec(log_dir)).benchmark)


@pytest.mark.asyncio
async def test_sigterm_stops_the_daemon_and_never_the_job_and_a_restart_resumes_it(
    tmp_path: Path, journal_target: JournalTarget
) -> None:
    """On either journal (SQLite; PostgreSQL: [journal] url, tests/postgres.py)."""
    replay = ReplayCluster(touch_files=True)
    config = replace(_config(tmp_path), journal=journal_target.postgres or SqliteJournal())
    log_dir = tmp_path / "logs"
    daemon = Daemon(config, replay)
    async with anyio.create_task_group() as tg:
        await _started(daemon, tg)
        assert await daemon.call("ping") == {"pong": True}
        submitted = read(RunSummary, await daemon.call("submit", spec_toml=_spec(log_dir)))
        run = submitted["run"]
        replay.expect(submitted["job_name"], Start(("127.0.0.1",)), End(JobState.COMPLETED))
        pending = await daemon.until_state(run, "pending")
        replay.step()
        await daemon.until_state(run, "running")
        os.kill(os.getpid(), signal.SIGTERM)  # what `systemctl stop` sends
    assert any(m.startswith("STOPPING=1") for m in daemon.messages)
    job = replay.job(submitted["job_name"])
    assert job.signals == [] and job.state is JobState.RUNNING  # the job was not touched
    assert not config.socket_path.exists()

    again = Daemon(config, replay)
    async with anyio.create_task_group() as tg:
        await _started(again, tg)
        assert (await again.status(run))["state"] == "running"  # resumed, not resubmitted
        _publish_marker(pending, log_dir)
        replay.step()
        final = await again.until_state(run, "succeeded", "failed")
        assert final["state"] == "succeeded", final["reason"]
        os.kill(os.getpid(), signal.SIGTERM)
    assert replay.count("sbatch") == 1
    assert (Path(final["archive"]) / "receipt.json").exists()
