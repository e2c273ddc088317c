"""Verifying: the verdict on the attempt's job, why it did not succeed, and what follows.

Slurm's records and the marker are collected through the cluster's poller
(`supervision.run.verify_job.verify_job`) until the pure verdict is final; the rest of the
attempt's evidence (a hang, the ranks' status files, the nodes reported unreachable or
named failed by Slurm) is gathered here, and `core.verdict.judge.judge` decides once: the
outcome and reason (an attempt ended early because an agent hung is a failure, not a
cancel), the cause and nodes, the receipt, the retry policy's decision. Then `retries`
records the attempt's end and places a retry. The receipt is built once, complete, when
the verdict is made; it is journaled before the event is returned.
"""

from __future__ import annotations

import functools
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import anyio
import structlog

from llmd_supervisor.core.results.evidence import GateResult
from llmd_supervisor.core.run.jobtext import job_fields
from llmd_supervisor.core.run.lifecycle import Retry, Verified
from llmd_supervisor.core.slurm.parse import JobState, parse_scontrol_job
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.core.verdict.cause import RankEnd, rank_end
from llmd_supervisor.core.verdict.decide import Outcome, SlurmQuery, Source
from llmd_supervisor.core.verdict.judge import Evidence, NodeReport, Reach, judge, node_report
from llmd_supervisor.core.verdict.usage import split as usage_split
from llmd_supervisor.errors import SlurmCommandError, SlurmParseError, SupervisorError
from llmd_supervisor.node.common import expand_hostlist
from llmd_supervisor.supervision.run import bench_files as bench_files
from llmd_supervisor.supervision.run import cancel, evidence, retries
from llmd_supervisor.supervision.run.bench_files import JudgedFiles
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import (
    ATTEMPT_EVENT,
    RECEIPT_EVENT,
    AttemptEntry,
    AttemptReceipt,
    JournalEvent,
    NodeUnreachable,
    Receipt,
    ReceiptEvent,
    RunPart,
    StageOverdue,
    ToJournal,
    of_type,
    parsed,
)
from llmd_supervisor.supervision.run.verify_job import VerifyResult, verify_job

log = structlog.get_logger("llmd_supervisor.runs")

# sinfo's %T of a node Slurm took out: down, drained/draining, fail(ing), not responding (*)
_NODE_DOWN = re.compile(r"(down|drain|fail)|.*\*$", re.IGNORECASE)


@dataclass(frozen=True)
class Judged:
    """What verification ends with: the event for the driver to apply (`Verified`, or a
    `Retry` of the run) with the events to journal in the same transaction (the attempt's
    history entry when it is new, then the receipt unless a retry follows), the history
    entry, and the files the verdict was made from (for the archive)."""

    event: Verified | Retry
    logged: tuple[ToJournal, ...]
    entry: AttemptEntry | None
    files: JudgedFiles


