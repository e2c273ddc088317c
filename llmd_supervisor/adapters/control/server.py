"""Control socket server: listens on the Unix socket, one task per connection.

Limits (`SocketLimits`, the ``[daemon]`` keys): a connection over the global or the peer
uid's cap gets one ``busy`` error line and is closed (logged as ``control.refused``, at
most once per uid and reason every 10 s, with the count since). A new connection must
send its first byte within ``first_byte_timeout_s``, a started request line must be whole
within ``request_timeout_s`` and an open connection may sit idle between requests for
``idle_timeout_s``: otherwise it gets one ``timeout`` error line and is closed
(``control.timeout``). A reply line the client does not take within ``write_timeout_s``
closes the connection (``control.write_timeout``). A streaming request over the uid's
``max_streams_per_uid`` is answered ``busy`` (the connection stays usable). Partial
request lines are held against a byte budget in all and per uid: a connection that would
go over it stops reading (the kernel pushes back on its writer) until bytes are freed or
its request timeout passes, so memory stays bounded whatever the peers send: the budget,
plus a line's first read (16 KiB, charged when it arrived) per connection.

Cancellation contract: when the client closes its end while a streaming request runs (or a
stream item cannot be written), the handler is cancelled and the connection is closed. A
non-streaming request always runs to completion, even if the client goes away, so that a
killed CLI cannot leave a ``submit`` or ``cancel`` half-done. When `ControlServer.serve` is
cancelled, every connection and running handler is cancelled with it and the socket file is
removed. A handler's exception becomes an ``internal`` error reply (logged as
``control.handler_failed``); nothing a client sends can stop the server.

The wire format and the ops are `control_protocol`'s.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import socket
import stat
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final, NoReturn

import anyio
import anyio.abc
import anyio.lowlevel
import structlog

from llmd_supervisor.adapters.control.limits import Occupancy, drop, timeout_message
from llmd_supervisor.adapters.control.protocol import (
    DEFAULT_MAX_MESSAGE,
    OPS,
    PROTOCOL_VERSION,
    Handler,
    Peer,
    Request,
    RequestRejected,
    Send,
    decode_request,
    encode,
    error_line,
    show,
)
from llmd_supervisor.core.config import SocketLimits
from llmd_supervisor.errors import ControlError, ControlSocketError

__all__ = [
    "ControlServer",
    "bind_unix_socket",
    "peer_credentials",
    "remove_socket_file",
    "socket_peer",
]

logger = structlog.get_logger("llmd_supervisor.adapters.control_server")

# struct ucred from <sys/socket.h>: pid_t pid; uid_t uid; gid_t gid.
_UCRED: Final = struct.Struct("3i")
_BACKLOG: Final = 128
_PROBE_TIMEOUT: Final = 2.0
# Bytes asked of the socket per read (anyio reads a Unix socket with recv(n), so nothing
# is read ahead): a line's first read is small and charged once it arrived, the rest of
# a line is read in reserved chunks.
_FIRST_READ: Final = 16 << 10
_READ_CHUNK: Final = 64 << 10
_REFUSE_WRITE_S: Final = 1.0  # a refused connection's one error line
# accept() failures that mean "out of resources for now", not "the listener is broken".
_TRANSIENT_ACCEPT_ERRNOS: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
)


def peer_credentials(stream: anyio.abc.SocketStream) -> Peer:
    """The peer's uid, gid and pid from SO_PEERCRED on an accepted Unix socket."""
    return socket_peer(stream.extra(anyio.abc.SocketAttribute.raw_socket))


def socket_peer(raw: socket.socket) -> Peer:
    """The peer's uid, gid and pid from SO_PEERCRED of a connected Unix socket."""
    data = raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(data)
    return Peer(uid=uid, gid=gid, pid=pid)


class _Stalled(Exception):
    """The client did not take a reply line within the write timeout."""


class _Closing(Exception):
    """The connection ends after the error line already sent (too large, timed out)."""


