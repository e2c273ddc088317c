"""Submitting: sbatch exactly once, and reconciling by the run's unique job name.

The driver journals `submitting` (`Submit`) before `submit` calls sbatch, so a daemon
that stops in between finds `submitting` on its next start and calls `reconcile`, which
looks the name up and never submits twice. Both return the event that ends the step.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Final, Literal

import anyio
import structlog

from llmd_supervisor.adapters.slurm.runner import NameLookup
from llmd_supervisor.core.render.script import render_sbatch
from llmd_supervisor.core.run.lifecycle import SubmitFailed, Submitted
from llmd_supervisor.errors import SlurmCommandError, SupervisorError
from llmd_supervisor.supervision.run.context import RunContext

log = structlog.get_logger("llmd_supervisor.runs")

# After a restart in `submitting`, look the job name up no earlier than this long after
# the state was journaled (an sbatch in flight then has finished or died with its daemon).
SUBMIT_SETTLE_S = 5.0
LOOKUPS: Final = 5  # find_by_name tries before the run is left in `submitting`


# sbatch starts only with this much time left to act for the cluster (`core.ha.lease`: a
# leader renews every 2 s and may act 10 s after its last renewal). Whatever it then takes,
# the next leader reconciles only after the in-flight window (`driver.IN_FLIGHT_S`).
SBATCH_LEASE_LEFT_S: Final = 5.0
_LEASE_LOOK_S: Final = 0.25


class Resubmit(Enum):
    """`reconcile`'s answer when no job can have the run's name: submit it (once)."""

    RESUBMIT = "resubmit"


RESUBMIT: Final = Resubmit.RESUBMIT


async def submit(ctx: RunContext, exclude: tuple[str, ...]) -> Submitted | SubmitFailed:
    """sbatch the run once, keeping `exclude` out (`submitting` is journaled already);
    after an sbatch failure, reconcile by name: the job may exist all the same."""
    sbatch = await _sbatch(ctx, exclude)
    if isinstance(sbatch, Submitted):
        return sbatch
    lookup = await _lookup(ctx)
    if lookup.job_id is not None:
        log.info("run.reconciled", job_name=ctx.run.slurm_job_name, slurm_job_id=lookup.job_id)
        return Submitted(lookup.job_id)
    return SubmitFailed(f"sbatch failed: {sbatch}")


async def _cancel_duplicates(ctx: RunContext, lookup: NameLookup) -> None:
    """Jobs beyond the first of the run's name should not exist (two daemons both
    submitted): cancel them and say so loudly. The first is the run's."""
    for job_id in lookup.others:
        log.error(
            "run.duplicate_job",
            job_name=ctx.run.slurm_job_name,
            slurm_job_id=job_id,
            kept=lookup.job_id,
            action="cancelled",
        )
        try:
            await ctx.cluster.client.scancel(job_id)
        except SlurmCommandError as exc:
            log.error("run.duplicate_job_cancel_failed", slurm_job_id=job_id, error=str(exc))


async def reconcile(ctx: RunContext) -> Submitted | SubmitFailed | Literal[Resubmit.RESUBMIT]:
    """`submitting` found on entry: sbatch may have been in flight when the daemon (or this
    loop) stopped. A job found by name is adopted. It is submitted again (`RESUBMIT`) only
    when squeue and sacct both answer that no job has the run's name, after a settle delay
    so that an sbatch left in flight has finished or died with its daemon; with accounting
    disabled a purged job cannot be ruled out, so the run fails instead of risking a
    second job."""
    job_name = ctx.run.slurm_job_name
    since = ctx.now() - ctx.run.transitions[-1].at
    await anyio.sleep(max(0.0, SUBMIT_SETTLE_S - since.total_seconds()))
    lookup = await _lookup(ctx)
    if lookup.job_id is not None:
        log.info("run.reconciled", job_name=job_name, slurm_job_id=lookup.job_id)
        return Submitted(lookup.job_id)
    if lookup.certain:
        log.info("run.resubmitting", job_name=job_name, why="the daemon stopped while submitting")
        return RESUBMIT
    return SubmitFailed(
        f"the daemon stopped while submitting; no job named {job_name} exists "
        "(accounting is disabled: it may have been purged); not resubmitted"
    )


async def _lease_time(ctx: RunContext) -> None:
    """Wait until this daemon may act long enough for an sbatch (at once on a single-node
    journal). A daemon that stops acting meanwhile has this task cancelled."""
    waited = False
    while ctx.lease_time_left() < SBATCH_LEASE_LEFT_S:
        if not waited:
            log.info(
                "run.sbatch_waits_for_lease",
                job_name=ctx.run.slurm_job_name,
                left_s=round(ctx.lease_time_left(), 2),
                needs_s=SBATCH_LEASE_LEFT_S,
            )
            waited = True
        await anyio.sleep(_LEASE_LOOK_S)


async def _lookup(ctx: RunContext) -> NameLookup:
    """find_by_name with retries (duplicates cancelled); SupervisorError (run left in
    `submitting`, reconciled by the next loop) if Slurm cannot answer at all."""
    name = ctx.run.slurm_job_name
    for attempt in range(LOOKUPS):
        try:
            lookup = await ctx.cluster.client.find_by_name(name, starttime=ctx.starttime())
            await _cancel_duplicates(ctx, lookup)
            return lookup
        except SlurmCommandError as exc:
            log.warning("run.lookup_failed", job_name=name, error=str(exc))
            await anyio.sleep(min(2**attempt, 30))
    raise SupervisorError(
        f"Could not find out whether job {name} was submitted; "
        "left in `submitting` to reconcile again."
    )


async def _sbatch(ctx: RunContext, exclude: tuple[str, ...]) -> Submitted | str:
    """Submit the run's script (a retry's rendered again with its own job name), keeping
    `exclude` out: `Submitted`, else the error text. On a shared journal sbatch starts
    only while this daemon may act for `SBATCH_LEASE_LEFT_S` more (`_lease_time`)."""
    await _lease_time(ctx)
    client, name = ctx.cluster.client, ctx.run.slurm_job_name
    own, spec = ctx.kind.foreign, ctx.kind.rendered
    if own is not None:
        script, options, env = own.script, own.sbatch_options(name), own.env
    else:
        assert spec is not None, "a run is a foreign job's or a rendered spec's"
        script, options, env = ctx.meta.script, [], None
        if ctx.run.submission > 1 or not script:
            script = await anyio.to_thread.run_sync(
                functools.partial(render_sbatch, spec, job_name=name)
            )
    if exclude:
        options.append(f"--exclude={','.join(exclude)}")
    try:
        await client.mkdir(ctx.meta.log_dir)
        job_id = await client.sbatch(script, *options, env=env)
    except SlurmCommandError as exc:
        log.warning("run.sbatch_failed", error=str(exc))
        return str(exc)
    log.info("run.submitted", job_name=name, slurm_job_id=job_id, exclude=list(exclude))
    return Submitted(job_id)
