"""The run journal against real SQLite files on disk and a real PostgreSQL server
(`journal` runs a test on both: ``[sqlite]``, ``[postgresql]``; tests/postgres.py)."""

from __future__ import annotations

import re
import sqlite3
import stat
from collections.abc import AsyncIterator, Iterator
from contextlib import closing, contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import cast

import anyio
import anyio.lowlevel
import pytest
import pytest_asyncio

from llmd_supervisor.adapters.journal.db import Db, SqliteDb
from llmd_supervisor.adapters.journal.schema import MIGRATIONS
from llmd_supervisor.adapters.journal.store import (
    SCHEMA_VERSION,
    Journal,
    NewEvent,
    RunMeta,
    StoredRun,
)
from llmd_supervisor.core.run.lifecycle import (
    Archived,
    CancelRequested,
    Event,
    LeftQueue,
    Requeued,
    Run,
    RunState,
    Started,
    Submit,
    Submitted,
    Verified,
    WatchersStopped,
    new_run,
    step,
)
from llmd_supervisor.core.run.retry_policy import Evidence, NodeFailure
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import JournalConflict, JournalError, JournalSchemaTooNew
from tests.postgres import JournalTarget

T0 = datetime(2025, 3, 4, 5, 6, 7, 890123, tzinfo=UTC)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def meta(*, owner_uid: int = 1000, created_at: datetime = T0, cluster: str = "dev") -> RunMeta:
    return RunMeta(
        owner_uid=owner_uid,
        cluster=cluster,
        spec_toml='name = "demo"\n[bench]\nrc = 0\n',
        script="#!/bin/bash\n#SBATCH --job-name=x\nsrun true\n",
        log_dir="/shared/logs/r",
        archive_dir="/var/lib/llmd/archive/r",
        created_at=created_at,
    )


def advance(run: Run, *events: Event, start: float = 1.0) -> Run:
    for i, event in enumerate(events):
        run, _ = step(run, event, at(start + i))
    return run


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection to the journal file, closed afterwards."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        yield conn


@pytest_asyncio.fixture
async def journal(journal_target: JournalTarget) -> AsyncIterator[Journal]:
    """A new journal on each backend."""
    async with await journal_target.open() as j:
        yield j


@pytest_asyncio.fixture
async def sqlite_journal(tmp_path: Path) -> AsyncIterator[Journal]:
    """A new SQLite journal, for what only SQLite has (pragmas, its file)."""
    async with await Journal.open(tmp_path / "state" / "journal.db") as j:
        yield j


async def inserted(
    journal: Journal, run_id: str, *, owner_uid: int = 1000, created_at: datetime = T0
) -> Run:
    run = new_run(run_id, f"llmd-{run_id}", at(0))
    await journal.insert_run(run, meta(owner_uid=owner_uid, created_at=created_at))
    return run


# --- round trip -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_saved_transition_and_its_event_are_one_write(journal: Journal) -> None:
    """The run's `run.transition` event is written with the save, or not at all: a save
    the compare-and-set refuses adds no event either."""
    run = await inserted(journal, "r-ev")
    submitting, _ = step(run, Submit(), at(1))
    moved = NewEvent("run.transition", {"from": "accepted", "to": "submitting"}, at(1))
    await journal.save(submitting, expected=RunState.ACCEPTED, events=[moved])
    stale = NewEvent("run.transition", {"from": "accepted", "to": "submitting"}, at(2))
    with pytest.raises(JournalConflict):
        await journal.save(submitting, expected=RunState.ACCEPTED, events=[stale])
    logged = await journal.events("r-ev")
    assert [(e["kind"], e["to"]) for e in logged] == [("run.transition", "submitting")]
    with pytest.raises(JournalError, match="may not use the keys"):
        bad = NewEvent("x", {"kind": "y"}, at(3))
        await journal.save(submitting, expected=RunState.SUBMITTING, events=[bad])


