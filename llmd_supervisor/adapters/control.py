"""Control socket: the daemon's local API over a Unix socket, and the client the CLI uses.

Wire protocol (version 1)
-------------------------
Newline-delimited JSON over a Unix stream socket, UTF-8, one JSON object per line.

Request::

    {"v": 1, "id": <int or str>, "op": "<op>", "args": {...}}

``args`` may be omitted when empty. Replies carry ``v`` and the request's ``id``:

* final success: ``{"v": 1, "id": ..., "ok": true, "result": {...}}``
* stream item (streaming ops only, zero or more before the final reply):
  ``{"v": 1, "id": ..., "stream": {...}}``
* error: ``{"v": 1, "id": ... or null, "ok": false, "error": {"code": ..., "message": ...}}``;
  ``id`` is null when the request's id could not be read. Codes are in `ERROR_CODES`.

Every request line gets exactly one final reply (success or error). Requests on one
connection are handled one after another, in order; a client may pipeline them, and a
streaming request occupies the connection until its final reply.

Message bound: a line (without its newline) may be at most ``max_message`` bytes (1 MiB by
default) in either direction. An over-long request line gets a ``too_large`` error with a
null id and the connection is then closed: the rest of that line is still in flight and
there is no way to tell where the next request starts. Malformed JSON, a non-object, a
wrong version, an unknown op or wrong argument types get an error reply and the connection
stays usable. The schema in `OPS` is checked strictly before a handler sees a request:
unknown argument keys are refused, booleans are not integers, and optional arguments that
were not sent are filled in with their defaults.

Cancellation contract: when the client closes its end while a streaming request runs (or a
stream item cannot be written), the handler is cancelled and the connection is closed. A
non-streaming request always runs to completion, even if the client goes away, so that a
killed CLI cannot leave a ``submit`` or ``cancel`` half-done. When `ControlServer.serve` is
cancelled, every connection and running handler is cancelled with it and the socket file is
removed. A handler's exception becomes an ``internal`` error reply (logged as
``control.handler_failed``); nothing a client sends can stop the server.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import socket
import stat
import struct
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Final, NoReturn, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from llmd_supervisor.errors import (
    ControlError,
    ControlProtocolError,
    ControlSocketError,
    DaemonUnreachable,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE",
    "ERROR_CODES",
    "OPS",
    "PROTOCOL_VERSION",
    "ArgSpec",
    "ControlClient",
    "ControlError",
    "ControlServer",
    "Handler",
    "OpSpec",
    "Peer",
    "Request",
    "Send",
    "decode_request",
    "may_access",
    "peer_credentials",
]

logger = structlog.get_logger(__name__)

PROTOCOL_VERSION: Final = 1
DEFAULT_MAX_MESSAGE: Final = 1 << 20

ERROR_CODES: Final = frozenset(
    {
        "bad_json",  # the line is not UTF-8 JSON (or is empty)
        "bad_request",  # wrong, missing or unknown field, or a wrong type; the message names it
        "unsupported_version",  # "v" is an integer other than PROTOCOL_VERSION
        "unknown_op",  # "op" is a string that is not in OPS
        "too_large",  # the line exceeds the message bound; the connection is closed
        "not_found",  # the run (or rank) does not exist
        "forbidden",  # the peer may not act on this run (see may_access)
        "conflict",  # the run is in a state that does not allow the op
        "internal",  # the daemon failed; details are in its log
    }
)

# struct ucred from <sys/socket.h>: pid_t pid; uid_t uid; gid_t gid.
_UCRED: Final = struct.Struct("3i")
_BACKLOG: Final = 128
_PROBE_TIMEOUT: Final = 2.0
# accept() failures that mean "out of resources for now", not "the listener is broken".
_TRANSIENT_ACCEPT_ERRNOS: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
)
_SHOWN_VALUE_MAX: Final = 60


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class ArgSpec:
    """One argument of an op: the JSON kinds it accepts, and its default when optional."""

    kinds: frozenset[str]  # subset of {"str", "bool", "int", "null"}
    required: bool = False
    default: object = None


@dataclass(frozen=True)
class OpSpec:
    """One op: its arguments and whether it sends stream items before the final reply."""

    args: Mapping[str, ArgSpec]
    streaming: bool = False


_STR: Final = frozenset({"str"})
_BOOL: Final = frozenset({"bool"})
_RUN: Final = ArgSpec(_STR, required=True)

# The one table of the protocol's ops.
OPS: Final[Mapping[str, OpSpec]] = MappingProxyType(
    {
        "ping": OpSpec({}),
        "submit": OpSpec(
            {
                "spec_toml": ArgSpec(_STR, required=True),
                "spec_path": ArgSpec(_STR, default=None),  # only for messages
                "dry_run": ArgSpec(_BOOL, default=False),
                # None: the daemon's first configured cluster
                "cluster": ArgSpec(frozenset({"str", "null"}), default=None),
            }
        ),
        "list": OpSpec({"all": ArgSpec(_BOOL, default=False)}),
        "status": OpSpec({"run": _RUN}),
        "logs": OpSpec(
            {
                "run": _RUN,
                "rank": ArgSpec(frozenset({"int", "null"}), default=None),
                "follow": ArgSpec(_BOOL, default=False),
            },
            streaming=True,
        ),
        "cancel": OpSpec({"run": _RUN}),
        "wait": OpSpec({"run": _RUN}, streaming=True),
        "archive": OpSpec({"run": _RUN}),
    }
)

_TOP_LEVEL_KEYS: Final = frozenset({"v", "id", "op", "args"})
_KIND_WORDS: Final = {
    "str": "a string",
    "bool": "a boolean",
    "int": "an integer",
    "null": "null",
    "float": "a non-integer number",
    "array": "an array",
    "object": "an object",
}


@dataclass(frozen=True)
class Peer:
    """The connecting process, as the kernel reports it (SO_PEERCRED)."""

    uid: int
    gid: int
    pid: int


@dataclass(frozen=True)
class Request:
    """A request that passed schema validation; `args` holds every argument of the op."""

    id: int | str
    op: str
    args: Mapping[str, object]


Send = Callable[[Mapping[str, object]], Awaitable[None]]


class Handler(Protocol):
    """What the daemon plugs into `ControlServer`."""

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        """Return the final result; raise `ControlError` for an error reply.

        `send` emits one stream item (streaming ops only; a stream item must not have a
        top-level ``"final"`` key, which the client reserves). It is cancelled, like the
        handler, when the client goes away.
        """
        ...


class _Rejected(ControlError):
    """A request refused before dispatch, with whatever id could be read from it."""

    def __init__(self, request_id: int | str | None, code: str, message: str) -> None:
        super().__init__(code, message)
        self.request_id = request_id


def _kind(value: object) -> str:
    """The JSON kind of a decoded value, with bool and int kept apart."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _show(value: object) -> str:
    """Render a client's value for an error message, short enough to stay within any bound."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= _SHOWN_VALUE_MAX else text[: _SHOWN_VALUE_MAX - 3] + "..."


def _expect(kinds: frozenset[str]) -> str:
    return " or ".join(_KIND_WORDS.get(k, k) for k in sorted(kinds, key=lambda k: k == "null"))


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {_show(key)}")
        obj[key] = value
    return obj


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not allowed in JSON")


def decode_request(line: bytes) -> Request:
    """Parse and validate one request line (without its newline); pure.

    Raises a `ControlError` whose ``request_id`` attribute is the request's id when it could
    be read (None otherwise).
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Rejected(
            None,
            "bad_json",
            f"Request is not valid UTF-8: byte 0x{line[exc.start]:02x} at offset {exc.start}.",
        ) from None
    if not text.strip():
        raise _Rejected(None, "bad_json", "Request line is empty; send one JSON object per line.")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
    except RecursionError:
        raise _Rejected(None, "bad_json", "Request JSON is nested too deeply.") from None
    except ValueError as exc:
        raise _Rejected(None, "bad_json", f"Request is not valid JSON: {exc}.") from None
    if not isinstance(obj, dict):
        raise _Rejected(
            None,
            "bad_request",
            f"Request must be a JSON object, got {_KIND_WORDS[_kind(obj)]} {_show(obj)}.",
        )

    if "id" not in obj:
        raise _Rejected(None, "bad_request", "Request field 'id' is missing.")
    request_id = obj["id"]
    if not isinstance(request_id, int | str) or isinstance(request_id, bool):
        raise _Rejected(
            None,
            "bad_request",
            f"Request field 'id' must be an integer or a string, got {_show(request_id)}.",
        )

    def reject(code: str, message: str) -> NoReturn:
        raise _Rejected(request_id, code, message)

    if "v" not in obj:
        reject(
            "bad_request", f"Request field 'v' is missing; this daemon speaks {PROTOCOL_VERSION}."
        )
    version = obj["v"]
    if _kind(version) != "int":
        reject("bad_request", f"Request field 'v' must be an integer, got {_show(version)}.")
    if version != PROTOCOL_VERSION:
        reject(
            "unsupported_version",
            f"Protocol version {_show(version)} is not supported; "
            f"this daemon speaks version {PROTOCOL_VERSION}.",
        )
    for key in sorted(set(obj) - _TOP_LEVEL_KEYS):
        reject(
            "bad_request",
            f"Request field {_show(key)} is not part of protocol version {PROTOCOL_VERSION}; "
            "a request has v, id, op and args.",
        )

    if "op" not in obj:
        reject("bad_request", "Request field 'op' is missing.")
    op = obj["op"]
    if not isinstance(op, str):
        reject("bad_request", f"Request field 'op' must be a string, got {_show(op)}.")
    spec = OPS.get(op)
    if spec is None:
        reject("unknown_op", f"Unknown op {_show(op)}; known ops are {', '.join(sorted(OPS))}.")

    raw_args = obj.get("args", {})
    if not isinstance(raw_args, dict):
        reject("bad_request", f"Request field 'args' must be an object, got {_show(raw_args)}.")
    for key in sorted(set(raw_args) - set(spec.args)):
        takes = ", ".join(sorted(spec.args)) or "no arguments"
        reject(
            "bad_request",
            f"Request field 'args.{key}' is not an argument of op {op!r}; it takes {takes}.",
        )
    args: dict[str, object] = {}
    for name, arg in spec.args.items():
        if name not in raw_args:
            if arg.required:
                reject("bad_request", f"Request field 'args.{name}' is required for op {op!r}.")
            args[name] = arg.default
            continue
        value = raw_args[name]
        if _kind(value) not in arg.kinds:
            reject(
                "bad_request",
                f"Request field 'args.{name}' of op {op!r} must be {_expect(arg.kinds)}, "
                f"got {_show(value)}.",
            )
        args[name] = value
    return Request(id=request_id, op=op, args=MappingProxyType(args))


