"""Leadership of one cluster: the lease as data, and the holder's view of it (pure).

With a shared (PostgreSQL) journal several daemons may supervise one cluster; one of them
leads it. The lease is one row per cluster, ``(cluster, holder, epoch, expires_at)``,
with ``expires_at`` on the DATABASE's clock (the only clock two daemons share):

* A candidate acquires the row by compare-and-set (`decide_acquisition`): when there is
  no row, the row names no holder (released), its ``expires_at`` is not after the
  database's now, or it already names the candidate. Every acquisition writes
  ``epoch + 1`` (1 for a new row), so an epoch names one tenure and never comes back.
  Two candidates that read the same row both ask for the same epoch; the write is
  conditional on the epoch they read (`compare_and_set`), so exactly one wins.
* The holder renews every `RENEW_EVERY_S` (2 s), setting ``expires_at`` to the
  database's now + `LEASE_S` (15 s). A renewal that updates no row means the lease is
  someone else's: the holder stops acting at once.
* The holder stops acting when it has not renewed successfully for `STOP_ACTING_AFTER_S`
  (10 s) by its own MONOTONIC clock. A renewal counts from the moment it was SENT: the
  database set ``expires_at`` after that moment, so the row is valid until at least
  sent + 15 s, and stopping at sent + 10 s leaves 5 s for an in-flight write to be
  fenced and for clock-rate differences. The local wall clock is never used, so a skewed
  or stepped wall clock changes nothing.
* A graceful stop releases the lease (holder NULL, the epoch kept) and notifies, so a
  standby takes over in about `ACQUIRE_EVERY_S` instead of `LEASE_S`.

Holder names are unique per daemon process (host, pid and a per-start nonce, chosen by
the caller): a restarted daemon is a new candidate and waits for expiry like any other.

`step(state, event) -> Decision` is the holder's state machine. States:

========================  =============================================================
state                     meaning
========================  =============================================================
`Standby(acquire_at)`     not acting; tries to acquire at monotonic ``acquire_at``
`Leader(epoch, ...)`      acting with ``epoch``; renewed successfully at (sent)
                          ``last_renewed``; next renewal at ``renew_at``
`Stopping()`              shutting down; nothing more is done (an acquisition that
                          still wins is released)
========================  =============================================================

Events are what the driver saw (`Tick`, `Acquired`, `NotAcquired`, `AcquireFailed`,
`Renewed`, `RenewalLost`, `RenewalFailed`, `Notified`, `ShutdownRequested`); each carries
the monotonic ``now`` at which it was seen. The decision holds the new state, the actions
to carry out in order (`Act`, `StopActing`, `Renew`, `Acquire`, `Release`) and
``next_tick``: the monotonic time by which the driver must call `step` with a `Tick`
again (None: never). The driver bounds every lease statement by `STATEMENT_TIMEOUT_S`
(less than `RENEW_EVERY_S`, so at most one is in flight) and never waits past
``next_tick`` for one: the stop-acting deadline is a tick like any other.

The SQL the adapter executes for the same rules is at the end of this module
(`ACQUIRE_SQL`, `RENEW_SQL`, `RELEASE_SQL`), with the table (`LEASE_TABLE_DDL`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Final

__all__ = [
    "ACQUIRE_EVERY_S",
    "ACQUIRE_SQL",
    "LEASE_NOTIFY_CHANNEL",
    "LEASE_S",
    "LEASE_TABLE",
    "LEASE_TABLE_DDL",
    "RELEASE_SQL",
    "RENEW_EVERY_S",
    "RENEW_SQL",
    "STATEMENT_TIMEOUT_S",
    "STOP_ACTING_AFTER_S",
    "Acquire",
    "AcquireFailed",
    "Acquired",
    "Act",
    "Action",
    "Decision",
    "Event",
    "Leader",
    "LeaseRow",
    "NotAcquired",
    "Notified",
    "Release",
    "Renew",
    "RenewalFailed",
    "RenewalLost",
    "Renewed",
    "ShutdownRequested",
    "Standby",
    "State",
    "StopActing",
    "StopReason",
    "Stopping",
    "Tick",
    "acting_time_left",
    "compare_and_set",
    "decide_acquisition",
    "start",
    "step",
]

RENEW_EVERY_S: Final = 2.0
LEASE_S: Final = 15.0  # expires_at = the database's now + this, at every (re)acquisition
STOP_ACTING_AFTER_S: Final = 10.0  # monotonic, since the last successful renewal was sent
ACQUIRE_EVERY_S: Final = 2.0  # a standby's attempts (and a notification's: at once)
STATEMENT_TIMEOUT_S: Final = 1.5  # each lease statement, client side; < RENEW_EVERY_S


# --- the row and its compare-and-set -----------------------------------------------------


@dataclass(frozen=True)
class LeaseRow:
    """A cluster's lease row as stored. ``holder`` is None once released."""

    cluster: str
    holder: str | None
    epoch: int  # 0 only before the first acquisition; never reused
    expires_at: datetime  # the database's clock


