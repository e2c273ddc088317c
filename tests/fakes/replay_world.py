"""A whole replayed site for daemon processes: Slurm (a `ReplayCluster`) and one node (the
in-process SSH server on 127.0.0.1), in a thread of their own that outlives any daemon.

Jobs run by themselves in real time, the way the demo's do on the dev cluster: PENDING for
`pending_s`, then RUNNING on 127.0.0.1 (slurmd creates the batch logs), writing batch log
lines, then the coordinator's results and marker, then COMPLETED 0:0. A daemon started with
`Daemon(world, ..., replay_socket=world.socket)` reaches them through
`tests.fakes.replay_service.ReplayRunner` and the SSH server, so it can be SIGKILLed and
restarted while its jobs go on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.core.spec.runspec import Benchmark, load_spec
from tests.devcluster import REPO
from tests.fakes.bench_results import finish_job
from tests.fakes.replay_service import serve_replay
from tests.fakes.slurm_replay import End, ReplayCluster, ReplayJob, Start, Step
from tests.fakes.ssh_server import HOST, FakeSshServer

T = TypeVar("T")
TICK_S = 0.05


JobAction = Callable[[ReplayJob, Path], None]  # (the job, its log directory)


@dataclass(frozen=True)
class Work(Step):
    """The job's batch script at work: batch log lines, then `action` (the coordinator's
    result files and marker, say)."""

    action: JobAction | None = None
    lines: int = 20

    def apply(self, job: ReplayJob) -> None:
        out, *rest = job._output_paths()
        with open(out, "a") as f:
            for i in range(self.lines):
                f.write(f"job {job.job_id} line {i}: {'x' * (i % 50)}\n")
        for err in rest:
            with open(err, "a") as f:
                f.write(f"job {job.job_id}: a line on stderr\n")
        if self.action is not None:
            self.action(job, Path(out).parent)


@dataclass(frozen=True)
class StampedEnd(End):
    """`End`, noting the wall time it ended the job at (job id -> epoch seconds)."""

    into: dict[str, float] = field(default_factory=dict, kw_only=True)

    def apply(self, job: ReplayJob) -> None:
        super().apply(job)
        self.into[job.job_id] = time.time()


@dataclass
class ReplayWorld:
    """See the module docstring. `call` runs a function in the world's thread (the only
    thread that may touch `cluster` while the world runs)."""

    root: Path
    portal: BlockingPortal
    benchmark: Benchmark
    cluster: ReplayCluster = field(default_factory=lambda: ReplayCluster(touch_files=True))
    pending_s: float = 0.5
    running_s: float = 1.5
    end_s: float = 0.3  # from the marker to COMPLETED
    ended_at: dict[str, float] = field(default_factory=dict)  # job id -> when it ended
    ssh: FakeSshServer | None = None
    # What each job does once it runs (a hostile job plants files here), and at its end
    # (default: every point's result file, then the marker, as the demo's coordinator).
    plant: JobAction | None = None
    finish: JobAction | None = None
    paused: bool = False  # jobs stay as they are (and the clock stands) while set
    slow: dict[str, float] = field(default_factory=dict)  # program -> seconds (serve_replay)
    received: list[str] = field(default_factory=list)  # programs called, as calls arrive

    @property
    def socket(self) -> Path:
        return self.root / "slurm.sock"

    @property
    def slurm_env(self) -> dict[str, str]:
        return dict(os.environ)

    def daemon_config(self) -> str:
        assert self.ssh is not None
        return f"""
[ssh]
user = "{self.ssh.username}"
identity_files = ["{self.ssh.client_key}"]
known_hosts = "{self.ssh.known_hosts}"
port = {self.ssh.port}
connect_timeout_s = 2

[[clusters]]
name = "dev"
"""

    def call(self, fn: Callable[[], T]) -> T:
        return self.portal.call(_sync, fn)

    def pause(self, paused: bool = True) -> None:
        """Hold every job where it is (False: let them go on)."""

        def set_paused() -> None:
            self.paused = paused

        self.call(set_paused)

    def sbatch_names(self) -> list[str]:
        """The job name of every sbatch the cluster answered, in order."""
        return self.call(lambda: [j.name for j in self.cluster.jobs.values()])

    def calls_received(self, program: str) -> int:
        """How many calls of `program` reached the cluster (answered or still in flight)."""
        return self.call(lambda: self.received.count(program))

    def job_ids_named(self, name: str) -> list[str]:
        return self.call(lambda: [j.job_id for j in self.cluster.jobs.values() if j.name == name])

    def _script(self, job: ReplayJob) -> None:
        job.script_steps(
            Start((HOST,), after=self.pending_s),
            Work(self.plant, after=0.2),
            Work(self.finish or self._finish, after=self.running_s),
            StampedEnd(JobState.COMPLETED, after=self.end_s, into=self.ended_at),
        )

    def _finish(self, job: ReplayJob, log_dir: Path) -> None:
        finish_job(log_dir, job.job_id, self.benchmark)

    async def _run_jobs(self) -> None:
        """Move the fake clock with real time; a new job gets the demo's timeline."""
        scripted: set[str] = set()
        while True:
            await anyio.sleep(TICK_S)
            if self.paused:
                continue
            for job in list(self.cluster.jobs.values()):
                if job.job_id not in scripted:
                    scripted.add(job.job_id)
                    if not job.steps_left and job.state is JobState.PENDING:
                        self._script(job)
            self.cluster.advance(TICK_S)


async def _sync(fn: Callable[[], T]) -> T:
    return fn()


@contextlib.contextmanager
def replay_world(
    root: Path,
    benchmark: Benchmark,
    *,
    plant: JobAction | None = None,
    finish: JobAction | None = None,
) -> Iterator[ReplayWorld]:
    """A running `ReplayWorld` under `root`; its SSH server's processes are ended after."""
    root.mkdir(parents=True, exist_ok=True)
    with start_blocking_portal() as portal:
        world = ReplayWorld(root, portal, benchmark, plant=plant, finish=finish)
        world.ssh = FakeSshServer(root / "sshd")
        portal.call(world.ssh.start)

        async def background(*, task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    await tg.start(
                        functools.partial(serve_replay, slow=world.slow, received=world.received),
                        world.cluster,
                        world.socket,
                    )
                    tg.start_soon(world._run_jobs)
                    task_status.started(scope)

        future, scope = portal.start_task(background)
        try:
            yield world
        finally:
            portal.call(scope.cancel)
            future.result(timeout=10)
            portal.call(world.ssh.aclose)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[ReplayWorld]:
    """A running `ReplayWorld` whose jobs run the demo spec's benchmark (its log dirs are
    the test's own); the daemon's root must lie outside them (`tmp_path / "daemon"`)."""
    benchmark = load_spec((REPO / "deploy" / "llm-d" / "demo.toml").read_text()).benchmark
    with replay_world(tmp_path / "world", benchmark) as w:
        yield w


__all__ = ["JobAction", "ReplayWorld", "StampedEnd", "Work", "replay_world", "world"]