@pytest.mark.asyncio
async def test_round_trip_through_the_whole_lifecycle(journal: Journal) -> None:
    run = new_run("r-1", "llmd-r-1", T0)
    m = meta()
    await journal.insert_run(run, m)
    assert await journal.get("r-1") == StoredRun(run, m)

    plus_two = timezone(timedelta(hours=2))
    events: list[tuple[Event, datetime]] = [
        (Submit(), at(1)),
        (Submitted("4242"), at(2)),
        (Started(("node-a", "node-b")), at(3).astimezone(plus_two)),
        (Requeued(), at(4)),
        (Started(("node-c", "node-d")), at(5)),
        (CancelRequested(), at(6)),
        (LeftQueue(), at(7)),
        (WatchersStopped(), at(8)),
        (Verified(Outcome.CANCELLED, "scancel by user 1000"), at(9)),
        (Archived(), at(10)),
    ]
    for event, when in events:
        before = run.state
        run, _ = step(run, event, when)
        await journal.save(run, expected=before)
        stored = await journal.get("r-1")
        assert stored == StoredRun(run, m)
        assert stored is not None
        assert all(t.at.tzinfo is UTC for t in stored.run.transitions)

    assert run.state is RunState.CANCELLED
    assert run.attempt == 2
    assert run.cancel_requested
    stored = await journal.get("r-1")
    assert stored is not None
    assert stored.run.outcome is Outcome.CANCELLED
    assert stored.run.nodes == ("node-c", "node-d")
    assert len(stored.run.transitions) == 10  # accepted + 9 state changes (cancel is a flag)
    assert await journal.find_by_job_name("llmd-r-1") == stored
    assert await journal.find_by_job_name("llmd-nope") is None
    assert await journal.get("nope") is None


@pytest.mark.asyncio
async def test_pragmas_are_as_promised(sqlite_journal: Journal) -> None:
    def pragmas(db: Db) -> tuple[object, ...]:
        conn = cast(SqliteDb, db).conn
        return tuple(
            conn.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
        )

    mode, synchronous, foreign_keys, busy = await sqlite_journal.read("test", pragmas)
    assert (mode, synchronous, foreign_keys) == ("wal", 2, 1)  # 2 is FULL
    assert isinstance(busy, int)
    assert busy > 0


# --- compare-and-set and conflicts ------------------------------------------------------------


@pytest.mark.asyncio
async def test_save_with_wrong_expected_state_is_a_conflict(journal: Journal) -> None:
    run = await inserted(journal, "r-1")
    submitting = advance(run, Submit())
    await journal.save(submitting, expected=RunState.ACCEPTED)
    pending = advance(submitting, Submitted("7"), start=2)

    with pytest.raises(JournalConflict) as info:
        await journal.save(pending, expected=RunState.ACCEPTED)
    err = info.value
    assert (err.run_id, err.expected, err.actual) == ("r-1", "accepted", "submitting")
    assert "r-1" in str(err)
    assert "'accepted'" in str(err)
    assert "'submitting'" in str(err)
    assert journal.location in str(err)
    stored = await journal.get("r-1")
    assert stored is not None
    assert stored.run == submitting


@pytest.mark.asyncio
async def test_stale_copy_in_the_same_state_is_a_conflict(journal: Journal) -> None:
    run = await inserted(journal, "r-1")
    pending = advance(run, Submit(), Submitted("7"))
    await journal.save(pending, expected=RunState.ACCEPTED)
    # Another task sees the job start and be requeued: pending again, attempt 2.
    requeued = advance(pending, Started(("n1",)), Requeued(), start=5)
    await journal.save(requeued, expected=RunState.PENDING)
    # A stale holder of the first pending copy must not overwrite attempt 2.
    stale = replace(pending, cancel_requested=True)
    with pytest.raises(JournalConflict, match="do not extend"):
        await journal.save(stale, expected=RunState.PENDING)
    stored = await journal.get("r-1")
    assert stored is not None
    assert stored.run == requeued


@pytest.mark.asyncio
async def test_non_state_change_is_saved_with_expected_equal_to_state(journal: Journal) -> None:
    run = await inserted(journal, "r-1")
    running = advance(run, Submit(), Submitted("7"), Started(("n1", "n2")))
    await journal.save(running, expected=RunState.ACCEPTED)
    flagged, actions = step(running, CancelRequested(), at(9))
    assert actions
    await journal.save(flagged, expected=RunState.RUNNING)
    stored = await journal.get("r-1")
    assert stored is not None
    assert stored.run.cancel_requested
    assert stored.run == flagged