def decide_acquisition(
    row: LeaseRow | None, cluster: str, candidate: str, db_now: datetime
) -> LeaseRow | None:
    """The row `candidate` writes to acquire `cluster`'s lease, given the row as read
    (None: there is none) and the database's now; None when it may not acquire it.

    It may when the row is absent, released, expired (``expires_at <= db_now``), or
    already its own; the row written has ``epoch + 1`` and expires `LEASE_S` after
    ``db_now``.
    """
    if not candidate:
        raise ValueError("a lease candidate needs a non-empty holder name")
    expires = db_now + timedelta(seconds=LEASE_S)
    if row is None:
        return LeaseRow(cluster, candidate, 1, expires)
    if row.holder is None or row.expires_at <= db_now or row.holder == candidate:
        return LeaseRow(cluster, candidate, row.epoch + 1, expires)
    return None


def compare_and_set(
    stored: LeaseRow | None, read_epoch: int | None, write: LeaseRow
) -> tuple[LeaseRow | None, bool]:
    """Apply a conditional write: it takes effect only if the stored row still has the
    epoch the writer read (None: the writer read no row, and there still is none).
    Returns the stored row afterwards and whether the write won."""
    current = None if stored is None else stored.epoch
    if current != read_epoch:
        return stored, False
    return write, True


# --- the holder's view --------------------------------------------------------------------


@dataclass(frozen=True)
class Standby:
    """Not acting for the cluster; the next acquisition attempt is due at ``acquire_at``."""

    acquire_at: float


@dataclass(frozen=True)
class Leader:
    """Acting for the cluster with ``epoch``.

    ``last_renewed`` is the monotonic time at which the last successful acquisition or
    renewal was sent; acting ends at ``last_renewed + STOP_ACTING_AFTER_S``.
    ``expires_at`` is the row's expiry as the database last said (for status only).
    """

    epoch: int
    last_renewed: float
    renew_at: float
    expires_at: datetime

    @property
    def acting_until(self) -> float:
        return self.last_renewed + STOP_ACTING_AFTER_S


@dataclass(frozen=True)
class Stopping:
    """Shutting down: the lease was released (if held) and nothing more is done."""


State = Standby | Leader | Stopping


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class Acquired:
    """The acquisition statement sent at ``sent`` wrote the row with ``epoch``."""

    epoch: int
    sent: float
    expires_at: datetime
    now: float


@dataclass(frozen=True)
class NotAcquired:
    """The acquisition statement wrote nothing: ``holder`` holds the lease."""

    holder: str | None
    expires_at: datetime
    now: float


@dataclass(frozen=True)
class AcquireFailed:
    """The acquisition statement failed or timed out; the row is unknown."""

    error: str
    now: float


@dataclass(frozen=True)
class Renewed:
    """The renewal of ``epoch`` sent at ``sent`` updated the row."""

    epoch: int
    sent: float
    expires_at: datetime
    now: float


