"""Byte-exact copying of a job's log file into a local copy, here or over a `NodeLink`.

`tail_to_local` streams a job's file into a local copy whose size is the resume offset:
``node/safe_read.py follow`` runs on the node (or here, for a shared log directory) and
every chunk is appended to the local file before the next await, so after an SSH drop, a
cancellation or a daemon restart the next tailer resumes exactly where the local copy
ends (no byte lost or duplicated). The follower opens nothing through a symbolic link and
reads only plain files of the job's account (see `adapters.nodes.jobfiles`); a copy is bounded
by a `CopyBudget` (per file and per run).
"""

from __future__ import annotations

import fcntl
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import structlog

from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
from llmd_supervisor.adapters.nodes.remote import CLOSE_LIMIT_S, backoff_delay
from llmd_supervisor.errors import FileRefused, LogCapped, RemoteError, TailConflict

_log = structlog.get_logger("llmd_supervisor.adapters.tail")

# How long a stopped tailer may spend catching up with the remote end before it returns.
DRAIN_LIMIT_S = 10.0
# How often the local copy is fsynced while bytes keep arriving.
FSYNC_EVERY_S = 1.0


class Stream(Protocol):
    """A running follower: `remote.RemoteStream` or `jobfiles.LocalStream`."""

    def stderr_text(self) -> str: ...
    async def read(self, action: str) -> bytes: ...
    async def send_eof(self) -> None: ...
    async def wait(self) -> int | None: ...
    async def collect_stderr(
        self, log: structlog.typing.FilteringBoundLogger, notice: jobfiles.Notice | None = None
    ) -> None: ...
    async def aclose(self) -> None: ...


