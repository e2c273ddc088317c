"""Per-run supervision: one driver loop per run (DESIGN.md section 3).

Each run is advanced by one loop, inside the daemon's root task group, with a task group
of its own. The loop reads the journaled record, asks the pure core what it needs
(`lifecycle.plan`: one step plus background actions), makes sure the background actions
run (the attempt's watchers; the cancel sequence while a cancel is requested and the job
is still queued) and awaits the step, which ends by applying an event. Every event goes
through `lifecycle.step` and is journaled (compare-and-set) before anything relies on it,
so whatever the journal holds after a crash or a supervision retry, `plan` of it says what
to (re)do, and every step is idempotent:

A run is of a spec the daemon renders (`core.spec.runspec`), or of a foreign job
(`core.spec.foreign`): a user's batch script submitted as it is, or a job submitted without
the daemon and adopted, which is journaled straight into `pending` with its job id.

  accepted     -> journal `submitting` with the unique job name, then sbatch
  submitting   -> (found on entry) look the job name up; resubmit only when squeue and
                  sacct both answer that it never existed
  pending/running -> follow the poller's views; the attempt's watchers while running
  finishing    -> stop the attempt, snapshot `scontrol show job`, complete the log copies
  verifying    -> collect evidence until the verdict is final (poller-batched queries)
  archiving    -> write and fsync the archive (retried until it succeeds), then declare

Each step is a phase of its own module (`submit`, `follow`, `finish`, `verify`,
`archive`; `retries` before a submission and after a verdict; `foreign` for a job the
daemon did not write; `cancel` in the background). A phase reads the run through a
`context.RunContext` and returns the event or value that this module then applies: the
run's handle (`RunHandle`) is changed here and nowhere else.

Stopping the daemon cancels these loops and never the jobs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters.files import archive as archive
from llmd_supervisor.adapters.journal.store import Journal, NewEvent, RunMeta, StoredRun
from llmd_supervisor.adapters.journal.writer import writing_as
from llmd_supervisor.adapters.slurm.runner import DEFAULT_TIMEOUT_S, CommandRunner
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.events.facts import RunDetails, finished_details, point_of_evidence
from llmd_supervisor.core.events.model import EventType, Links, Owner, PointFacts, RunRef
from llmd_supervisor.core.events.outbox import Outgoing, run_event_type, run_outgoing
from llmd_supervisor.core.events.routing import check_named
from llmd_supervisor.core.render.script import render_sbatch
from llmd_supervisor.core.run.health import NodeHealth
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.run.lifecycle import (
    BACKGROUND,
    Action,
    CallSbatch,
    CancelRequested,
    Event,
    FollowQueue,
    HoldExpired,
    Reconcile,
    Requeued,
    Run,
    RunState,
    RunVerify,
    StartWatchers,
    StopWatchers,
    Submit,
    WriteArchive,
    adopted_run,
    new_run,
    plan,
    step,
)
from llmd_supervisor.core.run.retry_policy import Quarantined, quarantine
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.core.spec.foreign import ForeignSpec
from llmd_supervisor.core.spec.runspec import RunSpec, load_spec
from llmd_supervisor.errors import (
    ControlError,
    IllegalTransition,
    SpecError,
    SupervisorError,
)
from llmd_supervisor.supervision.cluster.clusters import Cluster
from llmd_supervisor.supervision.cluster.poller import QueueView
from llmd_supervisor.supervision.control.access import host_name, user_name
from llmd_supervisor.supervision.control.views import results_table_of
from llmd_supervisor.supervision.ha.leading import Roles
from llmd_supervisor.supervision.run import (
    admission,
    cancel,
    failures,
    finish,
    follow,
    foreign,
    retries,
    submit,
    verify,
)
from llmd_supervisor.supervision.run import (
    archive as archiving,
)
from llmd_supervisor.supervision.run import bench_files as bench_files
from llmd_supervisor.supervision.run.attempt import Attempt
from llmd_supervisor.supervision.run.bench_files import JudgedFiles
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import (
    ATTEMPT_EVENT,
    JOB_FILES_EVENT,
    RECEIPT_EVENT,
    TRANSITION_EVENT,
    AttemptEntry,
    JobFiles,
    JournalEvent,
    ReceiptEvent,
    ToJournal,
    Transition,
    attempt_entry_of,
    last_receipt,
)
from llmd_supervisor.supervision.run.verify_job import utcnow

log = structlog.get_logger("llmd_supervisor.runs")

# A new leader reconciles a run the previous one left `submitting` this long after it took
# over: that leader started an sbatch only while it could act (`submit`), and its sbatch
# ends (or is killed) within the Slurm client's timeout.
IN_FLIGHT_S = DEFAULT_TIMEOUT_S + 2.0

# A standby asked for a run it does not know reads the shared journal again at most this
# often (`Supervisor.look_again`): unknown refs cost one read a second, however many come.
LOOK_AGAIN_S = 1.0

# The backoff after a failed step: doubling from the first delay up to the cap.
RETRY_FIRST_S = 1.0
RETRY_CAP_S = 60.0


@dataclass(frozen=True)
class Hooks:
    """Test seams; production uses the defaults."""

    # Called right after the journal committed a new record, before anything acts on it
    # (the crash-point fault tests kill the daemon here).
    after_journal: Callable[[Run], None] = lambda run: None
    # Runs every cluster's Slurm commands instead of the configured local or login-host
    # runner (fast tests replay captured Slurm output through it).
    runner: CommandRunner | None = None


@dataclass
class RunHandle:
    """A run's in-memory companion to its journal row: only what cannot be derived. Only
    this module changes it (tests/unit/test_handle_owner.py checks)."""

    stored: StoredRun
    spec: RunSpec | ForeignSpec
    configured: Cluster | None  # None: a finished run of a cluster no longer configured
    layout: RunLayout
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    changed: anyio.Event = field(default_factory=anyio.Event)  # set and replaced on a change
    version: int = 0
    attempt: Attempt | None = None  # the current (or last) watched allocation
    tail_bytes: int = 0  # log bytes copied from the nodes since the daemon started
    submitted_at: str | None = None  # an adopted job's SubmitTime (sacct --starttime)
    job_files_known: bool = False  # a foreign job's batch logs are known (`foreign`)
    history: list[AttemptEntry] = field(default_factory=list)  # attempts ended
    # The last `scontrol show job` record (taken in finishing); the archive writes it too,
    # so a snapshot a full disk refused is not lost.
    scontrol_snapshot: str | None = None
    judged_files: JudgedFiles | None = None  # what the last verdict was made from
    job_files_asked: int = 0
    held_until: datetime | None = None  # held for want of nodes until then (`retries.Hold`)
    # The supervisor's ids of the runs changed since its last look (`take_changed`).
    changes: set[str] | None = None

    def count_bytes(self, n: int) -> None:
        self.tail_bytes += n

    @property
    def run(self) -> Run:
        return self.stored.run

    @property
    def cluster(self) -> Cluster:
        if self.configured is None:
            raise SupervisorError(
                f"Run {self.run.run_id}'s cluster {self.meta.cluster!r} is no longer "
                "configured in this daemon."
            )
        return self.configured

    @property
    def meta(self) -> RunMeta:
        return self.stored.meta

    @property
    def health(self) -> Mapping[str, NodeHealth]:
        """The current attempt's node health (empty before the job runs)."""
        return self.attempt.health if self.attempt is not None else {}

    def notify(self) -> None:
        self.version += 1
        self.changed.set()
        self.changed = anyio.Event()
        if self.changes is not None:
            self.changes.add(self.run.run_id)

    def job_id(self) -> str:
        if self.run.slurm_job_id is None:
            raise IllegalTransition(self.run.state.value, "an operation needing a Slurm job id")
        return self.run.slurm_job_id

    @property
    def sigterm_grace_s(self) -> int:
        """The run's grace between TERM and the kill (its spec's)."""
        return self.spec.sigterm_grace_s

    @property
    def name(self) -> str:
        """What `list` calls the run: its spec's [run] name, its script's file name or
        ``adopted-JOBID`` ("" for a spec without a name)."""
        return self.spec.name if isinstance(self.spec, RunSpec) else self.spec.name()

    @property
    def coordinator_rank(self) -> int:
        """The rank that writes the marker (a foreign job's: the first node's view)."""
        return self.spec.topology.coordinator_rank if isinstance(self.spec, RunSpec) else 0

    def starttime(self) -> str:
        """sacct --starttime covering the run's submission (an adopted job's own)."""
        if self.submitted_at is not None:
            return self.submitted_at
        start = self.meta.created_at - timedelta(minutes=5)
        return start.astimezone().strftime("%Y-%m-%dT%H:%M:%S")


