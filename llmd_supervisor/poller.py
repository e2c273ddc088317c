"""One poller per cluster: the only place the daemon asks Slurm about its jobs.

Each tick issues at most one `squeue` for every tracked job, one `sacct` (chunked only
when the id list is long) for every job whose verification asked for accounting
evidence, and one `scontrol show job` per job that asked for the scontrol fallback.
Never a Slurm call per run per tick beyond that fallback (DESIGN.md section 6).

The interval adapts: `min_interval_s` while something changes or evidence is wanted,
growing to `max_interval_s` while idle, and always below MinJobAge/2 so scontrol can
still answer for a job that just ended. `poke()` asks for a tick now (a watcher saw the
marker appear). A failed squeue changes nothing: the previous view of every job stands.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio
import anyio.abc
import structlog

from llmd_supervisor.config import PollConfig
from llmd_supervisor.errors import SlurmCommandError, SlurmParseError
from llmd_supervisor.node.agent import expand_hostlist
from llmd_supervisor.slurm import SlurmClient
from llmd_supervisor.slurm_parse import (
    JobState,
    accounting_disabled,
    parse_scontrol_config,
    parse_squeue,
)
from llmd_supervisor.verdict import SlurmQuery, Source, failed_query, sacct_query, scontrol_query

log = structlog.get_logger("llmd_supervisor.poller")

DEFAULT_MIN_JOB_AGE_S = 300


@dataclass(frozen=True)
class QueueView:
    """What one squeue said about one job; `state is None` means it is no longer listed."""

    job_id: str
    state: JobState | None
    nodes: tuple[str, ...]
    reason: str
    seen_at: datetime

    @property
    def left_queue(self) -> bool:
        """Not listed any more, or listed in a terminal state (kept until MinJobAge)."""
        return self.state is None or self.state.is_terminal


@dataclass
class _Tracked:
    latest: QueueView | None = None
    changed: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class _EvidenceRequest:
    source: Source
    job_id: str
    starttime: str | None
    done: anyio.Event = field(default_factory=anyio.Event)
    result: SlurmQuery | None = None


class Poller:
    """Batches every Slurm query of one cluster into ticks."""

    def __init__(self, cluster: str, client: SlurmClient, poll: PollConfig) -> None:
        self.cluster = cluster
        self.client = client
        self.poll = poll
        self.min_job_age_s = DEFAULT_MIN_JOB_AGE_S
        self.accounting_enabled = True
        self._tracked: dict[str, _Tracked] = {}
        self._requests: list[_EvidenceRequest] = []
        self._wake = anyio.Event()
        self._interval = poll.min_interval_s
        self.ticks = 0

    # --- what runs ask for -------------------------------------------------------------

    def track(self, job_id: str) -> None:
        """Include `job_id` in every squeue from now on."""
        self._tracked.setdefault(job_id, _Tracked())
        self.poke()

    def untrack(self, job_id: str) -> None:
        self._tracked.pop(job_id, None)

    def latest(self, job_id: str) -> QueueView | None:
        tracked = self._tracked.get(job_id)
        return tracked.latest if tracked else None

    async def next_view(self, job_id: str, after: QueueView | None) -> QueueView:
        """Wait for a squeue view of `job_id` newer than `after`."""
        while True:
            tracked = self._tracked.setdefault(job_id, _Tracked())
            if tracked.latest is not None and tracked.latest is not after:
                return tracked.latest
            await tracked.changed.wait()

    async def evidence(self, source: Source, job_id: str, starttime: str | None) -> SlurmQuery:
        """One sacct or scontrol reading for `job_id`, taken in the next tick."""
        request = _EvidenceRequest(source, job_id, starttime)
        self._requests.append(request)
        self.poke()
        await request.done.wait()
        assert request.result is not None
        return request.result

    def poke(self) -> None:
        """Tick as soon as possible."""
        self._wake.set()

    # --- the loop ------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Tick until cancelled. Reads MinJobAge and the accounting type first (best effort)."""
        await self._read_config()
        task_status.started()
        while True:
            busy = await self._tick()
            self._interval = (
                self.poll.min_interval_s
                if busy
                else min(self._interval * 1.5, self.poll.max_interval_s)
            )
            interval = min(self._interval, self.min_job_age_s / 2 - 1)
            with anyio.move_on_after(max(interval, 0.05)):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def _read_config(self) -> None:
        try:
            result = await self.client.scontrol_config()
            config = parse_scontrol_config(result.stdout)
        except (SlurmCommandError, SlurmParseError) as exc:
            log.warning(
                "slurm.config_unreadable",
                cluster=self.cluster,
                error=str(exc),
                assumed_min_job_age_s=self.min_job_age_s,
            )
            return
        if config.min_job_age is not None:
            self.min_job_age_s = config.min_job_age
        self.accounting_enabled = config.accounting_enabled
        log.info(
            "slurm.config",
            cluster=self.cluster,
            min_job_age_s=self.min_job_age_s,
            accounting=self.accounting_enabled,
        )

    async def _tick(self) -> bool:
        """One round of queries; True if anything changed or evidence was asked for."""
        self.ticks += 1
        changed = await self._squeue(list(self._tracked))
        requests, self._requests = self._requests, []
        if requests:
            await self._answer(requests)
        return changed or bool(requests) or bool(self._requests)

    async def _squeue(self, job_ids: list[str]) -> bool:
        if not job_ids:
            return False
        try:
            result = await self.client.squeue(job_ids)
        except SlurmCommandError as exc:
            log.warning("slurm.squeue_failed", cluster=self.cluster, error=str(exc))
            await self._backoff()
            return False
        if not result.ok:
            log.warning(
                "slurm.squeue_failed",
                cluster=self.cluster,
                status=result.returncode,
                stderr=result.stderr.strip()[-300:],
            )
            await self._backoff()
            return False
        try:
            rows = {row.job_id: row for row in parse_squeue(result.stdout)}
        except SlurmParseError as exc:
            log.warning("slurm.squeue_unparsable", cluster=self.cluster, error=str(exc))
            return False
        changed = False
        for job_id in job_ids:
            tracked = self._tracked.get(job_id)
            if tracked is None:
                continue
            row = rows.get(job_id)
            view = QueueView(
                job_id=job_id,
                state=row.state.state if row else None,
                nodes=tuple(expand_hostlist(row.node_list)) if row and row.node_list else (),
                reason=row.reason if row else "",
                seen_at=result.started_at,
            )
            previous = tracked.latest
            if previous is None or (previous.state, previous.nodes) != (view.state, view.nodes):
                changed = True
                log.info(
                    "slurm.job_state",
                    cluster=self.cluster,
                    slurm_job_id=job_id,
                    state=view.state.value if view.state else "gone",
                    nodes=",".join(view.nodes),
                )
            tracked.latest = view
            tracked.changed.set()
            tracked.changed = anyio.Event()
        return changed

    async def _answer(self, requests: list[_EvidenceRequest]) -> None:
        sacct = [r for r in requests if r.source is Source.SACCT]
        for chunk in _chunks(sacct, self.poll.sacct_chunk):
            await self._sacct(chunk)
        for request in requests:
            if request.source is Source.SCONTROL:
                request.result = await self._scontrol(request.job_id)
            request.done.set()

    async def _sacct(self, requests: list[_EvidenceRequest]) -> None:
        ids = sorted({r.job_id for r in requests})
        starts = [r.starttime for r in requests if r.starttime]
        taken_at = datetime.now(UTC)
        try:
            result = await self.client.sacct(ids, starttime=min(starts) if starts else None)
        except SlurmCommandError as exc:
            for r in requests:
                r.result = failed_query(Source.SACCT, r.job_id, taken_at=taken_at, error=str(exc))
            return
        if accounting_disabled(result.stderr):
            self.accounting_enabled = False
        for r in requests:
            r.result = sacct_query(
                r.job_id,
                taken_at=result.started_at,
                returncode=result.returncode,
                stdout=result.stdout,
                stderr=result.stderr,
            )

    async def _scontrol(self, job_id: str) -> SlurmQuery:
        taken_at = datetime.now(UTC)
        try:
            result = await self.client.scontrol_job(job_id)
        except SlurmCommandError as exc:
            return failed_query(Source.SCONTROL, job_id, taken_at=taken_at, error=str(exc))
        return scontrol_query(
            job_id,
            taken_at=result.started_at,
            returncode=result.returncode,
            stdout=result.stdout,
            stderr=result.stderr,
        )

    async def _backoff(self) -> None:
        # Jitter spreads retries of several daemons; the interval is raised, not reset.
        self._interval = min(self._interval * 2, self.poll.max_interval_s)
        await anyio.sleep(random.uniform(0, self.poll.min_interval_s))


def _chunks(items: list[_EvidenceRequest], size: int) -> Iterable[list[_EvidenceRequest]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
