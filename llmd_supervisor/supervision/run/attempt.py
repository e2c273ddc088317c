"""One watched allocation of a run: node links, node health, log tailers, the marker copy.

An `Attempt` exists per allocation (a requeue or a retry makes a new one). It is started
with ``await tg.start(attempt.run)`` in its run's task group and counts as running only
once its task group is up. It is stopped by one call, which says whether the local copies
are complete:

* `drain()`: the tailers catch up with the nodes and stop (bounded by `finish_drain_s`); an
  attempt that is not running (the job ended before it was seen running, or a copy must
  be drained again) runs one drain-only pass instead;
* `abandon()`: cancel at once; every copy is an exact prefix of its log (the caller
  completes it another way, e.g. from the shared file system).

Cancellation (the run's task group going away) closes the node links within a bound; the
local copies stay exact prefixes, so the next attempt object resumes from their sizes.
Node health decisions are the pure `core.run.health.observe`; this module does the I/O.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters.nodes.tail import CopyBudget, NodeFiles, tail_to_local
from llmd_supervisor.core.config import Limits
from llmd_supervisor.core.run.health import (
    HealthLimits,
    LogStalled,
    NodeHealth,
    NodeUnreachable,
    Overdue,
    Probe,
    observe,
    overdue_stage,
)
from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.errors import FileRefused, LogCapped, RemoteError, SupervisorError
from llmd_supervisor.node.common import (
    STATE_BENCHMARKING,
    STATE_EXITED,
    STATE_FAILED,
    STATE_TERMINATED,
)
from llmd_supervisor.supervision.run.records import (
    LOG_CAPPED_EVENT,
    LOG_REFUSED_EVENT,
    LogCappedEvent,
    LogRefusedEvent,
)

log = structlog.get_logger("llmd_supervisor.attempt")

Record = Callable[[str, Mapping[str, object]], Awaitable[None]]
FileT = TypeVar("FileT")
# An agent in one of these has stopped rewriting its status file on purpose.
FINAL_AGENT_STATES = frozenset({STATE_EXITED, STATE_TERMINATED, STATE_FAILED})


class CopyState(StrEnum):
    """Whether an attempt's local log copies are complete."""

    COMPLETE = "complete"
    LOCAL_FAILED = "local_failed"  # local disk trouble: exact prefixes, drain again
    REMOTE_FAILED = "remote_failed"  # a tailer gave up on the node side: drain again