@pytest.mark.asyncio
async def test_save_of_unknown_run_is_a_conflict(journal: Journal) -> None:
    run = new_run("ghost", "llmd-ghost", T0)
    with pytest.raises(JournalConflict, match="no such run"):
        await journal.save(run, expected=RunState.ACCEPTED)


@pytest.mark.asyncio
async def test_inconsistent_run_record_is_refused(journal: Journal) -> None:
    run = await inserted(journal, "r-1")
    with pytest.raises(JournalError, match="last transition"):
        await journal.save(replace(run, state=RunState.RUNNING), expected=RunState.ACCEPTED)


@pytest.mark.asyncio
async def test_naive_datetimes_are_refused(journal: Journal) -> None:
    naive = datetime(2025, 1, 1, 12, 0)
    with pytest.raises(JournalError, match="no timezone"):
        await journal.insert_run(new_run("r-1", "j-1", naive), meta())
    with pytest.raises(JournalError, match="no timezone"):
        await journal.insert_run(new_run("r-2", "j-2", T0), meta(created_at=naive))
    assert await journal.list_runs() == []


@pytest.mark.asyncio
async def test_duplicate_run_id_or_job_name_is_a_conflict(journal: Journal) -> None:
    original = await inserted(journal, "r-1")
    with pytest.raises(JournalConflict, match="run id") as info:
        await journal.insert_run(new_run("r-1", "llmd-other", at(1)), meta(owner_uid=2))
    assert info.value.run_id == "r-1"
    with pytest.raises(JournalConflict, match="job name 'llmd-r-1'"):
        await journal.insert_run(new_run("r-2", "llmd-r-1", at(1)), meta(owner_uid=2))
    runs = await journal.list_runs()
    assert [s.run for s in runs] == [original]
    assert runs[0].meta == meta()


# --- listing ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_list_runs_filters_and_orders_by_creation(journal: Journal) -> None:
    # Inserted out of creation order, two owners, some final.
    specs = [("c", 1000, 3), ("a", 1000, 1), ("d", 2000, 4), ("b", 2000, 2), ("e", 1000, 0.5)]
    for run_id, owner, minute in specs:
        await inserted(journal, run_id, owner_uid=owner, created_at=at(minute))
    cancelled, _ = step((await _get(journal, "a")).run, CancelRequested(), at(9))
    await journal.save(cancelled, expected=RunState.ACCEPTED)
    failed = advance(
        (await _get(journal, "d")).run,
        Submit(),
        Submitted("1"),
        LeftQueue(),
        WatchersStopped(),
        Verified(Outcome.FAILED, "bench rc 7"),
        Archived(),
    )
    await journal.save(failed, expected=RunState.ACCEPTED)

    async def ids(*, active_only: bool = False, owner_uid: int | None = None) -> list[str]:
        runs = await journal.list_runs(active_only=active_only, owner_uid=owner_uid)
        return [s.run.run_id for s in runs]

    assert await ids() == ["e", "a", "b", "c", "d"]
    assert await ids(active_only=True) == ["e", "b", "c"]
    assert await ids(owner_uid=1000) == ["e", "a", "c"]
    assert await ids(owner_uid=2000, active_only=True) == ["b"]
    assert await ids(owner_uid=3000) == []
    listed = {s.run.run_id: s for s in await journal.list_runs()}
    assert listed["d"].run == failed
    assert listed["a"].run == cancelled
    assert listed["c"].meta.created_at == at(3)


async def _get(journal: Journal, run_id: str) -> StoredRun:
    stored = await journal.get(run_id)
    assert stored is not None
    return stored


# --- events and offsets -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_events_keep_order_and_fields(journal: Journal) -> None:
    await inserted(journal, "r-1")
    await inserted(journal, "r-2")
    await journal.add_event("r-1", "run.submitted", {"job_id": "7", "attempt": 1}, at(2))
    await journal.add_event("r-2", "run.other", {}, at(1))
    await journal.add_event(
        "r-1", "node.unreachable", {"host": "n1", "silent_s": 31.5, "ok": None}, at(1)
    )
    await journal.add_event("r-1", "stalled", {"logs": ["a.log", "b.log"], "note": "é"}, at(3))

    assert await journal.events("r-1") == [
        {"at": at(2).isoformat(), "kind": "run.submitted", "job_id": "7", "attempt": 1},
        {
            "at": at(1).isoformat(),
            "kind": "node.unreachable",
            "host": "n1",
            "silent_s": 31.5,
            "ok": None,
        },
        {"at": at(3).isoformat(), "kind": "stalled", "logs": ["a.log", "b.log"], "note": "é"},
    ]
    assert await journal.events("r-2") == [{"at": at(1).isoformat(), "kind": "run.other"}]
    assert await journal.events("nope") == []


