"""Control socket client: one connection (`ControlClient`), and the reconnecting helpers a
waiting CLI uses to ride out a daemon restart (`resumable_stream`, `call_retrying`).

The wire format is `control_protocol`'s. Which failures are worth a reconnect is decided
in one place, `connection_lost`: the socket is missing, nothing listens on it (a stale file
after a crash), the listen queue is full, or an open connection broke before its final
reply. Anything else (permission denied, an error reply, a reply that is not the protocol)
is raised at once.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from llmd_supervisor.adapters.control.protocol import (
    DEFAULT_MAX_MESSAGE,
    PROTOCOL_VERSION,
    encode,
    show,
)
from llmd_supervisor.errors import (
    ControlError,
    ControlProtocolError,
    DaemonUnreachable,
    SupervisorError,
)

__all__ = [
    "ControlClient",
    "Reconnect",
    "call_retrying",
    "connection_lost",
    "list_all",
    "resumable_stream",
]

# Why connecting failed, when another try may succeed: no socket (the daemon is between
# runs), a stale socket (it crashed), the listen queue is full (a crowd reconnecting).
_RETRY_CONNECT = (FileNotFoundError, ConnectionRefusedError, BlockingIOError)
# Why an open connection broke: the daemon stopped or was killed.
_CONNECTION_BROKE = (
    anyio.IncompleteRead,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    ConnectionResetError,
    BrokenPipeError,
)


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

    async def call(self, op: str, args: Mapping[str, object] | None = None) -> Mapping[str, object]:
        """Send one request and return its result; raise `ControlError` on an error reply.

        The result is a JSON object as it was decoded: its shape is the op's, which the
        caller checks (`core.protocol.runs.read`).

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
    ) -> AsyncGenerator[Mapping[str, object], None]:
        """Send one request; yield its stream items, then ``{"final": result}`` last
        (decoded JSON objects, unchecked as `call`'s result).

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
        line = encode({"v": PROTOCOL_VERSION, "id": request_id, "op": op, "args": dict(args or {})})
        if len(line) - 1 > self.max_message:
            raise ControlError(
                "too_large",
                f"Request for op {op!r} is {len(line) - 1} bytes, over the "
                f"{self.max_message}-byte message bound; it was not sent.",
            )
        self._busy = True
        try:
            await self._stream.send(line)
        except _CONNECTION_BROKE as exc:
            # A refused connection (over a cap) got one error line before it was closed.
            with anyio.move_on_after(1):
                await self._refusal(request_id)
            raise ControlProtocolError(self.path, "the daemon closed the connection") from exc
        while True:
            reply = await self._receive(request_id)
            if "stream" in reply:
                item = reply["stream"]
                if not isinstance(item, dict):
                    raise ControlProtocolError(
                        self.path, f"stream item {show(item)} is not an object"
                    )
                yield item
                continue
            ok = reply.get("ok")
            if ok is True:
                result = reply.get("result")
                if not isinstance(result, dict):
                    raise ControlProtocolError(self.path, f"result {show(result)} is not an object")
                self._busy = False
                yield {"final": result}
                return
            error = reply.get("error")
            if ok is False and isinstance(error, dict):
                code, message = error.get("code"), error.get("message")
                if isinstance(code, str) and isinstance(message, str):
                    self._busy = False
                    raise ControlError(code, message)
            raise ControlProtocolError(self.path, f"reply {show(reply)} is not a protocol reply")

    async def _refusal(self, request_id: int) -> None:
        """Raise the error reply waiting on a connection the daemon closed, if there is one."""
        try:
            reply = await self._receive(request_id)
        except ControlProtocolError:
            return
        error = reply.get("error")
        if reply.get("ok") is False and isinstance(error, dict):
            code, message = error.get("code"), error.get("message")
            if isinstance(code, str) and isinstance(message, str):
                self._busy = False
                raise ControlError(code, message)

    async def _receive(self, request_id: int) -> Mapping[str, object]:
        """Read one reply line for `request_id`."""
        assert self._reader is not None
        try:
            line = await self._reader.receive_until(b"\n", self.max_message + 1)
        except anyio.DelimiterNotFound:
            raise ControlProtocolError(
                self.path, f"a reply exceeded the {self.max_message}-byte message bound"
            ) from None
        except _CONNECTION_BROKE as exc:
            raise ControlProtocolError(
                self.path, "the daemon closed the connection before its final reply"
            ) from exc
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            raise ControlProtocolError(
                self.path, f"reply {show(line[:80])} is not valid JSON"
            ) from None
        if not isinstance(reply, dict) or reply.get("v") != PROTOCOL_VERSION:
            raise ControlProtocolError(
                self.path, f"reply {show(reply)} is not a version {PROTOCOL_VERSION} reply"
            )
        reply_id = reply.get("id")
        matches = type(reply_id) is int and reply_id == request_id
        if not matches and not (reply_id is None and reply.get("ok") is False):
            raise ControlProtocolError(
                self.path, f"reply id {show(reply_id)} does not match request id {request_id}"
            )
        return reply


# --------------------------------------------------------------------------- reconnecting


def connection_lost(exc: BaseException) -> bool:
    """Whether `exc` means the daemon is gone for now, so reconnecting later may work."""
    if isinstance(exc, DaemonUnreachable):
        return isinstance(exc.__cause__, _RETRY_CONNECT)
    if isinstance(exc, ControlProtocolError):
        return isinstance(exc.__cause__, _CONNECTION_BROKE)
    return False


@dataclass(frozen=True)
class Reconnect:
    """How a waiting client rides out a daemon restart.

    After the connection is lost (or cannot be made), it tries again with a jittered
    exponential delay from `first_delay_s` up to `max_delay_s`, for at most `window_s`
    since the loss; a connection that succeeds starts a new window. ``window_s=0`` never
    retries.
    """

    window_s: float = 600.0
    first_delay_s: float = 0.05
    max_delay_s: float = 1.0

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait after `failures` consecutive failed tries (1, 2, ...)."""
        base = min(self.max_delay_s, self.first_delay_s * 2.0 ** max(0, failures - 1))
        return base * (0.8 + 0.4 * rand())


