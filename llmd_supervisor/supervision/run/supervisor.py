"""The daemon's runs, as the control API, the dashboard and campaigns see them
(`Supervisor`): the entry points that make a run (`entries`), every run known
(`registry`), each driven by its cluster's leader (`driver.RunDriver`), and the nodes'
quarantine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters.journal.store import Journal, StoredRun
from llmd_supervisor.adapters.journal.writer import writing_as
from llmd_supervisor.adapters.slurm.runner import DEFAULT_TIMEOUT_S
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.run.kinds import RunKind
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.run.lifecycle import (
    CancelRequested,
    Event,
    RunState,
)
from llmd_supervisor.core.run.retry_policy import Quarantined, quarantine
from llmd_supervisor.core.spec.foreign import ForeignSpec
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.supervision.cluster.clusters import Cluster
from llmd_supervisor.supervision.ha.leading import Roles
from llmd_supervisor.supervision.run import (
    retries,
)
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.driver import Hooks, RunDriver, RunHandle
from llmd_supervisor.supervision.run.entries import RunEntries
from llmd_supervisor.supervision.run.outbound import Outbound
from llmd_supervisor.supervision.run.records import (
    ToJournal,
)
from llmd_supervisor.supervision.run.registry import RunRegistry
from llmd_supervisor.supervision.run.verify_job import utcnow

log = structlog.get_logger("llmd_supervisor.runs")

# A new leader reconciles a run the previous one left `submitting` this long after it took
# over: that leader started an sbatch only while it could act (`submit`), and its sbatch
# ends (or is killed) within the Slurm client's timeout.
IN_FLIGHT_S = DEFAULT_TIMEOUT_S + 2.0


class Supervisor:
    """Owns every run's driver; the control API talks to it."""

    def __init__(
        self,
        config: Config,
        journal: Journal,
        clusters: Mapping[str, Cluster],
        tg: anyio.abc.TaskGroup,
        *,
        clock: Callable[[], datetime] = utcnow,
        hooks: Hooks | None = None,
        roles: Roles | None = None,
    ) -> None:
        self._config = config
        self.journal = journal
        self.clusters = clusters
        self.tg = tg
        self.clock = clock
        self.hooks = hooks or Hooks()
        self.roles = roles or Roles.single_node([c.name for c in config.clusters])
        self.outbound = Outbound(config, journal)
        self.driver = RunDriver(
            config,
            journal,
            self.roles,
            self.outbound,
            clock=lambda: self.clock(),
            hooks=self.hooks,
        )
        self.registry: RunRegistry[RunHandle] = RunRegistry(
            config.archive_root, journal, self.roles, self._new_handle
        )
        self.entries = RunEntries(
            config,
            journal,
            clusters,
            self.roles,
            self.registry,
            self.outbound,
            clock=lambda: self.clock(),
            start=self._start,
            context=self.context,
            after_journal=lambda run: self.hooks.after_journal(run),
        )

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """A configuration replaced (a test's): every part reads the new one from now on."""
        self._config = self.driver.config = self.outbound.config = self.entries.config = config

    @property
    def handles(self) -> dict[str, RunHandle]:
        """Every run this daemon knows, by id (`registry`)."""
        return self.registry.handles

    # --- entry points (`entries`) --------------------------------------------------------

    async def submit(
        self,
        spec_toml: str,
        *,
        owner_uid: int,
        cluster: str | None = None,
        run_id: str | None = None,
    ) -> RunHandle:
        """A run spec: validated, rendered, journaled and supervised (`entries`)."""
        return await self.entries.submit(
            spec_toml, owner_uid=owner_uid, cluster=cluster, run_id=run_id
        )

    async def submit_script(
        self,
        spec_json: str,
        *,
        owner_uid: int,
        cluster: str | None = None,
        run_id: str | None = None,
    ) -> RunHandle:
        """A user's own batch script, submitted once as it is (`entries`)."""
        return await self.entries.submit_script(
            spec_json, owner_uid=owner_uid, cluster=cluster, run_id=run_id
        )

    async def adopt(
        self, spec_json: str, *, owner_uid: int, privileged: bool, cluster: str | None = None
    ) -> RunHandle:
        """A job submitted without the daemon becomes a run (`entries`)."""
        return await self.entries.adopt(
            spec_json, owner_uid=owner_uid, privileged=privileged, cluster=cluster
        )

    async def admit(self, spec_toml: str, cluster: str | None = None) -> RunSpec:
        """The validated spec, as `submit` (and a dry run) accepts it (`admission`)."""
        return await self.entries.admit(spec_toml, cluster)

    async def admit_foreign(self, spec_json: str, cluster: str | None, kind: str) -> ForeignSpec:
        """The validated foreign spec of `kind` (script or adopt): `admission`."""
        return await self.entries.admit_foreign(spec_json, cluster, kind)

    async def resume_all(self) -> int:
        """Start a driver for every run the journal holds as not final; return how many
        (a single-node journal: a shared one's runs start with each cluster's tenure,
        `take_over`)."""
        count = 0
        for handle in await self.registry.load():
            count += self._start(handle)
        return count

    async def take_over(self, cluster: str) -> None:
        """This daemon now leads `cluster` (`leading.Roles.follow`): load its runs from the
        journal as they are now and drive every one not final. A run left `submitting`
        by the previous leader is reconciled only after `IN_FLIGHT_S`: its sbatch, if one
        was in flight, has ended by then."""
        resumed = await self.registry.load(cluster, full=True)
        in_flight_until = anyio.current_time() + IN_FLIGHT_S
        for handle in resumed:
            if handle.run.state is RunState.SUBMITTING:
                self.roles.start(self.tg, cluster, self._supervise_at, handle, in_flight_until)
            else:
                self._start(handle)
        log.info("cluster.taken_over", cluster=cluster, resumed=len(resumed))

    async def refresh(self, cluster: str) -> None:
        """A standby's look at the journal: the leader's runs of `cluster` as they are
        now, for list, status and wait (`_refresh`: with every other run this daemon
        does not drive that changed)."""
        await self.registry.refresh()

    async def refresh_elsewhere(self) -> None:
        """The shared journal's runs of clusters this daemon does not have (the team's
        other clusters), as they are now, for list and status (`_refresh`)."""
        await self.registry.refresh()

    async def look_again(self) -> bool:
        """A run ref no handle answers: read the shared journal again (`registry`)."""
        return await self.registry.look_again()

    def get(self, ref: str) -> RunHandle | None:
        """A run by id, job name or Slurm job id."""
        return self.registry.get(ref)

    def take_changed(self) -> list[RunHandle]:
        """The handles new or changed since the last call (`registry`)."""
        return self.registry.take_changed()

    def _start(self, handle: RunHandle) -> bool:
        """Drive `handle` in its cluster's tenure; False when this daemon does not lead
        that cluster (its leader drives it)."""
        return self.roles.start(self.tg, handle.meta.cluster, self.driver.supervise, handle)

    async def _supervise_at(self, h: RunHandle, at: float) -> None:
        await anyio.sleep_until(at)
        await self.driver.supervise(h)

    async def nodes(self, release: tuple[str, str] | None = None) -> tuple[list[Quarantined], bool]:
        """Every node with failures counted, after releasing (cluster, node) if given; the
        runs held for want of nodes look again at once."""
        released = False
        if release is not None:
            await self.roles.require(release[0])
            with writing_as(functools.partial(self.roles.writer, release[0])):
                released = await self.journal.release_node(*release)
            log.info("node.released", cluster=release[0], node=release[1], had=released)
            for h in self.handles.values():
                if h.run.state is RunState.ACCEPTED:
                    h.notify()
        counted = await self.journal.node_failures()
        rules = retries.rules(self.config.limits)
        return quarantine(counted, now=self.clock(), rules=rules), released

    async def cancel(self, handle: RunHandle) -> None:
        """Journal the cancel request (IllegalTransition if the run is already final); the
        run's driver then makes sure the cancel sequence runs, now or after any retry."""
        await self.roles.require(handle.meta.cluster)
        with writing_as(functools.partial(self.roles.writer, handle.meta.cluster)):
            await self.apply(handle, CancelRequested())

    def _new_handle(self, stored: StoredRun, kind: RunKind, changes: set[str]) -> RunHandle:
        archive_dir = Path(stored.meta.archive_dir)
        layout = RunLayout(kind.log_dir, stored.run.slurm_job_name, archive_dir, kind.watch)
        cluster = self.clusters.get(stored.meta.cluster)
        return RunHandle(stored, kind, cluster, layout, changes=changes)

    def context(self, h: RunHandle) -> RunContext:
        """The run as its phases see it (`RunDriver.context`)."""
        return self.driver.context(h)

    async def apply(self, h: RunHandle, event: Event, logged: Sequence[ToJournal] = ()) -> None:
        """Apply `event` to the run (`RunDriver.apply`)."""
        await self.driver.apply(h, event, logged)