@pytest.mark.asyncio
async def test_bad_events_are_refused(journal: Journal) -> None:
    await inserted(journal, "r-1")
    with pytest.raises(JournalError, match="keys"):
        await journal.add_event("r-1", "x", {"kind": "y"}, at(1))
    with pytest.raises(JournalError, match="not JSON"):
        await journal.add_event("r-1", "x", {"when": datetime.now(UTC)}, at(1))
    with pytest.raises(JournalError, match="not JSON"):
        await journal.add_event("r-1", "x", {"v": float("nan")}, at(1))
    with pytest.raises(JournalError, match="no run ghost"):
        await journal.add_event("ghost", "x", {}, at(1))
    assert await journal.events("r-1") == []


# --- opening, migrations, reopening ------------------------------------------------------------


@pytest.mark.asyncio
async def test_open_creates_directory_and_migrates_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "journal.db"
    async with await Journal.open(path):
        pass
    assert stat.S_IMODE(path.parent.stat().st_mode) & ~0o750 == 0
    assert stat.S_IMODE(path.stat().st_mode) & ~0o600 == 0

    empty = tmp_path / "empty.db"
    empty.touch()
    async with await Journal.open(empty) as j:
        await inserted(j, "r-1")
    with raw(empty) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "transitions", "events"} <= tables
    assert "log_offsets" not in tables


def _version_1_database(path: Path) -> None:
    """A journal as version 1 left it: a run with transitions, an event and a log offset."""
    with raw(path) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("BEGIN")
        for statement in MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                *("r-old", "llmd-r-old", "running", 1, "4242", '["n1", "n2"]', 0, None, ""),
                *(1000, "dev", 'name = "demo"\n', "#!/bin/bash\n", "/shared/r", "/arch/r"),
                *(_stamp(0), _stamp(3)),
            ),
        )
        conn.executemany(
            "INSERT INTO transitions VALUES ('r-old', ?, ?, ?, ?)",
            [
                (0, "accepted", _stamp(0), "accepted"),
                (1, "submitting", _stamp(1), "Submit"),
                (2, "pending", _stamp(2), "Submitted"),
                (3, "running", _stamp(3), "Started"),
            ],
        )
        conn.execute(
            "INSERT INTO events (run_id, at, kind, fields) VALUES ('r-old', ?, 'x', ?)",
            (_stamp(1), '{"n": 1}'),
        )
        conn.execute("INSERT INTO log_offsets VALUES ('r-old', 'batch.out', 77, ?)", (_stamp(3),))
        conn.execute("PRAGMA user_version = 1")
        conn.execute("COMMIT")


def _stamp(minutes: float) -> str:
    return at(minutes).isoformat(timespec="microseconds")


