"""Sends the outbox's due deliveries to their destinations (DESIGN.md section 13).

One `EventSender` task in the daemon's root task group asks the journal for due
deliveries (`adapters.outbox.store`; at most `DUE_PER_DESTINATION` of each destination)
and attempts each in a task of its own, at most `PER_DESTINATION` at once per
destination, so a slow or dead receiver holds up neither another destination nor
anything the daemon does for its runs.

One attempt:

- **webhook**: ``POST`` of the event's body with the Standard Webhooks headers
  (`core.events.webhooks.webhook_headers`, ``webhook-id`` the event id on every attempt), signed
  with every key of the destination's ``secret_file`` (read again on every attempt, so a
  key is rotated without a restart; a file that others may read is refused);
- **slack**: ``POST`` of the message journaled with the delivery;
- **mail**: the mail journaled with the delivery on the stdin of the local
  ``sendmail -t -oi`` (`SENDMAIL`), which takes its recipients from the mail's headers;
  its exit status decides (`core.events.delivery.SendmailExit`).

HTTP: httpx (HTTP/1.1 on anyio), one client and one connection per attempt,
`core.events.delivery.TIMEOUT_S` for all of it (connect, send, the answer's head), redirects
never followed; only the status and ``Retry-After`` of the answer are read (its head is
bounded by httpcore at 100 KiB, its body never read). TLS verifies against the system's
trust store (``ssl.create_default_context()``: OpenSSL's default paths, which honour
SSL_CERT_FILE and SSL_CERT_DIR; not httpx's default, certifi's bundle). A login node
reaches the outside through an HTTP proxy: `core.events.routing.proxy_for` picks it per
URL (``[events] proxy``, else HTTPS_PROXY / HTTP_PROXY / ALL_PROXY of the daemon's
environment, none for a host in NO_PROXY); https goes through it with CONNECT.
What is done next is `core.events.delivery.next_step`'s decision, journaled: a delivery
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
import ssl
import stat
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Final

import anyio
import anyio.abc
import anyio.to_thread
import httpx
import structlog

from llmd_supervisor import __version__
from llmd_supervisor.adapters.outbox.store import Delivery, Outbox
from llmd_supervisor.core.events.delivery import (
    TIMEOUT_S,
    HttpResponse,
    NetworkFailure,
    Result,
    SendmailExit,
    Step,
    next_step,
)
from llmd_supervisor.core.events.outbox import DeliveryStatus
from llmd_supervisor.core.events.routing import (
    Destination,
    DestinationKind,
    EventsConfig,
    proxy_for,
    shown_proxy,
)
from llmd_supervisor.core.events.webhooks import (
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
SECRET_FILE_MAX: Final = 16 << 10
USER_AGENT: Final = f"llmd-supervisor/{__version__}"
SENDMAIL: Final = ("/usr/sbin/sendmail", "-t", "-oi")

# (url, body, headers, timeout in seconds, the proxy to go through or None): `post_json`.
Post = Callable[[str, bytes, Mapping[str, str], float, str | None], Awaitable[Result]]


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
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._outbox = outbox
        self._may_send = may_send  # False: a standby of a shared journal (its leader sends)
        self._destinations = {d.name: d for d in events.destinations}
        self._proxy = events.proxy  # [events] proxy: wins over the environment's
        self._environ = dict(environ if environ is not None else os.environ)
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
        proxy = proxy_for(dest.url, self._proxy, self._environ)
        return await self._post(dest.url, payload, headers, TIMEOUT_S, proxy)

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


async def post_json(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout_s: float,
    proxy: str | None = None,
) -> Result:
    """POST `body` (JSON) to `url` with `headers`, through the HTTP `proxy` if given
    (CONNECT for https); the answer's status and Retry-After, or the network failure (the
    timeout included). Never follows a redirect (a 3xx is the answer); the answer's body
    is never read."""
    shown = _shown(proxy)
    try:
        client = httpx.AsyncClient(
            verify=await anyio.to_thread.run_sync(ssl.create_default_context),
            proxy=proxy,
            trust_env=False,  # the caller chose the proxy (core.events.routing.proxy_for)
            follow_redirects=False,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=0),
        )
    except (ValueError, ImportError):  # its text may hold the proxy URL's password
        return NetworkFailure(f"the proxy {shown} cannot be used; give an http:// proxy URL")
    response: httpx.Response | None = None
    try:
        with anyio.fail_after(timeout_s):
            request = client.build_request(
                "POST",
                url,
                content=body,
                headers={"User-Agent": USER_AGENT, "Content-Type": "application/json", **headers},
            )
            response = await client.send(request, stream=True)
    except (TimeoutError, httpx.TimeoutException):
        return NetworkFailure(f"no answer within {timeout_s:g} s")
    except httpx.ProxyError as exc:
        return NetworkFailure(f"the proxy {shown} refused to forward it: {_cause(exc)}")
    except httpx.RemoteProtocolError as exc:
        return NetworkFailure(f"not an HTTP/1.x answer: {_cause(exc)}")
    except httpx.ConnectError as exc:
        if _tls_failure(exc):
            return NetworkFailure(f"TLS failed: {_cause(exc)}")
        if proxy is not None:
            return NetworkFailure(f"the proxy {shown} cannot be reached: {_cause(exc)}")
        return NetworkFailure(f"ConnectError: {_cause(exc)}")
    except httpx.HTTPError as exc:
        return NetworkFailure(f"{type(exc).__name__}: {_cause(exc)}")
    except (httpx.InvalidURL, ValueError):  # its text may hold the proxy URL's password
        return NetworkFailure(f"the URL or the proxy {shown} cannot be used")
    finally:  # the answer is in: closing cannot change it
        with anyio.move_on_after(CLOSE_S, shield=True), contextlib.suppress(Exception):
            if response is not None:
                await response.aclose()
            await client.aclose()
    return HttpResponse(
        status=response.status_code, retry_after=response.headers.get("retry-after")
    )


def _tls_failure(exc: BaseException) -> bool:
    """Whether an httpx error came from the TLS handshake (httpcore maps it to ConnectError)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain of causes is short; bound it anyway
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _shown(proxy: str | None) -> str:
    return "(none)" if proxy is None else shown_proxy(proxy)  # never its user or password


def _cause(exc: BaseException) -> str:
    """An httpx error's text, one line and bounded (it never holds a proxy's password:
    httpx names no URL in its transport errors)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
