"""Verify one finished job against the live cluster (the I/O around the pure verdict).

sacct first, `scontrol show job` as the fallback while sacct has no believable record,
the marker re-read every round (it may appear late on a shared filesystem), bounded
retry until the verdict is final or the deadline passes (then `unverified`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import structlog

from llmd_supervisor.errors import SlurmCommandError
from llmd_supervisor.fsutil import read_optional
from llmd_supervisor.marker import MarkerReading, read_marker
from llmd_supervisor.slurm import CommandResult, SlurmClient
from llmd_supervisor.verdict import (
    Outcome,
    SlurmQuery,
    Source,
    Verdict,
    VerdictState,
    believed,
    build_receipt,
    decide,
    failed_query,
    observe,
    sacct_query,
    scontrol_query,
)

log = structlog.get_logger("llmd_supervisor.verify")

# Exit status of `llmd-supervisor verify` (and `wait`) per outcome: 0 only for success.
EXIT_CODES: dict[Outcome, int] = {
    Outcome.SUCCEEDED: 0,
    Outcome.FAILED: 10,
    Outcome.CANCELLED: 11,
    Outcome.TIMED_OUT: 12,
    Outcome.NODE_FAILED: 13,
    Outcome.OUT_OF_MEMORY: 14,
    Outcome.UNVERIFIED: 15,
    Outcome.PENDING_EVIDENCE: 15,  # never returned by verify_job; listed for completeness
}


@dataclass(frozen=True)
class VerifyResult:
    verdict: Verdict
    state: VerdictState
    marker: MarkerReading
    receipt: dict[str, object]


Clock = Callable[[], datetime]


def _utcnow() -> datetime:
    return datetime.now(UTC)


async def verify_job(
    client: SlurmClient,
    job_id: str,
    *,
    marker_path: Path,
    evidence_timeout: float,
    interval: float = 1.0,
    cancel_requested: bool = False,
    starttime: str | None = None,
    clock: Clock = _utcnow,
) -> VerifyResult:
    """Query until the verdict is final; return it with its receipt.

    Never raises for Slurm failures: a failed or timed-out query is recorded in the
    receipt and asked again. Returns `unverified` once `evidence_timeout` seconds pass without a
    believable terminal record. On cancellation nothing is left running (see SlurmClient).
    """
    started = clock()
    deadline = started + timedelta(seconds=evidence_timeout)
    state = VerdictState(job_id=job_id, started_at=started)
    while True:
        if not state.accounting_disabled_seen:
            state = observe(state, await _query(client, Source.SACCT, job_id, starttime, clock))
        if believed(state) is None:
            state = observe(state, await _query(client, Source.SCONTROL, job_id, starttime, clock))
        marker = read_marker(await anyio.to_thread.run_sync(read_optional, marker_path), job_id)
        now = clock()
        verdict = decide(
            state,
            marker,
            cancel_requested=cancel_requested,
            accounting_disabled=state.accounting_disabled_seen,
            now=now,
            deadline=deadline,
        )
        log.debug(
            "verify.round", job_id=job_id, outcome=verdict.outcome.value, reason=verdict.reason
        )
        if verdict.final:
            receipt = build_receipt(
                state,
                marker,
                verdict,
                decided_at=now,
                cancel_requested=cancel_requested,
                accounting_disabled=state.accounting_disabled_seen,
            )
            log.info(
                "verify.decided",
                job_id=job_id,
                outcome=verdict.outcome.value,
                reason=verdict.reason,
            )
            return VerifyResult(verdict, state, marker, receipt)
        await anyio.sleep(min(interval, max(0.0, (deadline - now).total_seconds()) + 0.01))


async def _query(
    client: SlurmClient, source: Source, job_id: str, starttime: str | None, clock: Clock
) -> SlurmQuery:
    taken_at = clock()
    t0 = time.monotonic()
    try:
        result: CommandResult
        if source is Source.SACCT:
            result = await client.sacct([job_id], starttime=starttime)
            query = sacct_query(
                job_id,
                taken_at=taken_at,
                returncode=result.returncode,
                stdout=result.stdout,
                stderr=result.stderr,
            )
        else:
            result = await client.scontrol_job(job_id)
            query = scontrol_query(
                job_id,
                taken_at=taken_at,
                returncode=result.returncode,
                stdout=result.stdout,
                stderr=result.stderr,
            )
    except SlurmCommandError as exc:
        query = failed_query(source, job_id, taken_at=taken_at, error=str(exc))
    log.debug(
        "slurm.query",
        source=source.value,
        job_id=job_id,
        outcome=query.outcome.value,
        seconds=round(time.monotonic() - t0, 3),
        error=query.error or None,
    )
    return query