class _Connection:
    """One accepted client: reads request lines, dispatches them, writes replies."""

    def __init__(
        self,
        stream: anyio.abc.SocketStream,
        peer: Peer,
        handler: Handler,
        max_message: int,
        occupancy: Occupancy,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self._stream = stream
        self._buffer = bytearray()  # received, not yet a whole line; held in the budget
        self._line_started = 0.0  # when the first byte of the buffered line arrived
        self._peer = peer
        self._handler = handler
        self._max = max_message
        self._occ = occupancy
        self._limits = occupancy.limits
        self._log = log
        self._write_lock = anyio.Lock()
        self._gone = False
        self._served = 0

    async def run(self) -> None:
        """Serve requests until the client closes, errs beyond recovery, or times out."""
        try:
            while True:
                line = await self._next_line()
                if line is None:
                    return
                self._served += 1
                try:
                    request = decode_request(line)
                except RequestRejected as exc:
                    self._log.debug(
                        "control.request_rejected", request_id=show(exc.request_id), code=exc.code
                    )
                    await self._write(error_line(exc.request_id, exc.code, exc.message))
                    continue
                if not await self._dispatch(request):
                    return
        except _Closing:
            return
        finally:
            self._occ.budget.give(self._peer.uid, len(self._buffer))
            self._buffer.clear()

    async def _next_line(self) -> bytes | None:
        """The next request line without its newline; None at the end of the stream."""
        while True:
            newline = self._buffer.find(b"\n")
            if newline > self._max or (newline < 0 and len(self._buffer) > self._max):
                await self._close_with(
                    "too_large",
                    f"Request line exceeds the {self._max}-byte message bound; closing the "
                    "connection because the rest of the line cannot be resynchronised.",
                )
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                self._occ.budget.give(self._peer.uid, newline + 1)
                self._line_started = anyio.current_time()
                return line
            if not self._buffer:
                first = self._served == 0
                wait = self._limits.first_byte_timeout_s if first else self._limits.idle_timeout_s
                what = "first_byte" if first else "idle"
            else:
                wait = self._line_started + self._limits.request_timeout_s - anyio.current_time()
                what = "request"
            with anyio.move_on_after(wait) as scope:
                received = await self._receive()
            if scope.cancelled_caught:
                await self._timed_out(what)
            if not received:
                if self._buffer:
                    self._log.debug("control.partial_line_dropped", size=len(self._buffer))
                return None

    async def _receive(self) -> bool:
        """Read more into the buffer; False at the end of the stream.

        The first read of a line is charged after it arrived (an idle connection holds no
        budget); a line in progress reads on only once the budget has room for a read.
        """
        uid, budget = self._peer.uid, self._occ.budget
        reserved = 0
        if self._buffer:
            await budget.take(uid, _READ_CHUNK)
            reserved = _READ_CHUNK
        try:
            data = await self._stream.receive(reserved or _FIRST_READ)  # at most that
        except anyio.EndOfStream:
            data = b""
        except BaseException:
            budget.give(uid, reserved)
            raise
        if len(data) > reserved:
            budget.charge(uid, len(data) - reserved)
        else:
            budget.give(uid, reserved - len(data))
        if not data:
            return False
        if not self._buffer:
            self._line_started = anyio.current_time()
        self._buffer += data
        return True

    async def _timed_out(self, what: str) -> NoReturn:
        seconds, message = timeout_message(self._limits, what)
        self._log.info("control.timeout", kind=what, timeout_s=seconds, buffered=len(self._buffer))
        await self._close_with("timeout", message)

    async def _close_with(self, code: str, message: str) -> NoReturn:
        """Send one error line (no request id) and end the connection."""
        if code == "too_large":
            self._log.warning("control.too_large", max_message=self._max)
        gone = (anyio.BrokenResourceError, anyio.ClosedResourceError, _Stalled)
        with anyio.move_on_after(_REFUSE_WRITE_S), contextlib.suppress(*gone):
            await self._write(error_line(None, code, message))
        raise _Closing

    async def _write(self, data: bytes) -> None:
        """Send one line; `_Stalled` when the client does not take it in time."""
        async with self._write_lock:
            with anyio.move_on_after(self._limits.write_timeout_s) as scope:
                await self._stream.send(data)
            if scope.cancelled_caught:
                raise _Stalled

    async def _dispatch(self, request: Request) -> bool:
        """Run one request to its final reply; False when the connection must close."""
        self._log.debug("control.request", request_id=show(request.id), op=request.op)
        if not OPS[request.op].streaming:
            await self._write(await self._call(request, self._no_stream(request)))
            return True
        uid, cap = self._peer.uid, self._limits.max_streams_per_uid
        streams = self._occ.streams.get(uid, 0)
        if streams >= cap:
            self._log.info("control.refused", reason="max_streams_per_uid", streams=streams)
            await self._write(
                error_line(
                    request.id,
                    "busy",
                    f"uid {uid} already has {streams} streaming requests (wait, logs --follow, "
                    "campaign submit) "
                    f"open, the per-user limit (daemon.max_streams_per_uid = {cap}); end some "
                    "and try again.",
                )
            )
            return True
        self._occ.streams[uid] = streams + 1
        try:
            reply = await self._stream_request(request)
        finally:
            drop(self._occ.streams, uid)
        if self._gone or reply is None:
            self._log.info("control.client_gone", request_id=show(request.id), op=request.op)
            return False
        await self._write(reply)
        return True

    async def _stream_request(self, request: Request) -> bytes | None:
        reply: bytes | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_for_disconnect, tg.cancel_scope)
            reply = await self._call(request, self._stream_sender(request, tg.cancel_scope))
            tg.cancel_scope.cancel()
        return reply

    async def _call(self, request: Request, send: Send) -> bytes:
        """The handler's outcome as a final reply line; cancellation passes through."""
        try:
            result = await self._handler.handle(request, self._peer, send)
        except ControlError as exc:
            return error_line(request.id, exc.code, exc.message)
        except _Stalled:
            raise
        except Exception as exc:
            self._failed(request, exc_info=True)
            return self._internal(request, f"{type(exc).__name__}: {exc}")
        try:
            if not isinstance(result, Mapping):
                raise TypeError(f"handler returned {type(result).__name__}, not a mapping")
            line = encode(
                {"v": PROTOCOL_VERSION, "id": request.id, "ok": True, "result": dict(result)}
            )
        except (TypeError, ValueError, RecursionError) as exc:
            self._failed(request, exc_info=True)
            return self._internal(request, f"its result cannot be sent as JSON ({exc})")
        if len(line) - 1 > self._max:
            self._failed(request, reason="result too large", size=len(line) - 1)
            return self._internal(
                request, f"its result is {len(line) - 1} bytes, over the {self._max}-byte bound"
            )
        return line

    def _failed(self, request: Request, **kw: object) -> None:
        """Log control.handler_failed; a traceback holding a peer's odd text (a lone
        surrogate, say) must not break the log line, so that is retried without it."""
        try:
            self._log.error(
                "control.handler_failed", request_id=show(request.id), op=request.op, **kw
            )
        except (UnicodeError, ValueError):
            kw.pop("exc_info", None)
            self._log.error(
                "control.handler_failed", request_id=show(request.id), op=request.op, **kw
            )

    def _internal(self, request: Request, detail: str) -> bytes:
        if len(detail) > 200:
            detail = detail[:197] + "..."
        return error_line(
            request.id,
            "internal",
            f"Internal error while handling op {request.op!r} (request id {show(request.id)}): "
            f"{detail}; see the daemon log.",
        )

    def _no_stream(self, request: Request) -> Send:
        async def send(item: Mapping[str, object]) -> None:
            raise RuntimeError(f"op {request.op!r} does not stream, but its handler sent an item")

        return send

    def _stream_sender(self, request: Request, scope: anyio.CancelScope) -> Send:
        async def send(item: Mapping[str, object]) -> None:
            if not isinstance(item, Mapping):
                raise TypeError(f"a stream item must be a mapping, not {type(item).__name__}")
            if "final" in item:
                raise ValueError("a stream item must not have a top-level 'final' key")
            line = encode({"v": PROTOCOL_VERSION, "id": request.id, "stream": dict(item)})
            if len(line) - 1 > self._max:
                raise ValueError(
                    f"a stream item of {len(line) - 1} bytes exceeds the {self._max}-byte bound"
                )
            try:
                await self._write(line)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, _Stalled) as exc:
                # The client is gone (or stopped reading): cancel the handler rather than
                # report a write error.
                if isinstance(exc, _Stalled):
                    self._log.warning(
                        "control.write_timeout", timeout_s=self._limits.write_timeout_s
                    )
                self._gone = True
                scope.cancel()
                await anyio.lowlevel.checkpoint()
                raise

        return send

    async def _watch_for_disconnect(self, scope: anyio.CancelScope) -> None:
        """Cancel `scope` if the client closes its end while a streaming request runs.

        Bytes that arrive meanwhile (pipelined requests) are kept for after the stream, up
        to the message bound; beyond that reading stops and the kernel pushes back.
        """
        try:
            while len(self._buffer) <= self._max:
                if not await self._receive():
                    break
            else:
                await anyio.sleep_forever()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        self._gone = True
        scope.cancel()


