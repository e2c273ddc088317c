"""Sends the outbox's due deliveries to their destinations (DESIGN.md section 13).

One `EventSender` task in the daemon's root task group asks the journal for due
deliveries (`adapters.outbox_store`; at most `DUE_PER_DESTINATION` of each destination)
and attempts each in a task of its own, at most `PER_DESTINATION` at once per
destination, so a slow or dead receiver holds up neither another destination nor
anything the daemon does for its runs.

One attempt:

- **webhook**: ``POST`` of the event's body with the Standard Webhooks headers
  (`core.webhooks.webhook_headers`, ``webhook-id`` the event id on every attempt), signed
  with every key of the destination's ``secret_file`` (read again on every attempt, so a
  key is rotated without a restart; a file that others may read is refused);
- **slack**: ``POST`` of the message journaled with the delivery;
- **mail**: the mail journaled with the delivery on the stdin of the local
  ``sendmail -t -oi`` (`SENDMAIL`), which takes its recipients from the mail's headers;
  its exit status decides (`core.delivery.SendmailExit`).

HTTP: HTTP/1.1 over anyio's TCP (TLS for https, the system's trust store), one request
per connection, `core.delivery.TIMEOUT_S` for all of it (connect, send, the answer's
head), redirects never followed; only the status and ``Retry-After`` of the answer are
read. What is done next is `core.delivery.next_step`'s decision, journaled: a delivery
is ``delivered`` only once that write has committed (the write is shielded from
cancellation), so a stop between the receiver's 2xx and the commit sends it again, with
the same ``webhook-id``. A 410 Gone disables the destination (`Outbox.finish_attempt`).

Cancellation (the daemon stopping): attempts in flight are abandoned; an abandoned attempt
was never journaled, so it is made again, as the same attempt, after the restart.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import ssl
import stat
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import anyio
import anyio.abc
import anyio.to_thread
import structlog

from llmd_supervisor import __version__
from llmd_supervisor.adapters.outbox_store import Delivery, Outbox
from llmd_supervisor.core.delivery import (
    TIMEOUT_S,
    HttpResponse,
    NetworkFailure,
    Result,
    SendmailExit,
    Step,
    next_step,
)
from llmd_supervisor.core.event_routing import Destination, DestinationKind, EventsConfig
from llmd_supervisor.core.outbox import DeliveryStatus
from llmd_supervisor.core.webhooks import (
    SigningKey,
    parse_secret_file,
    unix_seconds,
    webhook_headers,
)
from llmd_supervisor.errors import SupervisorError, WebhookSecretError

__all__ = [
    "EventSender",
    "post_json",
    "read_secret_file",
    "read_secret_file_now",
    "send_mail",
]

log = structlog.get_logger("llmd_supervisor.events")

# Due deliveries read per destination at once (those in flight included): the most that
# wait for a destination's PER_DESTINATION attempt slots.
DUE_PER_DESTINATION: Final = 8
IDLE_S: Final = 1.0  # how often the journal is asked for due deliveries
PER_DESTINATION: Final = 2  # attempts in flight per destination
ERROR_BACKOFF_S: Final = 5.0  # after the journal failed to answer
COUNT_EVERY_S: Final = 10.0  # how often the deliveries are counted for the metrics
CLOSE_S: Final = 1.0  # closing a connection once its answer is read
RESPONSE_HEAD_MAX: Final = 16 << 10  # bytes of an answer's status line and headers
SECRET_FILE_MAX: Final = 16 << 10
USER_AGENT: Final = f"llmd-supervisor/{__version__}"
SENDMAIL: Final = ("/usr/sbin/sendmail", "-t", "-oi")
_STATUS_LINE: Final = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: |\r\n|$)")

Post = Callable[[str, bytes, Mapping[str, str], float], Awaitable[Result]]


class EventSender:
    """Delivers what the outbox holds; start with ``await tg.start(sender.run)``."""

    def __init__(
        self,
        outbox: Outbox,
        events: EventsConfig,
        *,
        clock: Callable[[], datetime],
        rng: Callable[[], float] = random.random,
        post: Post | None = None,
        sendmail: Sequence[str] = SENDMAIL,
        idle_s: float = IDLE_S,
        may_send: Callable[[], bool] = lambda: True,
    ) -> None:
        self._outbox = outbox
        self._may_send = may_send  # False: a standby of a shared journal (its leader sends)
        self._destinations = {d.name: d for d in events.destinations}
        self._clock = clock
        self._rng = rng
        self._post: Post = post or post_json
        self._sendmail = tuple(sendmail)
        self._idle_s = idle_s
        # Deliveries whose attempt runs now (event id, destination): never started twice.
        self._in_flight: set[tuple[str, str]] = set()
        self._limiters: dict[str, anyio.CapacityLimiter] = {}
        self._wake = anyio.Event()
        # Deliveries per (destination, status), counted every COUNT_EVERY_S (metrics).
        self._counts: dict[tuple[str, str], int] = {}
        self._counted_at = -COUNT_EVERY_S

    def counts(self) -> Mapping[tuple[str, str], int]:
        """The deliveries per (destination, status) as last counted."""
        return self._counts

    def wake(self) -> None:
        """Look for due deliveries now rather than at the next idle tick."""
        self._wake.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Deliver until cancelled. A journal error is logged and the loop goes on."""
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                try:
                    if self._may_send():
                        await self._start_due(tg)
                except SupervisorError as exc:  # the journal: busy, full, ...
                    log.warning("event.due_unread", error=str(exc), retry_in_s=ERROR_BACKOFF_S)
                    await anyio.sleep(ERROR_BACKOFF_S)
                with anyio.move_on_after(self._idle_s):
                    await self._wake.wait()
                self._wake = anyio.Event()

    async def _start_due(self, tg: anyio.abc.TaskGroup) -> None:
        if anyio.current_time() - self._counted_at >= COUNT_EVERY_S:
            self._counts = await self._outbox.counts()
            self._counted_at = anyio.current_time()
        due = await self._outbox.due(self._clock(), DUE_PER_DESTINATION)
        for delivery, payload in due:
            key = (delivery.event_id, delivery.destination)
            if key in self._in_flight:
                continue
            self._in_flight.add(key)
            tg.start_soon(self._attempt, delivery, payload)

    async def _attempt(self, d: Delivery, payload: bytes) -> None:
        key = (d.event_id, d.destination)
        limiter = self._limiters.setdefault(d.destination, anyio.CapacityLimiter(PER_DESTINATION))
        try:
            async with limiter:
                await self._deliver(d, payload)
        except Exception:  # a bug here must not stop the daemon: the delivery stays due
            log.exception("event.attempt_failed", event_id=d.event_id, destination=d.destination)
            await anyio.sleep(ERROR_BACKOFF_S)
        finally:
            self._in_flight.discard(key)

    async def _deliver(self, d: Delivery, payload: bytes) -> None:
        dest = self._destinations.get(d.destination)
        attempt = d.attempts + 1
        if dest is None:
            why = f"destination {d.destination!r} is no longer configured"
            await self._finish(d, DeliveryStatus.DEAD, d.attempts, None, why)
            return
        result = await self._send(dest, d, payload)
        now = self._clock()
        decision = next_step(attempt, result, now, self._rng)
        status = {
            Step.DONE: DeliveryStatus.DELIVERED,
            Step.RETRY: DeliveryStatus.RETRYING,
            Step.DEAD: DeliveryStatus.DEAD,
            Step.DISABLE: DeliveryStatus.DEAD,
        }[decision.step]
        await self._finish(
            d, status, attempt, decision.at, decision.reason, disable=decision.step is Step.DISABLE
        )

    async def _send(self, dest: Destination, d: Delivery, payload: bytes) -> Result:
        if dest.kind is DestinationKind.MAIL:
            return await send_mail(self._sendmail, payload, TIMEOUT_S)
        assert dest.url is not None  # webhook and slack destinations have one
        headers: dict[str, str] = {}
        if dest.kind is DestinationKind.WEBHOOK:
            assert dest.secret_file is not None
            try:
                keys = await read_secret_file(Path(dest.secret_file))
            except WebhookSecretError as exc:
                return NetworkFailure(f"not sent: {exc}")
            stamp = unix_seconds(self._clock())
            headers = webhook_headers(keys, d.event_id, stamp, payload)
        return await self._post(dest.url, payload, headers, TIMEOUT_S)

    async def _finish(
        self,
        d: Delivery,
        status: DeliveryStatus,
        attempts: int,
        next_at: datetime | None,
        why: str,
        *,
        disable: bool = False,
    ) -> None:
        # Shielded: a receiver's 2xx counts only once it is journaled, and it must be.
        with anyio.CancelScope(shield=True):
            await self._outbox.finish_attempt(
                d.event_id,
                d.destination,
                status=status,
                attempts=attempts,
                next_at=next_at,
                error=why,
                now=self._clock(),
                disable=disable,
            )
        fields = {
            "event_id": d.event_id,
            "type": d.type,
            "destination": d.destination,
            "attempt": attempts,
            "reason": why,
        }
        if status is DeliveryStatus.DELIVERED:
            log.info("event.delivered", **fields)
        elif status is DeliveryStatus.RETRYING:
            log.info(
                "event.retry_scheduled", next_at=next_at.isoformat() if next_at else None, **fields
            )
        else:
            log.warning("event.dead", **fields)
        if disable:
            log.warning(
                "event.destination_disabled",
                destination=d.destination,
                reason=why,
                hint="fix the receiver, then `events replay ID` enables the destination again",
            )


