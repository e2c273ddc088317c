"""The leadership lease (`core.ha.lease`): the compare-and-set rule, every transition of the
holder's view, clock skew, late renewals, a long partition and racing candidates."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from llmd_supervisor.core.ha.lease import (
    ACQUIRE_EVERY_S,
    ACQUIRE_SQL,
    LEASE_S,
    RELEASE_SQL,
    RENEW_EVERY_S,
    RENEW_SQL,
    STATEMENT_TIMEOUT_S,
    STOP_ACTING_AFTER_S,
    Acquire,
    Acquired,
    AcquireFailed,
    Act,
    Decision,
    Event,
    Leader,
    LeaseRow,
    NotAcquired,
    Notified,
    Release,
    Renew,
    RenewalFailed,
    RenewalLost,
    Renewed,
    ShutdownRequested,
    Standby,
    State,
    StopActing,
    Stopping,
    StopReason,
    Tick,
    acting_time_left,
    compare_and_set,
    decide_acquisition,
    start,
    step,
)

DB = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)  # the database's clock
LATER = DB + timedelta(seconds=LEASE_S)


def at(seconds: float) -> datetime:
    return DB + timedelta(seconds=seconds)


def test_the_timings_are_the_issue_s() -> None:
    assert (RENEW_EVERY_S, LEASE_S, STOP_ACTING_AFTER_S) == (2.0, 15.0, 10.0)
    # a holder stops acting well before its row can expire, and renews several times first
    assert STOP_ACTING_AFTER_S + RENEW_EVERY_S < LEASE_S
    assert STATEMENT_TIMEOUT_S < RENEW_EVERY_S <= ACQUIRE_EVERY_S


# --- the compare-and-set rule ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "candidate", "db_now", "expected_epoch"),
    [
        pytest.param(None, "b", DB, 1, id="no row: epoch 1"),
        pytest.param(LeaseRow("c", None, 4, at(100)), "b", DB, 5, id="released"),
        pytest.param(LeaseRow("c", "a", 4, DB), "b", DB, 5, id="expires exactly now"),
        pytest.param(LeaseRow("c", "a", 4, at(-1)), "b", DB, 5, id="expired"),
        pytest.param(LeaseRow("c", "a", 4, at(1)), "b", DB, None, id="held by another"),
        pytest.param(LeaseRow("c", "b", 4, at(14)), "b", DB, 5, id="own row: new epoch"),
        pytest.param(LeaseRow("c", "b", 4, at(-30)), "b", DB, 5, id="own expired row"),
    ],
)
def test_who_may_acquire(
    row: LeaseRow | None, candidate: str, db_now: datetime, expected_epoch: int | None
) -> None:
    written = decide_acquisition(row, "c", candidate, db_now)
    if expected_epoch is None:
        assert written is None
    else:
        assert written == LeaseRow("c", candidate, expected_epoch, db_now + timedelta(seconds=15))


def test_a_candidate_needs_a_name() -> None:
    with pytest.raises(ValueError, match="holder name"):
        decide_acquisition(None, "c", "", DB)


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(None, id="both read no row"),
        pytest.param(LeaseRow("c", "old", 7, at(-2)), id="both read an expired row"),
        pytest.param(LeaseRow("c", None, 7, at(-2)), id="both read a released row"),
    ],
)
@pytest.mark.parametrize("first", ["a", "b"])
def test_two_racing_candidates_exactly_one_wins(read: LeaseRow | None, first: str) -> None:
    """Both decide on the same read; whichever write reaches the row first wins and the
    other's condition (the epoch it read) no longer holds."""
    read_epoch = None if read is None else read.epoch
    writes = {c: decide_acquisition(read, "c", c, DB) for c in ("a", "b")}
    assert all(w is not None for w in writes.values())
    stored = read
    won = []
    for c in (first, "b" if first == "a" else "a"):
        w = writes[c]
        assert w is not None
        stored, ok = compare_and_set(stored, read_epoch, w)
        if ok:
            won.append(c)
    assert won == [first]
    assert stored is not None and stored.holder == first
    assert stored.epoch == (1 if read is None else 8)
    # the loser, reading again, may not acquire: the winner's row is fresh
    assert decide_acquisition(stored, "c", "b" if first == "a" else "a", at(1)) is None


