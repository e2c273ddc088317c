"""What the phases after a job's end read of it: its marker and its allocation's nodes;
and how a file the job made unreadable is reported."""

from __future__ import annotations

import structlog

from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.core.slurm.parse import parse_scontrol_job
from llmd_supervisor.errors import FileRefused, SlurmParseError
from llmd_supervisor.node.common import expand_hostlist
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import LOG_REFUSED_EVENT, LogRefusedEvent

log = structlog.get_logger("llmd_supervisor.runs")


async def marker(ctx: RunContext) -> bytes | None:
    """The marker as the cluster's files strategy reads it, else the coordinator's copy."""
    job_id = ctx.run.slurm_job_id
    path = None if job_id is None else ctx.layout.marker(job_id)
    if path is not None:
        data = await ctx.cluster.files.read(ctx.layout.log_dir, path)
        if data is not None:
            return data
    attempt = ctx.attempt
    return attempt.marker_copy if attempt is not None else None


def allocation(ctx: RunContext) -> tuple[str, ...]:
    """The attempt's nodes by rank, from Slurm: as the run saw it start, else as the job's
    `scontrol show job` record says (a job that ended before it was seen running, or a
    restart since)."""
    if ctx.run.nodes:
        return ctx.run.nodes
    attempt = ctx.attempt
    if attempt is not None and attempt.number == ctx.run.attempt and attempt.nodes:
        return tuple(attempt.nodes)
    snapshot = ctx.scontrol_snapshot
    return scontrol_nodes(snapshot) if snapshot else ()


def scontrol_nodes(text: str) -> tuple[str, ...]:
    """The allocated nodes from a `scontrol show job` record (empty if unparsable)."""
    try:
        node_list = parse_scontrol_job(text).node_list
    except SlurmParseError:
        return ()
    if not node_list or node_list == "(null)":
        return ()
    return tuple(expand_hostlist(node_list))


async def report_refused(ctx: RunContext, exc: FileRefused) -> None:
    """A job's file was not read (a link, a FIFO, beyond the budget...): logged and
    journaled as `records.LOG_REFUSED_EVENT`, with the job's names escaped."""
    fields = LogRefusedEvent(path=job_text(exc.path), reason=job_text(exc.why))
    log.warning("run.log_refused", **fields)
    await ctx.emit(LOG_REFUSED_EVENT, fields)