@dataclass
class Loop:
    """What one pass of a run's driver keeps while it runs (gone with a supervision retry,
    after which `plan` re-derives it from the journaled record)."""

    tg: anyio.abc.TaskGroup
    version: int = 0  # the run handle's version when the loop last planned
    view: QueueView | None = None  # the last poller view the loop acted on
    cancelling: str | None = None  # the job whose cancel sequence runs in `tg`


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
        self.config = config
        self.journal = journal
        self.clusters = clusters
        self.tg = tg
        self.clock = clock
        self.hooks = hooks or Hooks()
        self.roles = roles or Roles.single_node([c.name for c in config.clusters])
        self.handles: dict[str, RunHandle] = {}
        self._adopting = anyio.Lock()
        self._looked_again_at = -LOOK_AGAIN_S
        # A standby's reads of what changed (`_refresh`): one at a time, each from the
        # horizon the last one returned (0: none yet, every run).
        self._refreshing = anyio.Lock()
        self._horizon = 0
        self._changed: set[str] = set()  # run ids; `take_changed`

    # --- entry points ------------------------------------------------------------------

    async def submit(
        self,
        spec_toml: str,
        *,
        owner_uid: int,
        cluster: str | None = None,
        run_id: str | None = None,
    ) -> RunHandle:
        """Validate, render, journal as `accepted` and start supervising; SpecError if bad.
        A campaign chooses the `run_id` (12 hex digits) and journals it first, so that a
        restart in between finds out whether the run exists; JournalConflict if it does."""
        await self.roles.require(self.config.cluster(cluster).name)
        spec = await self.admit(spec_toml, cluster)
        owner = Owner(owner_uid, user_name(owner_uid) or "")
        check_named(spec.notify, owner, self.config.events)
        run_id = run_id or uuid.uuid4().hex[:12]
        job_name = f"llmd-{run_id}"
        # off the loop: the first render reads the node files (~0.5 s), each packs them
        script = await anyio.to_thread.run_sync(
            functools.partial(render_sbatch, spec, job_name=job_name)
        )
        return await self._accept(
            new_run(run_id, job_name, self.clock()), spec, spec_toml, script, owner_uid, cluster
        )

    async def submit_script(
        self,
        spec_json: str,
        *,
        owner_uid: int,
        cluster: str | None = None,
        run_id: str | None = None,
    ) -> RunHandle:
        """A user's own batch script (`submit --script`), submitted exactly once as it is,
        named uniquely; SpecError if its options are bad. A campaign chooses the `run_id`
        as for `submit`."""
        await self.roles.require(self.config.cluster(cluster).name)
        spec = await self.admit_foreign(spec_json, cluster, "script")
        run_id = run_id or uuid.uuid4().hex[:12]
        run = new_run(run_id, spec.job_name(run_id), self.clock())
        text = foreign_spec.dump(spec)
        return await self._accept(run, spec, text, spec.script, owner_uid, cluster)

    async def adopt(
        self, spec_json: str, *, owner_uid: int, privileged: bool, cluster: str | None = None
    ) -> RunHandle:
        """A job submitted without the daemon becomes a run (`adopt`); the same job adopted
        again is the run it already is. Only its owner (or `privileged`) may adopt it."""
        name = self.config.cluster(cluster).name
        await self.roles.require(name)
        spec = await self.admit_foreign(spec_json, cluster, "adopt")
        async with self._adopting:  # two adopts of one job make one run
            for h in self.handles.values():
                if h.meta.cluster == name and h.run.slurm_job_id == spec.job_id:
                    foreign.check_owner(spec, h.meta.owner_uid, owner_uid, privileged)
                    return h
            assert spec.job_id is not None
            job = await foreign.job_record(self.clusters[name].client, spec.job_id)
            owner = foreign.check_owner(spec, job.user_id, owner_uid, privileged)
            run_id = uuid.uuid4().hex[:12]
            run = adopted_run(run_id, f"adopted-{run_id}", spec.job_id, self.clock())
            handle = await self._accept(
                run, spec, foreign_spec.dump(spec), "", owner, cluster, start=False
            )
            _use_job_files(handle, await foreign.note_job_files(self.context(handle), job))
            self._start(handle)
            return handle

    async def _accept(
        self,
        run: Run,
        spec: RunSpec | ForeignSpec,
        spec_text: str,
        script: str,
        owner_uid: int,
        cluster: str | None,
        *,
        start: bool = True,
    ) -> RunHandle:
        """Prepare the archive, journal the new run and (with `start`) supervise it."""
        cluster_cfg = self.config.cluster(cluster)
        run_id = run.run_id
        if isinstance(spec, RunSpec):
            shown = spec_text
        else:
            shown = foreign_spec.dump(spec, with_env_values=False)
        spec_name = "spec.toml" if isinstance(spec, RunSpec) else "foreign.json"
        arch = await anyio.to_thread.run_sync(
            lambda: archive.prepare(
                self.config.archive_root, run_id, spec=(spec_name, shown), script=script
            )
        )
        meta = RunMeta(
            owner_uid=owner_uid,
            cluster=cluster_cfg.name,
            spec_toml=spec_text,
            script=script,
            log_dir=_log_dir(spec),
            archive_dir=str(arch),
            created_at=run.transitions[0].at,
        )
        name = spec.name if isinstance(spec, RunSpec) else spec.name()
        outgoing = self._outgoing(None, run, meta, name)
        # As the run's cluster's leader now: refused if this daemon stopped leading it
        # since `require` (nothing journaled, nothing submitted; the client is told).
        with writing_as(functools.partial(self.roles.writer, meta.cluster)):
            await self.journal.insert_run(run, meta, outgoing)
        self.hooks.after_journal(run)
        handle = self._handle(StoredRun(run, meta), spec)
        log.info("run.accepted", run_id=run_id, job_name=run.job_name, cluster=cluster_cfg.name)
        if start:
            self._start(handle)
        return handle

    async def admit(self, spec_toml: str, cluster: str | None = None) -> RunSpec:
        """The validated spec, as `submit` (and a dry run) accepts it (`admission`)."""
        return await admission.admit(self.config, self.clusters, spec_toml, cluster)

    async def admit_foreign(self, spec_json: str, cluster: str | None, kind: str) -> ForeignSpec:
        """The validated foreign spec of `kind` (script or adopt): `admission`."""
        return await admission.admit_foreign(self.config, self.clusters, spec_json, cluster, kind)

    async def resume_all(self) -> int:
        """Start a driver for every run the journal holds as not final; return how many
        (a single-node journal: a shared one's runs start with each cluster's tenure,
        `take_over`)."""
        count = 0
        for handle in await self._load():
            count += self._start(handle)
        return count

    async def take_over(self, cluster: str) -> None:
        """This daemon now leads `cluster` (`leading.Roles.follow`): load its runs from the
        journal as they are now and drive every one not final. A run left `submitting`
        by the previous leader is reconciled only after `IN_FLIGHT_S`: its sbatch, if one
        was in flight, has ended by then."""
        resumed = await self._load(cluster, full=True)
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
        await self._refresh()

    async def refresh_elsewhere(self) -> None:
        """The shared journal's runs of clusters this daemon does not have (the team's
        other clusters), as they are now, for list and status (`_refresh`)."""
        await self._refresh()

    async def _refresh(self) -> None:
        """Bring the handles of every run of a cluster this daemon does not act for up to
        date with the journal, reading only the runs written since the last such read
        (`Journal.runs_changed_since`): a standby's look every `leading.REFRESH_S` costs
        what changed, not the team's whole history. The runs this daemon drives are its
        own (their drivers wrote them); a takeover reads its cluster's runs whole."""
        async with self._refreshing:
            changed, horizon = await self.journal.runs_changed_since(self._horizon)
            await self._load(lambda name: not self.roles.acting(name), full=False, runs=changed)
            self._horizon = horizon

    async def look_again(self) -> bool:
        """A run ref no handle answers: on a shared journal another daemon may have
        accepted the run since this one's last refresh (every `leading.REFRESH_S`). Read
        the journal's runs of the clusters this daemon does not act for, at most once per
        `LOOK_AGAIN_S`; whether it read them (never on a journal of its own)."""
        now = anyio.current_time()
        if not self.roles.shared or now - self._looked_again_at < LOOK_AGAIN_S:
            return False
        self._looked_again_at = now
        try:  # checked per run as it is updated: a takeover meanwhile keeps its own
            await self._refresh()
        except SupervisorError as exc:  # the database is away: the answer stays not found
            log.warning("leading.refresh_failed", cluster=None, error=str(exc))
            return False
        return True

    async def _load(
        self,
        of: Callable[[str], bool] | str | None = None,
        *,
        full: bool = True,
        runs: list[StoredRun] | None = None,
    ) -> list[RunHandle]:
        """Create or update the handles of the journal's runs (`runs`, or every run the
        journal holds; of the clusters `of` names, one or a test; None: all); the ones not
        final that a driver could resume. `full`: their attempt histories and noted job
        files too, and forget what a driver had learnt in memory (a takeover)."""
        histories = await self.journal.events_of_kind(ATTEMPT_EVENT) if full else {}
        job_files = await self.journal.events_of_kind(JOB_FILES_EVENT) if full else {}
        wanted = (lambda name: name == of) if isinstance(of, str) else of
        resumable: list[RunHandle] = []
        for stored in await self.journal.list_runs() if runs is None else runs:
            if wanted is not None and not wanted(stored.meta.cluster):
                continue
            if full and not stored.run.state.is_final:
                stored = await self._archive_here(stored)
            run_id = stored.run.run_id
            handle = self.handles.get(run_id)
            if handle is not None and not full:
                if handle.run != stored.run:
                    handle.stored = StoredRun(stored.run, _slim(handle.meta, stored.run))
                    handle.notify()
                continue
            if handle is None:
                text = stored.meta.spec_toml
                try:
                    spec = (
                        foreign_spec.load(text)
                        if foreign_spec.is_foreign(text)
                        else load_spec(text)
                    )
                except SpecError as exc:  # a spec valid at submission fails validation now
                    log.error("run.resume_failed", run_id=run_id, error=str(exc))
                    continue
                handle = self._handle(StoredRun(stored.run, _slim(stored.meta, stored.run)), spec)
            else:
                _forget(handle, StoredRun(stored.run, _slim(stored.meta, stored.run)))
            handle.history = [attempt_entry_of(e) for e in histories.get(run_id, [])]
            if isinstance(handle.spec, ForeignSpec):
                noted = foreign.recalled(job_files.get(run_id, []))
                if noted is not None:
                    _use_job_files(handle, noted)
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
        here = archive.run_dir(self.config.archive_root, stored.run.run_id)
        if Path(stored.meta.archive_dir) == here:
            return stored
        meta, shown = stored.meta, ("spec.toml", stored.meta.spec_toml)
        if foreign_spec.is_foreign(meta.spec_toml):  # as `_accept` shows it: no env values
            try:
                loaded = foreign_spec.load(meta.spec_toml)
            except SpecError:
                return stored  # not resumable: `_load` says so
            shown = ("foreign.json", foreign_spec.dump(loaded, with_env_values=False))
        await anyio.to_thread.run_sync(
            lambda: archive.prepare(
                self.config.archive_root, stored.run.run_id, spec=shown, script=meta.script
            )
        )
        log.info("run.archive_moved", run_id=stored.run.run_id, was=meta.archive_dir, now=str(here))
        return StoredRun(stored.run, dataclasses.replace(meta, archive_dir=str(here)))

    def _start(self, handle: RunHandle) -> bool:
        """Drive `handle` in its cluster's tenure; False when this daemon does not lead
        that cluster (its leader drives it)."""
        return self.roles.start(self.tg, handle.meta.cluster, self._supervise, handle)

    async def _supervise_at(self, h: RunHandle, at: float) -> None:
        await anyio.sleep_until(at)
        await self._supervise(h)

    def get(self, ref: str) -> RunHandle | None:
        """A run by id, job name or Slurm job id."""
        if ref in self.handles:
            return self.handles[ref]
        for h in self.handles.values():
            if ref in (h.run.job_name, h.run.slurm_job_id):
                return h
        return None

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

    def _handle(self, stored: StoredRun, spec: RunSpec | ForeignSpec) -> RunHandle:
        watch = spec.watch if isinstance(spec, ForeignSpec) else None
        archive_dir = Path(stored.meta.archive_dir)
        layout = RunLayout(_log_dir(spec), stored.run.slurm_job_name, archive_dir, watch)
        handle = RunHandle(stored, spec, self.clusters.get(stored.meta.cluster), layout)
        handle.changes = self._changed
        self.handles[stored.run.run_id] = handle
        self._changed.add(stored.run.run_id)
        return handle

    def take_changed(self) -> list[RunHandle]:
        """The handles new or changed (`RunHandle.notify`) since the last call: what a
        periodic look (the status line, the metrics' verdicts) needs, without walking a
        team journal's 100,000 finished runs every time."""
        changed = list(self._changed)
        self._changed.clear()  # the same set: every handle adds to it
        return [h for run_id in changed if (h := self.handles.get(run_id)) is not None]

    # --- the driver ----------------------------------------------------------------------

    async def _supervise(self, h: RunHandle) -> None:
        """Drive the run to a final state. An unexpected error (a bug, the journal briefly
        failing) is logged and the loop re-entered after a backoff, from the journaled
        record: a run is never dropped, a requested cancel never lost, and its job is never
        touched because of the error. A step that keeps failing the same way
        (`failures.SAME_FAILURES_MAX` times in a row) ends the run `unverified` with the error as
        its reason (`failures`)."""
        delay = RETRY_FIRST_S
        same = failures.SameFailures()
        with structlog.contextvars.bound_contextvars(
            run_id=h.run.run_id, slurm_job_id=h.run.slurm_job_id
        ):
            while not h.run.state.is_final:
                try:
                    async with anyio.create_task_group() as tg:
                        loop = Loop(tg)
                        while not h.run.state.is_final:
                            loop.version = h.version
                            actions = plan(h.run)
                            await self._background(h, loop, actions)
                            await self._step(h, loop, actions[0])
                            delay = RETRY_FIRST_S
                            same.clear()
                        tg.cancel_scope.cancel()  # a cancel sequence still sleeping its grace
                except Exception as group:
                    exc = failures.first_leaf(group)
                    state = h.run.state
                    count = same.add(state, exc)
                    log.error(
                        "run.supervision_failed",
                        error=str(exc),
                        error_type=type(exc).__name__,
                        state=state.value,
                        failures=count,
                        retry_in_s=delay,
                        exc_info=not isinstance(exc, SupervisorError),
                    )
                    if failures.gives_up(state, exc, count) and await self._give_up(h, exc, count):
                        continue
                    await anyio.sleep(delay)
                    delay = min(delay * 2, RETRY_CAP_S)

    async def _background(self, h: RunHandle, loop: Loop, actions: tuple[Action, ...]) -> None:
        """Make sure the plan's background actions run in this loop's task group."""
        for action in actions:
            if not isinstance(action, BACKGROUND):
                continue
            if isinstance(action, StartWatchers):
                a = h.attempt
                if a is None or a.number != action.attempt or not a.running:
                    h.attempt = self.new_attempt(h, action.nodes)
                    await loop.tg.start(h.attempt.run)
            elif loop.cancelling != action.job_id:
                loop.cancelling = action.job_id
                loop.tg.start_soon(cancel.cancel_sequence, self.context(h), action.job_id)
        a = h.attempt
        if (
            a is not None
            and a.hung is not None
            and h.run.state is RunState.RUNNING
            and a.number == h.run.attempt
            and loop.cancelling != a.job_id
        ):  # a hung agent: end the attempt now, not at the time limit
            loop.cancelling = a.job_id
            loop.tg.start_soon(cancel.cancel_sequence, self.context(h), a.job_id)

    async def _give_up(self, h: RunHandle, exc: Exception, count: int) -> bool:
        """End the run `unverified` with `exc` as its reason (`failures.given_up`), its
        receipt journaled first; whether that was done (it needs the journal, which may be
        what fails: then the driver goes on retrying)."""
        receipt, event = failures.given_up(self.context(h), exc, count)
        run = h.run
        try:
            journaled: ReceiptEvent = {"receipt": receipt}
            await self.journal.add_event(run.run_id, RECEIPT_EVENT, journaled, self.clock())
            await self.apply(h, event)
        except Exception as again:  # the journal (or a bug) again: the driver keeps retrying
            error = str(failures.first_leaf(again))
            log.error("run.give_up_failed", error=error, reason=event.reason)
            return False
        log.error("run.given_up", reason=event.reason, failures=count)
        if run.slurm_job_id is not None and h.configured is not None:
            h.cluster.poller.untrack(run.slurm_job_id)
        return True

    async def _step(self, h: RunHandle, loop: Loop, action: Action) -> None:
        """Run the plan's step (a phase) and apply what it returns."""
        ctx = self.context(h)
        match action:
            case CallSbatch():
                await self._submit(h, ctx)
            case Reconcile():
                found = await submit.reconcile(ctx)
                if isinstance(found, submit.Resubmit):  # surely never submitted: now, once
                    found = await submit.submit(ctx, await retries.excluded(ctx))
                await self.apply(h, found)
            case FollowQueue():
                await self._learn_job_files(h, ctx)
                followed = await follow.follow_queue(ctx, loop.version, loop.view)
                if followed.view is not None:
                    loop.view = followed.view
                if followed.event is not None:
                    await self.apply(h, followed.event)
                if isinstance(followed.event, Requeued) and h.attempt is not None:
                    await h.attempt.drain()  # the old allocation's logs, into its own part
            case StopWatchers():
                finished = await finish.finish(ctx)
                h.attempt = finished.attempt
                finished.attempt.copies = finished.copies
                if finished.snapshot is not None:
                    h.scontrol_snapshot = finished.snapshot
                await self.apply(h, finished.event)
            case RunVerify():
                judged = await verify.verify(ctx)
                h.judged_files = judged.files
                await self.apply(h, judged.event, judged.logged)
                if judged.entry is not None:
                    h.history.append(judged.entry)
                    h.notify()  # an attempt ended (the metrics' GPU-hours)
            case WriteArchive():
                written = await archiving.write_archive(ctx)
                h.judged_files = None
                if written.attempt is not None:
                    h.attempt = written.attempt
                    written.attempt.copies = written.copies
                with anyio.CancelScope(shield=True):
                    await self.apply(h, written.event)
            case _:
                raise AssertionError(f"{action!r} is not a step")

    async def _submit(self, h: RunHandle, ctx: RunContext) -> None:
        """Journal `submitting`, then sbatch once (`submit`); a retry first waits its
        backoff, and a run whose excluded nodes leave too few is held (`retries`)."""
        match await retries.before_submit(ctx):
            case None:
                return  # waited: plan again
            case HoldExpired() as expired:
                event = await retries.expire_hold(ctx, expired)
                h.held_until = None
                await self.apply(h, event)
            case retries.Hold() as hold:
                h.held_until = hold.until
                await self.apply(h, hold.event)
                await ctx.wait_change(hold.recheck_s)
            case exclude:
                h.held_until = None
                await self.apply(h, Submit())
                await self.apply(h, await submit.submit(ctx, exclude))

    async def _learn_job_files(self, h: RunHandle, ctx: RunContext) -> None:
        """Learn a submitted foreign job's files once (a few tries: `foreign`)."""
        if not foreign.wanted(ctx, h.job_files_known, h.job_files_asked):
            return
        h.job_files_asked += 1
        files = await foreign.ask_job_files(ctx, h.job_files_asked)
        if files is not None:
            _use_job_files(h, files)

    def context(self, h: RunHandle) -> RunContext:
        """The run as its phases see it."""
        return _Context(self, h)

    def new_attempt(self, h: RunHandle, nodes: tuple[str, ...]) -> Attempt:
        """An attempt object for the run's current allocation (not started)."""

        async def record(kind: str, fields: Mapping[str, object]) -> None:
            await self.journal.add_event(h.run.run_id, kind, dict(fields), self.clock())

        return Attempt(
            number=h.run.attempt,
            job_id=h.job_id(),
            nodes=nodes,
            layout=h.layout,
            coordinator_rank=h.coordinator_rank,
            connect=h.cluster.connect,
            limits=self.config.limits,
            record=record,
            on_change=h.notify,
            on_marker=lambda: h.cluster.poller.expect_end(h.job_id()),
            on_bytes=h.count_bytes,
            on_hang=h.notify,  # the loop re-plans and ends the attempt (`_background`)
        )

    async def apply(self, h: RunHandle, event: Event, logged: Sequence[ToJournal] = ()) -> None:
        """step → journal (compare-and-set, with the events `logged` the step's phase
        returned, in one transaction) → tell whoever waits on the run."""
        async with h.lock:
            before = h.run
            now = self.clock()
            after, _ = step(before, event, now)  # the actions are plan(after): the loop's
            if after is before and not logged:
                return
            outgoing = await self._run_outgoing(h, before, after)
            moved: Transition = {
                "from": before.state.value,
                "to": after.state.value,
                "event": type(event).__name__,
            }
            events = [NewEvent(kind, fields, now) for kind, fields in logged]
            if after.state != before.state:
                events.append(NewEvent(TRANSITION_EVENT, moved, now))
            await self.journal.save(after, expected=before.state, outgoing=outgoing, events=events)
            self.hooks.after_journal(after)
            h.stored = StoredRun(after, _slim(h.meta, after))
            if after.submission != before.submission:  # a retry: a new job, its own name
                h.layout = dataclasses.replace(
                    h.layout, job_name=after.slurm_job_name, batch_paths=()
                )
                h.job_files_known, h.job_files_asked = False, 0
            if after.slurm_job_id != before.slurm_job_id:
                structlog.contextvars.bind_contextvars(slurm_job_id=after.slurm_job_id)
            log.info(
                "run.transition",
                frm=before.state.value,
                to=after.state.value,
                trigger=type(event).__name__,
            )
            if after.state.is_final:  # plan(after) is Declare
                self._declare(h)
            h.notify()

    def _outgoing(
        self,
        before: Run | None,
        after: Run,
        meta: RunMeta,
        name: str,
        named: Sequence[str] = (),
        details: RunDetails | None = None,
        judged: Sequence[PointFacts] = (),
    ) -> tuple[Outgoing, ...]:
        """The outbound events to journal with this change of the run (`core.events.outbox`)."""
        destinations = self.config.events.destinations
        if not destinations or (run_event_type(before, after) is None and not judged):
            return ()  # most transitions report nothing: no user lookup, no spec hash
        ref = RunRef(
            id=after.run_id,
            name=name,
            owner=user_name(meta.owner_uid) or "",
            owner_uid=meta.owner_uid,
            cluster=meta.cluster,
            spec_name=name,
            spec_sha256=hashlib.sha256(meta.spec_toml.encode("utf-8")).hexdigest(),
        )
        links = Links(
            archive=meta.archive_dir or None,
            report=self.config.dashboard.page(f"/runs/{after.run_id}#results"),
            dashboard=self.config.dashboard.page(f"/runs/{after.run_id}"),
        )
        try:
            return run_outgoing(
                before,
                after,
                ref,
                links,
                destinations,
                host_name(),
                named=named,
                details=details,
                judged=judged,
            )
        except Exception:  # a bug in making an event must never hold up the run
            log.exception("event.not_made", run_id=after.run_id, state=after.state.value)
            return ()

    async def _run_outgoing(self, h: RunHandle, before: Run, after: Run) -> tuple[Outgoing, ...]:
        """`_outgoing` for a change of a supervised run: with the points the verdict just
        judged when it leaves verifying, and with what the journal and the archive say
        of it (`core.events.facts`) when it is declared."""
        if not self.config.events.destinations:
            return ()
        named = h.spec.notify if isinstance(h.spec, RunSpec) else ()
        judged: tuple[PointFacts, ...] = ()
        files = h.judged_files
        if (
            before.state is RunState.VERIFYING
            and after.state is not RunState.VERIFYING
            and files is not None
            and files.bench is not None
            and isinstance(h.spec, RunSpec)
        ):
            try:
                gate = bench_files.judge(h.spec, files.bench.results)
                judged = tuple(point_of_evidence(e) for e in gate.points if e.point is not None)
            except Exception:  # never hold up a verdict for its points' events
                log.exception("event.points_unjudged", run_id=after.run_id)
        details = None
        if run_event_type(before, after) is EventType.RUN_FINISHED:
            try:
                details = await self._finished_details(h)
            except Exception:  # never hold up a verdict for its event's details
                log.exception("event.details_unread", run_id=after.run_id)
        return self._outgoing(before, after, h.meta, h.name, named, details, judged)

    async def _finished_details(self, h: RunHandle) -> RunDetails:
        """What a declared run's run.finished says beyond its record: its last receipt,
        its attempts (journaled) and its archived results table."""
        receipt = last_receipt(await self.journal.events(h.run.run_id))
        attempts = [dict(e) for e in h.history]
        path = Path(h.meta.archive_dir) / "results.json"
        try:
            table = await anyio.to_thread.run_sync(results_table_of, path)
        except ControlError as exc:  # not a table this daemon wrote: no points
            log.warning("event.results_unread", path=str(path), error=str(exc))
            table = None
        return finished_details(receipt, attempts, None if table is None else dict(table))

    def _declare(self, h: RunHandle) -> None:
        """The run's one canonical line (its outcome, reason and duration)."""
        run = h.run
        log.info(
            "run.finished",
            run_id=run.run_id,
            outcome=run.outcome.value if run.outcome else None,
            reason=run.reason,
            slurm_job_id=run.slurm_job_id,
            attempt=run.attempt,
            seconds=round((self.clock() - run.transitions[0].at).total_seconds(), 1),
            archive=h.meta.archive_dir,
        )


