"""The steps of a run's driver, one per state (see `driver`), and the cancel sequence.

Each step is idempotent: it may be re-done from the journaled record after a crash or a
supervision retry. It ends by applying an event (or returns to let the driver re-plan).
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import structlog

from llmd_supervisor.adapters import archive
from llmd_supervisor.adapters.slurm import NameLookup
from llmd_supervisor.core.cause import Diagnosis, diagnose, hang, rank_end
from llmd_supervisor.core.foreign import ForeignSpec
from llmd_supervisor.core.jobtext import job_fields, job_text
from llmd_supervisor.core.lifecycle import (
    Archived,
    HoldExpired,
    LeftQueue,
    Requeued,
    RunState,
    Started,
    Submit,
    SubmitFailed,
    Submitted,
    Verified,
    WatchersStopped,
)
from llmd_supervisor.core.render import render_sbatch
from llmd_supervisor.core.results import GateResult, results_table
from llmd_supervisor.core.slurm_parse import JobState, parse_scontrol_job
from llmd_supervisor.core.spec import RunSpec
from llmd_supervisor.core.usage import split as usage_split
from llmd_supervisor.core.verdict import Outcome, SlurmQuery, Source
from llmd_supervisor.errors import (
    FileRefused,
    RemoteError,
    SlurmCommandError,
    SlurmParseError,
    SupervisorError,
)
from llmd_supervisor.node.common import RC_CONFIG, expand_hostlist
from llmd_supervisor.supervision import bench_files, cancel, foreign_jobs, retries
from llmd_supervisor.supervision.attempt import CopyState
from llmd_supervisor.supervision.poller import QueueView
from llmd_supervisor.supervision.verify import VerifyResult, verify_job

if TYPE_CHECKING:
    from llmd_supervisor.supervision.driver import Loop, RunHandle, Supervisor

log = structlog.get_logger("llmd_supervisor.runs")

RECEIPT_EVENT = "verify.receipt"
# After a restart in `submitting`, look the job name up no earlier than this long after
# the state was journaled (an sbatch in flight then has finished or died with its daemon).
SUBMIT_SETTLE_S = 5.0
ARCHIVE_RETRY_CAP_S = 15.0
REMOTE_DRAINS = 3
_REQUEUED_STATES = frozenset(
    {JobState.PENDING, JobState.REQUEUED, JobState.REQUEUE_HOLD, JobState.REQUEUE_FED}
)
# sinfo's %T of a node Slurm took out: down, drained/draining, fail(ing), not responding (*)
_NODE_DOWN = re.compile(r"(down|drain|fail)|.*\*$", re.IGNORECASE)
_RUNNING_STATES = frozenset({JobState.RUNNING, JobState.COMPLETING, JobState.SUSPENDED})
_CONNECTING = "connecting"  # the action of a link's `RemoteError` when SSH itself failed


# --- submitting ----------------------------------------------------------------------------


async def submit(sup: Supervisor, h: RunHandle) -> None:
    """Journal `submitting`, then sbatch once; after an sbatch failure, reconcile by name.
    A retry first waits its backoff, and a run whose excluded nodes leave too few is held
    (`retries.before_submit`)."""
    exclude = await retries.before_submit(sup, h)
    if isinstance(exclude, HoldExpired):
        await _hold_expired(sup, h, exclude)
        return
    if exclude is None:
        return  # waiting: the driver plans again
    await sup.apply(h, Submit())
    sbatch_error = await _sbatch(sup, h, exclude)
    if sbatch_error is None:
        return
    lookup = await _lookup(sup, h)
    if lookup.job_id is not None:
        log.info("run.reconciled", job_name=h.run.slurm_job_name, slurm_job_id=lookup.job_id)
        await sup.apply(h, Submitted(lookup.job_id))
    else:
        await sup.apply(h, SubmitFailed(f"sbatch failed: {sbatch_error}"))


async def _hold_expired(sup: Supervisor, h: RunHandle, expired: HoldExpired) -> None:
    """A run held past its deadline fails: its receipt (the hold, and every attempt it
    had) is journaled first, then `HoldExpired` applied; the archive is written as for
    any verdict."""
    attempts = h.history
    receipt: dict[str, object] = {
        "outcome": Outcome.FAILED.value,
        "reason": expired.reason,
        "attempt": h.run.attempt,
        "slurm_job_name": h.run.slurm_job_name,
        "held": {"submission": h.run.submission, "reason": h.run.reason},
        "attempts": attempts,
        "usage_total": usage_split(attempts),
    }
    await sup.journal.add_event(h.run.run_id, RECEIPT_EVENT, {"receipt": receipt}, sup.clock())
    h.held_until = None
    await sup.apply(h, expired)


async def reconcile(sup: Supervisor, h: RunHandle) -> None:
    """`submitting` found on entry: sbatch may have been in flight when the daemon (or this
    loop) stopped. A job found by name is adopted. It is submitted again only when squeue
    and sacct both answer that no job has the run's name, after a settle delay so that an
    sbatch left in flight has finished or died with its daemon; with accounting disabled a
    purged job cannot be ruled out, so the run fails instead of risking a second job."""
    job_name = h.run.slurm_job_name
    since = sup.clock() - h.run.transitions[-1].at
    await anyio.sleep(max(0.0, SUBMIT_SETTLE_S - since.total_seconds()))
    lookup = await _lookup(sup, h)
    if lookup.job_id is not None:
        log.info("run.reconciled", job_name=job_name, slurm_job_id=lookup.job_id)
        await sup.apply(h, Submitted(lookup.job_id))
        return
    if lookup.certain:
        log.info("run.resubmitting", job_name=job_name, why="the daemon stopped while submitting")
        sbatch_error = await _sbatch(sup, h, await retries.excluded(sup, h))
        if sbatch_error is None:
            return
        lookup = await _lookup(sup, h)
        if lookup.job_id is not None:
            await sup.apply(h, Submitted(lookup.job_id))
        else:
            await sup.apply(h, SubmitFailed(f"sbatch failed: {sbatch_error}"))
        return
    await sup.apply(
        h,
        SubmitFailed(
            f"the daemon stopped while submitting; no job named {job_name} exists "
            "(accounting is disabled: it may have been purged); not resubmitted"
        ),
    )


async def _lookup(sup: Supervisor, h: RunHandle) -> NameLookup:
    """find_by_name with retries; SupervisorError (run left in `submitting`, reconciled by
    the next loop) if Slurm cannot answer at all."""
    for attempt in range(5):
        try:
            return await h.cluster.client.find_by_name(
                h.run.slurm_job_name, starttime=h.starttime()
            )
        except SlurmCommandError as exc:
            log.warning("run.lookup_failed", job_name=h.run.slurm_job_name, error=str(exc))
            await anyio.sleep(min(2**attempt, 30))
    raise SupervisorError(
        f"Could not find out whether job {h.run.slurm_job_name} was submitted; "
        "left in `submitting` to reconcile again."
    )


async def _sbatch(sup: Supervisor, h: RunHandle, exclude: tuple[str, ...]) -> str | None:
    """Submit the run's script (a retry's rendered again with its own job name), keeping
    `exclude` out; None on success (journaled), else the error text."""
    client, spec, name = h.cluster.client, h.spec, h.run.slurm_job_name
    if isinstance(spec, ForeignSpec):
        script, options, env = spec.script, spec.sbatch_options(name), spec.env
    else:
        script, options, env = h.meta.script, [], None
        if h.run.submission > 1 or not script:
            script = render_sbatch(spec, job_name=name)
    if exclude:
        options.append(f"--exclude={','.join(exclude)}")
    try:
        await client.mkdir(h.meta.log_dir)
        job_id = await client.sbatch(script, *options, env=env)
    except SlurmCommandError as exc:
        log.warning("run.sbatch_failed", error=str(exc))
        return str(exc)
    log.info("run.submitted", job_name=name, slurm_job_id=job_id, exclude=list(exclude))
    await sup.apply(h, Submitted(job_id))
    return None


# --- pending / running -----------------------------------------------------------------------


async def follow_queue(sup: Supervisor, h: RunHandle, loop: Loop) -> None:
    """Wait for the next queue view (or a change of the record: a cancel) and apply it."""
    job_id = h.job_id()
    await foreign_jobs.ensure_job_files(sup, h)
    poller = h.cluster.poller
    poller.track(job_id, h.starttime())
    files = h.cluster.files
    if h.run.state is RunState.PENDING:
        # The batch log appears when the job starts: squeue then, not at its cadence.
        if (out := h.layout.batch_out(job_id)) and (started := files.local_path(out)):
            poller.watch_start(job_id, started)
    elif (path := h.layout.marker(job_id)) and (marker := files.local_path(path)):
        poller.watch_end(job_id, marker)  # the marker appears just before the job ends
    last = loop.view
    view = await _next_view_or_change(h, loop, lambda: poller.next_view(job_id, last))
    if view is None:
        return  # the record changed (a cancel, a heartbeat): the driver re-plans
    loop.view = view
    if view.state is not JobState.PENDING:
        poller.unwatch_start(job_id)
    if view.left_queue:
        await sup.apply(h, LeftQueue())
    elif view.state in _RUNNING_STATES:
        if h.run.state is RunState.PENDING and view.nodes:
            await sup.apply(h, Started(view.nodes))
    elif (
        view.state in _REQUEUED_STATES
        and view.source == "squeue"  # sacct lags: right after a start it still says PENDING
        and h.run.state is RunState.RUNNING
    ):
        await sup.apply(h, Requeued())
        if h.attempt is not None:
            await h.attempt.drain()  # the old allocation's logs, into its own attempt part


async def _next_view_or_change(
    h: RunHandle, loop: Loop, next_view: Callable[[], Awaitable[QueueView]]
) -> QueueView | None:
    """The poller's next view, or None as soon as the run changed since the loop planned."""
    result: list[QueueView] = []
    async with anyio.create_task_group() as tg:

        async def take() -> None:
            result.append(await next_view())
            tg.cancel_scope.cancel()

        tg.start_soon(take)
        while h.version == loop.version:
            await h.changed.wait()
        tg.cancel_scope.cancel()
    return result[0] if result else None