async def send_mail(argv: Sequence[str], message: bytes, timeout_s: float) -> Result:
    """Hand `message` to ``sendmail`` (`argv`) on its stdin; how it ended. Killed after
    `timeout_s` (a NetworkFailure: retried)."""
    try:
        with anyio.fail_after(timeout_s):
            done = await anyio.run_process(
                list(argv),
                input=message,
                check=False,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
    except TimeoutError:
        return NetworkFailure(f"sendmail did not end within {timeout_s:g} s")
    except OSError:
        return SendmailExit(None)  # not installed, not executable
    return SendmailExit(done.returncode if done.returncode >= 0 else None)


async def read_secret_file(path: Path) -> tuple[SigningKey, ...]:
    """The signing keys of a destination's ``secret_file``; WebhookSecretError when it
    cannot be read, may be read by others, or holds no usable secret."""
    return await anyio.to_thread.run_sync(read_secret_file_now, path)


def read_secret_file_now(path: Path) -> tuple[SigningKey, ...]:
    """`read_secret_file`, in this thread (`config check`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise WebhookSecretError(str(path), None, f"it cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WebhookSecretError(str(path), None, "it is not a regular file")
        if st.st_mode & 0o077:
            raise WebhookSecretError(
                str(path),
                None,
                f"its mode is {stat.S_IMODE(st.st_mode):04o}; others may read it "
                f"(chmod 600 {path}, owned by the service account)",
            )
        data = os.read(fd, SECRET_FILE_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > SECRET_FILE_MAX:
        raise WebhookSecretError(str(path), None, f"it is larger than {SECRET_FILE_MAX} bytes")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise WebhookSecretError(str(path), None, "it is not ASCII text") from None
    return parse_secret_file(text, str(path))


async def post_json(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> Result:
    """POST `body` (JSON) to `url` over HTTP/1.1 with `headers`; the answer's status and
    Retry-After, or the network failure (the timeout included). Never follows a redirect
    (a 3xx is the answer)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    shown_host = f"[{host}]" if ":" in host else host
    authority = shown_host if parts.port is None else f"{shown_host}:{port}"
    lines = [
        f"POST {target} HTTP/1.1",
        f"Host: {authority}",
        f"User-Agent: {USER_AGENT}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body
    stream: anyio.abc.ByteStream | None = None
    try:
        with anyio.fail_after(timeout_s):
            if https:
                # Not standard-compatible: the answer's head is all that is read, and the
                # close does not wait for the receiver's close_notify.
                stream = await anyio.connect_tcp(
                    host,
                    port,
                    tls=True,
                    ssl_context=ssl.create_default_context(),
                    tls_hostname=host,
                    tls_standard_compatible=False,
                )
            else:
                stream = await anyio.connect_tcp(host, port)
            await stream.send(request)
            head = await _read_head(stream)
    except TimeoutError:
        return NetworkFailure(f"no answer within {timeout_s:g} s")
    except (OSError, ssl.SSLError, anyio.BrokenResourceError) as exc:
        return NetworkFailure(f"{type(exc).__name__}: {exc}")
    finally:
        if stream is not None:  # the answer is in: closing cannot change it
            with anyio.move_on_after(CLOSE_S, shield=True), contextlib.suppress(Exception):
                await stream.aclose()
    return _answer(head)


async def _read_head(stream: anyio.abc.ByteReceiveStream) -> bytes:
    """The answer up to the end of its headers (or what came before the peer closed)."""
    buf = b""
    while b"\r\n\r\n" not in buf and len(buf) < RESPONSE_HEAD_MAX:
        try:
            buf += await stream.receive()
        except anyio.EndOfStream:
            break
    return buf[:RESPONSE_HEAD_MAX]


def _answer(head: bytes) -> Result:
    match = _STATUS_LINE.match(head)
    if match is None:
        shown = head[:40].decode("ascii", "replace")
        return NetworkFailure(f"not an HTTP/1.x answer: {shown!r}")
    retry_after = None
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"retry-after":
            retry_after = value.strip().decode("latin-1")
    return HttpResponse(status=int(match.group(1)), retry_after=retry_after)
