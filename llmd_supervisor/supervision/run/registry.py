"""Every run this daemon knows, by id (`RunRegistry`): loaded from the journal at start
and at a takeover, brought up to date on a standby (`refresh`, `look_again`), with each
run's archive moved into this daemon's archive root when another login node's daemon
accepted it.

The registry reads the journal and keeps the handles; it changes a handle only through
the handle's own methods (the driver's `RunHandle`: `refreshed`, `forget`, `learnt`),
and never drives a run: the ones it finds resumable it returns to the driver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import anyio
import structlog

from llmd_supervisor.adapters.files import archive as archive
from llmd_supervisor.adapters.journal.store import Journal, RunMeta, StoredRun
from llmd_supervisor.core.run.kinds import RunKind, load_kind
from llmd_supervisor.core.run.lifecycle import Run, RunState
from llmd_supervisor.errors import SpecError, SupervisorError
from llmd_supervisor.supervision.cluster.clusters import Cluster
from llmd_supervisor.supervision.ha.leading import Roles
from llmd_supervisor.supervision.run import foreign
from llmd_supervisor.supervision.run.records import (
    ATTEMPT_EVENT,
    JOB_FILES_EVENT,
    AttemptEntry,
    JobFiles,
    attempt_entry_of,
)

log = structlog.get_logger("llmd_supervisor.runs")

# A standby asked for a run it does not know reads the shared journal again at most this
# often (`RunRegistry.look_again`): unknown refs cost one read a second, however many come.
LOOK_AGAIN_S = 1.0


class Handle(Protocol):
    """What the registry needs of a run's handle (`driver.RunHandle`)."""

    @property
    def run(self) -> Run: ...

    @property
    def meta(self) -> RunMeta: ...

    @property
    def kind(self) -> RunKind: ...

    @property
    def configured(self) -> Cluster | None: ...

    def refreshed(self, stored: StoredRun) -> None:
        """A newer record of a run another daemon drives."""
        ...

    def forget(self, stored: StoredRun) -> None:
        """The journal's record, and nothing an earlier tenure's driver learnt."""
        ...

    def learnt(self, history: Sequence[AttemptEntry], noted: JobFiles | None) -> None:
        """The run's ended attempts and (a foreign job's) noted batch logs, as journaled."""
        ...


H = TypeVar("H", bound=Handle)


def slim(meta: RunMeta, run: Run) -> RunMeta:
    """Drop the rendered script (~75 KB: it embeds the node agent) once Slurm has it; the
    journal and the archive's job.sbatch keep it. Keeps the daemon small with many runs."""
    if meta.script and run.state not in (RunState.ACCEPTED, RunState.SUBMITTING):
        return dataclasses.replace(meta, script="")
    return meta