# --- end of run --------------------------------------------------------------------------------


async def finish(sup: Supervisor, h: RunHandle) -> None:
    """Stop the attempt and complete its log copies (how: the cluster's files strategy)
    while `scontrol show job` is snapshotted into the archive."""
    job_id = h.job_id()
    snapshot: list[str] = []

    async def take_snapshot() -> None:
        result = await h.cluster.client.scontrol_job(job_id)
        if result.ok and result.stdout.strip():
            snapshot.append(result.stdout)
            h.scontrol_snapshot = result.stdout
            path = h.layout.archive_dir / "scontrol-show-job.txt"
            try:
                await anyio.to_thread.run_sync(path.write_text, result.stdout)
            except OSError as exc:  # a full disk: the archive writes it once it can
                log.warning("run.snapshot_unsaved", path=str(path), error=str(exc))

    attempt = h.attempt
    if attempt is not None and attempt.number == h.run.attempt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(take_snapshot)
            attempt.copies = await h.cluster.files.complete_copies(attempt, h.layout, job_id)
    else:
        # The job ended before it was seen running, or the daemon restarted since: the
        # copies are completed from what the local copies already hold.
        await take_snapshot()
        nodes = h.run.nodes or (_scontrol_nodes(snapshot[0]) if snapshot else ())
        attempt = h.attempt = sup.new_attempt(h, nodes)
        attempt.copies = await h.cluster.files.complete_copies(attempt, h.layout, job_id)
    await sup.apply(h, WatchersStopped())