@dataclass(frozen=True)
class RenewalLost:
    """The renewal of ``epoch`` updated no row: the lease is no longer this holder's."""

    epoch: int
    now: float


@dataclass(frozen=True)
class RenewalFailed:
    """The renewal of ``epoch`` failed or timed out; whether it updated the row is unknown."""

    epoch: int
    error: str
    now: float


@dataclass(frozen=True)
class Notified:
    """The database notified that a lease of this cluster was released."""

    now: float


@dataclass(frozen=True)
class ShutdownRequested:
    now: float


Event = (
    Tick
    | Acquired
    | NotAcquired
    | AcquireFailed
    | Renewed
    | RenewalLost
    | RenewalFailed
    | Notified
    | ShutdownRequested
)


class StopReason(StrEnum):
    """Why a leader stops acting."""

    SILENCE = "silence"  # no successful renewal for STOP_ACTING_AFTER_S
    LOST = "lost"  # a renewal updated no row: another holder has the lease
    SHUTDOWN = "shutdown"  # a graceful stop


@dataclass(frozen=True)
class Act:
    """Start acting for the cluster; every journal write carries ``epoch``."""

    epoch: int


@dataclass(frozen=True)
class StopActing:
    """Stop acting at once: no new side effect, no write with ``epoch`` (it would be
    fenced anyway)."""

    epoch: int
    reason: StopReason


@dataclass(frozen=True)
class Renew:
    """Send the renewal of ``epoch`` now (`RENEW_SQL`)."""

    epoch: int


@dataclass(frozen=True)
class Acquire:
    """Send the acquisition now (`ACQUIRE_SQL`)."""


@dataclass(frozen=True)
class Release:
    """Release the lease of ``epoch`` now (`RELEASE_SQL`), best effort."""

    epoch: int


Action = Act | StopActing | Renew | Acquire | Release


@dataclass(frozen=True)
class Decision:
    state: State
    actions: tuple[Action, ...]
    next_tick: float | None  # monotonic; None: no tick is needed any more


def start(now: float) -> Decision:
    """The first decision of a daemon: a standby that tries to acquire at once."""
    return step(Standby(acquire_at=now), Tick(now))


def acting_time_left(state: State, now: float) -> float:
    """Seconds this holder may still act (0 unless it leads): a side effect that takes
    up to T seconds (sbatch) is started only when this is more than T."""
    if not isinstance(state, Leader):
        return 0.0
    return max(0.0, state.acting_until - now)


def step(state: State, event: Event) -> Decision:
    """The holder's next state and actions after `event` (see the module docstring)."""
    if isinstance(state, Stopping):
        if isinstance(event, Acquired):  # sent before the stop, won after it
            return Decision(state, (Release(event.epoch),), None)
        return Decision(state, (), None)
    if isinstance(event, ShutdownRequested):
        if isinstance(state, Leader):
            actions: tuple[Action, ...] = (
                StopActing(state.epoch, StopReason.SHUTDOWN),
                Release(state.epoch),
            )
            return Decision(Stopping(), actions, None)
        return Decision(Stopping(), (), None)
    if isinstance(state, Leader):
        return _leader(state, event)
    return _standby(state, event)


def _standby(state: Standby, event: Event) -> Decision:
    now = event.now
    if isinstance(event, Acquired):
        if now >= event.sent + STOP_ACTING_AFTER_S:
            # Won too late to act on: ask again at once (the row is ours, so the next
            # acquisition wins with a new epoch unless the link is still down).
            return _standby_tick(Standby(acquire_at=now), now)
        leader = Leader(event.epoch, event.sent, event.sent + RENEW_EVERY_S, event.expires_at)
        after = _leader_tick(leader, now)
        return replace(after, actions=(Act(event.epoch), *after.actions))
    if isinstance(event, Notified):
        return _standby_tick(Standby(acquire_at=now), now)
    # Tick, NotAcquired, AcquireFailed: the next attempt stays as scheduled; renewal
    # results are of an epoch this holder no longer acts for.
    return _standby_tick(state, now)