class RunRegistry(Generic[H]):
    """The handles of every run the journal holds that this daemon has read, by run id;
    `make` creates one (the driver's), given the run and its kind and the set of changed
    run ids it reports its changes into (`take_changed`)."""

    def __init__(
        self,
        archive_root: Path,
        journal: Journal,
        roles: Roles,
        make: Callable[[StoredRun, RunKind, set[str]], H],
    ) -> None:
        self._archive_root = archive_root
        self._journal = journal
        self._roles = roles
        self._make = make
        self.handles: dict[str, H] = {}
        self._looked_again_at = -LOOK_AGAIN_S
        # A standby's reads of what changed (`refresh`): one at a time, each from the
        # horizon the last one returned (0: none yet, every run).
        self._refreshing = anyio.Lock()
        self._horizon = 0
        self._changed: set[str] = set()  # run ids; `take_changed`

    def add(self, stored: StoredRun, kind: RunKind) -> H:
        """A handle for a run (just accepted, or read from the journal)."""
        handle = self._make(stored, kind, self._changed)
        self.handles[stored.run.run_id] = handle
        self._changed.add(stored.run.run_id)
        return handle

    def get(self, ref: str) -> H | None:
        """A run by id, job name or Slurm job id."""
        if ref in self.handles:
            return self.handles[ref]
        for h in self.handles.values():
            if ref in (h.run.job_name, h.run.slurm_job_id):
                return h
        return None

    def take_changed(self) -> list[H]:
        """The handles new or changed (`RunHandle.notify`) since the last call: what a
        periodic look (the status line, the metrics' verdicts) needs, without walking a
        team journal's 100,000 finished runs every time."""
        changed = list(self._changed)
        self._changed.clear()  # the same set: every handle adds to it
        return [h for run_id in changed if (h := self.handles.get(run_id)) is not None]

    async def refresh(self) -> None:
        """Bring the handles of every run of a cluster this daemon does not act for up to
        date with the journal, reading only the runs written since the last such read
        (`Journal.runs_changed_since`): a standby's look every `leading.REFRESH_S` costs
        what changed, not the team's whole history. The runs this daemon drives are its
        own (their drivers wrote them); a takeover reads its cluster's runs whole."""
        async with self._refreshing:
            changed, horizon = await self._journal.runs_changed_since(self._horizon)
            await self.load(lambda name: not self._roles.acting(name), full=False, runs=changed)
            self._horizon = horizon

    async def look_again(self) -> bool:
        """A run ref no handle answers: on a shared journal another daemon may have
        accepted the run since this one's last refresh (every `leading.REFRESH_S`). Read
        the journal's runs of the clusters this daemon does not act for, at most once per
        `LOOK_AGAIN_S`; whether it read them (never on a journal of its own)."""
        now = anyio.current_time()
        if not self._roles.shared or now - self._looked_again_at < LOOK_AGAIN_S:
            return False
        self._looked_again_at = now
        try:  # checked per run as it is updated: a takeover meanwhile keeps its own
            await self.refresh()
        except SupervisorError as exc:  # the database is away: the answer stays not found
            log.warning("leading.refresh_failed", cluster=None, error=str(exc))
            return False
        return True

    async def load(
        self,
        of: Callable[[str], bool] | str | None = None,
        *,
        full: bool = True,
        runs: list[StoredRun] | None = None,
    ) -> list[H]:
        """Create or update the handles of the journal's runs (`runs`, or every run the
        journal holds; of the clusters `of` names, one or a test; None: all); the ones not
        final that a driver could resume. `full`: their attempt histories and noted job
        files too, and forget what a driver had learnt in memory (a takeover)."""
        histories = await self._journal.events_of_kind(ATTEMPT_EVENT) if full else {}
        job_files = await self._journal.events_of_kind(JOB_FILES_EVENT) if full else {}
        wanted = (lambda name: name == of) if isinstance(of, str) else of
        resumable: list[H] = []
        for stored in await self._journal.list_runs() if runs is None else runs:
            if wanted is not None and not wanted(stored.meta.cluster):
                continue
            if full and not stored.run.state.is_final:
                stored = await self._archive_here(stored)
            run_id = stored.run.run_id
            handle = self.handles.get(run_id)
            if handle is not None and not full:
                if handle.run != stored.run:
                    handle.refreshed(StoredRun(stored.run, slim(handle.meta, stored.run)))
                continue
            record = StoredRun(stored.run, slim(stored.meta, stored.run))
            if handle is None:
                try:
                    kind = load_kind(stored.meta.kind, stored.meta.spec_toml)
                except SpecError as exc:  # a spec valid at submission fails validation now
                    log.error("run.resume_failed", run_id=run_id, error=str(exc))
                    continue
                handle = self.add(record, kind)
            else:
                handle.forget(record)
            noted = None
            if handle.kind.foreign is not None:
                noted = foreign.recalled(job_files.get(run_id, []))
            handle.learnt([attempt_entry_of(e) for e in histories.get(run_id, [])], noted)
            if stored.run.state.is_final:
                continue
            if handle.configured is None:  # listed, but nothing can drive it here
                log.error(
                    "run.resume_failed",
                    run_id=run_id,
                    error=f"cluster {stored.meta.cluster!r} is no longer configured",
                )
                continue
            log.info("run.resumed", run_id=run_id, state=stored.run.state.value)
            resumable.append(handle)
        return resumable

    async def _archive_here(self, stored: StoredRun) -> StoredRun:
        """The run with its archive in this daemon's archive root, prepared there if it
        is not yet (a run another login node's daemon accepted: its archive directory
        is that node's unless the archive root is shared)."""
        here = archive.run_dir(self._archive_root, stored.run.run_id)
        if Path(stored.meta.archive_dir) == here:
            return stored
        meta = stored.meta
        try:  # as the run was accepted (a foreign spec without its environment's values)
            shown = load_kind(meta.kind, meta.spec_toml).archived_spec(meta.spec_toml)
        except SpecError:
            return stored  # not resumable: `load` says so
        await anyio.to_thread.run_sync(
            lambda: archive.prepare(
                self._archive_root, stored.run.run_id, spec=shown, script=meta.script
            )
        )
        log.info("run.archive_moved", run_id=stored.run.run_id, was=meta.archive_dir, now=str(here))
        return StoredRun(stored.run, dataclasses.replace(meta, archive_dir=str(here)))
