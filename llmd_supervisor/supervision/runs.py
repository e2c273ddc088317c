"""Per-run supervision: drives each run through the pure state machine.

One task per run, inside the daemon's root task group, with its own task group for the
watchers (SSH heartbeats, log tailers, marker watch) and the cancel sequence. The loop is
state-driven: whatever state the journal holds, the matching step is (re)done, so a
daemon restart resumes every run exactly where it was:

  accepted    -> journal `submitting` with the unique job name, then sbatch
  submitting  -> after a restart: look the job name up (squeue, then sacct); resubmit only
                 when both answer that it never existed
  pending/running -> follow the poller's views; start/restart watchers when running
  finishing   -> stop the watchers, snapshot `scontrol show job`, complete the log copies
  verifying   -> collect evidence until the verdict is final (poller-batched queries)
  archiving   -> write and fsync the archive (retried until it succeeds), then declare

Every transition goes through `lifecycle.step` and is journaled (compare-and-set) before
its action is relied on. Stopping the daemon cancels these tasks and never the jobs.
"""

from __future__ import annotations

import dataclasses
import functools
import getpass
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters import archive
from llmd_supervisor.adapters.fsutil import read_optional
from llmd_supervisor.adapters.journal import Journal, RunMeta, StoredRun
from llmd_supervisor.adapters.remote import NodeLink, SshSettings
from llmd_supervisor.adapters.slurm import NameLookup, SlurmClient
from llmd_supervisor.adapters.tail import tail_to_local
from llmd_supervisor.core.config import ClusterConfig, Config
from llmd_supervisor.core.lifecycle import (
    Action,
    Archived,
    CancelRequested,
    Declare,
    Event,
    LeftQueue,
    Requeued,
    Run,
    RunState,
    SendCancel,
    Started,
    StartWatchers,
    StopWatchers,
    Submit,
    SubmitFailed,
    Submitted,
    Verified,
    WatchersStopped,
    new_run,
    step,
)
from llmd_supervisor.core.marker import marker_filename
from llmd_supervisor.core.render import render_sbatch
from llmd_supervisor.core.slurm_parse import JobState, parse_scontrol_job
from llmd_supervisor.core.spec import RunSpec, load_spec
from llmd_supervisor.core.verdict import SlurmQuery, Source
from llmd_supervisor.errors import (
    IllegalTransition,
    RemoteError,
    SlurmCommandError,
    SlurmParseError,
    SpecError,
    SupervisorError,
)
from llmd_supervisor.node.common import expand_hostlist
from llmd_supervisor.supervision.poller import Poller, QueueView
from llmd_supervisor.supervision.verify import utcnow, verify_job

log = structlog.get_logger("llmd_supervisor.supervision.runs")

_REQUEUED_STATES = frozenset(
    {JobState.PENDING, JobState.REQUEUED, JobState.REQUEUE_HOLD, JobState.REQUEUE_FED}
)
RECEIPT_EVENT = "verify.receipt"
# After a restart in `submitting`, look the job name up no earlier than this long after
# the state was journaled (an sbatch in flight then has finished or died with its daemon).
SUBMIT_SETTLE_S = 5.0
ARCHIVE_RETRY_CAP_S = 15.0

# Fault injection for the crash tests: "STATE" or "STATE:N" SIGKILLs this process right
# after the journal committed the N-th (default first) transition into STATE, before any
# of its actions ran.
_CRASH_AFTER, _, _CRASH_NTH = os.environ.get("LLMD_SUPERVISOR_TEST_CRASH_AFTER", "").partition(":")
_crash_count = 0


def _crash(run: Run) -> None:
    global _crash_count
    _crash_count += 1
    if _crash_count >= int(_CRASH_NTH or 1):
        log.warning("test.crash", state=run.state.value, run_id=run.run_id)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class NodeHealth:
    """What the heartbeat watcher last learnt about one node."""

    rank: int
    reachable: bool = False
    last_ok: float | None = None  # time.monotonic()
    agent_state: str = ""
    reported_unreachable: bool = False


