"""A campaign's expansion off the event loop, stopped when its request is cancelled.

Expanding a campaign builds and validates one run spec per point (about 0.8 ms of CPU and
13 KiB each, up to ``[limits] campaign_max_points``): seconds of work that must neither
run on the event loop nor go on once its client went away. `Expander.run` runs it in a
worker thread, at most `CONCURRENT` expansions at once in the daemon (the others wait for
their turn, cancellably), and hands the work a stop check (`core.campaign.expand.Stop`) that
turns true when the awaiting task is cancelled: the control server cancels a
``campaign_submit`` whose client closed its connection. The expansion asks it between
combinations and raises `ExpansionStopped` at the next one.

Cancellation contract: on cancellation the stop check turns true, `run` waits, shielded,
at most `STOP_WAIT_S` for the thread to end, logs ``campaign.expansion_stopped`` (``ended``:
whether it did; ``built``: the combinations it had turned into points) and lets the
cancellation propagate. A thread still running then is abandoned; it ends at its next
check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final

import anyio
import anyio.to_thread
import structlog

from llmd_supervisor.core.campaign import expand as core
from llmd_supervisor.errors import ExpansionStopped

__all__ = ["CONCURRENT", "STOP_WAIT_S", "Expander"]

CONCURRENT: Final = 2  # expansions at once: each holds up to campaign_max_points points
STOP_WAIT_S: Final = 10.0  # a stopped expansion ends within one point; this is a backstop

log = structlog.get_logger("llmd_supervisor.campaigns")

Work = Callable[[core.Stop], core.Expansion]  # an expansion, given its stop check


class Expander:
    """The daemon's campaign expansions: `CONCURRENT` at once, each stoppable."""

    def __init__(self, concurrent: int = CONCURRENT) -> None:
        self._limiter = anyio.CapacityLimiter(concurrent)

    async def run(
        self, campaign: core.CampaignFile, limit: core.PointLimit, work: Work
    ) -> core.Expansion:
        """`work`'s expansion of `campaign`, computed in a worker thread (see the module's
        cancellation contract); its CampaignError (too many points, a bad point) as is."""
        stop, began, ended = threading.Event(), threading.Event(), threading.Event()
        stopped: list[ExpansionStopped] = []
        bound = log.bind(campaign=campaign.name, max_points=limit.points)

        def job() -> core.Expansion:
            began.set()
            try:
                # logged by the thread: the expansion is under way once this line is out
                bound.info("campaign.expansion_started", combinations=core.combinations(campaign))
                return work(stop.is_set)
            except ExpansionStopped as exc:
                stopped.append(exc)
                raise
            finally:
                ended.set()

        t0 = time.monotonic()
        try:
            expansion = await anyio.to_thread.run_sync(
                job, abandon_on_cancel=True, limiter=self._limiter
            )
        except anyio.get_cancelled_exc_class():
            stop.set()
            done = True  # a job never started ends at its first check, when it starts
            if began.is_set():
                with anyio.CancelScope(shield=True):
                    done = await anyio.to_thread.run_sync(ended.wait, STOP_WAIT_S)
            bound.info(
                "campaign.expansion_stopped",
                ended=done,
                started=began.is_set(),
                built=stopped[0].built if stopped else None,
                duration_s=round(time.monotonic() - t0, 3),
            )
            raise
        bound.info(
            "campaign.expanded",
            points=expansion.points,
            jobs=len(expansion.jobs),
            duration_s=round(time.monotonic() - t0, 3),
        )
        return expansion
