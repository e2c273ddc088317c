"""The control API: what each op of the control protocol does, from the supervisor's state.

`ControlApi` is the `Handler` the daemon root serves on its control socket. Its ops are one
table (`HANDLERS`, keyed by op name) that is checked against the protocol's `OPS` when this
module is imported: an op without a handler, a handler without an op, or a streaming
mismatch raises there, not at the first request. Results and stream items are the typed
structures of `llmd_supervisor.core.summary`.

Access: a peer sees and acts on its own runs; root and the admin group on every run
(`supervision.access`). The streaming ops follow change signals: ``wait`` sends a summary
when the run changed (`changed` of its handle) and ``logs`` with ``follow`` reads when the
local log copies grew (inotify on their directories; without it, or as a safety net, it
also wakes when the run changed or after a short timeout). A ``logs`` request may carry
per-file byte offsets, so a client that reconnects resumes exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Generic, Protocol, TypeVar

import anyio
import structlog

from llmd_supervisor.adapters.control_protocol import OPS, OpSpec, Peer, Request, Send
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.layout import RunLayout
from llmd_supervisor.core.lifecycle import Run
from llmd_supervisor.core.render import render_sbatch
from llmd_supervisor.core.spec import load_spec
from llmd_supervisor.core.summary import (
    ArchiveInfo,
    DryRun,
    LogChunk,
    LogsDone,
    NodeView,
    Pong,
    RunList,
    RunSummary,
)
from llmd_supervisor.errors import ControlError, IllegalTransition, SpecError, SupervisorError
from llmd_supervisor.supervision.access import may_access
from llmd_supervisor.supervision.verify import utcnow

__all__ = ["HANDLERS", "ControlApi", "Op", "check_handlers", "run_summary"]

log = structlog.get_logger("llmd_supervisor.supervision.api")

WAIT_REFRESH_S: Final = 5.0  # `wait` re-sends an unchanged summary this often (elapsed_s)
READ_CHUNK: Final = 128 << 10  # per file and item: even all-escape JSON stays under 1 MiB
FOLLOW_SAFETY_S: Final = 2.0  # a follower with inotify looks again at least this often
FOLLOW_POLL_S: Final = 0.25  # ... and without inotify
FOLLOW_MIN_PASS_S: Final = 0.02  # coalesce a burst of small writes into one pass


# --------------------------------------------------------------------------- what it reads


class HealthView(Protocol):
    """What the API reads of a node's heartbeat state."""

    @property
    def rank(self) -> int: ...
    @property
    def reachable(self) -> bool: ...
    @property
    def agent_state(self) -> str: ...


class MetaView(Protocol):
    """What the API reads of a run's journaled metadata."""

    @property
    def owner_uid(self) -> int: ...
    @property
    def cluster(self) -> str: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def archive_dir(self) -> str: ...
    @property
    def log_dir(self) -> str: ...


class HandleView(Protocol):
    """What the API reads of a run handle: its record, and the event set on every change."""

    @property
    def run(self) -> Run: ...
    @property
    def meta(self) -> MetaView: ...
    @property
    def health(self) -> Mapping[str, HealthView]: ...
    @property
    def changed(self) -> anyio.Event: ...
    @property
    def layout(self) -> RunLayout: ...


H = TypeVar("H", bound=HandleView)


class SupervisorView(Protocol[H]):
    """The supervisor's entry points the API uses."""

    @property
    def config(self) -> Config: ...
    @property
    def handles(self) -> Mapping[str, H]: ...
    def get(self, ref: str) -> H | None: ...
    async def submit(self, spec_toml: str, *, owner_uid: int, cluster: str | None = None) -> H: ...
    async def cancel(self, handle: H) -> None: ...


# --------------------------------------------------------------------------- summaries