async def verify(sup: Supervisor, h: RunHandle) -> None:
    job_id = h.job_id()
    poller = h.cluster.poller
    starttime = h.starttime()

    class _Evidence:
        async def query(self, source: Source, job_id: str) -> SlurmQuery:
            return await poller.evidence(source, job_id, starttime)

    spec = h.spec

    async def benchmark() -> GateResult:
        assert isinstance(spec, RunSpec)
        limits = sup.config.limits
        raw = await bench_files.read_results(h.cluster.files, h.layout, job_id, spec, limits)
        return bench_files.judge(spec, raw)

    marker_path = h.layout.marker(job_id)
    events = await sup.journal.events(h.run.run_id)
    # A cancel counts only if it reached the job before it ended (not asked for after).
    cancelled = cancel.reached(h.run, events, job_id)
    result = await verify_job(
        _Evidence(),
        job_id,
        marker_bytes=functools.partial(_marker, h),
        marker_format=h.layout.marker_format,
        marker_name=posixpath.basename(marker_path) if h.layout.watch and marker_path else "",
        benchmark=benchmark if isinstance(spec, RunSpec) else None,
        evidence_timeout=sup.config.limits.verify_timeout_s,
        interval=sup.config.poll.min_interval_s,
        cancel_requested=cancelled,
        clock=sup.clock,
    )
    hung = next(
        (
            e
            for e in events
            if e.get("kind") == "stage.overdue" and e.get("attempt") == h.run.attempt
        ),
        None,
    )
    outcome, reason, receipt = result.verdict.outcome, result.verdict.reason, dict(result.receipt)
    if hung is not None and outcome is not Outcome.SUCCEEDED and not cancelled:
        # ended by the supervisor because an agent hung: a failure, not a cancel
        outcome = Outcome.FAILED
        reason = (
            f"rank {hung.get('rank')} on {hung.get('node')} hung in stage "
            f"{hung.get('stage')!r}, {hung.get('over_s')} s past its {hung.get('deadline_s')} s "
            f"deadline: the attempt was ended early; {reason}"
        )
        receipt["outcome"], receipt["hung"] = outcome.value, hung
        rank = hung.get("rank")
        diagnosis: Diagnosis | None = hang(
            str(hung.get("stage")),
            rank if isinstance(rank, int) and not isinstance(rank, bool) else -1,
            _allocation(h),
        )
    else:
        diagnosis = await _diagnosis(sup, h, result, events)
    receipt["cause"] = None if diagnosis is None else diagnosis.as_json()
    if diagnosis is not None:
        reason = receipt["reason"] = f"{reason}; {diagnosis.text}"
    if h.run.cancel_requested and not cancelled:
        reason = receipt["reason"] = f"{reason}; the cancel did not reach the job before it ended"
    receipt["cancel_reached"] = cancelled
    receipt["attempt"], receipt["slurm_job_name"] = h.run.attempt, h.run.slurm_job_name
    decision = await retries.after_verdict(sup, h, result, diagnosis, outcome, reason, receipt)
    poller.untrack(job_id)
    if decision.retry:
        return
    if decision.unplaced:  # an infrastructure failure the retry could not get away from
        reason = receipt["reason"] = f"{reason}; {decision.why}"
    attempts = h.history
    receipt["attempts"] = attempts
    receipt["usage_total"] = usage_split(attempts)
    await sup.journal.add_event(h.run.run_id, RECEIPT_EVENT, {"receipt": receipt}, sup.clock())
    await sup.apply(h, Verified(outcome, reason))


