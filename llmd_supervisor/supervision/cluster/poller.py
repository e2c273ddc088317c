"""One poller per cluster: the only place the daemon asks Slurm about its jobs.

Each tick issues at most one `sacct` (allocation and step rows, chunked only when the id
list is long) covering every tracked job and every job whose verification asked for
accounting evidence, and one `scontrol show job` per job that asked for the scontrol
fallback (up to SCONTROL_AT_ONCE side by side: ten runs verified together wait for one
call's time, not ten). `squeue` (the authority on "left the queue", and the only source without
accounting) runs once per `squeue_interval_s` for all tracked jobs (2 slurmctld RPCs a
call: 12 a minute at 10 s), or at once when a run's batch log appears (it started). sacct
is answered by slurmdbd and costs slurmctld nothing, so ends are seen within
`min_interval_s` while jobs run, at a slurmctld load independent of their number
(DESIGN.md section 6; SLURM-FACTS "Polling cost").

The interval adapts: `min_interval_s` while a tracked job runs, something changed or
evidence is wanted, growing to `max_interval_s` while everything is pending, and always
below MinJobAge/2 so scontrol can still answer for a job that just ended. `poke()` asks
for a tick now; once a job's completion marker is seen (`expect_end`: by a node watcher,
or by a file check each tick where the log directory is visible here) its end is looked
for every ENDING_INTERVAL_S, with sacct alone. A failed or empty answer changes
nothing: the previous view of every job stands, and a job missing from sacct (which
lags sbatch by a second) is not taken as gone. A record of one job that does not parse
changes nothing for that job and nothing else (each job's evidence is its own rows only),
so no job can hold up another's end by what it prints.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters.slurm.runner import SlurmClient
from llmd_supervisor.core.config import PollConfig
from llmd_supervisor.core.slurm.parse import (
    JobState,
    accounting_disabled,
    allocation_row,
    invalid_job_id,
    parse_sacct_batch,
    parse_scontrol_config,
    parse_squeue_batch,
)
from llmd_supervisor.core.slurm.records import Rejected
from llmd_supervisor.core.verdict.decide import (
    SlurmQuery,
    Source,
    failed_query,
    sacct_query,
    scontrol_query,
)
from llmd_supervisor.errors import SlurmCommandError, SlurmParseError
from llmd_supervisor.node.common import expand_hostlist

log = structlog.get_logger("llmd_supervisor.supervision.poller")

DEFAULT_MIN_JOB_AGE_S = 300
# Once a job's marker is seen it ends within seconds; its end is looked for this often.
ENDING_INTERVAL_S = 0.1
# `scontrol show job` calls of one tick running at once (one slurmctld RPC each).
SCONTROL_AT_ONCE = 4
ENDING_WINDOW_S = 30.0


@dataclass(frozen=True)
class QueueView:
    """What Slurm last said about one job; `state is None` means squeue no longer lists it."""

    job_id: str
    state: JobState | None
    nodes: tuple[str, ...]
    reason: str
    seen_at: datetime
    source: str  # "squeue" or "sacct"

    @property
    def left_queue(self) -> bool:
        """Not listed any more, or in a terminal state (squeue keeps those until MinJobAge)."""
        return self.state is None or self.state.is_terminal


@dataclass
class _Tracked:
    starttime: str | None
    latest: QueueView | None = None
    ending_since: float | None = None  # monotonic time its marker was seen
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

    def __init__(
        self,
        cluster: str,
        client: SlurmClient,
        poll: PollConfig,
        *,
        squeue_interval_s: float = 10.0,
    ) -> None:
        self.cluster = cluster
        self.client = client
        self.poll = poll
        self.squeue_interval_s = squeue_interval_s
        self.min_job_age_s = DEFAULT_MIN_JOB_AGE_S
        self.accounting_enabled = True
        self._tracked: dict[str, _Tracked] = {}
        self._start_files: dict[str, Path] = {}
        self._end_files: dict[str, Path] = {}
        self._requests: list[_EvidenceRequest] = []
        self._wake = anyio.Event()
        self._interval = poll.min_interval_s
        self._last_squeue = -math.inf
        self.ticks = 0
        self.calls: Counter[str] = Counter()
        self._rejected: set[tuple[str, str | None]] = set()  # (command, job id) logged

    # --- what runs ask for -------------------------------------------------------------

    def track(self, job_id: str, starttime: str | None = None) -> None:
        """Follow `job_id` from now on (`starttime`: sacct --starttime covering its submit)."""
        if job_id not in self._tracked:
            self._tracked[job_id] = _Tracked(starttime)
            self._last_squeue = -math.inf  # see a new job in squeue at once
            self.poke()

    def untrack(self, job_id: str) -> None:
        self._tracked.pop(job_id, None)
        self._end_files.pop(job_id, None)
        self._rejected -= {("squeue", job_id), ("sacct", job_id)}

    def latest(self, job_id: str) -> QueueView | None:
        tracked = self._tracked.get(job_id)
        return tracked.latest if tracked else None

    async def next_view(self, job_id: str, after: QueueView | None) -> QueueView:
        """Wait for a view of `job_id` that differs from `after` (state, nodes or source)."""
        while True:
            tracked = self._tracked.get(job_id)
            if tracked is None:
                self.track(job_id)
                continue
            latest = tracked.latest
            if latest is not None and (after is None or _key(latest) != _key(after)):
                return latest
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

    def expect_end(self, job_id: str) -> None:
        """The job is about to end (its completion marker appeared): tick at once, then
        every ENDING_INTERVAL_S until it left the queue (for at most ENDING_WINDOW_S).
        sacct is answered by slurmdbd: this costs slurmctld nothing."""
        tracked = self._tracked.get(job_id)
        if tracked is not None and tracked.ending_since is None:
            tracked.ending_since = time.monotonic()
        self.poke()

    def _ending(self) -> bool:
        now = time.monotonic()
        return any(
            t.ending_since is not None and now - t.ending_since < ENDING_WINDOW_S
            for t in self._tracked.values()
        )

    def watch_start(self, job_id: str, path: Path) -> None:
        """Until it exists, check `path` (the job's batch log, which appears when the job
        starts) every tick; when it appears, squeue at once (its nodes are wanted). One
        thread hop per tick for all such jobs, not a task per job."""
        self._start_files[job_id] = path
        self.poke()

    def unwatch_start(self, job_id: str) -> None:
        self._start_files.pop(job_id, None)

    def watch_end(self, job_id: str, path: Path) -> None:
        """Until it exists, check `path` (the job's completion marker) every tick, in the
        same thread hop as the start files; when it appears, `expect_end`."""
        if job_id in self._tracked and self._tracked[job_id].ending_since is None:
            self._end_files[job_id] = path

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
                self.poll.min_interval_s if busy else min(self._interval * 1.5, self._idle_cap())
            )
            interval = min(self._interval, self.min_job_age_s / 2 - 1)
            if self._ending():
                interval = min(interval, ENDING_INTERVAL_S)
            with anyio.move_on_after(max(interval, 0.05)):
                await self._wake.wait()
            self._wake = anyio.Event()

    def _idle_cap(self) -> float:
        """The longest idle interval: ~1 s for a handful of pending jobs (a start should be
        seen promptly to attach the watchers), stretching with their number (sacct CPU)."""
        return min(self.poll.max_interval_s, max(1.0, len(self._tracked) / 50))

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
        """One round of queries; True while fast polling is warranted."""
        self.ticks += 1
        if self._start_files or self._end_files:
            starts, ends = list(self._start_files.items()), list(self._end_files.items())
            started, ending = await anyio.to_thread.run_sync(
                lambda: (_existing(starts), _existing(ends))
            )
            for job in started:
                self.unwatch_start(job)
                self._last_squeue = -math.inf
            for job in ending:
                self._end_files.pop(job, None)
                self.expect_end(job)
        requests, self._requests = self._requests, []
        changed = False
        sacct_ok = True
        tracked = list(self._tracked)
        sacct_requests = [r for r in requests if r.source is Source.SACCT]
        if self.accounting_enabled and (tracked or sacct_requests):
            sacct_ok, changed = await self._sacct(tracked, sacct_requests)
        else:
            self._answer_without_accounting(sacct_requests)
        now = time.monotonic()
        if tracked and (
            now - self._last_squeue >= self.squeue_interval_s
            or not self.accounting_enabled
            or not sacct_ok
        ):
            self._last_squeue = now
            changed = await self._squeue(tracked) or changed
        asked = [r for r in requests if r.source is Source.SCONTROL]
        if asked:  # several runs verified at once: their scontrol calls side by side
            limiter = anyio.CapacityLimiter(SCONTROL_AT_ONCE)
            async with anyio.create_task_group() as tg:
                for request in asked:
                    tg.start_soon(self._answer_scontrol, request, limiter)
        for request in requests:
            request.done.set()
        running = any(
            t.latest is not None and t.latest.state in _FAST_STATES for t in self._tracked.values()
        )
        return changed or running or bool(requests) or bool(self._requests)

    def _set_view(self, view: QueueView) -> bool:
        """Record a view; True if it changed what is known.

        sacct lags the queue (it said PENDING for a job squeue already showed running,
        and RUNNING after squeue saw it end), so a sacct view may only move a job
        forward (pending → running → ended); going back (a requeue) is squeue's to say.
        """
        tracked = self._tracked.get(view.job_id)
        if tracked is None:
            return False
        previous = tracked.latest
        if view.source == "sacct" and previous is not None and _phase(view) < _phase(previous):
            return False
        tracked.latest = view
        tracked.changed.set()
        tracked.changed = anyio.Event()
        if previous is not None and _key(previous)[:2] == _key(view)[:2]:
            return False
        log.info(
            "slurm.job_state",
            cluster=self.cluster,
            slurm_job_id=view.job_id,
            state=view.state.value if view.state else "gone",
            nodes=",".join(view.nodes),
            source=view.source,
        )
        return True

    async def _squeue(self, job_ids: list[str]) -> bool:
        self.calls["squeue"] += 1
        try:
            result = await self.client.squeue(job_ids)
        except SlurmCommandError as exc:
            log.warning("slurm.squeue_failed", cluster=self.cluster, error=str(exc))
            await self._backoff()
            return False
        if not result.ok and invalid_job_id(result.stderr):
            # squeue omits unknown ids from a list, but errors when it knows none of them:
            # every one of them has been purged (MinJobAge after its end).
            result = dataclasses.replace(result, returncode=0, stdout="")
        if not result.ok:
            log.warning(
                "slurm.squeue_failed",
                cluster=self.cluster,
                status=result.returncode,
                stderr=result.stderr.strip()[-300:],
            )
            await self._backoff()
            return False
        batch = parse_squeue_batch(result.stdout)
        if batch.stray:  # text before any job's record: the answer was not understood
            error = str(batch.stray[0].error)
            log.warning("slurm.squeue_unparsable", cluster=self.cluster, error=error)
            return False
        self._log_rejected("squeue", batch.rejected)
        rows = {row.job_id: row for row in batch.rows}
        changed = False
        for job_id in job_ids:
            if job_id in batch.rejected_jobs:
                continue  # its record did not parse: nothing is known of it (not "gone")
            row = rows.get(job_id)
            view = QueueView(
                job_id=job_id,
                state=row.state.state if row else None,
                nodes=tuple(expand_hostlist(row.node_list)) if row and row.node_list else (),
                reason=row.reason if row else "",
                seen_at=result.started_at,
                source="squeue",
            )
            changed = self._set_view(view) or changed
        return changed

    async def _sacct(
        self, tracked: list[str], requests: list[_EvidenceRequest]
    ) -> tuple[bool, bool]:
        """sacct for the tracked jobs and the evidence requests; (answered, changed)."""
        ids = sorted(set(tracked) | {r.job_id for r in requests})
        starts = [r.starttime for r in requests if r.starttime] + [
            t.starttime for t in self._tracked.values() if t.starttime
        ]
        answered, changed = True, False
        for chunk in _chunks(ids, self.poll.sacct_chunk):
            wanted = set(chunk)
            mine = [r for r in requests if r.job_id in wanted]
            ok, moved = await self._sacct_chunk(chunk, mine, min(starts) if starts else None)
            answered, changed = answered and ok, changed or moved
        return answered, changed

    async def _sacct_chunk(
        self, ids: list[str], requests: list[_EvidenceRequest], starttime: str | None
    ) -> tuple[bool, bool]:
        self.calls["sacct"] += 1
        taken_at = datetime.now(UTC)
        try:
            result = await self.client.sacct(ids, starttime=starttime)
        except SlurmCommandError as exc:
            for r in requests:
                r.result = failed_query(Source.SACCT, r.job_id, taken_at=taken_at, error=str(exc))
            await self._backoff()
            return False, False
        batch = parse_sacct_batch(result.stdout)
        for r in requests:
            # Each job's evidence is its own records (never another user's rows); text
            # that belongs to no job makes the answer an error for all, as it is.
            own = result.stdout if batch.stray or not result.ok else batch.text_of(r.job_id)
            r.result = sacct_query(
                r.job_id,
                taken_at=result.started_at,
                returncode=result.returncode,
                stdout=own,
                stderr=result.stderr,
            )
        if accounting_disabled(result.stderr):
            log.info("slurm.accounting_disabled", cluster=self.cluster)
            self.accounting_enabled = False
            return False, False
        if not result.ok:
            log.warning(
                "slurm.sacct_failed", cluster=self.cluster, stderr=result.stderr.strip()[-300:]
            )
            return False, False
        if batch.stray:
            error = str(batch.stray[0].error)
            log.warning("slurm.sacct_unparsable", cluster=self.cluster, error=error)
            return False, False
        self._log_rejected("sacct", batch.rejected)
        changed = False
        for job_id in ids:
            if job_id in batch.rejected_jobs:
                continue  # a record of it did not parse: its previous view stands
            row = allocation_row(batch.rows, job_id)
            if row is None or job_id not in self._tracked:
                continue  # sacct lags sbatch: absence here means nothing
            previous = self._tracked[job_id].latest
            view = QueueView(
                job_id=job_id,
                state=row.state.state,
                # sacct's early record of a job can name only the batch host (seen with
                # JobName "allocation"): node lists come from squeue alone.
                nodes=previous.nodes if previous else (),
                reason=row.reason,
                seen_at=result.started_at,
                source="sacct",
            )
            if self._set_view(view):
                changed = True
                if view.state in _FAST_STATES:
                    self._last_squeue = -math.inf  # learn the nodes now

        return True, changed

    def _log_rejected(self, command: str, rejected: tuple[Rejected, ...]) -> None:
        """Log each job's unparsable records once while it is tracked (not every tick)."""
        for r in rejected:
            if (command, r.job_id) in self._rejected:
                continue
            self._rejected.add((command, r.job_id))
            log.warning(
                f"slurm.{command}_record_unparsable",
                cluster=self.cluster,
                slurm_job_id=r.job_id,
                error=r.error.why,
                record=repr(r.text[:300]),  # control characters escaped
            )

    def _answer_without_accounting(self, requests: list[_EvidenceRequest]) -> None:
        taken_at = datetime.now(UTC)
        for r in requests:
            r.result = sacct_query(
                r.job_id,
                taken_at=taken_at,
                returncode=1,
                stdout="",
                stderr="Slurm accounting storage is disabled",
            )

    async def _answer_scontrol(
        self, request: _EvidenceRequest, limiter: anyio.CapacityLimiter
    ) -> None:
        async with limiter:
            request.result = await self._scontrol(request.job_id)

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


def _existing(files: list[tuple[str, Path]]) -> list[str]:
    return [job for job, path in files if path.exists()]


def _chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _phase(view: QueueView) -> int:
    """0 waiting (or unknown), 1 running, 2 left the queue."""
    if view.left_queue:
        return 2
    return 1 if view.state in _FAST_STATES or view.state is JobState.SUSPENDED else 0


def _key(view: QueueView) -> tuple[JobState | None, tuple[str, ...], str]:
    return (view.state, view.nodes, view.source)


# While a tracked job is in one of these states its end can come any moment: poll fast.
_FAST_STATES = frozenset({JobState.RUNNING, JobState.COMPLETING, JobState.CONFIGURING})