def test_the_epoch_grows_with_every_acquisition() -> None:
    row: LeaseRow | None = None
    epochs = []
    db_now = DB
    for holder in ["a", "b", "b", "a", "c"]:
        new = decide_acquisition(row, "c", holder, db_now)
        if new is None:  # held by another: wait for it to expire
            db_now = row.expires_at if row is not None else db_now
            new = decide_acquisition(row, "c", holder, db_now)
        assert new is not None
        stored, ok = compare_and_set(row, None if row is None else row.epoch, new)
        assert ok and stored is not None
        row = stored
        epochs.append(stored.epoch)
    assert epochs == [1, 2, 3, 4, 5]


def test_the_sql_carries_the_same_rule() -> None:
    """The adapter's statements say what the pure functions decide (run against a real
    PostgreSQL in the adapter slice)."""
    flat = " ".join(ACQUIRE_SQL.split())
    assert "epoch = l.epoch + 1" in flat
    assert "l.holder IS NULL OR l.expires_at <= now() OR l.holder = EXCLUDED.holder" in flat
    assert "RETURNING epoch, expires_at" in flat
    renew = " ".join(RENEW_SQL.split())
    assert "holder = %(holder)s AND epoch = %(epoch)s AND expires_at > now()" in renew
    assert "pg_notify('llmd_lease', cluster)" in RELEASE_SQL
    for sql in (ACQUIRE_SQL, RENEW_SQL, RELEASE_SQL):
        assert "clock_timestamp" not in sql  # one clock: the database's now()


# --- the holder's view ------------------------------------------------------------------


def leader(epoch: int = 3, last_renewed: float = 100.0, renew_at: float = 102.0) -> Leader:
    return Leader(epoch, last_renewed, renew_at, LATER)


