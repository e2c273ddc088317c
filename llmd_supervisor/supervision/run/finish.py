"""Finishing: stop the attempt's watchers, complete its log copies, snapshot the job.

`scontrol show job` is taken while the copies complete (slurmctld forgets the job after
MinJobAge) and written into the archive at once; the driver keeps it for the verdict's
diagnosis and the archive's second write.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import structlog

from llmd_supervisor.core.run.lifecycle import WatchersStopped
from llmd_supervisor.supervision.run.attempt import Attempt, CopyState
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.evidence import scontrol_nodes

log = structlog.get_logger("llmd_supervisor.runs")


@dataclass(frozen=True)
class Finished:
    """The attempt whose copies were completed (a new object when the job ended before it
    was seen running, or after a restart), their state, and the job's scontrol record
    (None when scontrol had none)."""

    attempt: Attempt
    copies: CopyState
    snapshot: str | None

    @property
    def event(self) -> WatchersStopped:
        """The event that ends the step."""
        return WatchersStopped()


async def finish(ctx: RunContext) -> Finished:
    """Stop the attempt and complete its log copies (how: the cluster's files strategy)
    while `scontrol show job` is snapshotted into the archive."""
    job_id = ctx.job_id()
    snapshot: list[str] = []

    async def take_snapshot() -> None:
        result = await ctx.cluster.client.scontrol_job(job_id)
        if result.ok and result.stdout.strip():
            snapshot.append(result.stdout)
            path = ctx.layout.archive_dir / "scontrol-show-job.txt"
            try:
                await anyio.to_thread.run_sync(path.write_text, result.stdout)
            except OSError as exc:  # a full disk: the archive writes it once it can
                log.warning("run.snapshot_unsaved", path=str(path), error=str(exc))

    files = ctx.cluster.files
    attempt = ctx.attempt
    if attempt is not None and attempt.number == ctx.run.attempt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(take_snapshot)
            copies = await files.complete_copies(attempt, ctx.layout, job_id)
    else:
        # The job ended before it was seen running, or the daemon restarted since: the
        # copies are completed from what the local copies already hold.
        await take_snapshot()
        nodes = ctx.run.nodes or (scontrol_nodes(snapshot[0]) if snapshot else ())
        attempt = ctx.new_attempt(nodes)
        copies = await files.complete_copies(attempt, ctx.layout, job_id)
    return Finished(attempt, copies, snapshot[0] if snapshot else None)
