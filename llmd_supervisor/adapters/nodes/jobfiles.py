"""Reading a job's files through `node/safe_read.py`, here or on a remote host.

A job's log directory is hostile input (links, FIFOs, devices, directories, huge files).
The daemon never opens it itself: it runs ``node/safe_read.py`` (stdlib only) as a child
process on this machine, or over SSH on a node or login host. That script opens every
component below the log directory's parent with ``O_NOFOLLOW | O_NONBLOCK`` and reads only
regular files with one link owned by its own account; a read that hangs (a dead NFS
server) holds a child process that is killed at its time limit, never a daemon thread.

`split(path)` gives the (root, rel) a path is opened as: the root is the log directory's
parent (followed as it is: the operator chose it, see `core.spec.log_dirs`), everything below is
not followed.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.abc
import anyio.lowlevel
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from llmd_supervisor import node
from llmd_supervisor.errors import FileRefused, RemoteError

SOURCE: Final = (Path(node.__file__).parent / "safe_read.py").read_text()
# Exit statuses and answer words of node/safe_read.py.
OK, MISSING, REFUSED, TOO_LARGE = 0, 1, 3, 4
# A marker or a status file is at most this large; a larger one is refused, unread.
SMALL_FILE_MAX: Final = 64 << 10
# A benchmark point's result file (vLLM's may hold per-request arrays) or a diagnostic.
RESULT_FILE_MAX: Final = 32 << 20
# Entry names read from one job directory per listing.
LIST_MAX: Final = 4096

_CHUNK = 1 << 20
_STDERR_KEEP = 4096
_SERVE_SLACK = 4096  # a serve answer's reason text may exceed a tiny limit
# Lines of a follower's stderr that say its file changed under it (see node/safe_read.py).
NOTICE_PREFIXES: Final = ("replaced: ", "truncated: ")
Notice = Callable[[str], None]


def stderr_lines(pending: bytes, data: bytes) -> tuple[list[str], bytes]:
    """The complete lines in `pending + data` (decoded, bounded) and what is left over."""
    *lines, rest = (pending + data).split(b"\n")
    return [ln.decode("utf-8", "replace")[:500] for ln in lines if ln.strip()], rest[-_STDERR_KEEP:]


def told(line: str, log: structlog.typing.FilteringBoundLogger, notice: Notice | None) -> None:
    """Log one line of a follower's stderr; hand a change of its file to `notice`."""
    log.info("tail.reader_message", message=line)
    if notice is not None and line.startswith(NOTICE_PREFIXES):
        notice(line)


def serve_request(op: str, rel: str, limit: int, *more: int) -> bytes:
    """One request line for ``safe_read.py serve``."""
    return (json.dumps([op, rel, limit, *more]) + "\n").encode()


def serve_head(head: bytes, op: str, limit: int) -> tuple[str, int] | None:
    """(answer word, payload length) of a ``serve`` answer's first line, or None when the
    length is not one `op` with `limit` can have (the largest: the bytes, or `limit` names
    of at most 255 bytes and a newline)."""
    word, _, size = head.decode(errors="replace").strip().partition(" ")
    most = (limit * 256 if op == "list" else limit) + _SERVE_SLACK
    n = int(size) if size.isdigit() else -1
    return (word, n) if 0 <= n <= most else None


def split(log_dir: str, path: str) -> tuple[str, str]:
    """(root, rel) of a path inside `log_dir`: root is log_dir's parent."""
    root = posixpath.dirname(log_dir.rstrip("/")) or "/"
    rel = posixpath.relpath(path, root)
    if rel.startswith("../") or rel == "..":
        raise ValueError(f"{path} is not inside the log directory {log_dir}")
    return root, rel


def argv(python: str, mode: str, *args: str) -> list[str]:
    """The command line that runs the script with `python` (-I -S: no site, no env)."""
    return [python, "-I", "-S", "-c", SOURCE, mode, *args]


def answer(path: str, status: int | str, data: bytes, limit: int = SMALL_FILE_MAX) -> bytes | None:
    """The bytes of a `read`, None when missing; FileRefused otherwise."""
    if status in (OK, "ok"):
        return data
    if status in (MISSING, "missing"):
        return None
    if status in (TOO_LARGE, "too_large"):
        raise FileRefused(path, too_large(limit))
    reason = data.decode("utf-8", "replace").strip().removeprefix("refused: ")
    raise FileRefused(path, reason or f"the reader failed with status {status}")