ROWS: list[tuple[str, State, Event, Decision]] = [
    # standby
    (
        "standby: tick before its attempt",
        Standby(50.0),
        Tick(49.0),
        Decision(Standby(50.0), (), 50.0),
    ),
    (
        "standby: tick at its attempt",
        Standby(50.0),
        Tick(50.0),
        Decision(Standby(52.0), (Acquire(),), 52.0),
    ),
    ("standby: late tick", Standby(50.0), Tick(57.5), Decision(Standby(59.5), (Acquire(),), 59.5)),
    (
        "standby: acquired",
        Standby(52.0),
        Acquired(epoch=4, sent=50.0, expires_at=LATER, now=50.3),
        Decision(Leader(4, 50.0, 52.0, LATER), (Act(4),), 52.0),
    ),
    (
        "standby: acquired, answer slow enough that a renewal is due",
        Standby(52.0),
        Acquired(epoch=4, sent=50.0, expires_at=LATER, now=52.5),
        Decision(Leader(4, 50.0, 54.5, LATER), (Act(4), Renew(4)), 54.5),
    ),
    (
        "standby: acquired too late to act",
        Standby(52.0),
        Acquired(epoch=4, sent=50.0, expires_at=LATER, now=60.0),
        Decision(Standby(62.0), (Acquire(),), 62.0),
    ),
    (
        "standby: not acquired",
        Standby(52.0),
        NotAcquired("a", LATER, 50.2),
        Decision(Standby(52.0), (), 52.0),
    ),
    (
        "standby: acquisition failed",
        Standby(52.0),
        AcquireFailed("timeout", 51.5),
        Decision(Standby(52.0), (), 52.0),
    ),
    (
        "standby: notified of a release",
        Standby(52.0),
        Notified(50.7),
        Decision(Standby(52.7), (Acquire(),), 52.7),
    ),
    (
        "standby: stale renewal ignored",
        Standby(52.0),
        Renewed(3, 49.0, LATER, 50.0),
        Decision(Standby(52.0), (), 52.0),
    ),
    (
        "standby: stale loss ignored",
        Standby(52.0),
        RenewalLost(3, 50.0),
        Decision(Standby(52.0), (), 52.0),
    ),
    ("standby: shutdown", Standby(52.0), ShutdownRequested(50.0), Decision(Stopping(), (), None)),
    # leader
    ("leader: tick before renewal", leader(), Tick(101.0), Decision(leader(), (), 102.0)),
    (
        "leader: renewal due",
        leader(),
        Tick(102.0),
        Decision(leader(renew_at=104.0), (Renew(3),), 104.0),
    ),
    (
        "leader: renewed",
        leader(renew_at=104.0),
        Renewed(3, sent=102.0, expires_at=LATER + timedelta(seconds=2), now=102.1),
        Decision(Leader(3, 102.0, 104.0, LATER + timedelta(seconds=2)), (), 104.0),
    ),
    (
        "leader: renewal succeeded late, counted from when it was sent",
        leader(renew_at=104.0),
        Renewed(3, sent=102.0, expires_at=LATER, now=109.0),
        Decision(Leader(3, 102.0, 111.0, LATER), (Renew(3),), 111.0),
    ),
    (
        "leader: renewal succeeded after the deadline it would have moved",
        leader(renew_at=104.0),
        Renewed(3, sent=102.0, expires_at=LATER, now=112.0),
        Decision(Standby(114.0), (StopActing(3, StopReason.SILENCE), Acquire()), 114.0),
    ),
    (
        "leader: an older renewal answering after a newer one moves nothing back",
        leader(last_renewed=104.0, renew_at=106.0),
        Renewed(3, sent=102.0, expires_at=DB, now=104.5),
        Decision(leader(last_renewed=104.0, renew_at=106.0), (), 106.0),
    ),
    (
        "leader: renewal failed",
        leader(renew_at=104.0),
        RenewalFailed(3, "timeout", 103.5),
        Decision(leader(renew_at=104.0), (), 104.0),
    ),
    (
        "leader: renewal failed at the deadline",
        leader(renew_at=110.0),
        RenewalFailed(3, "connection reset", 110.0),
        Decision(Standby(112.0), (StopActing(3, StopReason.SILENCE), Acquire()), 112.0),
    ),
    (
        "leader: renewal updated no row",
        leader(renew_at=104.0),
        RenewalLost(3, 102.2),
        Decision(Standby(104.2), (StopActing(3, StopReason.LOST),), 104.2),
    ),
    (
        "leader: loss of another epoch ignored",
        leader(renew_at=104.0),
        RenewalLost(2, 102.2),
        Decision(leader(renew_at=104.0), (), 104.0),
    ),
    (
        "leader: deadline just before",
        leader(renew_at=111.0),
        Tick(109.999),
        Decision(leader(renew_at=111.0), (), 110.0),
    ),
    (
        "leader: deadline",
        leader(renew_at=111.0),
        Tick(110.0),
        Decision(Standby(112.0), (StopActing(3, StopReason.SILENCE), Acquire()), 112.0),
    ),
    (
        "leader: shutdown releases",
        leader(),
        ShutdownRequested(101.0),
        Decision(Stopping(), (StopActing(3, StopReason.SHUTDOWN), Release(3)), None),
    ),
    (
        "leader: a notification changes nothing",
        leader(),
        Notified(101.0),
        Decision(leader(), (), 102.0),
    ),
    # stopping
    ("stopping: tick", Stopping(), Tick(200.0), Decision(Stopping(), (), None)),
    (
        "stopping: renewal",
        Stopping(),
        Renewed(3, 199.0, LATER, 200.0),
        Decision(Stopping(), (), None),
    ),
    (
        "stopping: an acquisition that still wins is released",
        Stopping(),
        Acquired(9, 199.0, LATER, 200.0),
        Decision(Stopping(), (Release(9),), None),
    ),
    (
        "stopping: shutdown again",
        Stopping(),
        ShutdownRequested(200.0),
        Decision(Stopping(), (), None),
    ),
]