def run_summary(h: HandleView, now: datetime) -> RunSummary:
    """The run as the control socket shows it."""
    run = h.run
    health: dict[str, NodeView] = {
        node: {"rank": n.rank, "reachable": n.reachable, "agent_state": n.agent_state}
        for node, n in h.health.items()
    }
    return {
        "run": run.run_id,
        "job_name": run.job_name,
        "state": run.state.value,
        "outcome": run.outcome.value if run.outcome else None,
        "reason": run.reason,
        "slurm_job_id": run.slurm_job_id,
        "attempt": run.attempt,
        "nodes": list(run.nodes),
        "nodes_healthy": sum(1 for n in health.values() if n["reachable"]),
        "cancel_requested": run.cancel_requested,
        "cluster": h.meta.cluster,
        "owner_uid": h.meta.owner_uid,
        "created_at": h.meta.created_at.isoformat(),
        "elapsed_s": round((now - h.meta.created_at).total_seconds(), 1),
        "archive": h.meta.archive_dir,
        "log_dir": h.meta.log_dir,
        "health": health,
        "transitions": [
            {"state": t.state.value, "at": t.at.isoformat(), "event": t.event}
            for t in run.transitions
        ],
        "last_log_line": _last_line(h.layout.batch_copy(run.attempt, run.slurm_job_id))
        if run.slurm_job_id is not None
        else "",
    }


