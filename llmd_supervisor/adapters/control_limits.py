"""What the control socket's peers hold, against the ``[daemon]`` limits: connections (in
all and per uid), streaming requests per uid, and the byte budget for partial request
lines. Used by `control_server`; no sockets here.
"""

from __future__ import annotations

from collections import deque

import anyio

from llmd_supervisor.core.config import SocketLimits

__all__ = ["REFUSAL_LOG_S", "Budget", "Occupancy", "RefusalLog", "drop", "timeout_message"]

REFUSAL_LOG_S = 10.0  # one control.refused line per uid and reason this often


class Budget:
    """Bytes of partial request lines held, in all and per uid; taking more waits.

    Waiters are granted in order as bytes are given back, skipping one whose uid is still
    over its share (so one uid's backlog never holds up another's), and only a waiter
    that got its bytes is woken: a crowd waiting costs nothing while nothing is freed.
    """

    def __init__(self, total: int, per_uid: int) -> None:
        self.total = total
        self.per_uid = per_uid
        self.held = 0
        self.by_uid: dict[int, int] = {}
        self._waiters: deque[tuple[int, int, anyio.Event]] = deque()

    def _fits(self, uid: int, n: int) -> bool:
        return self.held + n <= self.total and self.by_uid.get(uid, 0) + n <= self.per_uid

    async def take(self, uid: int, n: int) -> None:
        if self._fits(uid, n):
            self.charge(uid, n)
            return
        entry = (uid, n, anyio.Event())
        self._waiters.append(entry)
        try:
            await entry[2].wait()
        except BaseException:
            if entry[2].is_set():  # granted, but cancelled before it could be used
                self.give(uid, n)
            else:
                self._waiters.remove(entry)
            raise

    def charge(self, uid: int, n: int) -> None:
        """Count `n` bytes (already received, or granted) without waiting."""
        self.held += n
        self.by_uid[uid] = self.by_uid.get(uid, 0) + n

    def give(self, uid: int, n: int) -> None:
        if n <= 0:
            return
        self.held -= n
        left = self.by_uid[uid] - n
        if left:
            self.by_uid[uid] = left
        else:
            del self.by_uid[uid]
        for entry in list(self._waiters):
            if self.held >= self.total:
                break
            if self._fits(entry[0], entry[1]):
                self._waiters.remove(entry)
                self.charge(entry[0], entry[1])
                entry[2].set()


class Occupancy:
    """What the peers hold right now: connections (in all and per uid) and streams."""

    def __init__(self, limits: SocketLimits) -> None:
        self.limits = limits
        self.connections = 0
        self.by_uid: dict[int, int] = {}
        self.streams: dict[int, int] = {}
        self.refusals = RefusalLog()
        self.budget = Budget(limits.request_buffer_bytes, limits.request_buffer_bytes_per_uid)

    def refusal(self, uid: int) -> tuple[str, str] | None:
        """Why a new connection of `uid` is refused (reason, message), or None."""
        lim = self.limits
        if self.connections >= lim.max_connections:
            return "max_connections", (
                f"The daemon has {self.connections} control connections open, its limit "
                f"(daemon.max_connections = {lim.max_connections}); try again shortly."
            )
        held = self.by_uid.get(uid, 0)
        if held >= lim.max_connections_per_uid:
            return "max_connections_per_uid", (
                f"uid {uid} has {held} control connections open, the per-user limit "
                f"(daemon.max_connections_per_uid = {lim.max_connections_per_uid}); close "
                "some and try again."
            )
        return None

    def opened(self, uid: int) -> None:
        self.connections += 1
        self.by_uid[uid] = self.by_uid.get(uid, 0) + 1

    def closed(self, uid: int) -> None:
        self.connections -= 1
        drop(self.by_uid, uid)


def drop(counts: dict[int, int], uid: int) -> None:
    if counts[uid] <= 1:
        del counts[uid]
    else:
        counts[uid] -= 1


class RefusalLog:
    """Rate limit for refusal log lines: one per uid and reason every `REFUSAL_LOG_S`."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, str], tuple[float, int]] = {}

    def note(self, uid: int, reason: str, now: float) -> int | None:
        """None to stay quiet; else log now, with this many refusals left unlogged since."""
        key = (uid, reason)
        last, count = self._last.get(key, (now - REFUSAL_LOG_S, 0))
        if now - last < REFUSAL_LOG_S:
            self._last[key] = (last, count + 1)
            return None
        self._last[key] = (now, 0)
        if len(self._last) > 4096:  # a crowd of uids: forget the old entries
            self._last = {k: v for k, v in self._last.items() if now - v[0] < 6 * REFUSAL_LOG_S}
        return count


def timeout_message(limits: SocketLimits, what: str) -> tuple[float, str]:
    """The limit and the error message for a connection that timed out waiting for
    `what`: "first_byte", "idle" or "request"."""
    seconds, why = {
        "first_byte": (
            limits.first_byte_timeout_s,
            "no request arrived within {s:g} s of connecting (daemon.first_byte_timeout_s)",
        ),
        "idle": (
            limits.idle_timeout_s,
            "the connection was idle for {s:g} s (daemon.idle_timeout_s)",
        ),
        "request": (
            limits.request_timeout_s,
            "the request line was not complete within {s:g} s of its first byte "
            "(daemon.request_timeout_s)",
        ),
    }[what]
    return seconds, f"Closing the connection: {why.format(s=seconds)}."
