"""Archiving: the run's evidence on disk, fsynced, before its outcome is declared.

Written again until it succeeds (disk full, permissions); a log copy that is not complete
is drained again before each try (a node that keeps refusing: at most REMOTE_DRAINS
times, then `logs.incomplete` is recorded instead of hanging).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import anyio
import structlog

from llmd_supervisor.adapters.files import archive as archive
from llmd_supervisor.core.results.evidence import results_table
from llmd_supervisor.core.results.gpus import RoleGpus
from llmd_supervisor.core.run.lifecycle import Archived
from llmd_supervisor.core.spec.recipe import deployment_of, role_gpus
from llmd_supervisor.errors import FileRefused
from llmd_supervisor.supervision.run import bench_files as bench_files
from llmd_supervisor.supervision.run import evidence
from llmd_supervisor.supervision.run.attempt import Attempt, CopyState
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import (
    last_receipt,
)

log = structlog.get_logger("llmd_supervisor.runs")

ARCHIVE_RETRY_CAP_S = 15.0
REMOTE_DRAINS = 3


@dataclass(frozen=True)
class Written:
    """The archive is on disk: the attempt whose copies it holds (a new object after a
    restart, None when no job ran on nodes) and their state."""

    attempt: Attempt | None
    copies: CopyState

    @property
    def event(self) -> Archived:
        """The event that ends the step."""
        return Archived()


async def write_archive(ctx: RunContext) -> Written:
    """Write the archive, retrying with backoff while it fails: the outcome is never
    declared before its evidence is on disk. Cancellation leaves a try that started to
    write finish it (shielded, bounded by `archive_timeout_s`)."""
    judged = ctx.judged_files
    try:
        marker = judged.marker if judged is not None else await evidence.marker(ctx)
    except FileRefused:  # not a plain file: the verdict said so, nothing to archive
        marker = None
    attempt = ctx.attempt
    copies = attempt.copies if attempt is not None else CopyState.COMPLETE
    run = ctx.run
    if attempt is None and run.slurm_job_id is not None and run.nodes:
        # Restarted since the copies were completed: whether they were is not journaled,
        # so complete them again (it appends only what a copy lacks).
        attempt = ctx.new_attempt(run.nodes)
        copies = CopyState.LOCAL_FAILED
    files = await _bench_evidence(ctx, None if judged is None else judged.bench)
    limits = ctx.config.limits
    delay = 1.0
    remote_drains = 0
    while True:
        if copies is not CopyState.COMPLETE and attempt is not None and attempt.nodes:
            remote_drains += copies is CopyState.REMOTE_FAILED
            copies = await ctx.cluster.files.complete_copies(attempt, ctx.layout, attempt.job_id)
        events = await ctx.events()
        receipt = last_receipt(events)
        write = functools.partial(
            archive.write_archive,
            ctx.config.archive_root,
            run.run_id,
            receipt=receipt
            if receipt is not None
            else {"outcome": run.outcome, "reason": run.reason},
            events=events,
            marker=marker,
            scontrol_snapshot=ctx.scontrol_snapshot,
            files=files,
        )
        try:
            with anyio.fail_after(limits.archive_timeout_s, shield=True):
                path = await anyio.to_thread.run_sync(write)
        except (OSError, TimeoutError) as exc:
            log.error("run.archive_failed", error=str(exc), retry_in_s=delay)
            await ctx.emit("archive.failed", {"error": str(exc)})
            copies = CopyState.LOCAL_FAILED  # the log copies may be short too
        else:
            if copies is CopyState.COMPLETE:
                break
            if copies is CopyState.REMOTE_FAILED and remote_drains >= REMOTE_DRAINS:
                await ctx.emit("logs.incomplete", {"drains": remote_drains})
                break
        await anyio.sleep(delay)
        delay = min(delay * 2, ARCHIVE_RETRY_CAP_S)
    log.info("run.archived", archive=str(path))
    return Written(attempt, copies)


async def _bench_evidence(
    ctx: RunContext, judged: bench_files.BenchFiles | None
) -> dict[str, bytes]:
    """The benchmark's raw files, the ranks' status and diagnostics, and `results.json`
    (empty when no job ran): those the verdict was made from (`judged`), else read now
    (a restart since the verdict, a foreign job)."""
    job_id, kind = ctx.run.slurm_job_id, ctx.kind
    if job_id is None:
        return {}
    files, layout, limits = ctx.cluster.files, ctx.layout, ctx.config.limits
    refused = functools.partial(evidence.report_refused, ctx)
    if (own := kind.foreign) is not None:
        got = await bench_files.read_foreign(files, layout, job_id, refused, limits)
        roles = None
        if own.prefill_gpus is not None and own.decode_gpus is not None:
            roles = RoleGpus(own.prefill_gpus, own.decode_gpus)
        table = bench_files.foreign_table(got, roles, len(ctx.run.nodes) or None)
        return {**got.archived, "results.json": (json.dumps(table, indent=1) + "\n").encode()}
    spec = kind.rendered
    assert spec is not None, "a run is a foreign job's or a rendered spec's"
    found = judged or await bench_files.read_all(files, layout, job_id, spec, refused, limits)
    table = results_table(
        bench_files.judge(spec, found.results),
        role_gpus(spec.topology),
        deployment=deployment_of(spec),
    )
    return {**found.archived, "results.json": (json.dumps(table, indent=1) + "\n").encode()}