@dataclass
class RunHandle:
    """A run's in-memory companion to its journal row."""

    stored: StoredRun
    spec: RunSpec
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    changed: anyio.Event = field(default_factory=anyio.Event)
    version: int = 0
    tg: anyio.abc.TaskGroup | None = None
    submitting_here: bool = False  # this process journaled `submitting` and may call sbatch
    last_view: QueueView | None = None
    watchers_running: bool = False
    watchers_started: bool = False  # for the current attempt
    stop_watchers: anyio.Event = field(default_factory=anyio.Event)
    watchers_done: anyio.Event = field(default_factory=anyio.Event)
    health: dict[str, NodeHealth] = field(default_factory=dict)
    marker_copy: bytes | None = None
    tail_failed: str = ""  # a tailer gave up ("local" disk or "remote"): drain again
    known_nodes: tuple[str, ...] = ()  # the allocation's nodes, however learnt
    watch_scope: anyio.CancelScope | None = None  # the watchers' task group
    scontrol_snapshot: str | None = None
    tail_bytes: int = 0

    @property
    def run(self) -> Run:
        return self.stored.run

    @property
    def meta(self) -> RunMeta:
        return self.stored.meta

    def notify(self) -> None:
        self.version += 1
        self.changed.set()
        self.changed = anyio.Event()


