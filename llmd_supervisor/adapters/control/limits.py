"""What the control socket's peers hold, against the ``[daemon]`` limits: connections (in
all and per uid), streaming requests per uid, and the byte budget for partial request
lines. Used by `control_server`, and (`Caps`, `RefusalLog`) by the dashboard's listeners
(`web_server`, `supervision.web.dashboard`); no sockets here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

import anyio

from llmd_supervisor.core.config import SocketLimits

__all__ = [
    "REFUSAL_LOG_S",
    "Budget",
    "Caps",
    "Occupancy",
    "RefusalLog",
    "drop",
    "timeout_message",
]

K = TypeVar("K", bound=Hashable)

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


class Caps(Generic[K]):
    """How many of something (connections, streams) are held, in all and per peer (a uid,
    a source address), against a cap on each. `keys` name the caps (the total's and the
    per-peer one's, e.g. ``daemon.max_connections``): the refusal's reason is a key's own
    name, and its message names the key to raise (`fixed`: the caps are no config keys)."""

    def __init__(
        self,
        total: int,
        per_peer: int,
        *,
        holder: str,
        what: str,
        keys: tuple[str, str],
        per: str,
        fixed: bool = False,
    ) -> None:
        self.total_cap, self.per_peer_cap = total, per_peer
        self.holder, self.what, self.keys, self.per, self.fixed = holder, what, keys, per, fixed
        self.held = 0
        self.by_peer: dict[K, int] = {}

    def _limit(self, key: str, cap: int) -> str:
        return f"at most {cap}" if self.fixed else f"{key} = {cap}"

    def refusal(self, peer: K, shown: str) -> tuple[str, str] | None:
        """Why `peer` (`shown` so in the message) may not hold one more: (reason, message);
        or None."""
        total_key, peer_key = self.keys
        if self.held >= self.total_cap:
            return total_key.rsplit(".", 1)[-1], (
                f"{self.holder} has {self.held} {self.what} open, its limit "
                f"({self._limit(total_key, self.total_cap)}); try again shortly."
            )
        held = self.by_peer.get(peer, 0)
        if held >= self.per_peer_cap:
            return peer_key.rsplit(".", 1)[-1], (
                f"{shown} has {held} {self.what} open, the {self.per} limit "
                f"({self._limit(peer_key, self.per_peer_cap)}); close some and try again."
            )
        return None

    def opened(self, peer: K) -> None:
        self.held += 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1

    def closed(self, peer: K) -> None:
        self.held -= 1
        drop(self.by_peer, peer)


class Occupancy:
    """What the peers hold right now: connections (in all and per uid) and streams."""

    def __init__(self, limits: SocketLimits) -> None:
        self.limits = limits
        self.caps: Caps[int] = Caps(
            limits.max_connections,
            limits.max_connections_per_uid,
            holder="The daemon",
            what="control connections",
            keys=("daemon.max_connections", "daemon.max_connections_per_uid"),
            per="per-user",
        )
        self.streams: dict[int, int] = {}
        self.refusals = RefusalLog()
        self.budget = Budget(limits.request_buffer_bytes, limits.request_buffer_bytes_per_uid)

    @property
    def connections(self) -> int:
        return self.caps.held

    @property
    def by_uid(self) -> dict[int, int]:
        return self.caps.by_peer

    def refusal(self, uid: int) -> tuple[str, str] | None:
        """Why a new connection of `uid` is refused (reason, message), or None."""
        return self.caps.refusal(uid, f"uid {uid}")

    def opened(self, uid: int) -> None:
        self.caps.opened(uid)

    def closed(self, uid: int) -> None:
        self.caps.closed(uid)


def drop(counts: dict[K, int], key: K) -> None:
    if counts[key] <= 1:
        del counts[key]
    else:
        counts[key] -= 1


class RefusalLog:
    """Rate limit for refusal log lines: one per uid and reason every `REFUSAL_LOG_S`."""

    def __init__(self) -> None:
        self._last: dict[tuple[Hashable, str], tuple[float, int]] = {}

    def note(self, uid: Hashable, reason: str, now: float) -> int | None:
        """None to stay quiet; else log now, with this many refusals left unlogged since
        (`uid`: the peer, a uid or another key such as a listener and a source address)."""
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
