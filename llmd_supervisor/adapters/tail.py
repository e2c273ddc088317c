"""Byte-exact tailing of a remote file into a local copy, over a `NodeLink`.

`tail_to_local` streams a remote file into a local copy whose size is the resume offset:
the remote side runs ``tail -c +<size+1> -F`` and every chunk is appended to the local
file before the next await, so after an SSH drop, a cancellation or a daemon restart the
next tailer resumes exactly where the local copy ends (no byte lost or duplicated).
"""

from __future__ import annotations

import fcntl
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import structlog

from llmd_supervisor.adapters.remote import CLOSE_LIMIT_S, NodeLink, RemoteStream, backoff_delay
from llmd_supervisor.errors import RemoteError, TailConflict

_log = structlog.get_logger("llmd_supervisor.adapters.tail")

# How long a stopped tailer may spend catching up with the remote end before it returns.
DRAIN_LIMIT_S = 10.0
# How often the local copy is fsynced while bytes keep arriving.
FSYNC_EVERY_S = 1.0

# Runs on the node. The background `tail` owns the channel's stdout; the shell then waits
# for stdin EOF (the channel closing, or sshd exiting after a connection drop) and kills
# `tail`, so no follower is left behind on the node. When `tail` exits by itself the
# client sees stdout EOF.
_TAIL_SCRIPT = "\n".join(
    [
        'tail -c "+$1" -F -s "$3" -- "$2" & t=$!',
        "exec >/dev/null 2>&1",
        "cat",
        'kill "$t"',
        'wait "$t"',
    ]
)