class Supervisor:
    """Owns every run's task; the control handler talks to it."""

    def __init__(
        self,
        config: Config,
        journal: Journal,
        pollers: dict[str, Poller],
        clients: dict[str, SlurmClient],
        tg: anyio.abc.TaskGroup,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.config = config
        self.journal = journal
        self.pollers = pollers
        self.clients = clients
        self.tg = tg
        self.clock = clock
        self.handles: dict[str, RunHandle] = {}
        self.ssh = SshSettings(
            username=config.ssh.user or getpass.getuser(),
            client_keys=config.ssh.identity_files,
            known_hosts=config.ssh.known_hosts,
            port=config.ssh.port,
            connect_timeout=config.ssh.connect_timeout_s,
        )

    # --- entry points ------------------------------------------------------------------

    async def submit(
        self, spec_toml: str, *, owner_uid: int, cluster: str | None = None
    ) -> RunHandle:
        """Validate, render, journal as `accepted` and start supervising; SpecError if bad."""
        spec = load_spec(spec_toml)
        cluster_cfg = self.config.cluster(cluster)
        run_id = uuid.uuid4().hex[:12]
        job_name = f"llmd-{run_id}"
        script = render_sbatch(spec, job_name=job_name)
        now = self.clock()
        arch = await anyio.to_thread.run_sync(
            lambda: archive.prepare(
                self.config.archive_root, run_id, spec_toml=spec_toml, script=script
            )
        )
        meta = RunMeta(
            owner_uid=owner_uid,
            cluster=cluster_cfg.name,
            spec_toml=spec_toml,
            script=script,
            log_dir=spec.log_dir,
            archive_dir=str(arch),
            created_at=now,
        )
        run = new_run(run_id, job_name, now)
        await self.journal.insert_run(run, meta)
        handle = RunHandle(StoredRun(run, meta), spec)
        self.handles[run_id] = handle
        log.info("run.accepted", run_id=run_id, job_name=job_name, cluster=cluster_cfg.name)
        self.tg.start_soon(self._supervise, handle)
        return handle

    async def resume_all(self) -> int:
        """Start a task for every run the journal holds as not final; return how many."""
        count = 0
        for stored in await self.journal.list_runs():
            try:
                spec = load_spec(stored.meta.spec_toml)
            except SpecError as exc:  # a spec valid at submission fails validation now
                log.error("run.resume_failed", run_id=stored.run.run_id, error=str(exc))
                continue
            handle = RunHandle(StoredRun(stored.run, _slim(stored.meta, stored.run)), spec)
            self.handles[stored.run.run_id] = handle
            if not stored.run.state.is_final:
                if stored.meta.cluster not in self.pollers:
                    log.error(
                        "run.resume_failed",
                        run_id=stored.run.run_id,
                        error=f"cluster {stored.meta.cluster!r} is no longer configured",
                    )
                    continue
                count += 1
                log.info("run.resumed", run_id=stored.run.run_id, state=stored.run.state.value)
                self.tg.start_soon(self._supervise, handle)
        return count

    def get(self, ref: str) -> RunHandle | None:
        """A run by id, job name or Slurm job id."""
        if ref in self.handles:
            return self.handles[ref]
        for h in self.handles.values():
            if ref in (h.run.job_name, h.run.slurm_job_id):
                return h
        return None

    async def cancel(self, handle: RunHandle) -> None:
        """Ask for cancellation; IllegalTransition if the run is already final."""
        await self._apply(handle, CancelRequested())

    # --- the per-run loop ----------------------------------------------------------------

    async def _supervise(self, h: RunHandle) -> None:
        """Drive the run to a final state. An unexpected error (a bug, the journal briefly
        failing) is logged and the step retried with backoff: a run is never dropped, and
        its job is never touched because of it."""
        delay = 1.0
        with structlog.contextvars.bound_contextvars(
            run_id=h.run.run_id, slurm_job_id=h.run.slurm_job_id
        ):
            while not h.run.state.is_final:
                try:
                    async with anyio.create_task_group() as tg:
                        h.tg = tg
                        while not h.run.state.is_final:
                            await self._advance(h)
                            delay = 1.0
                        tg.cancel_scope.cancel()  # a cancel sequence still sleeping its grace
                except Exception as exc:
                    log.error(
                        "run.supervision_failed",
                        error=str(exc),
                        state=h.run.state.value,
                        retry_in_s=delay,
                        exc_info=not isinstance(exc, SupervisorError),
                    )
                    h.watchers_running = h.watchers_started = False
                    h.stop_watchers = anyio.Event()
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 60.0)
                finally:
                    h.tg = None

    async def _advance(self, h: RunHandle) -> None:
        state = h.run.state
        if state is RunState.ACCEPTED:
            h.submitting_here = True
            await self._apply(h, Submit())
        elif state is RunState.SUBMITTING:
            await self._submit(h)
        elif state in (RunState.PENDING, RunState.RUNNING):
            await self._follow_queue(h)
        elif state is RunState.FINISHING:
            await self._finish(h)
        elif state is RunState.VERIFYING:
            await self._verify(h)
        elif state is RunState.ARCHIVING:
            await self._archive(h)

    async def _apply(self, h: RunHandle, event: Event) -> tuple[Action, ...]:
        """step → journal (compare-and-set) → execute the actions the loop does not own."""
        async with h.lock:
            before = h.run
            now = self.clock()
            after, actions = step(before, event, now)
            if after is before:
                return ()
            await self.journal.save(after, expected=before.state)
            if _CRASH_AFTER and after.state.value == _CRASH_AFTER:
                _crash(after)
            h.stored = StoredRun(after, _slim(h.meta, after))
            if after.state is not before.state:
                await self.journal.add_event(
                    after.run_id,
                    "run.transition",
                    {
                        "from": before.state.value,
                        "to": after.state.value,
                        "event": type(event).__name__,
                    },
                    now,
                )
            if after.slurm_job_id != before.slurm_job_id:
                structlog.contextvars.bind_contextvars(slurm_job_id=after.slurm_job_id)
            log.info(
                "run.transition",
                frm=before.state.value,
                to=after.state.value,
                trigger=type(event).__name__,
            )
            h.notify()
        for action in actions:
            self._execute(h, action)
        return actions

    def _execute(self, h: RunHandle, action: Action) -> None:
        if isinstance(action, SendCancel) and h.tg is not None:
            h.tg.start_soon(self._cancel_sequence, h, action.job_id)
        elif isinstance(action, StartWatchers) and h.tg is not None:
            self._start_watchers(h, action.nodes)
        elif isinstance(action, StopWatchers):
            h.stop_watchers.set()
        elif isinstance(action, Declare):
            run = h.run
            created = run.transitions[0].at
            log.info(
                "run.finished",
                outcome=action.outcome.value,
                reason=action.reason,
                slurm_job_id=run.slurm_job_id,
                attempt=run.attempt,
                seconds=round((self.clock() - created).total_seconds(), 1),
                archive=h.meta.archive_dir,
            )
        # CallSbatch, RunVerify and WriteArchive are done by the state loop itself.

    # --- submitting ------------------------------------------------------------------------

    def _client(self, h: RunHandle) -> SlurmClient:
        return self.clients[h.meta.cluster]

    def _poller(self, h: RunHandle) -> Poller:
        return self.pollers[h.meta.cluster]

    def _starttime(self, h: RunHandle) -> str:
        start = h.meta.created_at - timedelta(minutes=5)
        return start.astimezone().strftime("%Y-%m-%dT%H:%M:%S")

    async def _submit(self, h: RunHandle) -> None:
        """sbatch once; after any sbatch failure or a crash, reconcile by the job's name.

        A job found by name is adopted. After an sbatch failure that left no job, the run
        fails with sbatch's error. After a crash during submission (no sbatch answer was
        seen), the job is submitted again only when squeue and sacct both answer that no
        job has the run's name, after a settle delay so that an sbatch the previous daemon
        left in flight has finished or died with it; with accounting disabled a purged
        job cannot be ruled out, so the run fails instead of risking a second job.
        """
        job_name = h.run.job_name
        resumed = not h.submitting_here
        h.submitting_here = False
        if resumed:
            since = self.clock() - h.run.transitions[-1].at
            await anyio.sleep(max(0.0, SUBMIT_SETTLE_S - since.total_seconds()))
            failure = "the daemon stopped while submitting"
        else:
            sbatch_error = await self._sbatch(h)
            if sbatch_error is None:
                return
            failure = f"sbatch failed: {sbatch_error}"
        lookup = await self._lookup(h)
        if lookup.job_id is not None:
            log.info("run.reconciled", job_name=job_name, slurm_job_id=lookup.job_id)
            await self._apply(h, Submitted(lookup.job_id))
        elif resumed and lookup.certain:
            log.info("run.resubmitting", job_name=job_name, why=failure)
            sbatch_error = await self._sbatch(h)
            if sbatch_error is not None:
                lookup = await self._lookup(h)
                if lookup.job_id is not None:
                    await self._apply(h, Submitted(lookup.job_id))
                else:
                    await self._apply(h, SubmitFailed(f"sbatch failed: {sbatch_error}"))
        else:
            why = "" if lookup.certain else " (accounting is disabled: it may have been purged)"
            await self._apply(
                h, SubmitFailed(f"{failure}; no job named {job_name} exists{why}; not resubmitted")
            )

    async def _lookup(self, h: RunHandle) -> NameLookup:
        """find_by_name with retries; SupervisorError (run left in `submitting`) if Slurm
        cannot answer at all."""
        for attempt in range(5):
            try:
                return await self._client(h).find_by_name(
                    h.run.job_name, starttime=self._starttime(h)
                )
            except SlurmCommandError as exc:
                log.warning("run.lookup_failed", job_name=h.run.job_name, error=str(exc))
                await anyio.sleep(min(2**attempt, 30))
        raise SupervisorError(
            f"Could not find out whether job {h.run.job_name} was submitted; "
            "left in `submitting` for the next daemon start to reconcile."
        )

    async def _sbatch(self, h: RunHandle) -> str | None:
        """Submit the run's script; None on success (journaled), else the error text."""
        client = self._client(h)
        try:
            await client.mkdir(h.meta.log_dir)
            job_id = await client.sbatch(h.meta.script)
        except SlurmCommandError as exc:
            log.warning("run.sbatch_failed", error=str(exc))
            return str(exc)
        log.info("run.submitted", job_name=h.run.job_name, slurm_job_id=job_id)
        await self._apply(h, Submitted(job_id))
        return None

    # --- pending / running -------------------------------------------------------------------

    async def _follow_queue(self, h: RunHandle) -> None:
        job_id = _job_id(h)
        poller = self._poller(h)
        poller.track(job_id, self._starttime(h))
        if h.run.state is RunState.RUNNING and not h.watchers_running:
            self._start_watchers(h, h.run.nodes)  # resumed after a restart
        local = self.config.cluster(h.meta.cluster).login_host is None
        if h.run.state is RunState.PENDING and local:
            # The batch log appears when the job starts: squeue then, not at its cadence.
            poller.watch_start(job_id, Path(h.meta.log_dir) / f"{h.run.job_name}-{job_id}.out")
        view = await poller.next_view(job_id, h.last_view)
        if view.state is not JobState.PENDING:
            poller.unwatch_start(job_id)
        h.last_view = view
        if view.left_queue:
            await self._apply(h, LeftQueue())
        elif view.state in (JobState.RUNNING, JobState.COMPLETING, JobState.SUSPENDED):
            if h.run.state is RunState.PENDING and view.nodes:
                await self._apply(h, Started(view.nodes))
        elif view.state in _REQUEUED_STATES and h.run.state is RunState.RUNNING:
            await self._apply(h, Requeued())
            if h.watchers_running:
                await h.watchers_done.wait()
            h.stop_watchers = anyio.Event()
            h.watchers_started = False

    async def _cancel_sequence(self, h: RunHandle, job_id: str) -> None:
        """TERM every step's tasks, wait the run's grace, then plain scancel if still queued.

        On cancellation (daemon stopping) the sequence just stops: the cancel request is
        journaled, the job keeps its TERM, and the outcome will still say `cancelled`.
        """
        client = self._client(h)
        grace = h.spec.sigterm_grace_s
        log.info("run.cancel_term", slurm_job_id=job_id, grace_s=grace)
        try:
            await client.scancel(job_id, signal="TERM")
        except SlurmCommandError as exc:
            log.warning("run.cancel_failed", step="term", error=str(exc))
        await self.journal.add_event(
            h.run.run_id,
            "cancel.term_sent",
            {"slurm_job_id": job_id, "grace_s": grace},
            self.clock(),
        )
        deadline = time.monotonic() + grace + 5
        while time.monotonic() < deadline:
            view = self._poller(h).latest(job_id)
            if view is not None and view.left_queue:
                return
            await anyio.sleep(0.5)
        log.info("run.cancel_kill", slurm_job_id=job_id)
        try:
            await client.scancel(job_id)
        except SlurmCommandError as exc:
            log.warning("run.cancel_failed", step="kill", error=str(exc))

    # --- watchers --------------------------------------------------------------------------

    def _start_watchers(self, h: RunHandle, nodes: tuple[str, ...]) -> None:
        assert h.tg is not None
        h.watchers_running = True
        h.watchers_started = True
        h.watchers_done = anyio.Event()
        h.tg.start_soon(self._watch, h, nodes)

    async def _watch(self, h: RunHandle, nodes: tuple[str, ...]) -> None:
        """One SSH link per node; per node a heartbeat/discovery loop and its tailers."""
        links = [NodeLink(node, self.ssh) for node in nodes]
        try:
            async with anyio.create_task_group() as tg:
                h.watch_scope = tg.cancel_scope
                for rank, link in enumerate(links):
                    h.health.setdefault(link.host, NodeHealth(rank))
                    tg.start_soon(self._watch_node, h, rank, link, tg)
        finally:
            # The tailers have stopped (their copies fsynced): the run may go on while
            # the links close.
            h.watchers_running = False
            h.watchers_done.set()
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as closing:
                    for link in links:
                        closing.start_soon(link.aclose)

    async def _watch_node(
        self, h: RunHandle, rank: int, link: NodeLink, tg: anyio.abc.TaskGroup
    ) -> None:
        job_id = _job_id(h)
        limits = self.config.limits
        log_dir = h.meta.log_dir
        job_dir = f"{log_dir}/{job_id}"
        local = archive.logs_dir(self.config.archive_root, h.run.run_id) / f"attempt{h.run.attempt}"
        tailing: set[str] = set()
        wanted: dict[str, str] = {}  # local name -> remote path
        if rank == 0:
            for ext in ("out", "err"):
                name = f"{h.run.job_name}-{job_id}.{ext}"
                wanted[name] = f"{log_dir}/{name}"
        coordinator = rank == h.spec.topology.coordinator_rank
        marker_path = f"{log_dir}/{marker_filename(job_id)}"
        health = h.health[link.host]
        prefix = f"rank{rank}."
        grown_at, last_size, stalled = time.monotonic(), -1, False
        while True:  # at least one pass: a run that ended before it was seen running
            stopping = h.stop_watchers.is_set()
            try:
                for name in await link.list_dir(job_dir):
                    if name.startswith(prefix) and not name.endswith(".status.json"):
                        wanted.setdefault(name, f"{job_dir}/{name}")
                status = await link.read_file(f"{job_dir}/rank{rank}.status.json")
                if status is not None:
                    health.agent_state = _status_state(status)
                if coordinator and h.marker_copy is None:
                    data = await link.read_file(marker_path)
                    if data:
                        h.marker_copy = data
                        log.info("run.marker_seen", node=link.host, size=len(data))
                        self._poller(h).poke()
                health.reachable = True
                health.last_ok = time.monotonic()
                health.reported_unreachable = False
            except RemoteError as exc:
                health.reachable = False
                silent = time.monotonic() - (health.last_ok or time.monotonic())
                if silent > limits.node_silent_s and not health.reported_unreachable:
                    health.reported_unreachable = True
                    log.warning("run.node_unreachable", node=link.host, silent_s=round(silent))
                    await self.journal.add_event(
                        h.run.run_id,
                        "node.unreachable",
                        {"node": link.host, "error": str(exc)},
                        self.clock(),
                    )
            for name, remote_path in wanted.items():
                if name not in tailing:
                    tailing.add(name)
                    tg.start_soon(self._tail, h, link, remote_path, local / name)
            size = sum(_size(local / name) for name in tailing)
            if size != last_size:
                grown_at, last_size, stalled = time.monotonic(), size, False
            elif not stalled and time.monotonic() - grown_at > limits.log_stall_s:
                stalled = True
                quiet = round(time.monotonic() - grown_at)
                log.warning("run.stalled", node=link.host, rank=rank, quiet_s=quiet)
                await self.journal.add_event(
                    h.run.run_id,
                    "log.stalled",
                    {"node": link.host, "rank": rank, "quiet_s": quiet},
                    self.clock(),
                )
            h.notify()
            if stopping:
                return
            with anyio.move_on_after(limits.heartbeat_interval_s):
                await h.stop_watchers.wait()

    async def _tail(self, h: RunHandle, link: NodeLink, remote_path: str, local_path: Path) -> None:
        def count(n: int) -> None:
            h.tail_bytes += n

        try:
            local_path.parent.mkdir(parents=True, exist_ok=True)
            await tail_to_local(link, remote_path, local_path, stop=h.stop_watchers, on_bytes=count)
        except* OSError as group:
            # Local disk trouble: the copy stays an exact prefix; the archive step drains
            # it again and does not declare before it is complete.
            h.tail_failed = "local"
            log.warning("run.tail_failed", remote=remote_path, error=str(group.exceptions[0]))
        except* SupervisorError as group:
            h.tail_failed = h.tail_failed or "remote"
            log.warning("run.tail_failed", remote=remote_path, error=str(group.exceptions[0]))

    # --- end of run ----------------------------------------------------------------------

    async def _finish(self, h: RunHandle) -> None:
        """Stop the watchers, snapshot `scontrol show job`, complete the log copies.

        Where this machine sees the run's log directory (a local cluster: the login node
        shares it with the nodes), the SSH tailers are cancelled (their copies are exact
        prefixes) and the copies completed from the shared filesystem in milliseconds;
        otherwise the tailers drain over SSH, bounded by `finish_drain_s`.
        """
        local = self.config.cluster(h.meta.cluster).login_host is None
        if local and h.watch_scope is not None:
            h.watch_scope.cancel()
        h.stop_watchers.set()
        result = await self._client(h).scontrol_job(_job_id(h))  # while the watchers stop
        nodes = h.run.nodes or (h.last_view.nodes if h.last_view else ())
        if result.ok and result.stdout.strip():
            h.scontrol_snapshot = result.stdout
            path = Path(h.meta.archive_dir) / "scontrol-show-job.txt"
            await anyio.to_thread.run_sync(path.write_text, result.stdout)
            nodes = nodes or _scontrol_nodes(result.stdout)
        h.known_nodes = nodes
        if local:
            # No need to wait for the cancelled tailers' cleanup (channel close, fsync):
            # they append nothing after the cancel, and the copies are exact prefixes.
            await self._drain_logs(h)
        else:
            if not h.watchers_started and nodes:
                # The job ended before it was seen running (or before a restart
                # re-attached): one drain-only pass still copies its logs.
                self._start_watchers(h, nodes)
            if h.watchers_running:
                with anyio.move_on_after(self.config.limits.finish_drain_s):
                    await h.watchers_done.wait()
        await self._apply(h, WatchersStopped())

    async def _verify(self, h: RunHandle) -> None:
        job_id = _job_id(h)
        poller = self._poller(h)
        starttime = self._starttime(h)
        cluster = self.config.cluster(h.meta.cluster)

        class _Evidence:
            async def query(self, source: Source, job_id: str) -> SlurmQuery:
                return await poller.evidence(source, job_id, starttime)

        async def marker_bytes() -> bytes | None:
            data = await self._read_marker(cluster, h)
            return data if data is not None else h.marker_copy

        result = await verify_job(
            _Evidence(),
            job_id,
            marker_bytes=marker_bytes,
            evidence_timeout=self.config.limits.verify_timeout_s,
            interval=self.config.poll.min_interval_s,
            cancel_requested=h.run.cancel_requested,
            clock=self.clock,
        )
        if h.marker_copy is None:
            h.marker_copy = await marker_bytes()
        await self.journal.add_event(
            h.run.run_id, RECEIPT_EVENT, {"receipt": result.receipt}, self.clock()
        )
        poller.untrack(job_id)
        await self._apply(h, Verified(result.verdict.outcome, result.verdict.reason))

    async def _read_marker(self, cluster: ClusterConfig, h: RunHandle) -> bytes | None:
        """The marker as this machine (local cluster) or the cluster's login host sees it.

        None when it is missing or cannot be read now (the caller falls back to the copy
        the SSH watcher took from the coordinator).
        """
        from llmd_supervisor.adapters.slurm_ssh import read_file  # the login-host read path

        path = Path(h.meta.log_dir) / marker_filename(_job_id(h))
        if cluster.login_host is None:  # this machine shares the log directory
            return await anyio.to_thread.run_sync(read_optional, path)
        client = self._client(h)
        try:
            return await read_file(client.runner, str(path), time_limit=client.timeout)
        except SlurmCommandError as exc:
            log.warning("run.marker_unreadable", host=cluster.login_host, error=str(exc))
            return None

    async def _archive(self, h: RunHandle) -> None:
        """Write the archive, retrying with backoff while it fails (disk full, permissions):
        the outcome is never declared before its evidence is on disk. A log copy that a
        tailer could not finish is drained again before each retry."""
        if h.marker_copy is None and h.run.slurm_job_id is not None:
            h.marker_copy = await self._read_marker(self.config.cluster(h.meta.cluster), h)
        delay = 1.0
        remote_drains = 0
        while True:
            if h.tail_failed and (h.known_nodes or h.run.nodes):
                remote_drains += h.tail_failed == "remote"
                h.tail_failed = ""
                await self._drain_logs(h)
            events = await self.journal.events(h.run.run_id)
            receipts = [e["receipt"] for e in events if e.get("kind") == RECEIPT_EVENT]
            receipt = receipts[-1] if receipts else None
            write = functools.partial(
                archive.write_archive,
                self.config.archive_root,
                h.run.run_id,
                receipt=receipt
                if isinstance(receipt, dict)
                else {"outcome": h.run.outcome, "reason": h.run.reason},
                events=events,
                marker=h.marker_copy,
                scontrol_snapshot=h.scontrol_snapshot,
            )
            try:
                with anyio.fail_after(self.config.limits.archive_timeout_s, shield=True):
                    path = await anyio.to_thread.run_sync(write)
            except (OSError, TimeoutError) as exc:
                log.error("run.archive_failed", error=str(exc), retry_in_s=delay)
                await self.journal.add_event(
                    h.run.run_id, "archive.failed", {"error": str(exc)}, self.clock()
                )
                h.tail_failed = "local"  # the log copies may be short too
            else:
                if h.tail_failed != "local" and (not h.tail_failed or remote_drains >= 3):
                    if h.tail_failed:  # the nodes refuse us now; say so, do not hang
                        await self.journal.add_event(
                            h.run.run_id, "logs.incomplete", {"drains": remote_drains}, self.clock()
                        )
                    break
            await anyio.sleep(delay)
            delay = min(delay * 2, ARCHIVE_RETRY_CAP_S)
        log.info("run.archived", archive=str(path))
        with anyio.CancelScope(shield=True):
            await self._apply(h, Archived())

    async def _drain_logs(self, h: RunHandle) -> None:
        """Copy what the tailers have not copied yet: from the shared log directory for a
        local cluster, else with one drain-only SSH watcher pass."""
        if self.config.cluster(h.meta.cluster).login_host is None:
            try:
                copied = await anyio.to_thread.run_sync(self._catch_up_local, h)
            except OSError as exc:
                h.tail_failed = "local"
                log.warning("run.catch_up_failed", error=str(exc))
            else:
                log.info("run.logs_completed", bytes=copied)
            return
        h.stop_watchers.set()
        self._start_watchers(h, h.known_nodes or h.run.nodes)
        with anyio.move_on_after(self.config.limits.finish_drain_s):
            await h.watchers_done.wait()

    def _catch_up_local(self, h: RunHandle) -> int:
        """Append to each local copy what its log file (seen through the shared log
        directory) holds beyond it; copies files no tailer saw. Returns bytes copied."""
        job_id = _job_id(h)
        log_dir = Path(h.meta.log_dir)
        local_dir = (
            archive.logs_dir(self.config.archive_root, h.run.run_id) / f"attempt{h.run.attempt}"
        )
        sources = [log_dir / f"{h.run.job_name}-{job_id}.{ext}" for ext in ("out", "err")]
        job_dir = log_dir / job_id
        if job_dir.is_dir():
            sources += sorted(
                p
                for p in job_dir.iterdir()
                if p.name.startswith("rank") and not p.name.endswith(".status.json") and p.is_file()
            )
        local_dir.mkdir(parents=True, exist_ok=True)
        copied = 0
        for source in sources:
            if source.exists():
                copied += _append_missing(source, local_dir / source.name)
        return copied