def _encode(message: Mapping[str, object]) -> bytes:
    """One protocol line. ASCII-only output, so any string a client sent can be echoed."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode("ascii") + b"\n"


def _error_line(request_id: int | str | None, code: str, message: str) -> bytes:
    return _encode(
        {
            "v": PROTOCOL_VERSION,
            "id": request_id,
            "ok": False,
            "error": {"code": code, "message": message},
        }
    )


# --------------------------------------------------------------------------- access


def peer_credentials(stream: anyio.abc.SocketStream) -> Peer:
    """The peer's uid, gid and pid from SO_PEERCRED on an accepted Unix socket."""
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    data = raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(data)
    return Peer(uid=uid, gid=gid, pid=pid)


def may_access(peer: Peer, owner_uid: int, admin_group: str | int | None) -> bool:
    """Whether `peer` may read or act on a run owned by `owner_uid`.

    Allowed: root, the owner, and members of `admin_group` (by gid or name): the peer's
    gid, the user's primary group, or a supplementary membership by user name. An admin
    group that does not exist admits nobody. Group lookups go through NSS and may block
    when NSS is remote (LDAP, sssd).
    """
    if peer.uid in (0, owner_uid):
        return True
    if admin_group is None:
        return False
    if isinstance(admin_group, int):
        gid = admin_group
    else:
        try:
            gid = grp.getgrnam(admin_group).gr_gid
        except KeyError:
            return False
    if peer.gid == gid:
        return True
    try:
        user = pwd.getpwuid(peer.uid)
    except KeyError:
        return False
    if user.pw_gid == gid:
        return True
    try:
        if user.pw_name in grp.getgrgid(gid).gr_mem:
            return True
    except KeyError:
        return False
    # NSS backends that do not list members in the group entry still answer this.
    return gid in os.getgrouplist(user.pw_name, user.pw_gid)


