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
- ``"peer"``: the `Peer` of a Unix-socket connection (SO_PEERCRED), None on TCP.

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
from collections.abc import Callable, Generator, Sequence
from typing import Any, Final

import anyio
import anyio.abc
import structlog
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmd_supervisor.adapters.control_server import socket_peer
from llmd_supervisor.errors import ConfigError

__all__ = ["STOP_GRACE_S", "bind_tcp", "parse_listen", "serve_asgi"]

log = structlog.get_logger("llmd_supervisor.adapters.web_server")

STOP_GRACE_S: Final = 2.0
_BACKLOG: Final = 128
KEEP_ALIVE_S: Final = 5  # an idle keep-alive connection is closed after this
MAX_CONNECTIONS: Final = 256  # concurrent connections and requests; more get 503
MAX_HEADER_BYTES: Final = 64 << 10  # h11's bound on a request's head


class _PeerProtocol(H11Protocol):
    """uvicorn's h11 protocol, telling the app which listener a connection came through and,
    on a Unix socket, who the peer is."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        raw = transport.get_extra_info("socket")
        peer = None
        listener = "tcp"
        if raw is not None and raw.family == socket.AF_UNIX:
            listener = "unix"
            try:
                # asyncio hands out a TransportSocket; getsockopt is all we need of it
                peer = socket_peer(raw)
            except OSError as exc:
                log.warning("web.peercred_failed", error=str(exc))
                transport.close()
                return
        # A copy per connection: the app's state dict is the server's, shared.
        self.app_state = {**self.app_state, "listener": listener, "peer": peer}


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


def _config(app: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http=_PeerProtocol,
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=int(STOP_GRACE_S),
        limit_concurrency=MAX_CONNECTIONS,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )


async def serve_asgi(
    app: Any,
    sockets: Sequence[socket.socket],
    *,
    name: str,
    on_stop: Callable[[], None] = lambda: None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on `sockets` (bound and listening) until cancelled; see the module
    docstring. Ready (`task_status`) once uvicorn accepts on every socket."""
    _route_uvicorn_logs()
    server = _Server(_config(app))
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
