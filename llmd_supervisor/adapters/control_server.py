"""Control socket server: listens on the Unix socket, one task per connection.

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

import errno
import grp
import os
import socket
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import anyio
import anyio.abc
import anyio.lowlevel
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from llmd_supervisor.adapters.control_protocol import (
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
from llmd_supervisor.errors import ControlError, ControlSocketError

__all__ = ["ControlServer", "peer_credentials"]

logger = structlog.get_logger("llmd_supervisor.adapters.control_server")

# struct ucred from <sys/socket.h>: pid_t pid; uid_t uid; gid_t gid.
_UCRED: Final = struct.Struct("3i")
_BACKLOG: Final = 128
_PROBE_TIMEOUT: Final = 2.0
# accept() failures that mean "out of resources for now", not "the listener is broken".
_TRANSIENT_ACCEPT_ERRNOS: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
)


def peer_credentials(stream: anyio.abc.SocketStream) -> Peer:
    """The peer's uid, gid and pid from SO_PEERCRED on an accepted Unix socket."""
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    data = raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(data)
    return Peer(uid=uid, gid=gid, pid=pid)


class _Connection:
    """One accepted client: reads request lines, dispatches them, writes replies."""

    def __init__(
        self,
        stream: anyio.abc.SocketStream,
        peer: Peer,
        handler: Handler,
        max_message: int,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._peer = peer
        self._handler = handler
        self._max = max_message
        self._log = log
        self._write_lock = anyio.Lock()
        self._gone = False

    async def run(self) -> None:
        """Serve requests until the client closes, sends an over-long line or goes away."""
        while True:
            try:
                # One byte over the bound proves the line is too long; a line that arrived
                # whole in one read can overshoot, hence the length check below.
                line = await self._reader.receive_until(b"\n", self._max + 1)
            except anyio.DelimiterNotFound:
                await self._too_large()
                return
            except anyio.IncompleteRead:
                if self._reader.buffer:
                    self._log.debug("control.partial_line_dropped", size=len(self._reader.buffer))
                return
            if len(line) > self._max:
                await self._too_large()
                return
            try:
                request = decode_request(line)
            except RequestRejected as exc:
                self._log.debug(
                    "control.request_rejected", request_id=exc.request_id, code=exc.code
                )
                await self._write(error_line(exc.request_id, exc.code, exc.message))
                continue
            if not await self._dispatch(request):
                return

    async def _too_large(self) -> None:
        self._log.warning("control.too_large", max_message=self._max)
        await self._write(
            error_line(
                None,
                "too_large",
                f"Request line exceeds the {self._max}-byte message bound; closing the "
                "connection because the rest of the line cannot be resynchronised.",
            )
        )

    async def _write(self, data: bytes) -> None:
        async with self._write_lock:
            await self._stream.send(data)

    async def _dispatch(self, request: Request) -> bool:
        """Run one request to its final reply; False when the connection must close."""
        self._log.debug("control.request", request_id=request.id, op=request.op)
        if not OPS[request.op].streaming:
            await self._write(await self._call(request, self._no_stream(request)))
            return True
        reply: bytes | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_for_disconnect, tg.cancel_scope)
            reply = await self._call(request, self._stream_sender(request, tg.cancel_scope))
            tg.cancel_scope.cancel()
        if self._gone or reply is None:
            self._log.info("control.client_gone", request_id=request.id, op=request.op)
            return False
        await self._write(reply)
        return True

    async def _call(self, request: Request, send: Send) -> bytes:
        """The handler's outcome as a final reply line; cancellation passes through."""
        try:
            result = await self._handler.handle(request, self._peer, send)
        except ControlError as exc:
            return error_line(request.id, exc.code, exc.message)
        except Exception as exc:
            self._log.exception("control.handler_failed", request_id=request.id, op=request.op)
            return self._internal(request, f"{type(exc).__name__}: {exc}")
        try:
            if not isinstance(result, Mapping):
                raise TypeError(f"handler returned {type(result).__name__}, not a mapping")
            line = encode(
                {"v": PROTOCOL_VERSION, "id": request.id, "ok": True, "result": dict(result)}
            )
        except (TypeError, ValueError, RecursionError) as exc:
            self._log.exception("control.handler_failed", request_id=request.id, op=request.op)
            return self._internal(request, f"its result cannot be sent as JSON ({exc})")
        if len(line) - 1 > self._max:
            self._log.error(
                "control.handler_failed",
                request_id=request.id,
                op=request.op,
                reason="result too large",
                size=len(line) - 1,
            )
            return self._internal(
                request, f"its result is {len(line) - 1} bytes, over the {self._max}-byte bound"
            )
        return line

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
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # The client is gone: cancel the handler rather than report a write error.
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
            while len(self._reader.buffer) <= self._max:
                self._reader.feed_data(await self._stream.receive())
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._gone = True
            scope.cancel()
            return
        await anyio.sleep_forever()