def _standby_tick(state: Standby, now: float) -> Decision:
    if now >= state.acquire_at:
        nxt = now + ACQUIRE_EVERY_S
        return Decision(Standby(acquire_at=nxt), (Acquire(),), nxt)
    return Decision(state, (), state.acquire_at)


def _leader(state: Leader, event: Event) -> Decision:
    now = event.now
    if isinstance(event, Renewed) and event.epoch == state.epoch:
        if event.sent > state.last_renewed:
            state = replace(state, last_renewed=event.sent, expires_at=event.expires_at)
        return _leader_tick(state, now)
    if isinstance(event, RenewalLost) and event.epoch == state.epoch:
        stop = StopActing(state.epoch, StopReason.LOST)
        nxt = now + ACQUIRE_EVERY_S
        return Decision(Standby(acquire_at=nxt), (stop,), nxt)
    # Tick, RenewalFailed, and anything of another epoch or for a standby.
    return _leader_tick(state, now)


def _leader_tick(state: Leader, now: float) -> Decision:
    if now >= state.acting_until:
        stop = StopActing(state.epoch, StopReason.SILENCE)
        after = _standby_tick(Standby(acquire_at=now), now)
        return replace(after, actions=(stop, *after.actions))
    if now >= state.renew_at:
        state = replace(state, renew_at=now + RENEW_EVERY_S)
        return Decision(state, (Renew(state.epoch),), min(state.renew_at, state.acting_until))
    return Decision(state, (), min(state.renew_at, state.acting_until))


# --- the SQL of the same rules (PostgreSQL; executed by the adapter) ----------------------

LEASE_TABLE: Final = "leader_lease"
LEASE_NOTIFY_CHANNEL: Final = "llmd_lease"  # payload: the cluster's name

LEASE_TABLE_DDL: Final = f"""
CREATE TABLE {LEASE_TABLE} (
    cluster    text PRIMARY KEY,
    holder     text,
    epoch      bigint NOT NULL CHECK (epoch >= 1),
    expires_at timestamptz NOT NULL
)
"""

# decide_acquisition + compare_and_set in one statement: the upsert locks the row, so a
# racing candidate re-evaluates the WHERE on the winner's row (holder set, not expired)
# and writes nothing. Parameters: cluster, holder, lease_s. Returns (epoch, expires_at)
# when acquired, no row otherwise.
ACQUIRE_SQL: Final = f"""
INSERT INTO {LEASE_TABLE} AS l (cluster, holder, epoch, expires_at)
VALUES (%(cluster)s, %(holder)s, 1, now() + make_interval(secs => %(lease_s)s))
ON CONFLICT (cluster) DO UPDATE
    SET holder = EXCLUDED.holder, epoch = l.epoch + 1, expires_at = EXCLUDED.expires_at
    WHERE l.holder IS NULL OR l.expires_at <= now() OR l.holder = EXCLUDED.holder
RETURNING epoch, expires_at
"""

# A renewal extends only the holder's own, unexpired tenure. Parameters: cluster, holder,
# epoch, lease_s. No row returned: RenewalLost.
RENEW_SQL: Final = f"""
UPDATE {LEASE_TABLE}
SET expires_at = now() + make_interval(secs => %(lease_s)s)
WHERE cluster = %(cluster)s AND holder = %(holder)s AND epoch = %(epoch)s
    AND expires_at > now()
RETURNING expires_at
"""

# Release keeps the epoch (the next acquisition increments it) and tells the standbys.
# Parameters: cluster, holder, epoch.
RELEASE_SQL: Final = f"""
WITH released AS (
    UPDATE {LEASE_TABLE} SET holder = NULL, expires_at = now()
    WHERE cluster = %(cluster)s AND holder = %(holder)s AND epoch = %(epoch)s
    RETURNING cluster
)
SELECT pg_notify('{LEASE_NOTIFY_CHANNEL}', cluster) FROM released
"""