class _Retry:
    """The window and backoff of one reconnecting request (state shared by its tries)."""

    def __init__(self, path: Path, policy: Reconnect, on_lost: Callable[[str], None]) -> None:
        self.path = path
        self.policy = policy
        self.on_lost = on_lost
        self.lost_at: float | None = None  # when the current outage began
        self.failures = 0  # consecutive tries that failed

    def connected(self) -> None:
        self.lost_at = None

    def progressed(self) -> None:
        self.failures = 0

    async def failed(self, exc: SupervisorError) -> None:
        """Sleep before the next try, or raise `DaemonUnreachable` once the window is over."""
        now = anyio.current_time()
        why = exc.why if isinstance(exc, DaemonUnreachable | ControlProtocolError) else str(exc)
        if self.lost_at is None:
            self.lost_at = now
            if self.policy.window_s > 0:
                self.on_lost(why)
        left = self.lost_at + self.policy.window_s - now
        if left <= 0:
            raise DaemonUnreachable(
                self.path,
                f"{why}; gave up after trying again for {self.policy.window_s:g} s",
            ) from exc
        self.failures += 1
        await anyio.sleep(min(left, self.policy.delay(self.failures)))


def _ignore(_: str) -> None:
    return None


async def resumable_stream(
    path: Path,
    op: str,
    args: Callable[[], Mapping[str, object]],
    *,
    reconnect: Reconnect,
    on_lost: Callable[[str], None] = _ignore,
    max_message: int = DEFAULT_MAX_MESSAGE,
) -> AsyncGenerator[Mapping[str, object], None]:
    """Like `ControlClient.stream`, but reconnecting and re-sending the request when the
    daemon goes away (see `connection_lost`) until it answers again or the window passes.

    `args()` is called for every (re)send, so a caller resumes by having it return where it
    is (e.g. the ``logs`` op's per-file offsets of what it has already printed): the items
    are yielded one at a time and the generator does not read on until the caller asks for
    the next one. `on_lost(why)` is called once when an outage begins. Raises
    `DaemonUnreachable` after the window, and error replies (`ControlError`) at once.
    """
    retry = _Retry(Path(path), reconnect, on_lost)
    while True:
        try:
            async with ControlClient(path, max_message=max_message) as client:
                retry.connected()
                async with aclosing(client.stream(op, args())) as items:
                    async for item in items:
                        retry.progressed()
                        yield item
                        if "final" in item:
                            return
        except (DaemonUnreachable, ControlProtocolError) as exc:
            if not connection_lost(exc):
                raise
            await retry.failed(exc)


async def call_retrying(
    path: Path,
    op: str,
    args: Mapping[str, object],
    *,
    reconnect: Reconnect,
    resend: bool,
    on_lost: Callable[[str], None] = _ignore,
) -> Mapping[str, object]:
    """One request, retried while the daemon cannot be reached.

    With ``resend=False`` (ops that must not run twice, like ``submit``) only a failure to
    connect is retried: once the request may have been sent, a broken connection is raised.
    """
    retry = _Retry(Path(path), reconnect, on_lost)
    while True:
        try:
            async with ControlClient(path) as client:
                retry.connected()
                return await client.call(op, args)
        except (DaemonUnreachable, ControlProtocolError) as exc:
            if not connection_lost(exc) or (isinstance(exc, ControlProtocolError) and not resend):
                raise
            await retry.failed(exc)


async def list_all(
    client: ControlClient, *, all_runs: bool, cluster: str | None = None
) -> Mapping[str, object]:
    """Every page of ``list`` (of `cluster`'s runs) on one connection, as one
    ``{"runs": [...]}`` result."""
    runs: list[object] = []
    after: object = None
    while True:
        args: dict[str, object] = {"all": all_runs, "after": after}
        if cluster is not None:
            args["cluster"] = cluster
        page = await client.call("list", args)
        got = page.get("runs")
        if not isinstance(got, list):
            return page  # not a list result: the caller's reader says what is wrong
        runs += got
        after = page.get("next")
        if not isinstance(after, str):
            return {"runs": runs}