async def _diagnosis(
    sup: Supervisor, h: RunHandle, result: VerifyResult, events: list[dict[str, object]]
) -> Diagnosis | None:
    """Why the run did not succeed (`core.cause`), from the verdict, the ranks' last status
    files (unreadable ones are left out), the nodes this attempt reported unreachable, and
    the benchmark's gate. Only the attempt's allocation names nodes (a status file's rank,
    never its ``host``); the nodes the daemon saw fail itself are Slurm's and those that did
    not take an SSH connection."""
    if result.verdict.outcome is Outcome.SUCCEEDED:
        return None
    allocation = _allocation(h)
    count = len(allocation) or (h.spec.topology.nodes if isinstance(h.spec, RunSpec) else 1)
    try:
        statuses = await bench_files.read_statuses(h.cluster.files, h.layout, h.job_id(), count)
    except (SupervisorError, OSError, TimeoutError) as exc:
        log.warning("run.status_unreadable", run_id=h.run.run_id, error=str(exc))
        statuses = []
    # The job wrote them: what they name reaches the reason and terminals escaped.
    ends = [e for status in statuses if (e := rank_end(job_fields(status), allocation))]
    reports = [
        e
        for e in events
        if e.get("kind") == "node.unreachable" and e.get("attempt") == h.run.attempt
    ]
    unreachable = [str(e.get("node")) for e in reports]
    observed = [str(e.get("node")) for e in reports if _no_ssh(e.get("node"), e.get("error"))]
    gate = result.receipt.get("benchmark")
    marker = result.marker.marker
    belief = result.verdict.belief
    slurm_state = None if belief is None else belief.record.state.state
    if slurm_state is JobState.NODE_FAIL and allocation:
        failed = await _failed_nodes(h, allocation)
        unreachable += failed
        observed += failed
    return diagnose(
        result.verdict.outcome,
        slurm_state=slurm_state,
        cancel_requested=cancel.reached(h.run, events, h.job_id()),
        allocation=allocation,
        ranks=ends,
        unreachable=unreachable,
        observed=observed,
        benchmark_failed=(isinstance(gate, dict) and gate.get("ok") is False)
        or (marker is not None and 0 < marker.rc < RC_CONFIG),
    )


