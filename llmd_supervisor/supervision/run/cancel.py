"""The cancel sequence (DESIGN.md section 7), and whether a cancel reached its job.

A cancel is journaled first (`CancelRequested`); the driver then makes sure this sequence
runs while the job is still queued: TERM to every step's tasks, the run's grace, then a
plain scancel if the job is still there. What each signal did is journaled, so that the
verdict can tell a job our cancel ended from one that had ended before it came: a cancel
asked for once the job has left the queue (in finishing or verifying), or one that
scancel refused because the job had already completed, changes nothing of its outcome
(`reached`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Final

import anyio
import structlog

from llmd_supervisor.core.run.lifecycle import Run
from llmd_supervisor.errors import SlurmCommandError
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import (
    KILL_EVENT,
    TERM_EVENT,
    CancelKill,
    CancelTerm,
    JournalEvent,
)

log = structlog.get_logger("llmd_supervisor.runs")
# Seconds past the grace before the plain scancel (the poller's view of the job's end lags).
KILL_MARGIN_S: Final = 5.0


async def cancel_sequence(ctx: RunContext, job_id: str) -> None:
    """TERM every step's tasks, wait the run's grace, then plain scancel if still queued.
    A job the poller has already seen leave the queue is not signalled at all. Run for a
    cancel request, and for an agent that hung (the driver's background actions).

    On cancellation (daemon stopping, supervision retry) the sequence just stops: the
    cancel request is journaled, so the next loop runs the sequence again while the job is
    queued, and the outcome will still say `cancelled`.
    """
    poller = ctx.cluster.poller

    def left() -> bool:
        view = poller.latest(job_id)
        return view is not None and view.left_queue

    if left():
        log.info("run.cancel_after_end", slurm_job_id=job_id)
        return
    client = ctx.cluster.client
    grace = ctx.spec.sigterm_grace_s
    log.info("run.cancel_term", slurm_job_id=job_id, grace_s=grace)
    why = "cancel" if ctx.run.cancel_requested else "hang"
    delivered = True
    try:
        await client.scancel(job_id, signal="TERM")
    except SlurmCommandError as exc:  # e.g. "Job/step already completing or completed"
        delivered = False
        log.warning("run.cancel_failed", step="term", error=str(exc))
    term: CancelTerm = {
        "slurm_job_id": job_id,
        "grace_s": grace,
        "delivered": delivered,
        "for": why,
    }
    await ctx.emit(TERM_EVENT, term)
    deadline = time.monotonic() + grace + KILL_MARGIN_S
    while time.monotonic() < deadline:
        if left():
            return
        await anyio.sleep(0.5)
    log.info("run.cancel_kill", slurm_job_id=job_id)
    try:
        await client.scancel(job_id)
    except SlurmCommandError as exc:
        log.warning("run.cancel_failed", step="kill", error=str(exc))
        return
    kill: CancelKill = {"slurm_job_id": job_id, "for": why}
    await ctx.emit(KILL_EVENT, kill)


def reached(run: Run, events: Iterable[JournalEvent], job_id: str) -> bool:
    """Whether the user's cancel reached job `job_id` while it ran: a cancel is requested
    and scancel delivered its TERM (or the plain scancel after the grace) to that job.
    Events journaled before these fields existed count as delivered."""
    if not run.cancel_requested:
        return False
    return any(
        e.get("slurm_job_id") == job_id
        and e.get("for") != "hang"
        and (
            e.get("kind") == KILL_EVENT
            or (e.get("kind") == TERM_EVENT and e.get("delivered", True))
        )
        for e in events
    )