class _Reads:
    """The marker and the benchmark's files as `verify_job` reads them (the last read
    of each is what the verdict was made from)."""

    def __init__(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self.marker: bytes | None = None
        self.bench: bench_files.BenchFiles | None = None

    async def read_marker(self) -> bytes | None:
        self.marker = None  # a refused marker stays None
        self.marker = await evidence.marker(self._ctx)
        return self.marker

    async def benchmark(self) -> GateResult:
        ctx, spec = self._ctx, self._ctx.spec
        assert isinstance(spec, RunSpec)
        self.bench = await bench_files.read_all(
            ctx.cluster.files,
            ctx.layout,
            ctx.job_id(),
            spec,
            functools.partial(evidence.report_refused, ctx),
            ctx.config.limits,
        )
        return bench_files.judge(spec, self.bench.results)

    def files(self) -> JudgedFiles:
        return JudgedFiles(self.marker, self.bench)


async def verify(ctx: RunContext) -> Judged:
    """Judge the attempt's job and decide on a retry (`retries`); the driver journals the
    attempt's end and the receipt with the verdict, in one transaction. Re-done after a
    crash, it finds the attempt's end recorded if the verdict was."""
    job_id = ctx.job_id()
    poller = ctx.cluster.poller
    starttime = ctx.starttime()

    class _Evidence:
        async def query(self, source: Source, job_id: str) -> SlurmQuery:
            return await poller.evidence(source, job_id, starttime)

    reads = _Reads(ctx)
    marker_path = ctx.layout.marker(job_id)
    events = await ctx.events()
    # A cancel counts only if it reached the job before it ended (not asked for after).
    cancelled = cancel.reached(ctx.run, events, job_id)
    result = await verify_job(
        _Evidence(),
        job_id,
        marker_bytes=reads.read_marker,
        marker_format=ctx.layout.marker_format,
        marker_name=posixpath.basename(marker_path) if ctx.layout.watch and marker_path else "",
        benchmark=reads.benchmark if isinstance(ctx.spec, RunSpec) else None,
        evidence_timeout=ctx.config.limits.verify_timeout_s,
        interval=ctx.config.poll.min_interval_s,
        cancel_requested=cancelled,
        clock=ctx.now,
    )
    judgement = judge(await _gather(ctx, result, events, cancelled), result.decided_at)
    outcome, reason, diagnosis = judgement.outcome, judgement.reason, judgement.diagnosis
    end = await retries.after_verdict(ctx, judgement)
    run, decision = ctx.run, end.decision
    ended: tuple[ToJournal, ...] = () if end.entry is None else ((ATTEMPT_EVENT, end.entry),)
    added: RunPart = {
        "cause": None if diagnosis is None else diagnosis.as_json(),
        "cancel_reached": cancelled,
        "attempt": run.attempt,
        "slurm_job_name": run.slurm_job_name,
    }
    if judgement.hang is not None:
        added["hung"] = judgement.hang.journaled
    if end.usage is not None:
        added["usage"] = end.usage
    if decision.retry:
        part: AttemptReceipt = {
            **judgement.receipt,
            **added,
            "outcome": outcome.value,
            "reason": reason,
            "retry": decision.why,
        }
        retry = await retries.retried(ctx, part, decision, reason)
        poller.untrack(job_id)
        return Judged(retry, ended, end.entry, reads.files())
    poller.untrack(job_id)
    if decision.unplaced:  # an infrastructure failure the retry could not get away from
        reason = f"{reason}; {decision.why}"
    attempts = [*ctx.history, *([] if end.entry is None else [end.entry])]
    receipt: Receipt = {
        **judgement.receipt,
        **added,
        "outcome": outcome.value,
        "reason": reason,
        "attempts": attempts,
        "usage_total": usage_split(attempts),
    }
    journaled: ReceiptEvent = {"receipt": receipt}
    logged = (*ended, (RECEIPT_EVENT, journaled))
    return Judged(Verified(outcome, reason), logged, end.entry, reads.files())


async def _gather(
    ctx: RunContext, result: VerifyResult, events: Sequence[JournalEvent], cancelled: bool
) -> Evidence:
    """The attempt's evidence for `judge`: the verdict's (`result`), an agent's hang its
    watchers journaled, the attempt's allocation, and, for a run that did not succeed and
    was not ended early by a hang, the ranks' last status files (unreadable ones are left
    out), the nodes this attempt reported unreachable and those Slurm names failed. Only
    the attempt's allocation names nodes (a status file's rank, never its ``host``)."""
    run = ctx.run
    allocation = evidence.allocation(ctx)
    typed = parsed(events)
    overdue = [e.hang for e in of_type(typed, StageOverdue) if e.attempt == run.attempt]
    hung = overdue[0] if overdue else None
    ranks: list[RankEnd] = []
    nodes: list[NodeReport] = []
    ended_early = hung is not None and not cancelled
    if result.verdict.outcome is not Outcome.SUCCEEDED and not ended_early:
        ranks = await _rank_ends(ctx, allocation)
        reports = of_type(typed, NodeUnreachable)
        nodes = [e.report for e in reports if e.attempt == run.attempt]
        belief = result.verdict.belief
        if belief is not None and belief.record.state.state is JobState.NODE_FAIL and allocation:
            failed = await _failed_nodes(ctx, allocation)
            nodes += [NodeReport(n, Reach.SLURM_FAILED) for n in failed]
    return Evidence(
        result.state,
        result.marker,
        result.deadline,
        gate=result.gate,
        cancel_reached=cancelled,
        cancel_requested=run.cancel_requested,
        hang=hung,
        allocation=allocation,
        ranks=tuple(ranks),
        nodes=tuple(nodes),
        policy=retries.policy(ctx),
        retries_done=run.submission - 1,
    )


async def _rank_ends(ctx: RunContext, allocation: tuple[str, ...]) -> list[RankEnd]:
    """Each rank's end from its last status file, on its node in the allocation."""
    spec = ctx.spec
    count = len(allocation) or (spec.topology.nodes if isinstance(spec, RunSpec) else 1)
    try:
        statuses = await bench_files.read_statuses(
            ctx.cluster.files, ctx.layout, ctx.job_id(), count
        )
    except (SupervisorError, OSError, TimeoutError) as exc:
        log.warning("run.status_unreadable", run_id=ctx.run.run_id, error=str(exc))
        statuses = []
    # The job wrote them: what they name reaches the reason and terminals escaped.
    return [e for status in statuses if (e := rank_end(job_fields(status), allocation))]


def no_ssh(node: object, error: object) -> bool:
    """Whether a `node.unreachable` report says the node did not take an SSH connection
    (the daemon's own evidence): its error is the link's `RemoteError` while connecting,
    worded by the daemon. A read of the job's files that failed or hung, or a status file
    gone stale (which the job can cause), is not (`core.verdict.judge.node_report`)."""
    return node_report(node, error).reach is Reach.NO_SSH


async def _failed_nodes(ctx: RunContext, allocation: tuple[str, ...]) -> list[str]:
    """The allocation's nodes Slurm names as failed: scontrol's FailedNode (24.11 shows it;
    22.05 does not) and those `sinfo` says are down, failing or not responding now."""
    failed: list[str] = []
    snapshot = ctx.layout.archive_dir / "scontrol-show-job.txt"
    try:
        text = ctx.scontrol_snapshot
        if text is None:
            text = await anyio.to_thread.run_sync(snapshot.read_text)
        node = parse_scontrol_job(text).fields.get("FailedNode", "")
        failed += expand_hostlist(node) if node and node != "(null)" else []
    except (OSError, SlurmParseError, ValueError):
        pass
    try:
        states: Mapping[str, str] = await ctx.cluster.client.node_states(allocation)
    except SlurmCommandError as exc:
        log.warning("run.node_states_unknown", error=str(exc))
        states = {}
    failed += [n for n, st in states.items() if _NODE_DOWN.match(st)]
    return sorted(set(failed) & set(allocation))
