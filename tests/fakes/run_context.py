"""A `RunContext` for one phase of a run at a time (`llmd_supervisor.supervision.run`):
the run's record, spec and history set by the test, Slurm replayed
(tests/fakes/slurm_replay.py), the run's events kept in memory, a real journal (SQLite in
the test's directory) for the node failures. A phase is checked in milliseconds, without
a driver, a daemon or a cluster.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio

from llmd_supervisor.adapters.files import archive as archive
from llmd_supervisor.adapters.journal.store import Journal, RunMeta
from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
from llmd_supervisor.adapters.slurm.runner import SlurmClient
from llmd_supervisor.core.config import ClusterConfig, Config, Limits, PollConfig
from llmd_supervisor.core.run.kinds import RunKind, kind_of
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.run.lifecycle import Run, Submit, Submitted, new_run, step
from llmd_supervisor.core.spec.foreign import ForeignSpec
from llmd_supervisor.core.spec.runspec import RunSpec, load_spec
from llmd_supervisor.errors import IllegalTransition
from llmd_supervisor.supervision.cluster.clusters import Cluster, SharedLogDir
from llmd_supervisor.supervision.cluster.poller import Poller
from llmd_supervisor.supervision.run.attempt import Attempt
from llmd_supervisor.supervision.run.bench_files import JudgedFiles
from llmd_supervisor.supervision.run.records import AttemptEntry, JournalEvent
from tests.devcluster import REPO
from tests.fakes.slurm_replay import ReplayCluster

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def demo_spec(log_dir: Path, extra: str = "") -> RunSpec:
    """The demo spec (4 nodes) writing into `log_dir`, with `extra` TOML appended."""
    lines = []
    for line in (REPO / "deploy" / "llm-d" / "demo.toml").read_text().splitlines():
        lines.append(f'log_dir = "{log_dir}"' if line.startswith("log_dir =") else line)
    return load_spec("\n".join(lines) + "\n" + extra)


@dataclass
class FakeRun:
    """One run as a phase sees it; the test sets what the driver would have."""

    run: Run
    meta: RunMeta
    spec: RunSpec | ForeignSpec
    layout: RunLayout
    cluster: Cluster
    config: Config
    journal: Journal
    replay: ReplayCluster
    history: Sequence[AttemptEntry] = ()
    attempt: Attempt | None = None
    scontrol_snapshot: str | None = None
    judged_files: JudgedFiles | None = None
    version: int = 0
    clock: datetime = T0
    emitted: list[dict[str, object]] = field(default_factory=list)  # {"at", "kind", **fields}
    waited: list[float] = field(default_factory=list)  # what `wait_change` was asked to wait
    changed: anyio.Event = field(default_factory=anyio.Event)
    lease_left: float = math.inf  # this daemon's time left to act (a shared journal's)

    @property
    def kind(self) -> RunKind:
        return kind_of(self.spec)

    def now(self) -> datetime:
        return self.clock

    def lease_time_left(self) -> float:
        return self.lease_left

    def job_id(self) -> str:
        if self.run.slurm_job_id is None:
            raise IllegalTransition(self.run.state.value, "an operation needing a Slurm job id")
        return self.run.slurm_job_id

    def starttime(self) -> str:
        start = self.replay.clock.now() - timedelta(hours=1)  # before any job of the test
        return start.astimezone().strftime("%Y-%m-%dT%H:%M:%S")

    def new_attempt(self, nodes: tuple[str, ...]) -> Attempt:
        async def record(kind: str, fields: Mapping[str, object]) -> None:
            await self.emit(kind, fields)

        return Attempt(
            number=self.run.attempt,
            job_id=self.job_id(),
            nodes=nodes,
            layout=self.layout,
            coordinator_rank=0,
            connect=self.cluster.connect,
            limits=self.config.limits,
            record=record,
            on_change=lambda: None,
            on_marker=lambda: None,
            on_bytes=lambda n: None,
        )

    async def events(self) -> list[JournalEvent]:
        return list(self.emitted)

    async def emit(self, kind: str, fields: Mapping[str, object]) -> None:
        self.emitted.append({"at": self.clock.isoformat(), "kind": kind, **fields})

    async def wait_change(self, seconds: float) -> None:
        self.waited.append(seconds)

    async def until_changed(self, since: int) -> None:
        while self.version == since:
            await self.changed.wait()

    # --- the test's side ------------------------------------------------------------------

    def kinds(self) -> list[str]:
        return [str(e["kind"]) for e in self.emitted]

    def submitted(self, job_id: str) -> None:
        """The record as the driver leaves it after `Submit` and `Submitted(job_id)`."""
        run, _ = step(self.run, Submit(), self.clock)
        self.run, _ = step(run, Submitted(job_id), self.clock)

    def change(self) -> None:
        """What the driver does on a change of the run (`RunHandle.notify`)."""
        self.version += 1
        self.changed.set()
        self.changed = anyio.Event()


@contextlib.asynccontextmanager
async def fake_run(
    tmp_path: Path,
    spec: RunSpec | ForeignSpec | None = None,
    *,
    replay: ReplayCluster | None = None,
    limits: Limits | None = None,
    owner_uid: int = 1000,
) -> AsyncIterator[FakeRun]:
    """A fresh run (`accepted`) of `spec` (default: the demo's) on a replayed cluster
    "dev", its poller running."""
    log_dir = tmp_path / "logs"
    spec = spec or demo_spec(log_dir)
    replay = replay or ReplayCluster(touch_files=True)
    config = Config(
        state_dir=tmp_path / "state",
        log_roots=(str(tmp_path),),
        poll=PollConfig(min_interval_s=0.05, max_interval_s=0.2),
        limits=limits or Limits(verify_timeout_s=10, finish_drain_s=1),
        clusters=(ClusterConfig("dev"),),
    )
    run = new_run("r1", "llmd-r1", T0)
    archive_dir = archive.prepare(config.archive_root, run.run_id, spec=("spec", ""), script="")
    watch = spec.watch if isinstance(spec, ForeignSpec) else None
    spec_log_dir = spec.watch.log_dir if isinstance(spec, ForeignSpec) else spec.log_dir
    # no script: `submit` renders it for a run spec, as for a retry
    meta = RunMeta(owner_uid, "dev", "", "", spec_log_dir, str(archive_dir), T0)
    layout = RunLayout(spec_log_dir, run.slurm_job_name, archive_dir, watch)
    client = SlurmClient(replay, timeout=5)
    poller = Poller("dev", client, config.poll, squeue_interval_s=0.05)
    cluster = Cluster(ClusterConfig("dev"), client, poller, SharedLogDir(), jobfiles.SharedFsNode)
    journal = await Journal.open(config.journal_path)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(poller.run)
            yield FakeRun(run, meta, spec, layout, cluster, config, journal, replay)
            tg.cancel_scope.cancel()
    finally:
        await journal.aclose()
