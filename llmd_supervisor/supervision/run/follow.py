"""Pending and running: follow the cluster poller's views of the run's job.

One call waits for the next view (or for the run to change: a cancel, a heartbeat) and
says what it means for the run: `Started`, `Requeued`, `LeftQueue` or nothing new.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from llmd_supervisor.core.run.lifecycle import LeftQueue, Requeued, RunState, Started
from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.supervision.cluster.poller import QueueView
from llmd_supervisor.supervision.run.context import RunContext

_REQUEUED_STATES = frozenset(
    {JobState.PENDING, JobState.REQUEUED, JobState.REQUEUE_HOLD, JobState.REQUEUE_FED}
)
_RUNNING_STATES = frozenset({JobState.RUNNING, JobState.COMPLETING, JobState.SUSPENDED})


@dataclass(frozen=True)
class Followed:
    """What one look at the queue found: the view acted on (None: the run changed first)
    and the event it means (None: nothing new)."""

    view: QueueView | None
    event: Started | Requeued | LeftQueue | None = None


async def follow_queue(ctx: RunContext, since: int, last: QueueView | None) -> Followed:
    """Wait for the queue view after `last` (or for a change of the run after its version
    `since`) and say what it means."""
    job_id = ctx.job_id()
    poller = ctx.cluster.poller
    poller.track(job_id, ctx.starttime())
    files = ctx.cluster.files
    if ctx.run.state is RunState.PENDING:
        # The batch log appears when the job starts: squeue then, not at its cadence.
        if (out := ctx.layout.batch_out(job_id)) and (started := files.local_path(out)):
            poller.watch_start(job_id, started)
    elif (path := ctx.layout.marker(job_id)) and (marker := files.local_path(path)):
        poller.watch_end(job_id, marker)  # the marker appears just before the job ends
    view = await _next_view_or_change(ctx, since, lambda: poller.next_view(job_id, last))
    if view is None:
        return Followed(None)  # the record changed (a cancel, a heartbeat): plan again
    if view.state is not JobState.PENDING:
        poller.unwatch_start(job_id)
    if view.left_queue:
        return Followed(view, LeftQueue())
    if view.state in _RUNNING_STATES:
        if ctx.run.state is RunState.PENDING and view.nodes:
            return Followed(view, Started(view.nodes))
    elif (
        view.state in _REQUEUED_STATES
        and view.source == "squeue"  # sacct lags: right after a start it still says PENDING
        and ctx.run.state is RunState.RUNNING
    ):
        return Followed(view, Requeued())
    return Followed(view)


async def _next_view_or_change(
    ctx: RunContext, since: int, next_view: Callable[[], Awaitable[QueueView]]
) -> QueueView | None:
    """The poller's next view, or None as soon as the run changed since version `since`."""
    result: list[QueueView] = []
    async with anyio.create_task_group() as tg:

        async def take() -> None:
            result.append(await next_view())
            tg.cancel_scope.cancel()

        tg.start_soon(take)
        await ctx.until_changed(since)
        tg.cancel_scope.cancel()
    return result[0] if result else None
