"""What a foreign job (`core.spec.foreign`) tells about itself through ``scontrol show job``:
its owner (who may adopt it), where its batch logs are (its own ``--output``/``--error``,
as Slurm expanded them) and when it was submitted (an adopted job's sacct window).

The batch log paths are journaled once (event ``job.files``) and read back after a
restart, so a job purged from slurmctld since is still copied from where it wrote. What
was learnt is returned (`JobFiles`); the driver puts it to use (`used`).
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Sequence
from typing import Final

import structlog

from llmd_supervisor.adapters.slurm.runner import SlurmClient
from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.slurm.parse import ScontrolJob, parse_scontrol_job
from llmd_supervisor.core.spec.foreign import ForeignSpec
from llmd_supervisor.errors import (
    AdoptRefused,
    SlurmCommandError,
    SlurmJobNotFound,
    SlurmParseError,
    SpecError,
    SupervisorError,
)
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import (
    JOB_FILES_EVENT,
    LOG_REFUSED_EVENT,
    JobFiles,
    JournalEvent,
    LogRefusedEvent,
    job_files_of,
)

log = structlog.get_logger("llmd_supervisor.runs")

ASK_AT_MOST: Final = 5  # scontrol asks for a job's files before its batch logs go uncopied
_SUBMIT_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}")


async def job_record(client: SlurmClient, job_id: str) -> ScontrolJob:
    """The job's `scontrol show job` record; SpecError when Slurm does not know it."""
    result = await client.scontrol_job(job_id)
    try:
        if not result.ok and "invalid job id" not in result.stderr.lower():
            raise SlurmCommandError(result.argv, result.returncode, result.stderr[-300:])
        return parse_scontrol_job(result.stdout if result.ok else result.stderr)
    except SlurmJobNotFound:
        raise SpecError(
            "JOBID",
            job_id,
            "Slurm does not know this job (never submitted, or purged from slurmctld after "
            "MinJobAge); adopt a job while `scontrol show job` still shows it",
        ) from None
    except SlurmParseError as exc:
        raise SupervisorError(f"Job {job_id}'s scontrol record cannot be read: {exc}") from exc


def check_owner(spec: ForeignSpec, job_uid: int | None, client_uid: int, privileged: bool) -> int:
    """The uid the adopted run belongs to (the job's owner); AdoptRefused unless the client
    is that owner or `privileged`."""
    assert spec.job_id is not None
    if job_uid is not None and (job_uid == client_uid or privileged):
        return job_uid
    raise AdoptRefused(spec.job_id, job_uid, client_uid)


async def note_job_files(ctx: RunContext, job: ScontrolJob) -> JobFiles:
    """Journal the job's batch logs and submit time, for the driver to use from now on. A
    batch log outside the run's log directory is not copied (a named event)."""
    log_dir = ctx.layout.log_dir
    inside = tuple(
        p for p in job.batch_logs if p.startswith(log_dir + "/") and posixpath.normpath(p) == p
    )
    submitted = job.fields.get("SubmitTime", "")
    files: JobFiles = {
        "batch_logs": list(inside),
        "submit_time": submitted if _SUBMIT_TIME.fullmatch(submitted) else None,
        "user_id": job.user_id,
    }
    await ctx.emit(JOB_FILES_EVENT, files)
    for path in job.batch_logs:
        if path not in inside:
            why = f"it is outside the run's log directory {log_dir} (give --log-dir)"
            refused = LogRefusedEvent(path=job_text(path), reason=why)  # the job's name
            log.warning("run.log_refused", **refused)
            await ctx.emit(LOG_REFUSED_EVENT, refused)
    return files


def recalled(noted: Sequence[JournalEvent]) -> JobFiles | None:
    """After a restart: the job's files as journaled (`noted`: its JOB_FILES_EVENTs)."""
    return job_files_of(noted[-1]) if noted else None


def wanted(ctx: RunContext, known: bool, asked: int) -> bool:
    """Whether to ask Slurm for a submitted foreign job's files (`asked` times so far)."""
    return ctx.layout.watch is not None and not known and asked < ASK_AT_MOST


async def ask_job_files(ctx: RunContext, asked: int) -> JobFiles | None:
    """Learn a submitted foreign job's files (this is ask number `asked`; after
    ASK_AT_MOST its batch logs are not copied, which the log says)."""
    try:
        job = await job_record(ctx.cluster.client, ctx.job_id())
    except (SupervisorError, SpecError) as exc:
        log.warning("run.job_files_unknown", error=str(exc), tries=asked)
        return None
    return await note_job_files(ctx, job)


def used(layout: RunLayout, spec: ForeignSpec, files: JobFiles) -> tuple[RunLayout, str | None]:
    """The run's layout with the job's batch logs, and the submit time its sacct window
    starts at (an adopted job's; None for a script the daemon submitted)."""
    layout = dataclasses.replace(layout, batch_paths=tuple(files["batch_logs"]))
    submitted = files["submit_time"] if spec.kind == "adopt" else None
    return layout, submitted