def too_large(limit: int) -> str:
    """Why a file larger than the `limit` it was read with is refused."""
    return f"it is larger than {limit} bytes"


def listing(path: str, status: str, data: bytes) -> list[str]:
    """The entry names of a `list` answer, [] when missing; FileRefused otherwise."""
    if status == "missing":
        return []
    if status != "ok":
        raise FileRefused(path, data.decode("utf-8", "replace") or f"the listing said {status}")
    return [n for n in data.decode("utf-8", "surrogateescape").split("\n") if n]


async def read_local(
    log_dir: str, path: str, *, time_limit: float, limit: int = SMALL_FILE_MAX
) -> bytes | None:
    """A file of a job seen through this machine's file system (marker, status, a
    benchmark result): its bytes, None when missing; `FileRefused` when not a plain file
    or larger than `limit`; `TimeoutError` when it cannot be read within `time_limit`
    (the reader is killed)."""
    root, rel = split(log_dir, path)
    cmd = argv(sys.executable, "read", root, rel, str(limit))
    with anyio.fail_after(time_limit):
        result = await anyio.run_process(cmd, check=False, stdin=subprocess.DEVNULL)
    return answer(path, result.returncode, result.stdout or result.stderr, limit)


async def list_local(log_dir: str, path: str, *, time_limit: float) -> list[str]:
    """Entry names of a job directory here (at most LIST_MAX), [] when missing;
    `FileRefused` when it is a link or not a directory."""
    root, rel = split(log_dir, path)
    request = serve_request("list", rel, LIST_MAX)
    with anyio.fail_after(time_limit):
        result = await anyio.run_process(argv(sys.executable, "serve", root), input=request)
    head, _, body = result.stdout.partition(b"\n")
    return listing(path, head.split(b" ")[0].decode(errors="replace"), body)