def _allocation(h: RunHandle) -> tuple[str, ...]:
    """The attempt's nodes by rank, from Slurm: as the run saw it start, else as the job's
    `scontrol show job` record says (a job that ended before it was seen running, or a
    restart since)."""
    if h.run.nodes:
        return h.run.nodes
    attempt = h.attempt
    if attempt is not None and attempt.number == h.run.attempt and attempt.nodes:
        return tuple(attempt.nodes)
    return _scontrol_nodes(h.scontrol_snapshot) if h.scontrol_snapshot else ()


def _no_ssh(node: object, error: object) -> bool:
    """Whether a `node.unreachable` report says the node did not take an SSH connection
    (the daemon's own evidence): its error is the link's `RemoteError` while connecting,
    worded by the daemon. A read of the job's files that failed or hung, or a status file
    gone stale (which the job can cause), is not."""
    prefix = str(RemoteError(str(node), _CONNECTING, "")).removesuffix(": .")
    return isinstance(error, str) and error.startswith(f"{prefix}: ")


async def _failed_nodes(h: RunHandle, allocation: tuple[str, ...]) -> list[str]:
    """The allocation's nodes Slurm names as failed: scontrol's FailedNode (24.11 shows it;
    22.05 does not) and those `sinfo` says are down, failing or not responding now."""
    failed: list[str] = []
    snapshot = h.layout.archive_dir / "scontrol-show-job.txt"
    try:
        text = h.scontrol_snapshot
        if text is None:
            text = await anyio.to_thread.run_sync(snapshot.read_text)
        node = parse_scontrol_job(text).fields.get("FailedNode", "")
        failed += expand_hostlist(node) if node and node != "(null)" else []
    except (OSError, SlurmParseError, ValueError):
        pass
    try:
        states = await h.cluster.client.node_states(allocation)
    except SlurmCommandError as exc:
        log.warning("run.node_states_unknown", error=str(exc))
        states = {}
    failed += [n for n, st in states.items() if _NODE_DOWN.match(st)]
    return sorted(set(failed) & set(allocation))


async def _marker(h: RunHandle) -> bytes | None:
    """The marker as the cluster's files strategy reads it, else the coordinator's copy."""
    path = None if h.run.slurm_job_id is None else h.layout.marker(h.run.slurm_job_id)
    if path is not None:
        data = await h.cluster.files.read(h.layout.log_dir, path)
        if data is not None:
            return data
    return h.attempt.marker_copy if h.attempt is not None else None