# --------------------------------------------------------------------------- server


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
            except _Rejected as exc:
                self._log.debug(
                    "control.request_rejected", request_id=exc.request_id, code=exc.code
                )
                await self._write(_error_line(exc.request_id, exc.code, exc.message))
                continue
            if not await self._dispatch(request):
                return

    async def _too_large(self) -> None:
        self._log.warning("control.too_large", max_message=self._max)
        await self._write(
            _error_line(
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
            return _error_line(request.id, exc.code, exc.message)
        except Exception as exc:
            self._log.exception("control.handler_failed", request_id=request.id, op=request.op)
            return self._internal(request, f"{type(exc).__name__}: {exc}")
        try:
            if not isinstance(result, Mapping):
                raise TypeError(f"handler returned {type(result).__name__}, not a mapping")
            line = _encode(
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
        return _error_line(
            request.id,
            "internal",
            f"Internal error while handling op {request.op!r} (request id {_show(request.id)}): "
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
            line = _encode({"v": PROTOCOL_VERSION, "id": request.id, "stream": dict(item)})
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


# --------------------------------------------------------------------------- client


class ControlClient:
    """One connection to the daemon; requests on it run one at a time.

    No timeouts of its own: wrap calls in `anyio.fail_after` where needed.
    """

    def __init__(self, path: Path, *, max_message: int = DEFAULT_MAX_MESSAGE) -> None:
        self.path = Path(path)
        self.max_message = max_message
        self._stream: anyio.abc.SocketStream | None = None
        self._reader: BufferedByteReceiveStream | None = None
        self._next_id = 1
        self._busy = False

    async def __aenter__(self) -> ControlClient:
        try:
            stream = await anyio.connect_unix(self.path)
        except FileNotFoundError as exc:
            raise DaemonUnreachable(
                self.path, "no socket exists there, so the daemon is not running"
            ) from exc
        except ConnectionRefusedError as exc:
            raise DaemonUnreachable(
                self.path,
                "nothing listens on the socket (a stale file), so the daemon is not running",
            ) from exc
        except PermissionError as exc:
            raise DaemonUnreachable(
                self.path,
                "permission denied; the socket admits only its owner and group, so ask to be "
                "added to the daemon's socket group",
            ) from exc
        except OSError as exc:
            raise DaemonUnreachable(self.path, exc.strerror or str(exc)) from exc
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stream, self._stream, self._reader = self._stream, None, None
        if stream is not None:
            await stream.aclose()

    async def call(self, op: str, args: Mapping[str, object] | None = None) -> dict[str, object]:
        """Send one request and return its result; raise `ControlError` on an error reply.

        Stream items of a streaming op are discarded (so this does not return for
        ``logs`` with ``follow``).
        """
        async with aclosing(self.stream(op, args)) as replies:
            async for item in replies:
                if "final" in item and len(item) == 1:
                    final = item["final"]
                    assert isinstance(final, dict)  # checked in stream()
                    return final
        raise ControlProtocolError(self.path, f"op {op!r} ended without a final reply")

    async def stream(
        self, op: str, args: Mapping[str, object] | None = None
    ) -> AsyncGenerator[dict[str, object], None]:
        """Send one request; yield its stream items, then ``{"final": result}`` last.

        Raises `ControlError` on an error reply (the connection stays usable unless the
        code is ``too_large``). A stream item never has a top-level ``"final"`` key (the
        server enforces it). Abandoning the iteration before the final item leaves the
        connection busy: further requests on it raise `ControlProtocolError`; closing the
        client makes the daemon cancel the request.
        """
        if self._stream is None:
            raise ControlProtocolError(self.path, "the client is not connected (use `async with`)")
        if self._busy:
            raise ControlProtocolError(
                self.path, "a previous request on this connection has not finished"
            )
        request_id = self._next_id
        self._next_id += 1
        line = _encode(
            {"v": PROTOCOL_VERSION, "id": request_id, "op": op, "args": dict(args or {})}
        )
        if len(line) - 1 > self.max_message:
            raise ControlError(
                "too_large",
                f"Request for op {op!r} is {len(line) - 1} bytes, over the "
                f"{self.max_message}-byte message bound; it was not sent.",
            )
        self._busy = True
        try:
            await self._stream.send(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise ControlProtocolError(self.path, "the daemon closed the connection") from exc
        while True:
            reply = await self._receive(request_id)
            if "stream" in reply:
                item = reply["stream"]
                if not isinstance(item, dict):
                    raise ControlProtocolError(
                        self.path, f"stream item {_show(item)} is not an object"
                    )
                yield item
                continue
            ok = reply.get("ok")
            if ok is True:
                result = reply.get("result")
                if not isinstance(result, dict):
                    raise ControlProtocolError(
                        self.path, f"result {_show(result)} is not an object"
                    )
                self._busy = False
                yield {"final": result}
                return
            error = reply.get("error")
            if ok is False and isinstance(error, dict):
                code, message = error.get("code"), error.get("message")
                if isinstance(code, str) and isinstance(message, str):
                    self._busy = False
                    raise ControlError(code, message)
            raise ControlProtocolError(self.path, f"reply {_show(reply)} is not a protocol reply")

    async def _receive(self, request_id: int) -> dict[str, object]:
        """Read one reply line for `request_id`."""
        assert self._reader is not None
        try:
            line = await self._reader.receive_until(b"\n", self.max_message + 1)
        except anyio.DelimiterNotFound:
            raise ControlProtocolError(
                self.path, f"a reply exceeded the {self.max_message}-byte message bound"
            ) from None
        except (anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise ControlProtocolError(
                self.path, "the daemon closed the connection before its final reply"
            ) from None
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            raise ControlProtocolError(
                self.path, f"reply {_show(line[:80])} is not valid JSON"
            ) from None
        if not isinstance(reply, dict) or reply.get("v") != PROTOCOL_VERSION:
            raise ControlProtocolError(
                self.path, f"reply {_show(reply)} is not a version {PROTOCOL_VERSION} reply"
            )
        reply_id = reply.get("id")
        matches = type(reply_id) is int and reply_id == request_id
        if not matches and not (reply_id is None and reply.get("ok") is False):
            raise ControlProtocolError(
                self.path, f"reply id {_show(reply_id)} does not match request id {request_id}"
            )
        return reply
