"""SSH adapter: one multiplexed connection per allocated node.

`NodeLink` owns one asyncssh connection to one node. It connects lazily, shares the
connection between every caller (each operation is its own channel), drops it on any
connection-level failure and reconnects on the next use, waiting an exponential backoff
with jitter (0.2 s doubling to 5 s) after failed attempts. Every asyncssh/OSError that
crosses this module's boundary becomes a `RemoteError`. `RemoteStream` is a long-running
remote command's output (the log followers of `adapters.nodes.tail` run on it).
"""

from __future__ import annotations

import contextlib
import random
import shlex
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio
import asyncssh
import structlog

from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
from llmd_supervisor.errors import RemoteError

_log = structlog.get_logger("llmd_supervisor.adapters.remote")

T = TypeVar("T")

BACKOFF_FIRST_S = 0.2
BACKOFF_CAP_S = 5.0
# Bound on closing channels/connections during cancellation or shutdown.
CLOSE_LIMIT_S = 2.0
_CHUNK = 1 << 16
_STDERR_KEEP = 2048
# Room for a refusal's reason beyond a request's size limit.


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
    python: str = "python3"  # runs node/safe_read.py on the node (the job's files are read so)

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
        # The node's `safe_read.py serve`: its connection, root and process.
        self._server: (
            tuple[asyncssh.SSHClientConnection, str, asyncssh.SSHClientProcess[bytes]] | None
        ) = None
        self._lock = anyio.Lock()
        self._files_lock = anyio.Lock()
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
    def python(self) -> str:
        """The interpreter that runs node/safe_read.py on the node."""
        return self.settings.python

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
            self._server = None
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

    async def read_file(self, log_dir: str, path: str, *, time_limit: float = 10) -> bytes | None:
        """A small file (marker, status) of the job in `log_dir`, read by `node/safe_read.py`:
        its bytes, None if missing; `FileRefused` if it is not a plain file of this account
        (a link, FIFO, device, directory) or larger than `jobfiles.SMALL_FILE_MAX`."""
        status, data = await self._files("read", log_dir, path, jobfiles.SMALL_FILE_MAX, time_limit)
        return jobfiles.answer(path, status, data)

    async def list_dir(self, log_dir: str, path: str, *, time_limit: float = 10) -> list[str]:
        """The entry names (at most `jobfiles.LIST_MAX`) of a directory in `log_dir`, []
        if it is missing; `FileRefused` if it is a link or not a directory."""
        status, data = await self._files("list", log_dir, path, jobfiles.LIST_MAX, time_limit)
        return jobfiles.listing(path, status, data)

    async def _files(
        self, op: str, log_dir: str, path: str, limit: int, time_limit: float
    ) -> tuple[str, bytes]:
        """One request to the node's `safe_read.py serve` (started once per connection and
        root, one request at a time): (answer word, payload)."""
        root, rel = jobfiles.split(log_dir, path)
        action = f"reading {path}" if op == "read" else f"listing {path}"
        request = jobfiles.serve_request(op, rel, limit)

        async def ask(conn: asyncssh.SSHClientConnection) -> tuple[str, bytes]:
            async with self._files_lock:
                server = self._server
                if server is None or server[0] is not conn or server[1] != root:
                    command = shlex.join(jobfiles.argv(self.settings.python, "serve", root))
                    proc = await conn.create_process(command, encoding=None)
                    if server is not None:
                        server[2].close()
                    server = self._server = (conn, root, proc)
                proc = server[2]
                try:
                    proc.stdin.write(request)
                    head = await proc.stdout.readuntil(b"\n")
                    answered = jobfiles.serve_head(head, op, limit)
                    if answered is None:
                        raise RemoteError(self.host, action, f"the reader answered {head[:80]!r}")
                    word, n = answered
                    data = await proc.stdout.readexactly(n) if n else b""
                except EOFError as exc:  # the reader ended (no python3 there?)
                    self._server = None
                    proc.close()
                    why = (await _stderr_of(proc)) or "it ended without an answer"
                    raise RemoteError(self.host, action, f"the file reader failed: {why}") from exc
                except BaseException:
                    self._server = None
                    proc.close()
                    raise
                return word, bytes(data)

        try:
            return await self._call(action, time_limit, ask)
        except RemoteError:
            if self._server is not None and self._server[0].is_closed():
                self._server = None
            raise

    async def open_stream(self, argv: Sequence[str], *, action: str) -> RemoteStream:
        """Start `shlex.join(argv)` on the node and hand back its output as a stream.

        Starting is bounded by twice the connect timeout; the command then runs without a
        time limit until it exits or its channel closes. The caller must `aclose` the stream,
        and the command must end itself when its stdin reaches EOF: sshd neither forwards
        signals nor kills a process whose channel closed. Raises `RemoteError` (`action`
        names the operation) if the command cannot be started.
        """
        command = shlex.join(argv)

        async def op(conn: asyncssh.SSHClientConnection) -> RemoteStream:
            proc = await conn.create_process(command, encoding=None)
            return RemoteStream(self, conn, proc)

        return await self._call(action, self.settings.connect_timeout * 2, op)

    async def aclose(self) -> None:
        """Close the connection (bounded wait); later operations raise `RemoteError`."""
        async with self._lock:
            self._closed = True
            conn, self._conn, self._server = self._conn, None, None
        if conn is not None:
            with anyio.CancelScope(shield=True):
                conn.close()
                with anyio.move_on_after(CLOSE_LIMIT_S):
                    await conn.wait_closed()


