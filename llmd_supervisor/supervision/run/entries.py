"""How a run comes to be (`RunEntries`): a spec submitted (`submit`), a user's own batch
script (`submit_script`), or a job submitted without the daemon and adopted (`adopt`).
Each is admitted (`admission`), its kind chosen once (`core.run.kinds`), its archive
prepared, and the run journaled as the run's cluster's leader before its handle is made
(`registry`) and its driver started.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Generic, Protocol, TypeVar

import anyio
import structlog

from llmd_supervisor.adapters.files import archive as archive
from llmd_supervisor.adapters.journal.store import Journal, RunMeta, StoredRun
from llmd_supervisor.adapters.journal.writer import writing_as
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.events.model import Owner
from llmd_supervisor.core.events.routing import check_named
from llmd_supervisor.core.render.script import render_sbatch
from llmd_supervisor.core.run.kinds import Rendered, RunKind, kind_of
from llmd_supervisor.core.run.lifecycle import Run, adopted_run, new_run
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.core.spec.foreign import ForeignSpec
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.supervision.cluster.clusters import Cluster
from llmd_supervisor.supervision.control.access import user_name
from llmd_supervisor.supervision.ha.leading import Roles
from llmd_supervisor.supervision.run import admission, foreign
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.outbound import Outbound
from llmd_supervisor.supervision.run.records import JobFiles
from llmd_supervisor.supervision.run.registry import Handle, RunRegistry

log = structlog.get_logger("llmd_supervisor.runs")


class EntryHandle(Handle, Protocol):
    """What an entry point needs of a run's handle beyond the registry's."""

    def use_job_files(self, files: JobFiles) -> None: ...


H = TypeVar("H", bound=EntryHandle)


class RunEntries(Generic[H]):
    """The entry points that make a run; `start` starts its driver (False: this daemon
    does not lead its cluster), `context` is the run as its phases see it, and
    `after_journal` the test seam called once the journal committed the new run."""

    def __init__(
        self,
        config: Config,
        journal: Journal,
        clusters: Mapping[str, Cluster],
        roles: Roles,
        registry: RunRegistry[H],
        outbound: Outbound,
        *,
        clock: Callable[[], datetime],
        start: Callable[[H], bool],
        context: Callable[[H], RunContext],
        after_journal: Callable[[Run], None],
    ) -> None:
        self.config = config
        self._journal = journal
        self._clusters = clusters
        self._roles = roles
        self._registry = registry
        self._outbound = outbound
        self._clock = clock
        self._start = start
        self._context = context
        self._after_journal = after_journal
        self._adopting = anyio.Lock()

    async def submit(
        self, spec_toml: str, *, owner_uid: int, cluster: str | None, run_id: str | None
    ) -> H:
        """Validate, render, journal as `accepted` and start supervising; SpecError if bad.
        A campaign chooses the `run_id` (12 hex digits) and journals it first, so that a
        restart in between finds out whether the run exists; JournalConflict if it does."""
        await self._roles.require(self.config.cluster(cluster).name)
        spec = await self.admit(spec_toml, cluster)
        owner = Owner(owner_uid, user_name(owner_uid) or "")
        check_named(spec.notify, owner, self.config.events)
        run_id = run_id or uuid.uuid4().hex[:12]
        job_name = f"llmd-{run_id}"
        # off the loop: the first render reads the node files (~0.5 s), each packs them
        script = await anyio.to_thread.run_sync(
            functools.partial(render_sbatch, spec, job_name=job_name)
        )
        run = new_run(run_id, job_name, self._clock())
        return await self._accept(run, Rendered(spec), spec_toml, script, owner_uid, cluster)

    async def submit_script(
        self, spec_json: str, *, owner_uid: int, cluster: str | None, run_id: str | None
    ) -> H:
        """A user's own batch script (`submit --script`), submitted exactly once as it is,
        named uniquely; SpecError if its options are bad. A campaign chooses the `run_id`
        as for `submit`."""
        await self._roles.require(self.config.cluster(cluster).name)
        spec = await self.admit_foreign(spec_json, cluster, "script")
        run_id = run_id or uuid.uuid4().hex[:12]
        run = new_run(run_id, spec.job_name(run_id), self._clock())
        text = foreign_spec.dump(spec)
        return await self._accept(run, kind_of(spec), text, spec.script, owner_uid, cluster)

    async def adopt(
        self, spec_json: str, *, owner_uid: int, privileged: bool, cluster: str | None
    ) -> H:
        """A job submitted without the daemon becomes a run (`adopt`); the same job adopted
        again is the run it already is. Only its owner (or `privileged`) may adopt it."""
        name = self.config.cluster(cluster).name
        await self._roles.require(name)
        spec = await self.admit_foreign(spec_json, cluster, "adopt")
        async with self._adopting:  # two adopts of one job make one run
            for h in self._registry.handles.values():
                if h.meta.cluster == name and h.run.slurm_job_id == spec.job_id:
                    foreign.check_owner(spec, h.meta.owner_uid, owner_uid, privileged)
                    return h
            assert spec.job_id is not None
            job = await foreign.job_record(self._clusters[name].client, spec.job_id)
            owner = foreign.check_owner(spec, job.user_id, owner_uid, privileged)
            run_id = uuid.uuid4().hex[:12]
            run = adopted_run(run_id, f"adopted-{run_id}", spec.job_id, self._clock())
            handle = await self._accept(
                run, kind_of(spec), foreign_spec.dump(spec), "", owner, cluster, start=False
            )
            handle.use_job_files(await foreign.note_job_files(self._context(handle), job))
            self._start(handle)
            return handle

    async def admit(self, spec_toml: str, cluster: str | None = None) -> RunSpec:
        """The validated spec, as `submit` (and a dry run) accepts it (`admission`)."""
        return await admission.admit(self.config, self._clusters, spec_toml, cluster)

    async def admit_foreign(self, spec_json: str, cluster: str | None, kind: str) -> ForeignSpec:
        """The validated foreign spec of `kind` (script or adopt): `admission`."""
        return await admission.admit_foreign(self.config, self._clusters, spec_json, cluster, kind)

    async def _accept(
        self,
        run: Run,
        kind: RunKind,
        spec_text: str,
        script: str,
        owner_uid: int,
        cluster: str | None,
        *,
        start: bool = True,
    ) -> H:
        """Prepare the archive, journal the new run and (with `start`) supervise it."""
        cluster_cfg = self.config.cluster(cluster)
        run_id = run.run_id
        shown = kind.archived_spec(spec_text)
        root = self.config.archive_root
        arch = await anyio.to_thread.run_sync(
            lambda: archive.prepare(root, run_id, spec=shown, script=script)
        )
        meta = RunMeta(
            owner_uid=owner_uid,
            cluster=cluster_cfg.name,
            spec_toml=spec_text,
            script=script,
            log_dir=kind.log_dir,
            archive_dir=str(arch),
            created_at=run.transitions[0].at,
            kind=kind.column,
        )
        outgoing = self._outbound.made(None, run, meta, kind.name)
        # As the run's cluster's leader now: refused if this daemon stopped leading it
        # since `require` (nothing journaled, nothing submitted; the client is told).
        with writing_as(functools.partial(self._roles.writer, meta.cluster)):
            await self._journal.insert_run(run, meta, outgoing)
        self._after_journal(run)
        handle = self._registry.add(StoredRun(run, meta), kind)
        log.info("run.accepted", run_id=run_id, job_name=run.job_name, cluster=cluster_cfg.name)
        if start:
            self._start(handle)
        return handle