class ControlServer:
    """Serves the control protocol on a Unix socket, one task per connection."""

    def __init__(
        self,
        path: Path,
        handler: Handler,
        *,
        mode: int = 0o660,
        group: str | int | None = None,
        max_message: int = DEFAULT_MAX_MESSAGE,
    ) -> None:
        if max_message < 64:
            raise ValueError(f"max_message must be at least 64 bytes, got {max_message}")
        self.path = Path(path)
        self.handler = handler
        self.mode = mode
        self.group = group
        self.max_message = max_message
        self._connections = 0

    @property
    def connections(self) -> int:
        """The number of client connections open right now."""
        return self._connections

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
                    "control.listening", path=str(self.path), mode=oct(self.mode), group=self.group
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
                    tg.start_soon(self._serve_connection, stream)
        finally:
            self._remove_socket(identity)
            logger.info("control.closed", path=str(self.path))

    async def _serve_connection(self, stream: anyio.abc.SocketStream) -> None:
        """Serve one client; never lets an error escape into the server."""
        async with stream:
            try:
                peer = peer_credentials(stream)
            except OSError as exc:
                logger.warning("control.peercred_failed", error=str(exc))
                return
            log = logger.bind(peer_uid=peer.uid, peer_gid=peer.gid, peer_pid=peer.pid)
            connection = _Connection(stream, peer, self.handler, self.max_message, log)
            self._connections += 1
            try:
                await connection.run()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                log.debug("control.client_gone")
            except Exception:
                log.exception("control.connection_failed")
            finally:
                self._connections -= 1

    async def _bind(self) -> tuple[anyio.abc.SocketListener, tuple[int, int]]:
        """Bind and listen; the socket file's (st_dev, st_ino) identifies it for removal."""
        gid = self._group_id()
        path = str(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = False
        try:
            try:
                sock.bind(path)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise ControlSocketError(self.path, f"cannot bind: {exc.strerror}") from exc
                await self._remove_stale()
                try:
                    sock.bind(path)
                except OSError as exc2:
                    raise ControlSocketError(self.path, f"cannot bind: {exc2.strerror}") from exc2
            bound = True
            try:
                if gid is not None:
                    os.chown(path, -1, gid)
                os.chmod(path, self.mode)
                st = os.stat(path)
                sock.listen(_BACKLOG)
            except OSError as exc:
                raise ControlSocketError(
                    self.path, f"cannot set up the socket: {exc.strerror}"
                ) from exc
            listener = await anyio.abc.SocketListener.from_socket(sock)
        except BaseException:
            sock.close()
            if bound:
                self.path.unlink(missing_ok=True)
            raise
        return listener, (st.st_dev, st.st_ino)

    def _group_id(self) -> int | None:
        if self.group is None or isinstance(self.group, int):
            return self.group
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise ControlSocketError(
                self.path, f"the socket group {self.group!r} does not exist"
            ) from None

    async def _remove_stale(self) -> None:
        """Remove a socket file nothing listens on; refuse a live socket or a non-socket."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketError(
                self.path, "the path exists and is not a socket; not removing it"
            )
        try:
            with anyio.fail_after(_PROBE_TIMEOUT):
                probe = await anyio.connect_unix(self.path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass
        except TimeoutError:
            raise ControlSocketError(
                self.path,
                f"something holds the socket but did not accept within {_PROBE_TIMEOUT:g} s; "
                "not removing it",
            ) from None
        except OSError as exc:
            raise ControlSocketError(
                self.path, f"cannot tell whether another daemon listens on it ({exc.strerror})"
            ) from exc
        else:
            await probe.aclose()
            raise ControlSocketError(
                self.path,
                "another llmd-supervisor daemon is already listening on it; stop that daemon "
                "or configure a different socket path",
            )
        # The daemon's single-instance lock on its state directory closes the window
        # between this probe and the unlink.
        self.path.unlink(missing_ok=True)
        logger.info("control.stale_socket_removed", path=str(self.path))

    def _remove_socket(self, identity: tuple[int, int]) -> None:
        """Unlink the socket file unless something else has replaced it since binding."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == identity:
            self.path.unlink(missing_ok=True)
