"""HTTP serving for the daemon: uvicorn on sockets the daemon bound itself, on its loop.

`serve_asgi` runs one uvicorn `Server` for an ASGI app inside the caller's task group, on
listening sockets bound beforehand (`bind_tcp`, and `control_server.bind_unix_socket` for
a Unix socket: same stale-file and mode rules as the control socket). uvicorn's own signal
handling is off (the daemon root owns SIGTERM/SIGINT), so are its lifespan events, its
logging configuration (its warnings become ``web.server_message`` events), its access
log and its proxy-header trust.

Every request's ASGI scope carries in ``scope["state"]``:

- ``"listener"``: ``"unix"`` or ``"tcp"``, from the accepted socket's family (never from a
  header), and
- ``"peer"``: the `Peer` of a Unix-socket connection (SO_PEERCRED), None on TCP, and
- ``"source"``: the source address of a TCP connection, None on a Unix socket.

Limits (`WebLimits`, the dashboard's keys; the metrics endpoint keeps the defaults): each
listener (the Unix socket, TCP) has its own cap on open connections, and within it a cap
per peer: per uid (SO_PEERCRED) on the Unix socket, per source address on TCP (the control
socket's `Caps`). A connection over a cap is answered 503 with the reason and closed
(logged as ``web.refused``, at most once per peer and reason every 10 s). A request head
must be whole within ``head_timeout_s`` of the connection (or of the previous response on
a kept-alive one): otherwise the connection is answered 408 and closed
(``web.head_timeout``, rate-limited the same way). uvicorn has no such timeout of its own;
without it a peer holding unfinished heads would hold its connections for ever. A request
body still arriving once its response is complete closes the connection (no app here
reads bodies).

Cancellation contract: when `serve_asgi` is cancelled it calls `on_stop` (so that
long-lived responses, server-sent event streams, can end by themselves), stops accepting,
closes idle connections, gives running responses `STOP_GRACE_S` and then cancels what is
left, all inside a shielded scope, and closes the listening sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import Any, ClassVar, Final

import anyio
import anyio.abc
import h11
import structlog
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmd_supervisor.adapters.control.limits import Caps, RefusalLog
from llmd_supervisor.adapters.control.server import socket_peer
from llmd_supervisor.core.config import WebLimits
from llmd_supervisor.errors import ConfigError

__all__ = ["STOP_GRACE_S", "bind_tcp", "parse_listen", "serve_asgi"]

log = structlog.get_logger("llmd_supervisor.adapters.web_server")

STOP_GRACE_S: Final = 2.0
_BACKLOG: Final = 128
KEEP_ALIVE_S: Final = 5  # an idle keep-alive connection is closed after this
MAX_HEADER_BYTES: Final = 64 << 10  # h11's bound on a request's head
LINGER_S: Final = 1.0  # a refused connection is read (and dropped) this long at most
_PHRASES: Final = {408: "Request Timeout", 503: "Service Unavailable"}
LISTENERS: Final = ("unix", "tcp")


class _Admission:
    """One server's caps (connections per listener and per peer in it), its head timeout,
    and the rate limit of their log lines."""

    def __init__(self, name: str, limits: WebLimits, *, configured: bool) -> None:
        self.name = name
        self.limits = limits
        where = {"unix": "Unix socket", "tcp": "TCP listener"}
        per = {"unix": "per-user", "tcp": "per-address"}
        self.caps: dict[str, Caps[Hashable]] = {
            kind: Caps(
                limits.max_connections,
                limits.max_connections_per_peer,
                holder=f"The {name}'s {where[kind]}",
                what="connections",
                keys=(f"{name}.max_connections", f"{name}.max_connections_per_peer"),
                per=per[kind],
                fixed=not configured,
            )
            for kind in LISTENERS
        }
        self.quiet = RefusalLog()

    def note(self, event: str, now: float, listener: str, shown: str, reason: str) -> None:
        """Log `event` for this peer and reason, at most once every 10 s (with the count)."""
        since = self.quiet.note((listener, shown), reason, now)
        if since is None:
            return
        caps = self.caps[listener]
        if reason == "head_timeout":
            log.info(
                event,
                server=self.name,
                listener=listener,
                peer=shown,
                timeout_s=self.limits.head_timeout_s,
                since_last=since,
            )
            return
        log.warning(
            event,
            server=self.name,
            listener=listener,
            peer=shown,
            reason=reason,
            connections=caps.held,
            since_last=since,
        )


class _PeerProtocol(H11Protocol):
    """uvicorn's h11 protocol, telling the app which listener a connection came through and,
    on a Unix socket, who the peer is; refusing a connection over a cap and closing one
    whose request head is not whole in time."""

    admission: ClassVar[_Admission]  # set on each server's own subclass (`_protocol`)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._held: tuple[Caps[Hashable], Hashable] | None = None
        raw = transport.get_extra_info("socket")
        peer = None
        source = None
        if raw is not None and raw.family == socket.AF_UNIX:
            listener = "unix"
            try:
                # asyncio hands out a TransportSocket; getsockopt is all we need of it
                peer = socket_peer(raw)
            except OSError as exc:
                log.warning("web.peercred_failed", error=str(exc))
                transport.close()
                return
            key: Hashable = peer.uid
            shown = f"uid {peer.uid}"
        else:
            listener = "tcp"
            source = self.client[0] if self.client else "?"
            key = shown = source
        self._listener, self._shown = listener, shown
        caps = self.admission.caps[listener]
        refusal = caps.refusal(key, shown)
        if refusal is not None:
            reason, message = refusal
            self.admission.note("web.refused", self.loop.time(), listener, shown, reason)
            self._answer_and_close(503, message)
            return
        caps.opened(key)
        self._held = (caps, key)
        # A copy per connection: the app's state dict is the server's, shared.
        self.app_state = {**self.app_state, "listener": listener, "peer": peer, "source": source}
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (getattr(self, "_head_timer", None), getattr(self, "_linger", None)):
            if timer is not None:
                timer.cancel()
        held = getattr(self, "_held", None)
        if held is not None:
            self._held = None
            held[0].closed(held[1])
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # answered and closing: what the peer still sends is dropped
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY:
            # Answered, and the request's body still coming: no app here reads one (GET and
            # HEAD only), and trickled bytes would stop uvicorn's keep-alive timer for ever.
            self.transport.close()
            return
        self._watch_head()

    def _watch_head(self) -> None:
        """A timer while a request head is awaited (the peer's h11 state is IDLE), none
        while a request is served."""
        if self.transport.is_closing() or self._linger is not None:
            return
        if self.conn.their_state is h11.IDLE:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(
                    self.admission.limits.head_timeout_s, self._head_timed_out
                )
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        seconds = self.admission.limits.head_timeout_s
        key = f"{self.admission.name}.head_timeout_s"
        self.admission.note(
            "web.head_timeout", self.loop.time(), self._listener, self._shown, "head_timeout"
        )
        self._answer_and_close(
            408,
            f"Closing the connection: no whole request head arrived within {seconds:g} s ({key}).",
        )

    def _answer_and_close(self, status: int, message: str) -> None:
        """A plain-text answer outside h11 (no request was read), then a lingering close:
        the write side ends at once, what the peer still sends is dropped for at most
        `LINGER_S` (closing with unread bytes would reset the connection, and the peer
        might never read the answer)."""
        body = (message + "\n").encode()
        head = (
            f"HTTP/1.1 {status} {_PHRASES[status]}\r\n"
            "content-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)


class _ToStructlog(logging.Handler):
    """uvicorn's own warnings (a malformed request, say) as events of the daemon's log."""

    def emit(self, record: logging.LogRecord) -> None:
        log.log(
            record.levelno,
            "web.server_message",
            logger=record.name,
            message=record.getMessage(),
            exc_info=record.exc_info or False,
        )


def _route_uvicorn_logs() -> None:
    """Send uvicorn's loggers to structlog once (not to stderr as plain text)."""
    root = logging.getLogger("uvicorn")
    if not any(isinstance(h, _ToStructlog) for h in root.handlers):
        root.addHandler(_ToStructlog(logging.WARNING))
        root.setLevel(logging.WARNING)
        root.propagate = False


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to the daemon."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        return None


def parse_listen(listen: str) -> tuple[str, int]:
    """`host:port` of a validated loopback address as a bind address."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def bind_tcp(listen: str, key: str) -> socket.socket:
    """A listening TCP socket on the loopback `listen`; `ConfigError` naming `key` when it
    cannot be bound."""
    host, port = parse_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(key, listen, f"it cannot be resolved ({exc.strerror or exc})") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            key, listen, f"it cannot be bound ({exc.strerror or exc}); pick a free loopback port"
        ) from exc
    sock.setblocking(False)
    return sock


def _protocol(admission: _Admission) -> type[_PeerProtocol]:
    """The protocol class of one server: its own admission state."""

    class _Admitted(_PeerProtocol):
        pass

    _Admitted.admission = admission
    return _Admitted


def _config(app: Any, admission: _Admission) -> uvicorn.Config:
    # No limit_concurrency: the caps are per listener and per peer (`_Admission`), and
    # uvicorn's one count would also hold the refused connections still lingering.
    return uvicorn.Config(
        app,
        http=_protocol(admission),
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=int(STOP_GRACE_S),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )


async def serve_asgi(
    app: Any,
    sockets: Sequence[socket.socket],
    *,
    name: str,
    limits: WebLimits | None = None,
    on_stop: Callable[[], None] = lambda: None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on `sockets` (bound and listening) until cancelled; see the module
    docstring. `limits`: the ``[name]`` section's keys (None: the defaults, which no key
    changes). Ready (`task_status`) once uvicorn accepts on every socket."""
    _route_uvicorn_logs()
    admission = _Admission(name, limits or WebLimits(), configured=limits is not None)
    server = _Server(_config(app, admission))
    server.config.load()
    server.lifespan = server.config.lifespan_class(server.config)
    try:
        await server.startup(sockets=list(sockets))
        log.info("web.listening", server=name, sockets=[_shown(s) for s in sockets])
        task_status.started()
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(server, on_stop)
        for s in sockets:
            s.close()
        log.info("web.closed", server=name)


async def _stop(server: _Server, on_stop: Callable[[], None]) -> None:
    """Stop accepting, let responses end within STOP_GRACE_S, then cancel the rest."""
    on_stop()
    server.should_exit = True
    for s in getattr(server, "servers", []):
        s.close()
    state = server.server_state
    for connection in list(state.connections):
        connection.shutdown()
    with anyio.move_on_after(STOP_GRACE_S):
        # uvicorn signals neither set's emptying: look every 50 ms, for at most the grace
        while state.tasks or state.connections:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    for task in list(state.tasks):
        task.cancel()
    for connection in list(state.connections):
        transport = getattr(connection, "transport", None)
        if transport is not None:
            transport.close()


def _shown(s: socket.socket) -> str:
    try:
        name = s.getsockname()
    except OSError:
        return "?"
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name)
