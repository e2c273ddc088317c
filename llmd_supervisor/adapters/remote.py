"""SSH adapter: one multiplexed connection per allocated node, and byte-exact log tailing.

`NodeLink` owns one asyncssh connection to one node. It connects lazily, shares the
connection between every caller (each operation is its own channel), drops it on any
connection-level failure and reconnects on the next use, waiting an exponential backoff
with jitter (0.2 s doubling to 5 s) after failed attempts. Every asyncssh/OSError that
crosses this module's boundary becomes a `RemoteError`.

`tail_to_local` streams a remote file into a local copy whose size is the resume offset:
the remote side runs ``tail -c +<size+1> -F`` and every chunk is appended to the local
file before the next await, so after an SSH drop, a cancellation or a daemon restart the
next tailer resumes exactly where the local copy ends (no byte lost or duplicated).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import random
import shlex
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio
import asyncssh
import structlog

from llmd_supervisor.errors import RemoteError, TailConflict

_log = structlog.get_logger("llmd_supervisor.adapters.remote")

T = TypeVar("T")

BACKOFF_FIRST_S = 0.2
BACKOFF_CAP_S = 5.0
# How long a stopped tailer may spend catching up with the remote end before it returns.
DRAIN_LIMIT_S = 10.0
# How often the local copy is fsynced while bytes keep arriving.
FSYNC_EVERY_S = 1.0
# Bound on closing channels/connections during cancellation or shutdown.
CLOSE_LIMIT_S = 2.0
_CHUNK = 1 << 16
_STDERR_KEEP = 2048

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


@dataclass(frozen=True)
class SshSettings:
    """How to reach the allocated nodes; host keys are verified unless explicitly disabled."""

    username: str
    client_keys: tuple[str, ...]
    known_hosts: str | None  # path; None only with insecure_accept_any_host_key=True
    port: int = 22
    connect_timeout: float = 10.0
    keepalive_interval: float = 5.0
    insecure_accept_any_host_key: bool = False

    def __post_init__(self) -> None:
        if self.known_hosts is None and not self.insecure_accept_any_host_key:
            raise ValueError(
                "SshSettings.known_hosts is None: give a known_hosts path, or set "
                "insecure_accept_any_host_key=True (dev clusters only)"
            )


@dataclass(frozen=True)
class RemoteResult:
    """A finished remote command; `exit_status` is negative (-signal) if a signal killed it."""

    exit_status: int
    stdout: bytes
    stderr: bytes


@dataclass
class LinkStats:
    """Process-wide SSH counters over every `NodeLink` (read by the metrics)."""

    connects: int = 0  # first connections of a link
    reconnects: int = 0  # connections re-established after a drop
    connect_failures: int = 0


LINK_STATS = LinkStats()
_LINKS: weakref.WeakSet[NodeLink] = weakref.WeakSet()


def open_connections() -> int:
    """How many links hold a live connection right now."""
    return sum(1 for link in list(_LINKS) if link.connected)


def backoff_delay(failures: int, rand: Callable[[], float] = random.random) -> float:
    """Delay before the next attempt after `failures` consecutive failures (jittered)."""
    if failures <= 0:
        return 0.0
    base = min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2.0 ** min(failures - 1, 32))
    return base * (0.5 + 0.5 * rand())


def _why(exc: BaseException) -> str:
    """A short reason for an outside error, without a trailing period."""
    text = str(exc).strip().rstrip(".") or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if isinstance(exc, OSError) else text


def _text(data: bytes) -> str:
    """Decode remote diagnostics for a log field."""
    return data.decode("utf-8", "replace").strip()


def _is_connection_failure(exc: BaseException) -> bool:
    """True for errors that mean the connection itself is gone (not just one channel)."""
    return isinstance(exc, asyncssh.DisconnectError | OSError)


class NodeLink:
    """One multiplexed asyncssh connection to one node, reconnected on demand with backoff+jitter.

    All operations share the connection (one channel each) and raise `RemoteError` on a
    connect or channel failure or when `time_limit` expires. A connection-level failure
    drops the connection; the next operation reconnects, after a jittered exponential
    backoff if the previous connect attempt failed. Cancelling an operation closes its
    channel (best effort, bounded) and leaves the connection usable.
    """

    def __init__(self, host: str, settings: SshSettings) -> None:
        self.host = host
        self.settings = settings
        self.last_ok: float | None = None
        self.reconnects = 0
        self._conn: asyncssh.SSHClientConnection | None = None
        self._sftp: asyncssh.SFTPClient | None = None
        self._lock = anyio.Lock()
        self._sftp_lock = anyio.Lock()
        self._connected_once = False
        self._failures = 0
        self._not_before = 0.0
        self._closed = False
        self._log = _log.bind(host=host)
        _LINKS.add(self)

    def __repr__(self) -> str:
        state = "connected" if self.connected else "idle"
        return f"NodeLink({self.host!r}, {state}, reconnects={self.reconnects})"

    @property
    def connected(self) -> bool:
        """Whether a live connection is held right now (no I/O; keepalives detect drops)."""
        return self._conn is not None and not self._conn.is_closed()

    @property
    def closed(self) -> bool:
        """Whether `aclose` was called; every later operation raises `RemoteError`."""
        return self._closed

    # ---- connection management

    def _mark_ok(self) -> None:
        self.last_ok = time.monotonic()

    async def _connection(self) -> asyncssh.SSHClientConnection:
        """Return the live connection, connecting (after any pending backoff) if needed."""
        async with self._lock:
            if self._closed:
                raise RemoteError(self.host, "connecting", "the link was closed")
            conn = self._conn
            if conn is not None and not conn.is_closed():
                return conn
            if conn is not None:
                self._discard(conn, "the connection was closed")
            wait = self._not_before - time.monotonic()
            if wait > 0:
                await anyio.sleep(wait)
            s = self.settings
            known_hosts = None if s.insecure_accept_any_host_key else s.known_hosts
            try:
                with anyio.fail_after(s.connect_timeout + 1):
                    conn = await asyncssh.connect(
                        self.host,
                        port=s.port,
                        username=s.username,
                        client_keys=list(s.client_keys),
                        known_hosts=known_hosts,
                        config=None,
                        agent_path=None,
                        preferred_auth="publickey",
                        connect_timeout=s.connect_timeout,
                        keepalive_interval=s.keepalive_interval,
                        keepalive_count_max=3,
                    )
            except (asyncssh.Error, OSError) as exc:  # TimeoutError is an OSError
                self._failures += 1
                LINK_STATS.connect_failures += 1
                delay = backoff_delay(self._failures)
                self._not_before = time.monotonic() + delay
                why = (
                    f"no connection within {s.connect_timeout:g} s"
                    if isinstance(exc, TimeoutError)
                    else _why(exc)
                )
                self._log.warning(
                    "ssh.error",
                    action="connecting",
                    error=why,
                    failures=self._failures,
                    retry_in_s=round(delay, 3),
                )
                raise RemoteError(self.host, "connecting", why) from exc
            self._failures = 0
            self._not_before = 0.0
            if self._connected_once:
                self.reconnects += 1
                LINK_STATS.reconnects += 1
                self._log.info("ssh.reconnect", reconnects=self.reconnects)
            else:
                LINK_STATS.connects += 1
                self._log.info("ssh.connect", port=s.port, user=s.username)
            self._connected_once = True
            self._conn = conn
            self._mark_ok()
            return conn

    def _discard(self, conn: asyncssh.SSHClientConnection, why: str) -> None:
        """Forget `conn` (if it is still current) and close it without waiting."""
        if self._conn is conn:
            self._conn = None
            self._sftp = None
            self._log.warning("ssh.error", action="using the connection", error=why, dropped=True)
        conn.close()

    def _fail(
        self, conn: asyncssh.SSHClientConnection, action: str, exc: BaseException
    ) -> RemoteError:
        """Translate `exc`; drop the connection if the failure was connection-level."""
        why = _why(exc)
        if _is_connection_failure(exc) or conn.is_closed():
            self._discard(conn, why)
        else:
            self._log.warning("ssh.error", action=action, error=why)
        return RemoteError(self.host, action, why)

    async def _call(
        self,
        action: str,
        time_limit: float,
        op: Callable[[asyncssh.SSHClientConnection], Awaitable[T]],
    ) -> T:
        """Run `op` on the live connection within `time_limit`, translating every failure."""
        try:
            with anyio.fail_after(time_limit):
                conn = await self._connection()
                try:
                    result = await op(conn)
                except (asyncssh.Error, OSError) as exc:
                    if isinstance(exc, TimeoutError) and not conn.is_closed():
                        raise  # our own time limit, handled below
                    raise self._fail(conn, action, exc) from exc
        except TimeoutError as exc:
            self._log.warning("ssh.error", action=action, error=f"time limit {time_limit:g} s")
            raise RemoteError(self.host, action, f"no answer within {time_limit:g} s") from exc
        self._mark_ok()
        return result

    async def _sftp_client(self, conn: asyncssh.SSHClientConnection) -> asyncssh.SFTPClient:
        """The SFTP session of `conn`, started once per connection."""
        async with self._sftp_lock:
            if self._sftp is None or self._conn is not conn:
                sftp = await conn.start_sftp_client()
                if self._conn is conn:
                    self._sftp = sftp
                return sftp
            return self._sftp

    # ---- operations

    async def run(
        self, argv: Sequence[str], *, time_limit: float, stdin: bytes | None = None
    ) -> RemoteResult:
        """Run `shlex.join(argv)` on the node, feed it `stdin` then EOF, and return its result.

        Raises `RemoteError` on connect/channel failure, a lost exit status, or when
        `time_limit` expires. The command runs under GNU ``timeout`` (TERM at `time_limit`
        + 1 s, KILL 2 s later), because sshd neither forwards signals nor kills a process
        whose channel closed: a timed-out, cancelled or disconnected call therefore never
        leaves the process running past that bound. On expiry or cancellation the channel
        is closed without waiting for the remote side.
        """
        shown = shlex.join(argv)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        action = f"running `{shown}`"
        command = shlex.join(["timeout", "-k", "2", f"{time_limit + 1:g}", *argv])

        async def op(conn: asyncssh.SSHClientConnection) -> RemoteResult:
            proc = await conn.create_process(command, encoding=None)
            try:
                if stdin:
                    proc.stdin.write(stdin)
                proc.stdin.write_eof()
                stdout, stderr = await proc.communicate()
                status = proc.returncode
            finally:
                proc.close()
            if status is None:
                raise asyncssh.ConnectionLost("the channel closed without an exit status")
            return RemoteResult(status, bytes(stdout or b""), bytes(stderr or b""))

        return await self._call(action, time_limit, op)

    async def read_file(self, path: str, *, time_limit: float = 10) -> bytes | None:
        """The whole content of `path` on the node (over SFTP), or None if it does not exist."""

        async def op(conn: asyncssh.SSHClientConnection) -> bytes | None:
            sftp = await self._sftp_client(conn)
            try:
                async with sftp.open(path, "rb") as f:
                    data = await f.read()
            except asyncssh.SFTPNoSuchFile:
                return None
            return data if isinstance(data, bytes) else data.encode()

        return await self._call(f"reading {path}", time_limit, op)

    async def size(self, path: str, *, time_limit: float = 10) -> int | None:
        """The size in bytes of `path` on the node (following symlinks), or None if missing."""

        async def op(conn: asyncssh.SSHClientConnection) -> int | None:
            sftp = await self._sftp_client(conn)
            try:
                attrs = await sftp.stat(path)
            except asyncssh.SFTPNoSuchFile:
                return None
            return int(attrs.size or 0)

        return await self._call(f"checking the size of {path}", time_limit, op)

    async def list_dir(self, path: str, *, time_limit: float = 10) -> list[str]:
        """The entry names of directory `path` on the node (no `.`/`..`), [] if it is missing."""

        async def op(conn: asyncssh.SSHClientConnection) -> list[str]:
            sftp = await self._sftp_client(conn)
            try:
                names = await sftp.listdir(path)
            except asyncssh.SFTPNoSuchFile:
                return []
            return sorted(str(n) for n in names if n not in (".", ".."))

        return await self._call(f"listing {path}", time_limit, op)

    async def _open_tail(self, remote_path: str, start: int, poll_interval: float) -> _Stream:
        """Start the remote follower of `remote_path` from byte offset `start`."""
        command = shlex.join(
            [
                "sh",
                "-c",
                _TAIL_SCRIPT,
                "llmd-tail",
                str(start + 1),
                remote_path,
                f"{poll_interval:g}",
            ]
        )

        async def op(conn: asyncssh.SSHClientConnection) -> _Stream:
            proc = await conn.create_process(command, encoding=None)
            return _Stream(self, conn, proc)

        return await self._call(
            f"starting a tail of {remote_path}", self.settings.connect_timeout * 2, op
        )

    async def aclose(self) -> None:
        """Close the connection (bounded wait); later operations raise `RemoteError`."""
        async with self._lock:
            self._closed = True
            conn, self._conn, self._sftp = self._conn, None, None
        if conn is not None:
            with anyio.CancelScope(shield=True):
                conn.close()
                with anyio.move_on_after(CLOSE_LIMIT_S):
                    await conn.wait_closed()


class _Stream:
    """A running remote follower: stdout chunks in order, stderr kept for diagnostics."""

    def __init__(
        self,
        link: NodeLink,
        conn: asyncssh.SSHClientConnection,
        proc: asyncssh.SSHClientProcess[bytes],
    ) -> None:
        self.link = link
        self.conn = conn
        self.proc = proc
        self.stderr_tail = b""

    async def read(self, action: str) -> bytes:
        """The next chunk; b"" at EOF. Raises `RemoteError` if the channel or connection broke."""
        try:
            chunk = await self.proc.stdout.read(_CHUNK)
        except (asyncssh.Error, OSError) as exc:
            raise self.link._fail(self.conn, action, exc) from exc
        if chunk:
            self.link._mark_ok()
        return bytes(chunk)

    async def collect_stderr(self, log: structlog.typing.FilteringBoundLogger) -> None:
        """Keep the last bytes of the follower's stderr and log each line of it."""
        pending = b""
        with contextlib.suppress(asyncssh.Error, OSError):
            while True:
                data = bytes(await self.proc.stderr.read(_CHUNK))
                if not data:
                    break
                self.stderr_tail = (self.stderr_tail + data)[-_STDERR_KEEP:]
                *lines, pending = (pending + data).split(b"\n")
                pending = pending[-_STDERR_KEEP:]
                for line in lines:
                    if line.strip():
                        log.info("tail.remote_message", message=_text(line))
        if pending.strip():
            log.info("tail.remote_message", message=_text(pending))

    async def aclose(self) -> None:
        """Close the channel (shielded, bounded); the remote shell then kills its `tail`."""
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(asyncssh.Error, OSError):
                self.proc.stdin.write_eof()
            self.proc.close()
            with anyio.move_on_after(CLOSE_LIMIT_S):
                await self.proc.wait_closed()


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
    `RemoteError` (the local copy is still a consistent prefix). A remote file replaced
    or truncated while being followed is followed by name, as ``tail -F`` does: its new
    bytes are appended.
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
    stream = await link._open_tail(remote_path, copy.offset, poll_interval)
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
    except* RemoteError as group:
        raise group.exceptions[0] from None
    finally:
        await stream.aclose()
    if ended and not drained:
        tail = _text(stream.stderr_tail)
        raise RemoteError(
            link.host, f"tailing {remote_path}", f"the remote tail ended ({tail or 'no message'})"
        )
    await copy.sync()
    return drained