def _log_dir(spec: RunSpec | ForeignSpec) -> str:
    return spec.watch.log_dir if isinstance(spec, ForeignSpec) else spec.log_dir


def _forget(h: RunHandle, stored: StoredRun) -> None:
    """What a driver of an earlier tenure learnt in memory is not this one's: the run is
    the journal's now, and the next driver learns the rest again."""
    h.stored = stored
    h.attempt = None
    h.scontrol_snapshot = None
    h.judged_files = None
    h.held_until = None
    h.job_files_known, h.job_files_asked = False, 0
    h.layout = dataclasses.replace(h.layout, job_name=stored.run.slurm_job_name, batch_paths=())
    h.notify()


def _slim(meta: RunMeta, run: Run) -> RunMeta:
    """Drop the rendered script (~75 KB: it embeds the node agent) once Slurm has it; the
    journal and the archive's job.sbatch keep it. Keeps the daemon small with many runs."""
    if meta.script and run.state not in (RunState.ACCEPTED, RunState.SUBMITTING):
        return dataclasses.replace(meta, script="")
    return meta


def _use_job_files(h: RunHandle, files: JobFiles) -> None:
    """A foreign job's batch logs (and an adopted job's submit time) from now on."""
    assert isinstance(h.spec, ForeignSpec)
    h.layout, submitted = foreign.used(h.layout, h.spec, files)
    if submitted is not None:
        h.submitted_at = submitted
    h.job_files_known = True