class LocalStream:
    """The follower run here as a child process, shaped like `remote.RemoteStream`."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.stderr_tail = b""

    def stderr_text(self) -> str:
        return self.stderr_tail.decode("utf-8", "replace").strip()

    async def read(self, action: str) -> bytes:
        assert self.process.stdout is not None
        try:
            return await self.process.stdout.receive(_CHUNK)
        except anyio.EndOfStream:
            return b""
        except (anyio.BrokenResourceError, OSError) as exc:
            raise RemoteError("localhost", action, str(exc)) from exc

    async def send_eof(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(anyio.BrokenResourceError, OSError):
                await self.process.stdin.aclose()

    async def collect_stderr(
        self, log: structlog.typing.FilteringBoundLogger, notice: Notice | None = None
    ) -> None:
        assert self.process.stderr is not None
        pending = b""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            while True:
                data = await self.process.stderr.receive(_CHUNK)
                self.stderr_tail = (self.stderr_tail + data)[-_STDERR_KEEP:]
                lines, pending = stderr_lines(pending, data)
                for line in lines:
                    told(line, log, notice)
        for line in stderr_lines(pending, b"\n")[0]:
            told(line, log, notice)

    async def wait(self) -> int | None:
        with anyio.move_on_after(5):
            return await self.process.wait()
        return None

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.send_eof()
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
            with anyio.move_on_after(5):
                await self.process.wait()


class LocalFiles:
    """Opens followers on this machine (the shared log directory), like a `NodeLink`."""

    host = "localhost"
    closed = False
    python = sys.executable

    async def open_stream(self, command: Sequence[str], *, action: str) -> LocalStream:
        try:
            process = await anyio.open_process(list(command))
        except OSError as exc:
            raise RemoteError(self.host, action, str(exc)) from exc
        return LocalStream(process)

    def __repr__(self) -> str:
        return "LocalFiles()"


async def _receive_exactly(out: BufferedByteReceiveStream, n: int) -> bytes:
    """`n` bytes of `out`, chunk by chunk with the loop free between chunks, copied once at
    the end (a 32 MiB result file: `receive_exactly` copies it several times in one go)."""
    chunks: list[bytes] = []
    while n > 0:
        chunk = await out.receive(min(n, _CHUNK))
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


# Requests written to a reader child at once: far below a pipe's 64 KiB, so the write never
# waits for a child that is itself blocked writing an answer nobody reads yet.
PIPELINE_BYTES: Final = 16 << 10


@dataclass(frozen=True)
class _Ask:
    """One request to a ``safe_read.py serve`` child."""

    op: str  # read | list | from
    path: str
    limit: int
    more: tuple[int, ...] = ()


def _pipelined(lines: Sequence[bytes]) -> Iterator[tuple[int, int]]:
    """[start, end) ranges of `lines` of at most PIPELINE_BYTES each (at least one line)."""
    start = size = 0
    for i, line in enumerate(lines):
        if i > start and size + len(line) > PIPELINE_BYTES:
            yield start, i
            start, size = i, 0
        size += len(line)
    if start < len(lines):
        yield start, len(lines)


class SharedFsNode(LocalFiles):
    """One allocated node's files read on this machine from the shared file system
    (``access = "shared-fs"``: no SSH). Shaped like a `NodeLink`: `host` names the node in
    events; small reads and listings go to one ``safe_read.py serve`` child kept per node
    (one request at a time, each bounded by its time limit: a reader that hangs on a dead
    file server is killed and the next request starts a new one); followers are child
    processes too. A failed or timed-out read raises `RemoteError`, like an SSH failure,
    so the node's probe fails and its silence is reported."""

    def __init__(self, node: str) -> None:
        self.host = node
        self.closed = False
        self._lock = anyio.Lock()
        self._server: tuple[str, anyio.abc.Process, BufferedByteReceiveStream] | None = None

    def __repr__(self) -> str:
        return f"SharedFsNode({self.host!r})"

    @property
    def root(self) -> str | None:
        """The directory its reader child serves (None: no child yet)."""
        return None if self._server is None else self._server[0]

    async def read_file(
        self, log_dir: str, path: str, *, time_limit: float = 10, limit: int = SMALL_FILE_MAX
    ) -> bytes | None:
        """A file of the job of at most `limit` bytes (the marker, a status file, a
        result): like `NodeLink.read_file`."""
        status, data = await self._ask("read", log_dir, path, limit, time_limit)
        return answer(path, status, data, limit)

    async def list_dir(self, log_dir: str, path: str, *, time_limit: float = 10) -> list[str]:
        """A job directory's entry names: like `NodeLink.list_dir`."""
        status, data = await self._ask("list", log_dir, path, LIST_MAX, time_limit)
        return listing(path, status, data)

    async def read_from(
        self, log_dir: str, path: str, offset: int, limit: int, *, time_limit: float = 30
    ) -> bytes | None:
        """At most `limit` bytes of a job's file from `offset` on (None: missing)."""
        status, data = await self._ask("from", log_dir, path, limit, time_limit, offset)
        return answer(path, status, data, limit)

    async def list_dirs(
        self, log_dir: str, paths: Sequence[str], *, time_limit: float = 10
    ) -> list[list[str] | FileRefused]:
        """`list_dir` of each of `paths`, asked together (one round trip per
        `PIPELINE_BYTES` of requests); a directory that is not the job's is its
        FileRefused. `time_limit` bounds the whole."""
        asks = [_Ask("list", path, LIST_MAX) for path in paths]
        out: list[list[str] | FileRefused] = []
        answers = await self._ask_many(log_dir, asks, time_limit)
        for ask, (status, data) in zip(asks, answers, strict=True):
            try:
                out.append(listing(ask.path, status, data))
            except FileRefused as exc:
                out.append(exc)
        return out

    async def read_froms(
        self, log_dir: str, reads: Sequence[tuple[str, int, int]], *, time_limit: float = 30
    ) -> list[bytes | FileRefused | None]:
        """`read_from` of each (path, offset, limit) of `reads`, asked together like
        `list_dirs`: what each holds from its offset on (None: missing; FileRefused)."""
        asks = [_Ask("from", path, limit, (offset,)) for path, offset, limit in reads]
        out: list[bytes | FileRefused | None] = []
        answers = await self._ask_many(log_dir, asks, time_limit)
        for ask, (status, data) in zip(asks, answers, strict=True):
            try:
                out.append(answer(ask.path, status, data, ask.limit))
            except FileRefused as exc:
                out.append(exc)
        return out

    async def _ask(
        self,
        op: str,
        log_dir: str,
        path: str,
        limit: int,
        time_limit: float,
        *more: int,
    ) -> tuple[str, bytes]:
        (got,) = await self._ask_many(log_dir, [_Ask(op, path, limit, more)], time_limit)
        return got

    async def _ask_many(
        self, log_dir: str, asks: Sequence[_Ask], time_limit: float
    ) -> list[tuple[str, bytes]]:
        """The (answer word, payload) of each request, in order. The requests go to the
        reader child in writes of at most `PIPELINE_BYTES` (it answers them in order; a
        write that small never waits on a child that is busy writing its answers), and
        every answer of one write is read before the next write."""
        if not asks:
            return []
        action = f"listing {asks[0].path}" if asks[0].op == "list" else f"reading {asks[0].path}"
        if len(asks) > 1:
            action += f" and {len(asks) - 1} more of its files"
        root = split(log_dir, log_dir)[0]
        lines = [serve_request(a.op, split(log_dir, a.path)[1], a.limit, *a.more) for a in asks]
        async with self._lock:
            if self.closed:
                raise RemoteError(self.host, action, "the node's file reader is closed")
            try:
                with anyio.fail_after(time_limit):
                    if self._server is None or self._server[0] != root:
                        await self._stop()
                        proc = await anyio.open_process(argv(sys.executable, "serve", root))
                        assert proc.stdout is not None
                        self._server = (root, proc, BufferedByteReceiveStream(proc.stdout))
                    _, proc, out = self._server
                    assert proc.stdin is not None
                    got: list[tuple[str, bytes]] = []
                    for start, end in _pipelined(lines):
                        await proc.stdin.send(b"".join(lines[start:end]))
                        for ask in asks[start:end]:
                            head = await out.receive_until(b"\n", 64)
                            answered = serve_head(head, ask.op, ask.limit)
                            if answered is None:
                                why = f"the reader answered {head!r}"
                                raise RemoteError(self.host, action, why)
                            word, n = answered
                            got.append((word, await _receive_exactly(out, n)))
                    return got
            except BaseException as exc:  # whatever happened, the reader starts afresh
                await self._stop()
                if isinstance(exc, TimeoutError):
                    why = f"no answer within {time_limit:g} s (the shared file system hangs?)"
                    raise RemoteError(self.host, action, why) from None
                if isinstance(
                    exc, anyio.EndOfStream | anyio.IncompleteRead | anyio.BrokenResourceError
                ):
                    raise RemoteError(
                        self.host, action, f"the file reader ended ({exc!r})"
                    ) from None
                if isinstance(exc, OSError):
                    raise RemoteError(self.host, action, str(exc)) from exc
                raise

    async def _stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await LocalStream(server[1]).aclose()

    async def aclose(self) -> None:
        self.closed = True
        with anyio.CancelScope(shield=True):
            await self._stop()


# Reader children kept for the job files seen on this machine (per cluster).
LOCAL_READERS: Final = 4


class LocalReaders:
    """`size` readers of the job files this machine sees (`SharedFsNode`s, each keeping one
    ``safe_read.py serve`` child), shared by all runs of a cluster: a run's end reads its
    marker, results and status files through a child already running instead of starting
    one per read. A request waits for a free reader and prefers one that already serves
    the log directory's parent; a reader that fails or times out restarts its child."""

    def __init__(self, size: int = LOCAL_READERS) -> None:
        self._idle = [SharedFsNode("localhost") for _ in range(size)]
        self._free = anyio.Semaphore(size)

    @contextlib.asynccontextmanager
    async def reader(self, log_dir: str) -> AsyncIterator[SharedFsNode]:
        """A free reader, for as long as the block lasts."""
        root = split(log_dir, log_dir)[0]
        async with self._free:
            i = next((i for i, r in enumerate(self._idle) if r.root == root), -1)
            reader = self._idle.pop(i)
            try:
                yield reader
            finally:
                self._idle.append(reader)

    async def aclose(self) -> None:
        for reader in self._idle:
            await reader.aclose()