class ControlServer:
    """Serves the control protocol on a Unix socket, one task per connection.

    `limits` default to the handler's ``socket_limits`` attribute when it has one (the
    control API carries the daemon's ``[daemon]`` settings), else to `SocketLimits()`.
    """

    def __init__(
        self,
        path: Path,
        handler: Handler,
        *,
        mode: int = 0o600,
        group: str | int | None = None,
        max_message: int = DEFAULT_MAX_MESSAGE,
        limits: SocketLimits | None = None,
    ) -> None:
        if max_message < 64:
            raise ValueError(f"max_message must be at least 64 bytes, got {max_message}")
        if limits is None:
            carried = getattr(handler, "socket_limits", None)
            limits = carried if isinstance(carried, SocketLimits) else SocketLimits()
        self.path = Path(path)
        self.handler = handler
        self.mode = mode
        self.group = group
        self.max_message = max_message
        self.limits = limits
        self._occ = Occupancy(limits)

    @property
    def connections(self) -> int:
        """The number of client connections open right now."""
        return self._occ.connections

    @property
    def buffered(self) -> int:
        """Bytes of partial request lines held right now (within the budget)."""
        return self._occ.budget.held

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on the socket and serve until cancelled.

        Binds the path (a stale socket file is removed only when nothing answers on it;
        a live one or a non-socket file raises `ControlSocketError`), applies the group
        and mode, reports readiness through `task_status`, and on exit (cancellation
        included) removes the socket file if it is still the one it bound. Cancellation
        cancels every connection and running handler.
        """
        listener, identity = await self._bind()
        try:
            async with listener, anyio.create_task_group() as tg:
                logger.info(
                    "control.listening",
                    path=str(self.path),
                    mode=oct(self.mode),
                    group=self.group,
                    max_connections=self.limits.max_connections,
                    max_connections_per_uid=self.limits.max_connections_per_uid,
                )
                task_status.started()
                while True:
                    try:
                        stream = await listener.accept()
                    except anyio.BrokenResourceError as exc:
                        cause = exc.__cause__
                        if not (
                            isinstance(cause, OSError) and cause.errno in _TRANSIENT_ACCEPT_ERRNOS
                        ):
                            raise
                        logger.warning("control.accept_failed", error=str(cause))
                        await anyio.sleep(0.1)
                        continue
                    self._admit(stream, tg.start_soon)
        finally:
            self._remove_socket(identity)
            logger.info("control.closed", path=str(self.path))

    def _admit(self, stream: anyio.abc.SocketStream, start: Callable[..., object]) -> None:
        """Serve an accepted connection, or refuse it (one ``busy`` line) over a cap."""
        try:
            peer = peer_credentials(stream)
        except OSError as exc:
            logger.warning("control.peercred_failed", error=str(exc))
            start(stream.aclose)
            return
        refusal = self._occ.refusal(peer.uid)
        if refusal is not None:
            self._log_refusal(peer, *refusal)
            start(self._refuse, stream, refusal[1])
            return
        self._occ.opened(peer.uid)  # counted at once, so a burst cannot overshoot the cap
        start(self._serve_connection, stream, peer)

    def _log_refusal(self, peer: Peer, reason: str, message: str) -> None:
        count = self._occ.refusals.note(peer.uid, reason, anyio.current_time())
        if count is not None:
            logger.warning(
                "control.refused",
                reason=reason,
                peer_uid=peer.uid,
                peer_pid=peer.pid,
                connections=self._occ.connections,
                uid_connections=self._occ.by_uid.get(peer.uid, 0),
                refused_since_last=count,
            )

    async def _refuse(self, stream: anyio.abc.SocketStream, message: str) -> None:
        async with stream:
            with anyio.move_on_after(_REFUSE_WRITE_S):
                with contextlib.suppress(
                    anyio.BrokenResourceError, anyio.ClosedResourceError, OSError
                ):
                    await stream.send(error_line(None, "busy", message))

    async def _serve_connection(self, stream: anyio.abc.SocketStream, peer: Peer) -> None:
        """Serve one client; never lets an error escape into the server."""
        log = logger.bind(peer_uid=peer.uid, peer_gid=peer.gid, peer_pid=peer.pid)
        try:
            async with stream:
                connection = _Connection(
                    stream, peer, self.handler, self.max_message, self._occ, log
                )
                await connection.run()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            log.debug("control.client_gone")
        except _Stalled:
            log.warning("control.write_timeout", timeout_s=self.limits.write_timeout_s)
        except Exception:
            log.exception("control.connection_failed")
        finally:
            self._occ.closed(peer.uid)

    async def _bind(self) -> tuple[anyio.abc.SocketListener, tuple[int, int]]:
        """Bind and listen; the socket file's (st_dev, st_ino) identifies it for removal."""
        sock, identity = await bind_unix_socket(self.path, self.mode, self.group)
        try:
            listener = await anyio.abc.SocketListener.from_socket(sock)
        except BaseException:
            sock.close()
            remove_socket_file(self.path, identity)
            raise
        return listener, identity

    def _remove_socket(self, identity: tuple[int, int]) -> None:
        remove_socket_file(self.path, identity)


