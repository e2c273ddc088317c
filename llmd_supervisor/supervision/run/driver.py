"""Per-run supervision: one driver loop per run (DESIGN.md section 3).

Each run is advanced by one loop, inside the daemon's root task group, with a task group
of its own. The loop reads the journaled record, asks the pure core what it needs
(`lifecycle.plan`: one step plus background actions), makes sure the background actions
run (the attempt's watchers; the cancel sequence while a cancel is requested and the job
is still queued) and awaits the step, which ends by applying an event. Every event goes
through `lifecycle.step` and is journaled (compare-and-set) before anything relies on it,
so whatever the journal holds after a crash or a supervision retry, `plan` of it says what
to (re)do, and every step is idempotent:

A run is of one kind (`core.run.kinds`, journaled with it): a spec the daemon renders, a
user's batch script submitted as it is, or a job submitted without the daemon and adopted,
which is journaled straight into `pending` with its job id.

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
`context.RunContext` and returns the event or value that this module then applies
(`steps.PhaseResult`: the event, the events journaled with it, a frozen memo): the run's
handle (`RunHandle`) is changed here and nowhere else. The `Supervisor` is the entry
points over the run registry (`registry`), the ways a run comes to be (`entries`) and the
`RunDriver`; a change's outbound events are read before the run's lock (`outbound`).

Stopping the daemon cancels these loops and never the jobs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters.journal.store import Journal, NewEvent, RunMeta, StoredRun
from llmd_supervisor.adapters.slurm.runner import CommandRunner
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.run.health import NodeHealth
from llmd_supervisor.core.run.kinds import RunKind
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.run.lifecycle import (
    BACKGROUND,
    Action,
    CallSbatch,
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
    plan,
    step,
)
from llmd_supervisor.core.spec.foreign import ForeignSpec
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.errors import (
    IllegalTransition,
    SupervisorError,
)
from llmd_supervisor.supervision.cluster.clusters import Cluster
from llmd_supervisor.supervision.cluster.poller import QueueView
from llmd_supervisor.supervision.ha.leading import Roles
from llmd_supervisor.supervision.run import (
    cancel,
    failures,
    follow,
    foreign,
    retries,
    steps,
    submit,
)
from llmd_supervisor.supervision.run.attempt import Attempt
from llmd_supervisor.supervision.run.bench_files import JudgedFiles
from llmd_supervisor.supervision.run.context import LiveContext, RunContext
from llmd_supervisor.supervision.run.outbound import Outbound, Prepared
from llmd_supervisor.supervision.run.records import (
    RECEIPT_EVENT,
    TRANSITION_EVENT,
    AttemptEntry,
    JobFiles,
    ReceiptEvent,
    ToJournal,
    Transition,
)
from llmd_supervisor.supervision.run.registry import slim
from llmd_supervisor.supervision.run.steps import Memo, PhaseResult

log = structlog.get_logger("llmd_supervisor.runs")

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
    kind: RunKind  # what the run is: a rendered spec, a user's own script, an adopted job
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

    def refreshed(self, stored: StoredRun) -> None:
        """A newer record of a run another daemon drives (a standby's look)."""
        self.stored = stored
        self.notify()

    def forget(self, stored: StoredRun) -> None:
        """What a driver of an earlier tenure learnt in memory is not this one's: the run is
        the journal's now, and the next driver learns the rest again."""
        self.stored = stored
        self.attempt = None
        self.scontrol_snapshot = None
        self.judged_files = None
        self.held_until = None
        self.job_files_known, self.job_files_asked = False, 0
        self.layout = dataclasses.replace(
            self.layout, job_name=stored.run.slurm_job_name, batch_paths=()
        )
        self.notify()

    def learnt(self, history: Sequence[AttemptEntry], noted: JobFiles | None) -> None:
        """The run's ended attempts and (a foreign job's) noted batch logs, as journaled."""
        self.history = list(history)
        if noted is not None:
            self.use_job_files(noted)

    def keep(self, memo: Memo) -> None:
        """What a phase found that the driver keeps in memory (`steps.Memo`)."""
        if memo.attempt is not None:
            self.attempt = memo.attempt
        if memo.snapshot is not None:
            self.scontrol_snapshot = memo.snapshot
        if memo.judged is not None or memo.consumed:
            self.judged_files = memo.judged

    def ended(self, entry: AttemptEntry) -> None:
        """An attempt ended (its history entry journaled with the verdict)."""
        self.history.append(entry)
        self.notify()  # the metrics' GPU-hours

    def use_job_files(self, files: JobFiles) -> None:
        """A foreign job's batch logs (and an adopted job's submit time) from now on."""
        spec = self.kind.foreign
        assert spec is not None, "only a foreign job has job files to use"
        self.layout, submitted = foreign.used(self.layout, spec, files)
        if submitted is not None:
            self.submitted_at = submitted
        self.job_files_known = True

    @property
    def spec(self) -> RunSpec | ForeignSpec:
        return self.kind.spec

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
        return self.kind.name

    @property
    def coordinator_rank(self) -> int:
        """The rank that writes the marker (a foreign job's: the first node's view)."""
        return self.kind.coordinator_rank

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


class RunDriver:
    """Drives each run, one loop per run (`supervise`): plans, runs the plan's phase and
    applies what it returns (`apply`: the one place a run's record changes)."""

    def __init__(
        self,
        config: Config,
        journal: Journal,
        roles: Roles,
        outbound: Outbound,
        *,
        clock: Callable[[], datetime],
        hooks: Hooks,
    ) -> None:
        self.config = config
        self.journal = journal
        self.roles = roles
        self.outbound = outbound
        self.clock = clock
        self.hooks = hooks

    async def supervise(self, h: RunHandle) -> None:
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
                await self._applied(h, await steps.reconciled(ctx))
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
                await self._applied(h, await steps.finished(ctx))
            case RunVerify():
                await self._applied(h, await steps.verified(ctx))
            case WriteArchive():  # the outcome journaled even if the daemon stops now
                await self._applied(h, await steps.archived(ctx), shield=True)
            case _:
                raise AssertionError(f"{action!r} is not a step")

    async def _applied(self, h: RunHandle, result: PhaseResult, *, shield: bool = False) -> None:
        """A phase's result: its memo kept, its event applied, its attempt entry added."""
        h.keep(result.memo)
        with anyio.CancelScope(shield=shield):
            await self.apply(h, result.event, result.logged)
        if result.entry is not None:
            h.ended(result.entry)

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
            h.use_job_files(files)

    def context(self, h: RunHandle) -> RunContext:
        """The run as its phases see it."""
        cluster = h.meta.cluster
        return LiveContext(
            h,
            self.config,
            self.journal,
            self.clock,
            lambda: self.roles.time_left(cluster),
            functools.partial(self.new_attempt, h),
        )

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
        returned, in one transaction) → tell whoever waits on the run. What its outbound
        events say beyond the run's records is read before the run's lock (`outbound`)."""
        prepared = await self._prepare(h, h.run, event)
        async with h.lock:
            before = h.run
            now = self.clock()
            after, _ = step(before, event, now)  # the actions are plan(after): the loop's
            if after is before and not logged:
                return
            if prepared is None or not prepared.of(before, after):  # changed meanwhile
                prepared = await self._prepare(h, before, event)
            assert prepared is not None
            outgoing = self.outbound.built(before, after, prepared, h.meta, h.kind)
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
            h.stored = StoredRun(after, slim(h.meta, after))
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

    async def _prepare(self, h: RunHandle, before: Run, event: Event) -> Prepared | None:
        """What the outbound events of `event`'s change of the run read (`outbound`); None
        if the event does not apply to `before`."""
        try:
            after, _ = step(before, event, self.clock())
        except IllegalTransition:
            return None
        files, history = h.judged_files, h.history
        return await self.outbound.prepare(before, after, h.meta, h.kind, files, history)

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
