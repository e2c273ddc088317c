"""systemd's sd_notify protocol (READY/STATUS/STOPPING/WATCHDOG) and the event-loop monitor.

`Notifier` sends one datagram per message to ``$NOTIFY_SOCKET`` (a filesystem path, or an
abstract socket written ``@name``); without that variable every call is a no-op, so the
daemon behaves the same outside systemd. Sending never raises: a notification that cannot
be delivered is logged (``sdnotify.send_failed``) and dropped, because systemd being
unreachable must not stop supervision.

`watchdog_interval` reads ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, which must name this
process when set). `loop_monitor` pings ``WATCHDOG=1`` every half interval from a task of
the daemon's root task group: a blocked event loop therefore misses its pings and systemd
restarts the service. The same task measures how late the loop woke it (the loop lag) for
the metrics.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

import anyio
import anyio.abc
import structlog

log = structlog.get_logger("llmd_supervisor.adapters.sdnotify")

# Without a watchdog the loop lag is still measured, this often.
LAG_PROBE_INTERVAL_S = 1.0


class Notifier:
    """Sends sd_notify datagrams to `address` (None: every call is a no-op)."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.sent = 0
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        return cls(env.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def _target(self) -> str | bytes:
        assert self.address is not None
        if self.address.startswith("@"):
            return b"\0" + self.address[1:].encode()  # Linux abstract namespace
        return self.address

    def notify(self, message: str) -> None:
        """Send `message` (newline-separated ``KEY=value`` lines); never raises."""
        if self._sock is None:
            return
        try:
            self._sock.sendto(message.encode(), self._target())
        except OSError as exc:
            log.warning(
                "sdnotify.send_failed",
                socket=self.address,
                message=message.split("\n", 1)[0],
                error=exc.strerror or str(exc),
            )
            return
        self.sent += 1

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """systemd's WatchdogSec in seconds for this process, or None when no watchdog is asked for."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (e.g. our parent)
    return int(usec) / 1e6


async def loop_monitor(
    notify: Callable[[str], None],
    watchdog_s: float | None,
    on_lag: Callable[[float], None],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Ping the watchdog every `watchdog_s`/2 (if set) and report the loop lag until cancelled.

    The lag is how much later than asked the loop resumed this task; a lag near the
    watchdog interval means systemd is about to kill the daemon (``daemon.loop_lag`` is
    logged above a quarter of it).
    """
    period = watchdog_s / 2 if watchdog_s else LAG_PROBE_INTERVAL_S
    warn_above = watchdog_s / 4 if watchdog_s else 1.0
    if watchdog_s:
        notify("WATCHDOG=1")
        log.info("sdnotify.watchdog", interval_s=watchdog_s, ping_every_s=period)
    task_status.started()
    while True:
        asked = time.monotonic()
        await anyio.sleep(period)
        lag = max(0.0, time.monotonic() - asked - period)
        on_lag(lag)
        if lag > warn_above:
            log.warning("daemon.loop_lag", lag_s=round(lag, 3), watchdog_s=watchdog_s)
        if watchdog_s:
            notify("WATCHDOG=1")