async def write_archive(sup: Supervisor, h: RunHandle) -> None:
    """Write the archive, retrying with backoff while it fails (disk full, permissions):
    the outcome is never declared before its evidence is on disk. A log copy that is not
    complete is drained again before each retry (a node that keeps refusing: at most
    REMOTE_DRAINS times, then `logs.incomplete` is recorded instead of hanging)."""
    try:
        marker = await _marker(h)
    except FileRefused:  # not a plain file: the verdict said so, nothing to archive
        marker = None
    attempt = h.attempt
    copies = attempt.copies if attempt is not None else CopyState.COMPLETE
    if attempt is None and h.run.slurm_job_id is not None and h.run.nodes:
        # Restarted since the copies were completed: whether they were is not journaled,
        # so complete them again (it appends only what a copy lacks).
        attempt = h.attempt = sup.new_attempt(h, h.run.nodes)
        copies = CopyState.LOCAL_FAILED
    evidence = await _bench_evidence(sup, h)
    delay = 1.0
    remote_drains = 0
    while True:
        if copies is not CopyState.COMPLETE and attempt is not None and attempt.nodes:
            remote_drains += copies is CopyState.REMOTE_FAILED
            copies = await h.cluster.files.complete_copies(attempt, h.layout, attempt.job_id)
            attempt.copies = copies
        events = await sup.journal.events(h.run.run_id)
        receipts = [e["receipt"] for e in events if e.get("kind") == RECEIPT_EVENT]
        receipt = receipts[-1] if receipts else None
        write = functools.partial(
            archive.write_archive,
            sup.config.archive_root,
            h.run.run_id,
            receipt=receipt
            if isinstance(receipt, dict)
            else {"outcome": h.run.outcome, "reason": h.run.reason},
            events=events,
            marker=marker,
            scontrol_snapshot=h.scontrol_snapshot,
            files=evidence,
        )
        try:
            with anyio.fail_after(sup.config.limits.archive_timeout_s, shield=True):
                path = await anyio.to_thread.run_sync(write)
        except (OSError, TimeoutError) as exc:
            log.error("run.archive_failed", error=str(exc), retry_in_s=delay)
            await sup.journal.add_event(
                h.run.run_id, "archive.failed", {"error": str(exc)}, sup.clock()
            )
            copies = CopyState.LOCAL_FAILED  # the log copies may be short too
        else:
            if copies is CopyState.COMPLETE:
                break
            if copies is CopyState.REMOTE_FAILED and remote_drains >= REMOTE_DRAINS:
                await sup.journal.add_event(
                    h.run.run_id, "logs.incomplete", {"drains": remote_drains}, sup.clock()
                )
                break
        await anyio.sleep(delay)
        delay = min(delay * 2, ARCHIVE_RETRY_CAP_S)
    log.info("run.archived", archive=str(path))
    with anyio.CancelScope(shield=True):
        await sup.apply(h, Archived())


async def _bench_evidence(sup: Supervisor, h: RunHandle) -> dict[str, bytes]:
    """The benchmark's raw files, the ranks' status and diagnostics, and `results.json`
    (empty when no job ran)."""
    if h.run.slurm_job_id is None:
        return {}
    job_id, spec = h.run.slurm_job_id, h.spec

    async def refused(exc: FileRefused) -> None:
        fields = {"path": job_text(exc.path), "reason": job_text(exc.why)}  # the job's names
        log.warning("run.log_refused", **fields)
        await sup.journal.add_event(h.run.run_id, "log.refused", fields, sup.clock())

    files, limits = h.cluster.files, sup.config.limits
    if isinstance(spec, ForeignSpec):
        got = await bench_files.read_foreign(files, h.layout, job_id, refused, limits)
        table = bench_files.foreign_table(got)
        return {**got.archived, "results.json": (json.dumps(table, indent=1) + "\n").encode()}
    got = await bench_files.read_all(files, h.layout, job_id, spec, refused, limits)
    gpus = spec.topology.gpus_per_node * spec.topology.nodes
    table = results_table(bench_files.judge(spec, got.results), gpus)
    return {**got.archived, "results.json": (json.dumps(table, indent=1) + "\n").encode()}


def _scontrol_nodes(text: str) -> tuple[str, ...]:
    """The allocated nodes from a `scontrol show job` record (empty if unparsable)."""
    try:
        node_list = parse_scontrol_job(text).node_list
    except SlurmParseError:
        return ()
    if not node_list or node_list == "(null)":
        return ()
    return tuple(expand_hostlist(node_list))