@dataclass(eq=False, kw_only=True)
class Attempt:
    """Everything that exists only while one allocation of a run is watched."""

    number: int
    job_id: str
    nodes: tuple[str, ...]
    layout: RunLayout
    coordinator_rank: int
    connect: Callable[[str], NodeFiles]  # a node's files: over SSH, or the shared file system
    limits: Limits
    record: Record  # journal an event of the run
    on_change: Callable[[], None]  # the run's waiters may want to look again
    on_marker: Callable[[], None]  # the coordinator's marker was seen
    on_bytes: Callable[[int], None]  # log bytes copied
    on_hang: Callable[[], None] = lambda: None  # a rank's agent is past a stage's deadline
    # The attempt's state: node health, the coordinator's marker copy, copy state.
    health: dict[str, NodeHealth] = field(init=False)
    marker_copy: bytes | None = field(default=None, init=False)
    copies: CopyState = field(default=CopyState.COMPLETE, init=False)
    budget: CopyBudget = field(init=False)  # what the run's log copies may still take
    hung: tuple[str, int, Overdue] | None = field(default=None, init=False)  # node, rank
    _refused: set[str] = field(default_factory=set, init=False)  # paths reported
    running: bool = field(default=False, init=False)
    _stop: anyio.Event = field(default_factory=anyio.Event, init=False)
    _done: anyio.Event = field(default_factory=anyio.Event, init=False)
    _scope: anyio.CancelScope | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        now = time.monotonic()
        self.health = {n: NodeHealth(n, rank, since=now) for rank, n in enumerate(self.nodes)}
        self._health_limits = HealthLimits(self.limits.node_silent_s, self.limits.log_stall_s)
        self.budget = CopyBudget(
            self.limits.log_copy_max_bytes_per_file,
            self.limits.log_copy_max_bytes_per_run,
            used=_tree_size(self.layout.logs_root),
        )

    async def refused(self, exc: FileRefused | LogCapped) -> None:
        """Journal (once per path) that a job's file is not copied, or no further. The job
        named the file: its name (and the reader's answer) is escaped (`core.run.jobtext`)."""
        fields: LogRefusedEvent | LogCappedEvent
        if isinstance(exc, FileRefused):
            key, event = exc.path, LOG_REFUSED_EVENT
            fields = LogRefusedEvent(path=job_text(exc.path), reason=job_text(exc.why))
        else:
            key, event = exc.local_path, LOG_CAPPED_EVENT
            fields = LogCappedEvent(copy=job_text(exc.local_path), size=exc.size)
        if key in self._refused:
            return
        self._refused.add(key)
        log.warning(f"run.{event.replace('.', '_')}", **fields)
        await self.record(event, fields)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Watch every node until stopped: per node a heartbeat/discovery loop and its
        tailers. With the stop already asked for, one pass whose tailers drain."""
        links = [self.connect(node) for node in self.nodes]
        self._done = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                self.running = True
                for rank, link in enumerate(links):
                    tg.start_soon(self._watch_node, rank, link, tg)
                task_status.started()
        finally:
            # The tailers have stopped (their copies fsynced): the run may go on while
            # the links close.
            self.running = False
            self._done.set()
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as closing:
                    for link in links:
                        closing.start_soon(link.aclose)

    async def drain(self) -> CopyState:
        """Stop with the copies caught up (bounded by `finish_drain_s`); their state."""
        self._stop.set()
        with anyio.move_on_after(self.limits.finish_drain_s):
            if self.running:
                await self._done.wait()
            elif self.nodes:
                self.copies = CopyState.COMPLETE
                await self.run()
        return self.copies

    def abandon(self) -> None:
        """Stop at once; the copies are exact prefixes of the logs."""
        self._stop.set()
        if self._scope is not None:
            self._scope.cancel()

    async def _watch_node(self, rank: int, link: NodeFiles, tg: anyio.abc.TaskGroup) -> None:
        layout, job_id = self.layout, self.job_id
        local = layout.copies(self.number)
        wanted = dict(layout.batch_logs(job_id)) if rank == 0 else {}  # copy name -> remote
        tailing: set[str] = set()
        coordinator = rank == self.coordinator_rank
        log_dirs = layout.log_dirs(job_id, rank)
        status_path, marker_path = layout.status_file(job_id, rank), layout.marker(job_id)
        while True:  # at least one pass: a run that ended before it was seen running
            stopping = self._stop.is_set()
            state: str | None = None
            age: float | None = None
            try:
                for directory in log_dirs:
                    for name in await self._files(link.list_dir, directory) or ():
                        copy = layout.log_copy_name(job_id, rank, directory, name)
                        if copy is not None:
                            wanted.setdefault(copy, f"{directory}/{name}")
                if status_path is not None:
                    status = await self._files(link.read_file, status_path)
                    if status is not None:
                        state, age = status_state(status, time.time())
                        await self._check_overdue(link.host, rank, status)
                if coordinator and self.marker_copy is None and marker_path is not None:
                    data = await self._files(link.read_file, marker_path)
                    if data:
                        self.marker_copy = data
                        log.info("run.marker_seen", node=link.host, size=len(data))
                        self.on_marker()
                probe = Probe(ok=True, agent_state=state, status_age_s=age)
            except RemoteError as exc:
                probe = Probe(ok=False, error=str(exc))
            for name, remote_path in wanted.items():
                if name not in tailing:
                    tailing.add(name)
                    tg.start_soon(self._tail, link, remote_path, local / name, tg)
            watched = bool(wanted or log_dirs)
            probe = dataclasses.replace(
                probe, log_bytes=sum(_size(local / n) for n in tailing) if watched else None
            )
            health, events = observe(
                self.health[link.host], probe, time.monotonic(), self._health_limits
            )
            self.health[link.host] = health
            for event in events:
                await self._report(event)
            self.on_change()
            if stopping:
                return
            with anyio.move_on_after(self.limits.heartbeat_interval_s):
                await self._stop.wait()

    async def _check_overdue(self, node: str, rank: int, status: bytes) -> None:
        """A rank whose agent runs a stage past its deadline (by more than the margin) is
        hung: journal it (once per attempt) and tell the run, which ends the attempt."""
        if self.hung is not None:
            return
        try:
            stages = json.loads(status).get("stages")
        except (ValueError, AttributeError, RecursionError):
            return
        late = overdue_stage(stages, time.time(), self.limits.stage_overdue_margin_s)
        if late is None:
            return
        self.hung = (node, rank, late)
        fields = {"node": node, "rank": rank, "stage": late.stage, "deadline_s": late.deadline_s,
                  "over_s": late.over_s, "attempt": self.number}  # fmt: skip
        log.warning("run.stage_overdue", **fields)
        await self.record("stage.overdue", fields)
        self.on_hang()

    async def _files(self, op: Callable[[str, str], Awaitable[FileT]], path: str) -> FileT | None:
        """`op(log_dir, path)` on a node; None (and a journal event) if refused."""
        try:
            return await op(self.layout.log_dir, path)
        except FileRefused as exc:
            await self.refused(exc)
            return None

    async def _report(self, event: NodeUnreachable | LogStalled) -> None:
        if isinstance(event, NodeUnreachable):
            log.warning("run.node_unreachable", node=event.node, silent_s=round(event.silent_s))
            fields = {"node": event.node, "error": event.error, "attempt": self.number}
            await self.record("node.unreachable", fields)
        else:
            quiet = round(event.quiet_s)
            log.warning("run.stalled", node=event.node, rank=event.rank, quiet_s=quiet)
            await self.record(
                "log.stalled", {"node": event.node, "rank": event.rank, "quiet_s": quiet}
            )

    async def _tail(
        self, link: NodeFiles, remote_path: str, local_path: Path, tg: anyio.abc.TaskGroup
    ) -> None:
        def changed(line: str) -> None:  # the job replaced or truncated the file
            what, _, detail = line.partition(": ")
            fields = {"node": link.host, "path": remote_path, "copy": str(local_path)}
            log.warning(f"run.log_{what}", detail=detail, **fields)

            async def note() -> None:
                await self.record(f"log.{what}", {**fields, "detail": detail})

            tg.start_soon(note)

        try:
            local_path.parent.mkdir(parents=True, exist_ok=True)
            await tail_to_local(
                link,
                self.layout.log_dir,
                remote_path,
                local_path,
                stop=self._stop,
                on_bytes=self.on_bytes,
                budget=self.budget,
                on_notice=changed,
            )
        except* (FileRefused, LogCapped) as group:
            for exc in group.exceptions:  # not copied (or no further) by design: complete
                assert isinstance(exc, FileRefused | LogCapped)
                await self.refused(exc)
        except* OSError as group:
            # Local disk trouble: the copy stays an exact prefix; the archive step drains
            # it again and does not declare before it is complete.
            self.copies = CopyState.LOCAL_FAILED
            log.warning("run.tail_failed", remote=remote_path, error=str(group.exceptions[0]))
        except* SupervisorError as group:
            if self.copies is CopyState.COMPLETE:
                self.copies = CopyState.REMOTE_FAILED
            log.warning("run.tail_failed", remote=remote_path, error=str(group.exceptions[0]))


def _tree_size(root: Path) -> int:
    """Bytes of the files under `root` (the run's log copies so far)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def status_state(data: bytes, now: float) -> tuple[str, float | None]:
    """The agent's state, with the point it is at while benchmarking, and the seconds since
    it last rewrote the file (None: final state, or no usable time). The job writes the
    file: what is kept of it is escaped and bounded (`core.run.jobtext`)."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return "unreadable", None
    if not isinstance(value, dict):
        return "unreadable", None
    state = job_text(str(value.get("state", ""))[:40], 40)
    age = None
    updated = value.get("updated_at")
    if state not in FINAL_AGENT_STATES and isinstance(updated, str) and len(updated) <= 40:
        try:
            age = max(0.0, now - datetime.fromisoformat(updated).timestamp())
        except ValueError:
            age = None
    reason = value.get("reason")
    if state == STATE_BENCHMARKING and isinstance(reason, str) and reason:
        return f"{state}: {job_text(reason, 80)}", age
    return state, age
