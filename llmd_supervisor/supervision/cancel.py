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
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final

import anyio
import structlog

from llmd_supervisor.core.lifecycle import Run
from llmd_supervisor.errors import SlurmCommandError

if TYPE_CHECKING:
    from llmd_supervisor.supervision.driver import RunHandle, Supervisor

log = structlog.get_logger("llmd_supervisor.runs")

TERM_EVENT: Final = "cancel.term_sent"  # {slurm_job_id, grace_s, delivered, for}
KILL_EVENT: Final = "cancel.kill_sent"  # {slurm_job_id, for}
# Seconds past the grace before the plain scancel (the poller's view of the job's end lags).
KILL_MARGIN_S: Final = 5.0


async def cancel_sequence(sup: Supervisor, h: RunHandle, job_id: str) -> None:
    """TERM every step's tasks, wait the run's grace, then plain scancel if still queued.
    A job the poller has already seen leave the queue is not signalled at all. Run for a
    cancel request, and for an agent that hung (`driver._background`).

    On cancellation (daemon stopping, supervision retry) the sequence just stops: the
    cancel request is journaled, so the next loop runs the sequence again while the job is
    queued, and the outcome will still say `cancelled`.
    """
    poller = h.cluster.poller

    def left() -> bool:
        view = poller.latest(job_id)
        return view is not None and view.left_queue

    if left():
        log.info("run.cancel_after_end", slurm_job_id=job_id)
        return
    client = h.cluster.client
    grace = h.spec.sigterm_grace_s
    log.info("run.cancel_term", slurm_job_id=job_id, grace_s=grace)
    why = "cancel" if h.run.cancel_requested else "hang"
    delivered = True
    try:
        await client.scancel(job_id, signal="TERM")
    except SlurmCommandError as exc:  # e.g. "Job/step already completing or completed"
        delivered = False
        log.warning("run.cancel_failed", step="term", error=str(exc))
    fields = {
        "slurm_job_id": job_id,
        "grace_s": grace,
        "delivered": delivered,
        "for": why,
    }
    await sup.journal.add_event(h.run.run_id, TERM_EVENT, fields, sup.clock())
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
    fields = {"slurm_job_id": job_id, "for": why}
    await sup.journal.add_event(h.run.run_id, KILL_EVENT, fields, sup.clock())


def reached(run: Run, events: Iterable[Mapping[str, object]], job_id: str) -> bool:
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