def _last_line(path: Path) -> str:
    """The last non-empty line of a (local, small-read) log copy, or ""."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((line for line in reversed(lines) if line.strip()), "")


# --------------------------------------------------------------------------- the API


class ControlApi(Generic[H]):
    """Answers control-socket requests from the supervisor's state (a `Handler`)."""

    def __init__(
        self, supervisor: SupervisorView[H], *, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.sup = supervisor
        self.clock = clock

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        return await HANDLERS[request.op].handler(self, request.args, peer, send)

    def _visible(self, args: Mapping[str, object], peer: Peer) -> H:
        """The run `args["run"]` names, if the peer may see it; ControlError otherwise."""
        ref = str(args["run"])
        handle = self.sup.get(ref)
        if handle is None:
            raise ControlError("not_found", f"No run {ref!r} is known to this daemon.")
        if not may_access(peer, handle.meta.owner_uid, self.sup.config.admin_group):
            raise ControlError(
                "forbidden",
                f"Run {handle.run.run_id} belongs to uid {handle.meta.owner_uid}; uid {peer.uid} "
                "may not see or change it (needs root or the admin group).",
            )
        return handle

    async def _ping(self, args: Mapping[str, object], peer: Peer, send: Send) -> Pong:
        return {"pong": True}

    async def _submit(
        self, args: Mapping[str, object], peer: Peer, send: Send
    ) -> RunSummary | DryRun:
        spec_toml = str(args["spec_toml"])
        where = str(args["spec_path"] or "the spec")
        cluster = args["cluster"]
        names = [c.name for c in self.sup.config.clusters]
        if cluster is not None and cluster not in names:
            raise ControlError(
                "bad_request",
                f"Cluster {cluster!r} is not configured in this daemon; "
                f"use one of: {', '.join(names)}.",
            )
        try:
            if args["dry_run"]:
                script = render_sbatch(load_spec(spec_toml), job_name="llmd-dry-run")
                return {"dry_run": True, "script": script}
            handle = await self.sup.submit(
                spec_toml, owner_uid=peer.uid, cluster=None if cluster is None else str(cluster)
            )
        except SpecError as exc:
            raise ControlError("bad_request", f"{where}: {exc}") from exc
        return run_summary(handle, self.clock())

    async def _list(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunList:
        admin = self.sup.config.admin_group
        now = self.clock()
        runs = [
            run_summary(h, now)
            for h in list(self.sup.handles.values())
            if may_access(peer, h.meta.owner_uid, admin)
            and (args["all"] or not h.run.state.is_final or h.meta.owner_uid == peer.uid)
        ]
        runs.sort(key=lambda r: r["created_at"])
        return {"runs": runs}

    async def _status(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunSummary:
        return run_summary(self._visible(args, peer), self.clock())

    async def _cancel(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunSummary:
        handle = self._visible(args, peer)
        try:
            await self.sup.cancel(handle)
        except IllegalTransition as exc:
            raise ControlError(
                "conflict", f"Run {handle.run.run_id} is already {handle.run.state.value}."
            ) from exc
        return run_summary(handle, self.clock())

    async def _archive(self, args: Mapping[str, object], peer: Peer, send: Send) -> ArchiveInfo:
        handle = self._visible(args, peer)
        return {"archive": handle.meta.archive_dir, "state": handle.run.state.value}

    async def _wait(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunSummary:
        """Stream a summary whenever the run changed visibly (and every WAIT_REFRESH_S)
        until it is final; the final summary is the result."""
        handle = self._visible(args, peer)
        shown: dict[str, object] | None = None
        refresh_at = 0.0
        while not handle.run.state.is_final:
            changed = handle.changed  # taken before reading: a change after it sets it
            summary = run_summary(handle, self.clock())
            visible = {k: v for k, v in summary.items() if k != "elapsed_s"}
            now = anyio.current_time()
            if visible != shown or now >= refresh_at:
                await send(summary)
                shown, refresh_at = visible, now + WAIT_REFRESH_S
            with anyio.move_on_after(refresh_at - now):
                await changed.wait()
        return run_summary(handle, self.clock())

    async def _logs(self, args: Mapping[str, object], peer: Peer, send: Send) -> LogsDone:
        """Stream the local log copies (batch .out/.err, or one rank's logs) from the
        requested offsets; with follow, until the run is final and the copies are read."""
        handle = self._visible(args, peer)
        rank, follow = args["rank"], bool(args["follow"])
        given = args["offsets"]  # validated: str -> non-negative int, or None
        offsets: dict[str, int] = {}
        if isinstance(given, Mapping):
            offsets = {str(k): v for k, v in given.items() if isinstance(v, int)}
        root = handle.layout.logs_root

        def wanted(path: Path) -> bool:
            if isinstance(rank, int):
                return RunLayout.is_rank_log(path.name, rank)
            return RunLayout.is_batch_log(path.name)

        sent = 0
        growth = _Growth.open() if follow else None
        try:
            while True:
                final = handle.run.state.is_final  # read before the files: nothing after it
                changed = handle.changed
                chunks, dirs = await anyio.to_thread.run_sync(
                    _read_new, root, wanted, dict(offsets), final
                )
                backlog = False
                for chunk in chunks:
                    await send(chunk)
                    offsets[chunk["file"]] = chunk["end"]
                    sent += chunk["end"] - chunk["offset"]
                    backlog = backlog or chunk["end"] - chunk["offset"] >= READ_CHUNK
                if backlog:
                    continue  # more is there already: read on at once
                if chunks:
                    if follow and not final:
                        await anyio.sleep(FOLLOW_MIN_PASS_S)  # let a burst of writes land
                    continue  # look once more: nothing new is the end of a pass
                if not follow or final:
                    return {"bytes": sent, "state": handle.run.state.value}
                if growth is not None:
                    if growth.watch(dirs):
                        continue  # a new directory: read again, now that it is watched
                    with anyio.move_on_after(FOLLOW_SAFETY_S):
                        await _first_of(changed.wait, growth.wait)
                else:
                    with anyio.move_on_after(FOLLOW_POLL_S):
                        await changed.wait()
        finally:
            if growth is not None:
                growth.close()


OpHandler = Callable[
    [ControlApi[Any], Mapping[str, object], Peer, Send], Awaitable[Mapping[str, object]]
]


@dataclass(frozen=True)
class Op:
    """One row of the API table: the op's handler and whether it streams."""

    handler: OpHandler
    streaming: bool = False


# The one table of what each op does; it must match the protocol's OPS exactly.
HANDLERS: Final[Mapping[str, Op]] = MappingProxyType(
    {
        "ping": Op(ControlApi._ping),
        "submit": Op(ControlApi._submit),
        "list": Op(ControlApi._list),
        "status": Op(ControlApi._status),
        "logs": Op(ControlApi._logs, streaming=True),
        "cancel": Op(ControlApi._cancel),
        "wait": Op(ControlApi._wait, streaming=True),
        "archive": Op(ControlApi._archive),
    }
)


def check_handlers(handlers: Mapping[str, Op], ops: Mapping[str, OpSpec]) -> None:
    """Raise `SupervisorError` unless `handlers` has exactly the ops of `ops`, streaming alike."""
    problems = [f"op {op!r} has no handler" for op in sorted(set(ops) - set(handlers))]
    problems += [f"handler {op!r} is not an op" for op in sorted(set(handlers) - set(ops))]
    problems += [
        f"op {op!r} {'streams' if ops[op].streaming else 'does not stream'} but its handler "
        f"{'does not' if ops[op].streaming else 'does'}"
        for op in sorted(set(ops) & set(handlers))
        if ops[op].streaming != handlers[op].streaming
    ]
    if problems:
        raise SupervisorError(
            f"The control API does not match the protocol's table of ops: {'; '.join(problems)}."
        )


check_handlers(HANDLERS, OPS)


# --------------------------------------------------------------------------- log copies


def _read_new(
    root: Path, wanted: Callable[[Path], bool], offsets: Mapping[str, int], final: bool
) -> tuple[list[LogChunk], list[Path]]:
    """New bytes of the wanted files under `root` past `offsets` (one chunk per file), and
    the directories to watch. Blocking: run in a thread.

    A chunk never ends inside a UTF-8 character unless the run is `final` (nothing more
    will come): the rest of the character goes with the next chunk.
    """
    chunks: list[LogChunk] = []
    dirs = [root.parent]
    try:
        entries = sorted(root.rglob("*"))
    except OSError:
        entries = []
    for path in entries:
        if path.is_dir():
            dirs.append(path)
            continue
        if not wanted(path):
            continue
        name = str(path.relative_to(root))
        start = offsets.get(name, 0)
        try:
            with path.open("rb") as f:
                f.seek(start)
                data = f.read(READ_CHUNK)
        except OSError:
            continue
        if not final:
            data = data[: _whole_utf8(data)]
        if data:
            chunks.append(
                {
                    "file": name,
                    "offset": start,
                    "end": start + len(data),
                    "data": data.decode("utf-8", "replace"),
                }
            )
    if root.is_dir():
        dirs.insert(1, root)
    return chunks, dirs


def _whole_utf8(data: bytes) -> int:
    """The length of `data` without a UTF-8 character cut off at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        if byte >> 5 == 0b110:
            need = 2
        elif byte >> 4 == 0b1110:
            need = 3
        elif byte >> 3 == 0b11110:
            need = 4
        else:  # ASCII, or not a lead byte at all: nothing to hold back
            return len(data)
        return len(data) - back if need > back else len(data)
    return len(data)


async def _first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as any of `waits` returns (the others are cancelled)."""
    async with anyio.create_task_group() as tg:

        async def one(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(one, wait)


# inotify(7): the local log copies are written by this process's tailers.
_IN_MODIFY: Final = 0x002
_IN_CLOSE_WRITE: Final = 0x008
_IN_MOVED_TO: Final = 0x080
_IN_CREATE: Final = 0x100
_IN_NONBLOCK: Final = os.O_NONBLOCK
_IN_CLOEXEC: Final = os.O_CLOEXEC
_MASK: Final = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE


def _load_libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC: Final = _load_libc()


class _Growth:
    """Wakes a log follower when anything in its watched directories is written or created.

    One inotify instance per follower (closed with it); `open` returns None where inotify
    is not available (or the per-user instance limit is reached), and the follower falls
    back to short timeouts.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._watched: set[Path] = set()

    @classmethod
    def open(cls) -> _Growth | None:
        if _LIBC is None:
            return None
        fd = int(_LIBC.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        if fd < 0:
            log.info("api.inotify_unavailable", errno=ctypes.get_errno())
            return None
        return cls(fd)

    def watch(self, dirs: Iterable[Path]) -> bool:
        """Watch the directories not watched yet; whether any was added (one that cannot
        be watched, e.g. gone again, is skipped)."""
        added = False
        for d in dirs:
            if d in self._watched:
                continue
            if _LIBC.inotify_add_watch(self._fd, os.fsencode(d), _MASK) >= 0:
                self._watched.add(d)
                added = True
        return added

    async def wait(self) -> None:
        """Until at least one event arrived since the last wait; drains them."""
        await anyio.wait_readable(self._fd)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._fd, 1 << 16):
                pass

    def close(self) -> None:
        os.close(self._fd)