def _append_missing(source: Path, copy: Path) -> int:
    """Append source's bytes beyond copy's size to copy, fsynced; return how many."""
    with copy.open("ab") as out, source.open("rb") as src:
        src.seek(out.tell())
        n = 0
        while chunk := src.read(1 << 20):
            out.write(chunk)
            n += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return n


def _slim(meta: RunMeta, run: Run) -> RunMeta:
    """Drop the rendered script (~75 KB: it embeds the node agent) once Slurm has it; the
    journal and the archive's job.sbatch keep it. Keeps the daemon small with many runs."""
    if meta.script and run.state not in (RunState.ACCEPTED, RunState.SUBMITTING):
        return dataclasses.replace(meta, script="")
    return meta


def _job_id(h: RunHandle) -> str:
    if h.run.slurm_job_id is None:
        raise IllegalTransition(h.run.state.value, "an operation needing a Slurm job id")
    return h.run.slurm_job_id


def _scontrol_nodes(text: str) -> tuple[str, ...]:
    """The allocated nodes from a `scontrol show job` record (empty if unparsable)."""
    try:
        node_list = parse_scontrol_job(text).node_list
    except SlurmParseError:
        return ()
    if not node_list or node_list == "(null)":
        return ()
    return tuple(expand_hostlist(node_list))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _status_state(data: bytes) -> str:
    try:
        value = json.loads(data)
    except ValueError:
        return "unreadable"
    return str(value.get("state", "")) if isinstance(value, dict) else "unreadable"