@pytest.mark.parametrize(
    ("state", "event", "expected"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_step(state: State, event: Event, expected: Decision) -> None:
    assert step(state, event) == expected


def test_a_daemon_starts_as_a_standby_trying_at_once() -> None:
    assert start(7.0) == Decision(Standby(9.0), (Acquire(),), 9.0)


def run(state: State, events: list[Event]) -> tuple[State, list[object]]:
    actions: list[object] = []
    for event in events:
        decision = step(state, event)
        state = decision.state
        actions += decision.actions
    return state, actions


@pytest.mark.parametrize("skew", [timedelta(0), timedelta(hours=-3), timedelta(days=400)])
def test_the_database_clock_s_value_changes_nothing(skew: timedelta) -> None:
    """Only monotonic times decide: the database's expires_at (whatever its offset from
    this host's wall clock) is reported, never compared."""
    events: list[Event] = [
        Acquired(1, sent=0.0, expires_at=DB + skew, now=0.1),
        Tick(2.0),
        Renewed(1, sent=2.0, expires_at=DB + skew + timedelta(seconds=2), now=2.1),
        Tick(4.0),
        RenewalFailed(1, "timeout", 5.5),
        Tick(6.0),
        RenewalFailed(1, "timeout", 7.5),
        Tick(11.9),
        Tick(12.0),
    ]
    state, actions = run(Standby(0.0), events)
    assert actions == [
        Act(1),
        Renew(1),
        Renew(1),
        Renew(1),
        Renew(1),
        StopActing(1, StopReason.SILENCE),
        Acquire(),
    ]
    assert state == Standby(14.0)


def test_a_partition_longer_than_ten_seconds() -> None:
    """Renewals stop answering at 20 s (each times out); the holder stops acting at
    exactly 10 s after the last successful one was sent, keeps trying to acquire every
    2 s while cut off, and acts again (a new epoch) once its link is back."""
    state: State = Leader(5, 20.0, 22.0, LATER)
    events: list[Event] = []
    t = 22.0
    while t < 30.0:
        events += [Tick(t), RenewalFailed(5, "timeout", t + STATEMENT_TIMEOUT_S)]
        t += RENEW_EVERY_S
    events.append(Tick(30.0))
    state, actions = run(state, events)
    assert actions == [Renew(5)] * 4 + [StopActing(5, StopReason.SILENCE), Acquire()]
    assert acting_time_left(state, 30.0) == 0.0
    # still cut off: attempts every 2 s fail
    state, actions = run(
        state, [AcquireFailed("timeout", 31.5), Tick(32.0), AcquireFailed("x", 33.5)]
    )
    assert actions == [Acquire()] and isinstance(state, Standby)
    # the link is back at 41 s: its own row (or an expired one) is acquired with epoch 6
    state, actions = run(state, [Tick(41.0), Acquired(6, sent=41.0, expires_at=LATER, now=41.2)])
    assert actions == [Acquire(), Act(6)]
    assert state == Leader(6, 41.0, 43.0, LATER)


def test_acting_time_left_bounds_a_side_effect() -> None:
    state = leader(last_renewed=100.0)
    assert acting_time_left(state, 100.0) == STOP_ACTING_AFTER_S
    assert acting_time_left(state, 104.0) == pytest.approx(6.0)
    assert acting_time_left(state, 111.0) == 0.0
    assert acting_time_left(Standby(0.0), 0.0) == 0.0
    assert acting_time_left(Stopping(), 0.0) == 0.0


def test_a_leader_renewing_on_time_acts_forever() -> None:
    state: State = Leader(2, 0.0, 2.0, LATER)
    for k in range(1, 200):
        t = k * RENEW_EVERY_S
        d = step(state, Tick(t))
        assert d.actions == (Renew(2),)
        d = step(d.state, Renewed(2, sent=t, expires_at=LATER, now=t + 0.4))
        assert d.actions == ()
        state = d.state
    assert isinstance(state, Leader) and state.last_renewed == 398.0


def test_never_two_acting_holders() -> None:
    """The holder that loses its row stops acting (at once on a renewal that updates no
    row, by its deadline otherwise) before the row can expire for the next one: a
    leader that stopped hearing the database at t stops at t + 10 s, the row expires at
    t + 15 s at the earliest, and only then may another candidate acquire."""
    old = Leader(1, 0.0, 2.0, at(15))
    _, actions = run(old, [Tick(2.0), RenewalFailed(1, "cut", 3.5), Tick(4.0), Tick(10.0)])
    assert StopActing(1, StopReason.SILENCE) in actions
    stopped_at = 10.0
    row = LeaseRow("c", "old", 1, at(0) + timedelta(seconds=LEASE_S))  # written at t=0
    assert decide_acquisition(row, "c", "new", at(stopped_at)) is None
    assert decide_acquisition(row, "c", "new", at(LEASE_S)) == LeaseRow("c", "new", 2, at(30))