class _LocalCopy:
    """The local copy, opened for append: its size is the offset of the next remote byte."""

    def __init__(self, path: Path, on_bytes: Callable[[int], None] | None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
        """Write all of `data` before returning (no await: a cancellation cannot split it)."""
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.offset += len(data)
        self._dirty = True
        if self.on_bytes is not None:
            self.on_bytes(len(data))

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
        """Final fsync (shielded, bounded) and close; also releases the lock."""
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(CLOSE_LIMIT_S):
                await self.sync()
            os.close(self.fd)


async def tail_to_local(
    link: NodeLink,
    remote_path: str,
    local_path: Path,
    *,
    stop: anyio.Event,
    poll_interval: float = 0.1,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Append remote_path's bytes to local_path, starting at local_path's current size.

    The local size is the resume offset. The node runs GNU ``tail -c +<size+1> -F`` over
    a channel of `link`'s shared connection (inotify where available, else polling every
    `poll_interval`). SSH drops are survived: the follower is restarted (reconnecting with
    backoff) at the local size. A file that does not exist yet is waited for, polled over
    SFTP every `poll_interval` (also when resuming at a nonzero offset, so a vanished file
    is never re-read from its start). When `stop` is set, the remote's current size is
    read and bytes are copied until the local copy reaches it, for at most DRAIN_LIMIT_S
    (best effort), then the function returns.

    The local file is held with an exclusive flock; a second tailer on the same local file
    raises `TailConflict`. Every chunk is written completely before the next await, so on
    cancellation (or a crash) the local file is a byte-exact prefix of the remote one. On
    return or cancellation the remote follower is closed (its shell kills ``tail`` when the
    channel's stdin reaches EOF, also after a connection drop) and the local copy is
    fsynced (shielded, bounded). If `link` is closed under it, the tailer raises
    `RemoteError` (the local copy is still a consistent prefix); a local file error (disk
    full, I/O error) ends it with that `OSError`. A remote file replaced or truncated while
    being followed is followed by name, as ``tail -F`` does: its new bytes are appended.
    """
    log = _log.bind(host=link.host, remote=remote_path, local=str(local_path))
    copy = _LocalCopy(local_path, on_bytes)
    drain = _Drain(stop)
    try:
        log.info("tail.resumed" if copy.offset else "tail.started", offset=copy.offset)
        failures = 0
        while True:
            before = copy.offset
            drain.notice()
            with anyio.CancelScope(deadline=drain.deadline):
                try:
                    if await _follow_once(link, remote_path, copy, drain, poll_interval, log):
                        log.info("tail.stopped", offset=copy.offset)
                        return
                except RemoteError as exc:
                    log.warning("tail.interrupted", error=str(exc), offset=copy.offset)
                    if link.closed:
                        raise
            if drain.expired():
                log.warning("tail.drain_incomplete", offset=copy.offset, limit_s=DRAIN_LIMIT_S)
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


class _Drain:
    """The stop request and the deadline of the drain it starts (set once, when noticed)."""

    def __init__(self, stop: anyio.Event) -> None:
        self.stop = stop
        self.deadline = math.inf

    def notice(self) -> None:
        """Start the drain clock if `stop` is set and the clock is not running yet."""
        if self.stop.is_set() and self.deadline == math.inf:
            self.deadline = anyio.current_time() + DRAIN_LIMIT_S

    def expired(self) -> bool:
        self.notice()
        return anyio.current_time() >= self.deadline


async def _follow_once(
    link: NodeLink,
    remote_path: str,
    copy: _LocalCopy,
    drain: _Drain,
    poll_interval: float,
    log: structlog.typing.FilteringBoundLogger,
) -> bool:
    """Run one remote follower until it ends (False) or the stop request is drained (True)."""
    remote_size = await link.size(remote_path)
    warned = False
    while remote_size is None:
        # Start `tail` only on an existing file: it then follows it with inotify (a file
        # that appears later is polled every -s), and it would print a file appearing
        # later from its first byte, ignoring +N, which duplicates bytes on a resume.
        if not warned:
            if copy.offset:
                log.warning("tail.remote_missing", offset=copy.offset)
            else:
                log.info("tail.waiting_for_file")
            warned = True
        with anyio.move_on_after(poll_interval):
            await drain.stop.wait()
        if drain.stop.is_set():
            return True  # nothing to drain from a missing file
        remote_size = await link.size(remote_path)
    if remote_size is not None and remote_size < copy.offset:
        # `tail -c +N` prints nothing until the file grows past N: a replaced or truncated
        # remote file shows up as a stalled log.
        log.warning("tail.remote_shorter", remote_size=remote_size, offset=copy.offset)
    stream = await _open_follower(link, remote_path, copy.offset, poll_interval)
    drained = False
    ended = False
    target: int | None = None
    try:
        async with anyio.create_task_group() as tg:

            async def watch_stop() -> None:
                nonlocal target, drained
                await drain.stop.wait()
                drain.notice()
                tg.cancel_scope.deadline = drain.deadline
                end = await link.size(remote_path, time_limit=DRAIN_LIMIT_S)
                target = end if end is not None else copy.offset
                if copy.offset >= target:
                    drained = True
                    tg.cancel_scope.cancel()

            async def pump() -> None:
                nonlocal drained, ended
                action = f"tailing {remote_path}"
                while True:
                    chunk = await stream.read(action)
                    if not chunk:
                        ended = True
                        tg.cancel_scope.cancel()
                        return
                    copy.append(chunk)
                    if target is not None and copy.offset >= target:
                        drained = True
                        tg.cancel_scope.cancel()
                        return
                    await copy.maybe_sync()

            tg.start_soon(stream.collect_stderr, log)
            tg.start_soon(watch_stop)
            tg.start_soon(pump)
    except* (RemoteError, OSError) as group:
        # One pump fails at a time; its error (remote, or the local disk's) is the answer.
        raise group.exceptions[0] from None
    finally:
        await stream.aclose()
    if ended and not drained:
        tail = stream.stderr_text()
        raise RemoteError(
            link.host, f"tailing {remote_path}", f"the remote tail ended ({tail or 'no message'})"
        )
    await copy.sync()
    return drained


async def _open_follower(
    link: NodeLink, remote_path: str, start: int, poll_interval: float
) -> RemoteStream:
    """Start the remote follower of `remote_path` from byte offset `start`."""
    args = [str(start + 1), remote_path, f"{poll_interval:g}"]
    argv = ["sh", "-c", _TAIL_SCRIPT, "llmd-tail", *args]
    return await link.open_stream(argv, action=f"starting a tail of {remote_path}")