async def _stderr_of(proc: asyncssh.SSHClientProcess[bytes]) -> str:
    """What an ended process wrote to stderr (bounded, best effort)."""
    with anyio.move_on_after(1), contextlib.suppress(asyncssh.Error, OSError):
        return _text(bytes(await proc.stderr.read(_STDERR_KEEP)))
    return ""


class RemoteStream:
    """A running remote command: stdout chunks in order, the tail of stderr kept for diagnostics."""

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

    def stderr_text(self) -> str:
        """The kept end of stderr, decoded for a message."""
        return _text(self.stderr_tail)

    async def read(self, action: str) -> bytes:
        """The next chunk; b"" at EOF. Raises `RemoteError` if the channel or connection broke."""
        try:
            chunk = await self.proc.stdout.read(_CHUNK)
        except (asyncssh.Error, OSError) as exc:
            raise self.link._fail(self.conn, action, exc) from exc
        if chunk:
            self.link._mark_ok()
        return bytes(chunk)

    async def collect_stderr(
        self, log: structlog.typing.FilteringBoundLogger, notice: jobfiles.Notice | None = None
    ) -> None:
        """Keep the last bytes of the follower's stderr and log each line of it (a change
        of the followed file also goes to `notice`)."""
        pending = b""
        with contextlib.suppress(asyncssh.Error, OSError):
            while True:
                data = bytes(await self.proc.stderr.read(_CHUNK))
                if not data:
                    break
                self.stderr_tail = (self.stderr_tail + data)[-_STDERR_KEEP:]
                lines, pending = jobfiles.stderr_lines(pending, data)
                for line in lines:
                    jobfiles.told(line, log, notice)
        for line in jobfiles.stderr_lines(pending, b"\n")[0]:
            jobfiles.told(line, log, notice)

    async def send_eof(self) -> None:
        """Close the command's stdin (the file follower then drains and exits)."""
        with contextlib.suppress(asyncssh.Error, OSError):
            self.proc.stdin.write_eof()

    async def wait(self) -> int | None:
        """The command's exit status once it ended (bounded wait), None if unknown."""
        with anyio.move_on_after(CLOSE_LIMIT_S), contextlib.suppress(asyncssh.Error, OSError):
            await self.proc.wait_closed()
        return self.proc.returncode

    async def aclose(self) -> None:
        """Send EOF and close the channel (shielded, bounded); the command sees EOF on stdin."""
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(asyncssh.Error, OSError):
                self.proc.stdin.write_eof()
            self.proc.close()
            with anyio.move_on_after(CLOSE_LIMIT_S):
                await self.proc.wait_closed()
