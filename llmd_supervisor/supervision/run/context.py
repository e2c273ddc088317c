"""What a phase of a run may read and emit (`RunContext`), and nothing more.

A phase reads the run's journaled record and its events, the cluster, the daemon's
configuration and the clock; it may journal events of its own (`emit`) and wait for the
run to change. It never changes the run: it returns the lifecycle event (or the value)
that the driver (`driver`, the only module that holds a run's handle) then applies.
Everything here is read-only to a phase: the Protocol's members are properties.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Protocol

import anyio

from llmd_supervisor.adapters.journal.store import Journal, RunMeta
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.run.kinds import RunKind
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.run.lifecycle import Run
from llmd_supervisor.core.spec.foreign import ForeignSpec
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.supervision.cluster.clusters import Cluster
from llmd_supervisor.supervision.run.attempt import Attempt
from llmd_supervisor.supervision.run.bench_files import JudgedFiles
from llmd_supervisor.supervision.run.records import AttemptEntry, JournalEvent


class RunContext(Protocol):
    """One run, as a phase sees it."""

    @property
    def run(self) -> Run:
        """The run's journaled record."""
        ...

    @property
    def meta(self) -> RunMeta: ...

    @property
    def spec(self) -> RunSpec | ForeignSpec: ...

    @property
    def kind(self) -> RunKind:
        """What the run is (`core.run.kinds`): what differs between its kinds."""
        ...

    @property
    def layout(self) -> RunLayout:
        """Every path of the run (its current job's batch logs included)."""
        ...

    @property
    def cluster(self) -> Cluster:
        """The run's cluster (SupervisorError when it is no longer configured)."""
        ...

    @property
    def config(self) -> Config: ...

    @property
    def journal(self) -> Journal: ...

    @property
    def history(self) -> Sequence[AttemptEntry]:
        """The run's ended attempts (`records.ATTEMPT_EVENT`), oldest first."""
        ...

    @property
    def attempt(self) -> Attempt | None:
        """The current (or last) watched allocation."""
        ...

    @property
    def scontrol_snapshot(self) -> str | None:
        """The last `scontrol show job` record, taken in `finishing`."""
        ...

    @property
    def judged_files(self) -> JudgedFiles | None:
        """What the last verdict was made from (None: no verdict in this process yet)."""
        ...

    @property
    def version(self) -> int:
        """Grows with every change of the run (`until_changed`)."""
        ...

    def now(self) -> datetime: ...

    def lease_time_left(self) -> float:
        """Seconds this daemon may still act for the run's cluster without renewing its
        lease (inf on a single-node journal): an sbatch starts only with enough."""
        ...

    def job_id(self) -> str:
        """The run's Slurm job id (IllegalTransition before it has one)."""
        ...

    def starttime(self) -> str:
        """sacct --starttime covering the run's submission."""
        ...

    def new_attempt(self, nodes: tuple[str, ...]) -> Attempt:
        """An attempt object for the run's current allocation (not started)."""
        ...

    async def events(self) -> list[JournalEvent]:
        """The run's journaled events, in order."""
        ...

    async def emit(self, kind: str, fields: Mapping[str, object]) -> None:
        """Journal an event of the run (not a change of its record)."""
        ...

    async def wait_change(self, seconds: float) -> None:
        """Until the run changes (a cancel, a node release) or `seconds` pass."""
        ...

    async def until_changed(self, since: int) -> None:
        """Until the run's `version` is no longer `since`."""
        ...


class RunView(Protocol):
    """What `LiveContext` reads of a run's handle (the driver's `RunHandle`)."""

    @property
    def run(self) -> Run: ...
    @property
    def meta(self) -> RunMeta: ...
    @property
    def spec(self) -> RunSpec | ForeignSpec: ...
    @property
    def kind(self) -> RunKind: ...
    @property
    def layout(self) -> RunLayout: ...
    @property
    def cluster(self) -> Cluster: ...
    @property
    def history(self) -> Sequence[AttemptEntry]: ...
    @property
    def attempt(self) -> Attempt | None: ...
    @property
    def scontrol_snapshot(self) -> str | None: ...
    @property
    def judged_files(self) -> JudgedFiles | None: ...
    @property
    def version(self) -> int: ...
    @property
    def changed(self) -> anyio.Event: ...
    def job_id(self) -> str: ...
    def starttime(self) -> str: ...


class LiveContext:
    """A supervised run as its phases see it (`RunContext`): read-only, and what they
    emit goes to the journal as the run's events."""

    def __init__(
        self,
        h: RunView,
        config: Config,
        journal: Journal,
        clock: Callable[[], datetime],
        time_left: Callable[[], float],
        new_attempt: Callable[[tuple[str, ...]], Attempt],
    ) -> None:
        self._h = h
        self._config = config
        self._journal = journal
        self._clock = clock
        self._time_left = time_left
        self._new_attempt = new_attempt

    @property
    def run(self) -> Run:
        return self._h.run

    @property
    def meta(self) -> RunMeta:
        return self._h.meta

    @property
    def spec(self) -> RunSpec | ForeignSpec:
        return self._h.spec

    @property
    def kind(self) -> RunKind:
        return self._h.kind

    @property
    def layout(self) -> RunLayout:
        return self._h.layout

    @property
    def cluster(self) -> Cluster:
        return self._h.cluster

    @property
    def config(self) -> Config:
        return self._config

    @property
    def journal(self) -> Journal:
        return self._journal

    @property
    def history(self) -> Sequence[AttemptEntry]:
        return tuple(self._h.history)

    @property
    def attempt(self) -> Attempt | None:
        return self._h.attempt

    @property
    def scontrol_snapshot(self) -> str | None:
        return self._h.scontrol_snapshot

    @property
    def judged_files(self) -> JudgedFiles | None:
        return self._h.judged_files

    @property
    def version(self) -> int:
        return self._h.version

    def now(self) -> datetime:
        return self._clock()

    def job_id(self) -> str:
        return self._h.job_id()

    def lease_time_left(self) -> float:
        return self._time_left()

    def starttime(self) -> str:
        return self._h.starttime()

    def new_attempt(self, nodes: tuple[str, ...]) -> Attempt:
        return self._new_attempt(nodes)

    async def events(self) -> list[JournalEvent]:
        return list(await self._journal.events(self._h.run.run_id))

    async def emit(self, kind: str, fields: Mapping[str, object]) -> None:
        await self._journal.add_event(self._h.run.run_id, kind, fields, self._clock())

    async def wait_change(self, seconds: float) -> None:
        changed = self._h.changed
        with anyio.move_on_after(seconds):
            await changed.wait()

    async def until_changed(self, since: int) -> None:
        while self._h.version == since:
            await self._h.changed.wait()
