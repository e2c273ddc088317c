"""What a foreign job (`core.foreign`) tells about itself through ``scontrol show job``:
its owner (who may adopt it), where its batch logs are (its own ``--output``/``--error``,
as Slurm expanded them) and when it was submitted (an adopted job's sacct window).

The batch log paths are journaled once (event ``job.files``) and read back after a
restart, so a job purged from slurmctld since is still copied from where it wrote.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import TYPE_CHECKING

import structlog

from llmd_supervisor.adapters.slurm import SlurmClient
from llmd_supervisor.core.foreign import ForeignSpec
from llmd_supervisor.core.jobtext import job_text
from llmd_supervisor.core.slurm_parse import ScontrolJob, parse_scontrol_job
from llmd_supervisor.errors import (
    AdoptRefused,
    SlurmCommandError,
    SlurmJobNotFound,
    SlurmParseError,
    SpecError,
    SupervisorError,
)

if TYPE_CHECKING:
    from llmd_supervisor.supervision.driver import RunHandle, Supervisor

log = structlog.get_logger("llmd_supervisor.runs")

JOB_FILES_EVENT = "job.files"
ASK_AT_MOST = 5  # scontrol asks for a job's files before its batch logs go uncopied
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


async def note_job_files(sup: Supervisor, h: RunHandle, job: ScontrolJob) -> None:
    """Journal the job's batch logs and submit time, and use them from now on. A batch
    log outside the run's log directory is not copied (a named event)."""
    log_dir = h.layout.log_dir
    inside = tuple(
        p for p in job.batch_logs if p.startswith(log_dir + "/") and posixpath.normpath(p) == p
    )
    submitted = job.fields.get("SubmitTime", "")
    fields: dict[str, object] = {
        "batch_logs": list(inside),
        "submit_time": submitted if _SUBMIT_TIME.fullmatch(submitted) else None,
        "user_id": job.user_id,
    }
    await sup.journal.add_event(h.run.run_id, JOB_FILES_EVENT, fields, sup.clock())
    for path in job.batch_logs:
        if path not in inside:
            why = f"it is outside the run's log directory {log_dir} (give --log-dir)"
            refused = {"path": job_text(path), "reason": why}  # the job chose its name
            log.warning("run.log_refused", **refused)
            await sup.journal.add_event(h.run.run_id, "log.refused", refused, sup.clock())
    _use(h, fields)


def recall_job_files(h: RunHandle, noted: list[dict[str, object]]) -> None:
    """After a restart: the job's files as journaled (`noted`: its JOB_FILES_EVENTs)."""
    if noted:
        _use(h, noted[-1])


async def ensure_job_files(sup: Supervisor, h: RunHandle) -> None:
    """Learn a submitted foreign job's files once (a few tries; then its batch logs are
    not copied, which the log says)."""
    if h.layout.watch is None or h.job_files_known or h.job_files_asked >= ASK_AT_MOST:
        return
    h.job_files_asked += 1
    try:
        job = await job_record(h.cluster.client, h.job_id())
    except (SupervisorError, SpecError) as exc:
        log.warning("run.job_files_unknown", error=str(exc), tries=h.job_files_asked)
        return
    await note_job_files(sup, h, job)


def _use(h: RunHandle, fields: dict[str, object]) -> None:
    paths = fields.get("batch_logs")
    batch = tuple(str(p) for p in paths) if isinstance(paths, list) else ()
    h.layout = dataclasses.replace(h.layout, batch_paths=batch)
    submitted = fields.get("submit_time")
    if isinstance(h.spec, ForeignSpec) and h.spec.kind == "adopt" and isinstance(submitted, str):
        h.submitted_at = submitted
    h.job_files_known = True