def run_summary(h: RunHandle, now: datetime) -> dict[str, object]:
    """The run as the control socket shows it."""
    run = h.run
    healthy = sum(1 for n in h.health.values() if n.reachable)
    return {
        "run": run.run_id,
        "job_name": run.job_name,
        "state": run.state.value,
        "outcome": run.outcome.value if run.outcome else None,
        "reason": run.reason,
        "slurm_job_id": run.slurm_job_id,
        "attempt": run.attempt,
        "nodes": list(run.nodes),
        "nodes_healthy": healthy,
        "cancel_requested": run.cancel_requested,
        "cluster": h.meta.cluster,
        "owner_uid": h.meta.owner_uid,
        "created_at": h.meta.created_at.isoformat(),
        "elapsed_s": round((now - h.meta.created_at).total_seconds(), 1),
        "archive": h.meta.archive_dir,
        "log_dir": h.meta.log_dir,
        "health": {
            node: {"rank": n.rank, "reachable": n.reachable, "agent_state": n.agent_state}
            for node, n in h.health.items()
        },
        "transitions": [
            {"state": t.state.value, "at": t.at.isoformat(), "event": t.event}
            for t in run.transitions
        ],
        "last_log_line": _last_line(
            archive.logs_dir(Path(h.meta.archive_dir).parent, run.run_id)
            / f"attempt{run.attempt}"
            / f"{run.job_name}-{run.slurm_job_id}.out"
        ),
    }


def _last_line(path: Path) -> str:
    """The last non-empty line of a (local, small-read) log copy, or ""."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((line for line in reversed(lines) if line.strip()), "")