@pytest.mark.asyncio
async def test_a_version_1_journal_migrates_and_keeps_its_runs(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    _version_1_database(path)
    async with await Journal.open(path) as journal:
        stored = await journal.get("r-old")
        assert stored is not None
        assert stored.run.state is RunState.RUNNING
        assert stored.run.slurm_job_id == "4242"
        assert stored.run.nodes == ("n1", "n2")
        assert [t.state for t in stored.run.transitions] == [
            RunState.ACCEPTED,
            RunState.SUBMITTING,
            RunState.PENDING,
            RunState.RUNNING,
        ]
        assert stored.meta.created_at == at(0)
        assert stored.meta.log_dir == "/shared/r"
        assert await journal.events("r-old") == [{"at": _stamp(1), "kind": "x", "n": 1}]
        # The migrated journal goes on working: the run steps on, new runs go in.
        left = advance(stored.run, LeftQueue(), start=4)
        await journal.save(left, expected=RunState.RUNNING)
        await inserted(journal, "r-new")
        assert [s.run.run_id for s in await journal.list_runs()] == ["r-old", "r-new"]
    with raw(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 10
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "log_offsets" not in tables
        assert {"campaigns", "campaign_jobs", "verified_points"} <= tables
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    async with await Journal.open(path) as journal:  # a migrated journal reopens as it is
        again = await journal.get("r-old")
        assert again is not None
        assert again.run == left


# --- node failures (core.run.retry_policy's quarantine) ----------------------------------------


def _failure(node: str, run_id: str, minutes: float, **changes: object) -> NodeFailure:
    f = NodeFailure("dev", node, 1000, run_id, 1, Evidence.INFERRED, "its engine died", at(minutes))
    return replace(f, **changes)  # type: ignore[arg-type]  # test values


@pytest.mark.asyncio
async def test_node_failures_are_counted_once_per_attempt_and_forgotten_when_old(
    journal: Journal,
) -> None:
    first = _failure("node5", "r1", 0)
    await journal.count_node_failure(first, forget_before=at(-60))
    again = replace(first, at=at(1), reason="counted again after a crash")
    await journal.count_node_failure(again, forget_before=at(-60))  # the same attempt
    other = _failure("node5", "r2", 2, owner_uid=1001, evidence=Evidence.OBSERVED)
    await journal.count_node_failure(other, forget_before=at(-60))
    await journal.count_node_failure(
        _failure("node6", "r1", 3, cluster="c2"), forget_before=at(-60)
    )
    assert await journal.node_failures("dev") == [first, other]
    assert [f.cluster for f in await journal.node_failures()] == ["dev", "dev", "c2"]
    retry = _failure("node5", "r1", 4, attempt=2)
    await journal.count_node_failure(retry, forget_before=at(1))  # r1's first is forgotten
    assert await journal.node_failures("dev") == [other, retry]
    assert await journal.release_node("dev", "node5")
    assert await journal.node_failures("dev") == []
    assert not await journal.release_node("dev", "node5")
    assert [f.node for f in await journal.node_failures()] == ["node6"]


def _version_3_database(path: Path) -> None:
    """A journal as version 3 left it: a run and the quarantine record its failure made."""
    _version_1_database(path)
    with raw(path) as conn:
        conn.execute("BEGIN")
        for statements in MIGRATIONS[1:3]:
            for statement in statements:
                conn.execute(statement)
        conn.execute(
            "INSERT INTO quarantine VALUES ('dev', 'node5', 3, 'its engine died', 'r-old', ?, ?)",
            (_stamp(0), _stamp(360)),
        )
        conn.execute(
            "INSERT INTO quarantine VALUES ('dev', 'node6', 1, 'x', 'gone', ?, ?)",
            (_stamp(1), _stamp(361)),
        )
        conn.execute("PRAGMA user_version = 3")
        conn.execute("COMMIT")


@pytest.mark.asyncio
async def test_a_version_3_quarantine_becomes_one_inferred_failure_of_its_runs_owner(
    tmp_path: Path,
) -> None:
    """What counted a version-3 record cannot be told apart any more: it keeps the node
    from nobody alone (issue 3.2: a job's word never quarantines a node for everyone)."""
    path = tmp_path / "journal.db"
    _version_3_database(path)
    async with await Journal.open(path) as journal:
        assert await journal.node_failures() == [
            NodeFailure(
                "dev", "node5", 1000, "r-old", 1, Evidence.INFERRED, "its engine died", at(0)
            ),
            NodeFailure("dev", "node6", -1, "gone", 1, Evidence.INFERRED, "x", at(1)),
        ]
    with raw(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "quarantine" not in tables and "node_failures" in tables


@pytest.mark.asyncio
async def test_a_node_failure_with_unknown_evidence_is_a_journal_error(
    sqlite_journal: Journal,
) -> None:
    journal = sqlite_journal
    await journal.count_node_failure(_failure("node5", "r1", 0), forget_before=at(-60))
    with raw(journal.path) as conn:
        conn.execute("DROP TABLE node_failures")
        conn.execute(
            "CREATE TABLE node_failures (cluster, node, owner_uid, run_id, attempt, evidence, "
            "reason, at, id)"
        )
        conn.execute(
            "INSERT INTO node_failures VALUES ('dev', 'n', 1, 'r', 1, 'rumour', 'x', ?, 1)",
            (_stamp(0),),
        )
    with pytest.raises(JournalError, match="evidence 'rumour'"):
        await journal.node_failures()


@pytest.mark.asyncio
async def test_a_newer_schema_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    newer = SCHEMA_VERSION + 5
    with raw(path) as conn:
        conn.execute(f"PRAGMA user_version = {newer}")
    with pytest.raises(JournalSchemaTooNew) as info:
        await Journal.open(path)
    message = str(info.value)
    assert f"schema is version {newer}, newer than this daemon's {SCHEMA_VERSION}" in message
    assert "upgrade llmd-supervisor" in message
    assert str(path) in message
    with raw(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == newer


@pytest.mark.asyncio
async def test_garbage_file_and_directory_are_journal_errors(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not an SQLite database, not even a little" * 100)
    with pytest.raises(JournalError, match=re.escape(str(garbage))):
        await Journal.open(garbage)
    directory = tmp_path / "dir.db"
    directory.mkdir()
    with pytest.raises(JournalError, match=re.escape(str(directory))):
        await Journal.open(directory)


@pytest.mark.asyncio
async def test_reopening_keeps_everything(journal_target: JournalTarget) -> None:
    journal = await journal_target.open()
    run = await inserted(journal, "r-1")
    running = advance(run, Submit(), Submitted("9"), Started(("n1",)))
    await journal.save(running, expected=RunState.ACCEPTED)
    await journal.add_event("r-1", "run.started", {"nodes": ["n1"]}, at(3))
    await journal.aclose()
    await journal.aclose()  # idempotent
    with pytest.raises(JournalError, match="closed"):
        await journal.get("r-1")

    async with await journal_target.open() as again:
        assert await again.get("r-1") == StoredRun(running, meta())
        assert await again.events("r-1") == [
            {"at": at(3).isoformat(), "kind": "run.started", "nodes": ["n1"]}
        ]
        assert [s.run.run_id for s in await again.list_runs(active_only=True)] == ["r-1"]


# --- sqlite errors surface as JournalError ----------------------------------------------------


@pytest.mark.asyncio
async def test_full_disk_is_a_journal_error_and_rolls_back(sqlite_journal: Journal) -> None:
    journal = sqlite_journal
    await inserted(journal, "r-1")

    def cap(db: Db) -> None:
        conn = cast(SqliteDb, db).conn
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")

    await journal.read("test", cap)
    big = replace(meta(), spec_toml="x" * 1_000_000)
    with pytest.raises(JournalError) as info:
        await journal.insert_run(new_run("r-2", "llmd-r-2", at(1)), big)
    assert not isinstance(info.value, JournalConflict)
    assert "SQLITE_FULL" in str(info.value)
    assert "insert run r-2" in str(info.value)
    assert str(journal.path) in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    # Nothing half-written, and the journal still works.
    assert [s.run.run_id for s in await journal.list_runs()] == ["r-1"]
    await journal.add_event("r-1", "after", {}, at(1))
    assert [e["kind"] for e in await journal.events("r-1")] == ["after"]


@pytest.mark.asyncio
async def test_read_only_database_is_a_journal_error(sqlite_journal: Journal) -> None:
    journal = sqlite_journal
    run = await inserted(journal, "r-1")
    await journal.read("test", lambda c: c.execute("PRAGMA query_only = ON"))
    with pytest.raises(JournalError, match="save run r-1") as info:
        await journal.save(advance(run, Submit()), expected=RunState.ACCEPTED)
    assert isinstance(info.value.__cause__, sqlite3.Error)
    await journal.read("test", lambda c: c.execute("PRAGMA query_only = OFF"))
    stored = await journal.get("r-1")
    assert stored is not None
    assert stored.run == run


# --- concurrency -------------------------------------------------------------------------------


async def _drive(journal: Journal, run_id: str) -> None:
    run = await inserted(journal, run_id)
    path: list[Event] = [
        Submit(),
        Submitted(run_id),
        Started(("n1", "n2")),
        LeftQueue(),
        WatchersStopped(),
        Verified(Outcome.SUCCEEDED, "ok"),
        Archived(),
    ]
    for i, event in enumerate(path):
        before = run.state
        run, _ = step(run, event, at(i + 1))
        await journal.save(run, expected=before)
        await journal.add_event(run_id, "step", {"i": i}, at(i + 1))


@pytest.mark.asyncio
async def test_many_tasks_saving_concurrently_are_serialised(journal: Journal) -> None:
    async with anyio.create_task_group() as tg:
        for i in range(40):
            tg.start_soon(_drive, journal, f"r-{i:02d}")
    runs = await journal.list_runs()
    assert len(runs) == 40
    assert all(s.run.state is RunState.SUCCEEDED for s in runs)
    assert await journal.list_runs(active_only=True) == []


@pytest.mark.asyncio
async def test_racing_compare_and_set_has_exactly_one_winner(journal: Journal) -> None:
    run = await inserted(journal, "r-1")
    outcomes: list[str] = []

    async def contender(i: int) -> None:
        candidate, _ = step(run, Submit(), at(i))
        try:
            await journal.save(candidate, expected=RunState.ACCEPTED)
        except JournalConflict as exc:
            assert exc.actual == "submitting"
            outcomes.append("conflict")
        else:
            outcomes.append(f"won {i}")

    async with anyio.create_task_group() as tg:
        for i in range(30):
            tg.start_soon(contender, i)
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1
    assert outcomes.count("conflict") == 29
    stored = await _get(journal, "r-1")
    assert stored.run.state is RunState.SUBMITTING
    assert len(stored.run.transitions) == 2


@pytest.mark.asyncio
async def test_two_journals_on_one_database_wait_for_each_other(
    journal_target: JournalTarget,
) -> None:
    async with await journal_target.open() as first, await journal_target.open() as second:
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(_drive, first, f"a-{i}")
                tg.start_soon(_drive, second, f"b-{i}")
        assert len(await first.list_runs(active_only=False)) == 20
        assert await second.list_runs(active_only=True) == []


# --- the event loop keeps running -----------------------------------------------------------


@pytest.mark.asyncio
async def test_event_loop_runs_while_a_save_waits_for_the_database(
    sqlite_journal: Journal,
) -> None:
    """A save blocked on SQLite's lock must not block the loop: only the loop can free it."""
    journal = sqlite_journal
    run = await inserted(journal, "r-1")
    ticks = 0
    with raw(journal.path) as other:
        other.execute("BEGIN IMMEDIATE")  # hold the write lock, as another process could

        async def ticker() -> None:
            nonlocal ticks
            while ticks < 200:
                ticks += 1
                await anyio.lowlevel.checkpoint()
            other.execute("COMMIT")

        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(journal.save, advance(run, Submit()), expected=RunState.ACCEPTED))
            tg.start_soon(ticker)
    assert ticks == 200
    assert (await _get(journal, "r-1")).run.state is RunState.SUBMITTING


@pytest.mark.asyncio
async def test_ticker_keeps_ticking_during_a_large_batch_of_saves(journal: Journal) -> None:
    runs = [await inserted(journal, f"r-{i:03d}") for i in range(150)]
    ticks = 0
    progress: list[int] = []

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        for run in runs:
            before = ticks
            await journal.save(advance(run, Submit()), expected=RunState.ACCEPTED)
            progress.append(ticks - before)
        tg.cancel_scope.cancel()
    # Every save handed the loop back to the ticker at least once while it ran.
    assert min(progress) >= 1
    assert ticks >= len(runs)
    assert await journal.list_runs(active_only=True) == await journal.list_runs()


@pytest.mark.asyncio
async def test_runs_changed_since_a_read_are_the_runs_written_after_it(
    journal: Journal,
) -> None:
    """A standby's refresh (`Journal.runs_changed_since`): the first read returns every
    run and a horizon; the next only the runs written after that read (a save, a new
    run), with their transitions; none when nothing was written."""
    first = await inserted(journal, "r-1")
    await inserted(journal, "r-2")
    every, horizon = await journal.runs_changed_since()
    assert [s.run.run_id for s in every] == ["r-1", "r-2"]
    assert (await journal.runs_changed_since(horizon))[0] == []

    submitting, _ = step(first, Submit(), at(1))
    await journal.save(submitting, expected=RunState.ACCEPTED)
    await inserted(journal, "r-3", created_at=at(2))
    changed, later = await journal.runs_changed_since(horizon)
    assert [(s.run.run_id, s.run.state) for s in changed] == [
        ("r-1", RunState.SUBMITTING),
        ("r-3", RunState.ACCEPTED),
    ]
    assert changed[0].run == submitting  # with its whole history
    assert later > horizon
    assert (await journal.runs_changed_since(later))[0] == []