async def bind_unix_socket(
    path: Path, mode: int, group: str | int | None
) -> tuple[socket.socket, tuple[int, int]]:
    """A listening Unix socket at `path` with `group` and `mode`, and its file's identity
    (st_dev, st_ino) for `remove_socket_file`.

    A stale socket file is removed only when nothing answers on it; a live one or a
    non-socket file raises `ControlSocketError`. (The dashboard binds its socket so too.)
    """
    gid = _group_id(path, group)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        try:
            sock.bind(str(path))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ControlSocketError(path, f"cannot bind: {exc.strerror}") from exc
            await _remove_stale(path)
            try:
                sock.bind(str(path))
            except OSError as exc2:
                raise ControlSocketError(path, f"cannot bind: {exc2.strerror}") from exc2
        bound = True
        try:
            if gid is not None:
                os.chown(path, -1, gid)
            os.chmod(path, mode)
            st = os.stat(path)
            sock.listen(_BACKLOG)
        except OSError as exc:
            raise ControlSocketError(path, f"cannot set up the socket: {exc.strerror}") from exc
    except BaseException:
        sock.close()
        if bound:
            _unlink(path)
        raise
    return sock, (st.st_dev, st.st_ino)


def _group_id(path: Path, group: str | int | None) -> int | None:
    if group is None or isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ControlSocketError(path, f"the socket group {group!r} does not exist") from None


async def _remove_stale(path: Path) -> None:
    """Remove a socket file nothing listens on; refuse a live socket or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlSocketError(path, "the path exists and is not a socket; not removing it")
    try:
        with anyio.fail_after(_PROBE_TIMEOUT):
            probe = await anyio.connect_unix(path)
    except (ConnectionRefusedError, FileNotFoundError):
        pass
    except TimeoutError:
        raise ControlSocketError(
            path,
            f"something holds the socket but did not accept within {_PROBE_TIMEOUT:g} s; "
            "not removing it",
        ) from None
    except OSError as exc:
        raise ControlSocketError(
            path, f"cannot tell whether another daemon listens on it ({exc.strerror})"
        ) from exc
    else:
        await probe.aclose()
        raise ControlSocketError(
            path,
            "another llmd-supervisor daemon is already listening on it; stop that daemon "
            "or configure a different socket path",
        )
    # The daemon's single-instance lock on its state directory closes the window
    # between this probe and the unlink.
    _unlink(path)
    logger.info("control.stale_socket_removed", path=str(path))


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def remove_socket_file(path: Path, identity: tuple[int, int]) -> None:
    """Unlink the socket file unless something else has replaced it since binding."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity:
        path.unlink(missing_ok=True)
