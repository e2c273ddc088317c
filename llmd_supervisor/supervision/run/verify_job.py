"""Collect evidence about one finished job until the pure verdict is final.

sacct first, `scontrol show job` as the fallback while sacct has no believable record,
the marker re-read every round (it may appear late on a shared filesystem), bounded
retry until the verdict is final or the deadline passes (then `unverified`). Where the
queries come from is pluggable: `DirectEvidence` runs them (the `verify` command); the
daemon passes its cluster's poller, which batches them with every other run's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

import anyio
import structlog

from llmd_supervisor.adapters.slurm.runner import CommandResult, SlurmClient
from llmd_supervisor.core.results.evidence import GateResult
from llmd_supervisor.core.spec.foreign import MarkerFormat
from llmd_supervisor.core.verdict.decide import (
    Outcome,
    SlurmQuery,
    Source,
    Verdict,
    VerdictReceipt,
    VerdictState,
    believed,
    build_receipt,
    decide,
    failed_query,
    observe,
    sacct_query,
    scontrol_query,
    with_benchmark,
)
from llmd_supervisor.core.verdict.marker import MarkerReading, read_marker, refused_marker
from llmd_supervisor.errors import FileRefused, SlurmCommandError

log = structlog.get_logger("llmd_supervisor.supervision.verify_job")

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


class Evidence(Protocol):
    """Where sacct / scontrol readings come from."""

    async def query(self, source: Source, job_id: str) -> SlurmQuery: ...


MarkerBytes = Callable[[], Awaitable[bytes | None]]
Benchmark = Callable[[], Awaitable[GateResult | None]]
Clock = Callable[[], datetime]


def utcnow() -> datetime:
    return datetime.now(UTC)


QUERY_GRACE_S = 1.0  # how long past the deadline a round's queries may still answer


@dataclass(frozen=True)
class VerifyResult:
    """The final verdict with what it was made from: the Slurm queries folded, the marker,
    the benchmark's gate (None: not looked for), when it was decided and the deadline the
    evidence was waited for until (`core.verdict.judge.judge` decides the same from them)."""

    verdict: Verdict
    state: VerdictState
    marker: MarkerReading
    receipt: VerdictReceipt
    gate: GateResult | None
    decided_at: datetime
    deadline: datetime


class DirectEvidence:
    """Runs each query itself (one job, no batching): the `verify` command's source."""

    def __init__(self, client: SlurmClient, *, starttime: str | None = None) -> None:
        self.client = client
        self.starttime = starttime

    async def query(self, source: Source, job_id: str) -> SlurmQuery:
        taken_at = utcnow()
        t0 = time.monotonic()
        try:
            result: CommandResult
            if source is Source.SACCT:
                result = await self.client.sacct([job_id], starttime=self.starttime)
                classify = sacct_query
            else:
                result = await self.client.scontrol_job(job_id)
                classify = scontrol_query
            query = classify(
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
            slurm_job_id=job_id,
            outcome=query.outcome.value,
            seconds=round(time.monotonic() - t0, 3),
            error=query.error or None,
        )
        return query


async def verify_job(
    evidence: Evidence,
    job_id: str,
    *,
    marker_bytes: MarkerBytes,
    marker_format: MarkerFormat = MarkerFormat.ANY,
    marker_name: str = "",
    benchmark: Benchmark | None = None,
    evidence_timeout: float,
    interval: float = 1.0,
    cancel_requested: bool = False,
    clock: Clock = utcnow,
) -> VerifyResult:
    """Query until the verdict is final; return it with its receipt.

    Never raises for Slurm failures: a failed or timed-out query is recorded in the
    receipt and asked again. Returns `unverified` once `evidence_timeout` seconds pass
    without a believable terminal record. Once final, `benchmark` (when given) judges the
    results: a success whose results fail the validity gate is `failed` (the receipt
    holds each point's evidence). Cancellation leaves nothing running.
    """
    started = clock()
    deadline = started + timedelta(seconds=evidence_timeout)
    state = VerdictState(job_id=job_id, started_at=started)
    while True:
        # Both sources are asked at once (the poller answers both in one tick); scontrol's
        # answer counts only where sacct's alone does not settle the record.
        sources = [Source.SCONTROL] if state.accounting_disabled_seen else [Source.SACCT]
        if believed(state) is None and sources[0] is Source.SACCT:
            sources.append(Source.SCONTROL)
        for query in await _query_within(evidence, job_id, sources, deadline, clock):
            if query.source is Source.SACCT or believed(state) is None:
                state = observe(state, query)
        try:
            marker = read_marker(await marker_bytes(), job_id, marker_format, marker_name)
        except FileRefused as exc:  # a link, FIFO, directory...: never a valid marker
            marker = refused_marker(exc.why, job_id)
        now = clock()
        verdict = decide(
            state,
            marker,
            cancel_requested=cancel_requested,
            accounting_disabled=state.accounting_disabled_seen,
            now=now,
            deadline=deadline,
        )
        if verdict.final:
            gate = await benchmark() if benchmark is not None else None
            verdict = with_benchmark(verdict, gate)
            receipt = build_receipt(
                state,
                marker,
                verdict,
                decided_at=now,
                cancel_requested=cancel_requested,
                accounting_disabled=state.accounting_disabled_seen,
                benchmark=gate,
            )
            log.info(
                "verify.decided",
                slurm_job_id=job_id,
                outcome=verdict.outcome.value,
                reason=verdict.reason,
                queries=len(state.queries),
            )
            return VerifyResult(verdict, state, marker, receipt, gate, now, deadline)
        await anyio.sleep(min(interval, max(0.0, (deadline - now).total_seconds()) + 0.01))


async def _query_within(
    evidence: Evidence, job_id: str, sources: list[Source], deadline: datetime, clock: Clock
) -> list[SlurmQuery]:
    """The sources' readings, or failed ones when they do not answer by the deadline
    (plus QUERY_GRACE_S): a hung command (munge, an unreachable slurmctld) does not keep
    `verify --timeout` waiting past its limit."""
    remaining = max(0.0, (deadline - clock()).total_seconds()) + QUERY_GRACE_S
    with anyio.move_on_after(remaining):
        return await _query_all(evidence, job_id, sources)
    why = f"no answer within the evidence deadline (+{QUERY_GRACE_S:g} s)"
    return [failed_query(s, job_id, taken_at=clock(), error=why) for s in sources]


async def _query_all(evidence: Evidence, job_id: str, sources: list[Source]) -> list[SlurmQuery]:
    """The sources' readings, asked concurrently, in the order given."""
    results: dict[Source, SlurmQuery] = {}

    async def ask(source: Source) -> None:
        results[source] = await evidence.query(source, job_id)

    async with anyio.create_task_group() as tg:
        for source in sources:
            tg.start_soon(ask, source)
    return [results[s] for s in sources]