class Follows(Protocol):
    """Where followers run: a `NodeLink`, or `jobfiles.LocalFiles` for this machine."""

    @property
    def host(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def python(self) -> str: ...
    async def open_stream(self, argv: Sequence[str], *, action: str) -> Stream: ...


class NodeFiles(Follows, Protocol):
    """One allocated node's files as an attempt watches them: a `NodeLink` (SSH to the
    node), or `jobfiles.SharedFsNode` (this machine's view of the shared file system)."""

    async def read_file(
        self, log_dir: str, path: str, *, time_limit: float = ...
    ) -> bytes | None: ...
    async def list_dir(self, log_dir: str, path: str, *, time_limit: float = ...) -> list[str]: ...
    async def aclose(self) -> None: ...


@dataclass
class CopyBudget:
    """How many bytes a run's log copies may still take: `per_file` for each copy,
    `per_run` for all of them (`used` so far, counted from the copies on disk)."""

    per_file: int
    per_run: int
    used: int = 0

    def allowed(self, offset: int) -> int:
        """Bytes a copy now `offset` bytes long may still append."""
        return max(0, min(self.per_file - offset, self.per_run - self.used))


class _LocalCopy:
    """The local copy, opened for append: its size is the offset of the next remote byte."""

    def __init__(
        self, path: Path, on_bytes: Callable[[int], None] | None, budget: CopyBudget | None
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.budget = budget
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self.fd = os.open(path, flags, 0o666)  # the daemon's umask decides
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self.fd)
            raise TailConflict(str(path)) from exc
        self.offset = os.fstat(self.fd).st_size
        self.on_bytes = on_bytes
        self._dirty = False
        self._last_sync = time.monotonic()

    def append(self, data: bytes) -> None:
        """Write all of `data` before returning (no await: a cancellation cannot split it);
        only what the budget allows, then `LogCapped`."""
        capped = self.budget is not None and len(data) > self.budget.allowed(self.offset)
        if self.budget is not None:
            data = data[: self.budget.allowed(self.offset)]
            self.budget.used += len(data)
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.offset += len(data)
        self._dirty = True
        if self.on_bytes is not None:
            self.on_bytes(len(data))
        if capped and self.budget is not None:
            raise LogCapped(str(self.path), self.offset, self.budget.per_file, self.budget.per_run)

    async def maybe_sync(self) -> None:
        """fsync at most every FSYNC_EVERY_S while data keeps arriving."""
        if self._dirty and time.monotonic() - self._last_sync >= FSYNC_EVERY_S:
            await self.sync()

    async def sync(self) -> None:
        """fsync in a worker thread (a cancellation waits for it to finish)."""
        if self._dirty:
            self._dirty = False
            self._last_sync = time.monotonic()
            await anyio.to_thread.run_sync(os.fsync, self.fd)

    async def aclose(self) -> None:
        """Final fsync (shielded, bounded) and close; also releases the lock. Once."""
        if self.fd < 0:
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(CLOSE_LIMIT_S):
                await self.sync()
            fd, self.fd = self.fd, -1
            os.close(fd)


async def tail_to_local(
    link: Follows,
    log_dir: str,
    remote_path: str,
    local_path: Path,
    *,
    stop: anyio.Event,
    poll_interval: float = 0.1,
    on_bytes: Callable[[int], None] | None = None,
    budget: CopyBudget | None = None,
    drain_limit: float | None = None,
    on_notice: jobfiles.Notice | None = None,
) -> None:
    """Append remote_path's bytes to local_path, starting at local_path's current size.

    The local size is the resume offset. `link` runs ``safe_read.py follow`` (polling every
    `poll_interval`) on the job's file `remote_path` inside `log_dir`. SSH drops are
    survived: the follower is restarted (reconnecting with backoff) at the local size. A
    file that does not exist yet is waited for. When `stop` is set, the follower's stdin is
    closed: it copies what is left up to the file's current end and exits; that drain takes
    at most `drain_limit` (default DRAIN_LIMIT_S; best effort), then the function returns.

    The local file is held with an exclusive flock; a second tailer on the same local file
    raises `TailConflict`. Every chunk is written completely before the next await, so on
    cancellation (or a crash) the local file is a byte-exact prefix of the remote one. On
    return or cancellation the follower is closed (it exits when its stdin reaches EOF, also
    after a connection drop) and the local copy is fsynced (shielded, bounded). If `link`
    is closed under it, the tailer raises `RemoteError` (the local copy is still a
    consistent prefix); a local file error (disk full, I/O error) ends it with that
    `OSError`. `FileRefused` ends it when the job's file is a link, FIFO, device or not the
    job's, and `LogCapped` when the budget is spent (the copy keeps the allowed prefix). A
    file replaced or truncated while being followed is followed by name, as ``tail -F``
    does: the new file's bytes are appended, and the follower's line saying so
    (``replaced: ...``, ``truncated: ...``) goes to `on_notice`.
    """
    log = _log.bind(host=link.host, remote=remote_path, local=str(local_path))
    copy = _LocalCopy(local_path, on_bytes, budget)
    drain = _Drain(stop, DRAIN_LIMIT_S if drain_limit is None else drain_limit)
    try:
        if budget is not None and budget.allowed(copy.offset) == 0:
            log.info("tail.capped", offset=copy.offset)
            return
        log.info("tail.resumed" if copy.offset else "tail.started", offset=copy.offset)
        failures = 0
        while True:
            before = copy.offset
            drain.notice()
            with anyio.CancelScope(deadline=drain.deadline):
                try:
                    if await _follow_once(
                        link, log_dir, remote_path, copy, drain, poll_interval, log, on_notice
                    ):
                        log.info("tail.stopped", offset=copy.offset)
                        return
                except RemoteError as exc:
                    log.warning("tail.interrupted", error=str(exc), offset=copy.offset)
                    if link.closed:
                        raise
            if drain.expired():
                log.warning("tail.drain_incomplete", offset=copy.offset, limit_s=drain.limit)
                log.info("tail.stopped", offset=copy.offset)
                return
            failures = 0 if copy.offset > before else failures + 1
            # Connect failures already wait out the link's own backoff; this one only paces
            # restarts of a follower that keeps ending on a live connection.
            with anyio.move_on_after(backoff_delay(min(max(failures, 1), 3))):
                await stop.wait()
            log.info("tail.resumed", offset=copy.offset)
    finally:
        await copy.aclose()


class RangeReader(Protocol):
    """Reads parts of a job's files, many in one round trip: `jobfiles.SharedFsNode`."""

    async def read_froms(
        self, log_dir: str, reads: Sequence[tuple[str, int, int]], *, time_limit: float = ...
    ) -> list[bytes | FileRefused | None]: ...


COPY_CHUNK = 8 << 20  # bytes asked of the reader at a time for one file by `copy_rests`
# How long `copy_rests` waits for a cancelled tailer to let go of a local copy (each
# releases its copy's lock right after the cancel, before closing its channel).
RELEASE_LIMIT_S = 10.0


async def copy_rests(
    reader: RangeReader,
    log_dir: str,
    files: Sequence[tuple[str, Path]],
    *,
    on_bytes: Callable[[int], None] | None = None,
    budget: CopyBudget | None = None,
    time_limit: float = 30.0,
) -> list[FileRefused | LogCapped]:
    """Append what each (remote path, local copy) of `files` holds beyond the local copy's
    size, up to its current end (one pass, no following: a run's end). The same copy
    rules as `tail_to_local`: the local size is the offset, an exclusive flock (waiting up
    to RELEASE_LIMIT_S for a cancelled tailer of the same copy to let go: TailConflict
    after that), every chunk written whole, the budget, fsynced at the end. Every file's
    next chunk is asked in one batch (`RangeReader.read_froms`, bounded by `time_limit`;
    its `RemoteError`), so a run's dozen logs cost a round trip or two, not a dozen.
    Returns why files were skipped: a `FileRefused` for one that is not the job's, a
    `LogCapped` for one beyond the budget."""
    copies: list[tuple[str, _LocalCopy]] = []
    skipped: list[FileRefused | LogCapped] = []
    try:
        for remote, local in files:
            copy = await _open_released(local, on_bytes, budget)
            copies.append((remote, copy))
            if budget is not None and budget.allowed(copy.offset) == 0:
                _log.info("tail.capped", local=str(local), offset=copy.offset)
        pending = [
            (remote, copy)
            for remote, copy in copies
            if budget is None or budget.allowed(copy.offset) > 0
        ]
        while pending:
            # One byte over the allowance: a file beyond it raises LogCapped (named).
            wants = [
                COPY_CHUNK if budget is None else min(COPY_CHUNK, budget.allowed(c.offset) + 1)
                for _, c in pending
            ]
            reads = [(r, c.offset, w) for (r, c), w in zip(pending, wants, strict=True)]
            got = await reader.read_froms(log_dir, reads, time_limit=time_limit)
            more = []
            for (remote, copy), want, data in zip(pending, wants, got, strict=True):
                if isinstance(data, FileRefused):
                    skipped.append(data)
                elif data:
                    try:
                        copy.append(data)
                    except LogCapped as exc:
                        skipped.append(exc)
                        continue
                    if len(data) == want:
                        more.append((remote, copy))
            pending = more
    finally:
        for _, copy in copies:
            await copy.aclose()
    return skipped


async def _open_released(
    path: Path, on_bytes: Callable[[int], None] | None, budget: CopyBudget | None
) -> _LocalCopy:
    """The local copy at `path`, once a cancelled tailer of it has let go."""
    deadline = anyio.current_time() + RELEASE_LIMIT_S
    while True:
        try:
            return _LocalCopy(path, on_bytes, budget)
        except TailConflict:
            if anyio.current_time() >= deadline:
                raise
            await anyio.sleep(0.02)


class _Drain:
    """The stop request and the deadline of the drain it starts (set once, when noticed)."""

    def __init__(self, stop: anyio.Event, limit: float) -> None:
        self.stop = stop
        self.limit = limit
        self.deadline = math.inf

    def notice(self) -> None:
        """Start the drain clock if `stop` is set and the clock is not running yet."""
        if self.stop.is_set() and self.deadline == math.inf:
            self.deadline = anyio.current_time() + self.limit

    def expired(self) -> bool:
        self.notice()
        return anyio.current_time() >= self.deadline


async def _follow_once(
    link: Follows,
    log_dir: str,
    remote_path: str,
    copy: _LocalCopy,
    drain: _Drain,
    poll_interval: float,
    log: structlog.typing.FilteringBoundLogger,
    on_notice: jobfiles.Notice | None,
) -> bool:
    """Run one follower until it ends (False) or the stop request is drained (True)."""
    root, rel = jobfiles.split(log_dir, remote_path)
    command = jobfiles.argv(
        link.python, "follow", root, rel, str(copy.offset), f"{poll_interval:g}"
    )
    stream = await link.open_stream(command, action=f"starting a follower of {remote_path}")
    ended = False
    watching = anyio.CancelScope()
    try:
        try:
            async with anyio.create_task_group() as tg:

                async def watch_stop() -> None:
                    with watching:
                        await drain.stop.wait()
                        drain.notice()
                        tg.cancel_scope.deadline = drain.deadline
                        await stream.send_eof()  # the follower copies up to the end, exits

                async def pump() -> None:
                    nonlocal ended
                    action = f"following {remote_path}"
                    while chunk := await stream.read(action):
                        copy.append(chunk)
                        await copy.maybe_sync()
                    ended = True
                    watching.cancel()
                    # The follower has exited: its last stderr line (why) follows at once.
                    limit = anyio.current_time() + CLOSE_LIMIT_S
                    tg.cancel_scope.deadline = min(tg.cancel_scope.deadline, limit)

                tg.start_soon(stream.collect_stderr, log, on_notice)
                tg.start_soon(watch_stop)
                tg.start_soon(pump)
        except* (RemoteError, OSError, LogCapped) as group:
            # One pump fails at a time; its error (remote, the local disk's, the cap) is it.
            raise group.exceptions[0] from None
    except anyio.get_cancelled_exc_class():
        # Cancelled (the run's end): let go of the copy, whose lock the end-of-run copy
        # waits for, before the slower close of the follower's channel.
        await copy.aclose()
        raise
    finally:
        status = await stream.wait() if ended else None
        await stream.aclose()
    if not ended:
        return False  # the drain deadline passed (the caller notices)
    await copy.sync()
    if status == jobfiles.REFUSED:
        lines = stream.stderr_text().splitlines()
        why = [line.removeprefix("refused: ") for line in lines if line.startswith("refused: ")]
        raise FileRefused(remote_path, why[-1] if why else "the follower refused it")
    if status == jobfiles.OK and drain.stop.is_set():
        return True
    raise RemoteError(
        link.host,
        f"following {remote_path}",
        f"the follower ended with status {status} ({stream.stderr_text() or 'no message'})",
    )