class _Context:
    """A run as its phases see it (`context.RunContext`): read-only, and what they emit
    goes to the journal as the run's events."""

    def __init__(self, sup: Supervisor, h: RunHandle) -> None:
        self._sup = sup
        self._h = h

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
    def layout(self) -> RunLayout:
        return self._h.layout

    @property
    def cluster(self) -> Cluster:
        return self._h.cluster

    @property
    def config(self) -> Config:
        return self._sup.config

    @property
    def journal(self) -> Journal:
        return self._sup.journal

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
        return self._sup.clock()

    def job_id(self) -> str:
        return self._h.job_id()

    def lease_time_left(self) -> float:
        return self._sup.roles.time_left(self._h.meta.cluster)

    def starttime(self) -> str:
        return self._h.starttime()

    def new_attempt(self, nodes: tuple[str, ...]) -> Attempt:
        return self._sup.new_attempt(self._h, nodes)

    async def events(self) -> list[JournalEvent]:
        return list(await self._sup.journal.events(self._h.run.run_id))

    async def emit(self, kind: str, fields: Mapping[str, object]) -> None:
        await self._sup.journal.add_event(self._h.run.run_id, kind, fields, self._sup.clock())

    async def wait_change(self, seconds: float) -> None:
        changed = self._h.changed
        with anyio.move_on_after(seconds):
            await changed.wait()

    async def until_changed(self, since: int) -> None:
        while self._h.version == since:
            await self._h.changed.wait()
