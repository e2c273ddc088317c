"""Campaigns in the journal (adapters.journal.campaign_store) against a real SQLite file and a real
PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import pytest_asyncio

from llmd_supervisor.adapters.journal.campaign_store import (
    CampaignStore,
    StoredCampaign,
    StoredJob,
    VerifiedPoint,
)
from llmd_supervisor.adapters.journal.rows import iso
from llmd_supervisor.adapters.journal.schema import MIGRATIONS
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.errors import JournalConflict, JournalError
from tests.postgres import JournalTarget

T0 = datetime(2026, 12, 3, 10, 0, 0, 123456, tzinfo=UTC)


def campaign(campaign_id: str = "c0ffee000001", owner_uid: int = 1000) -> StoredCampaign:
    return StoredCampaign(
        campaign_id=campaign_id,
        name="sweep",
        owner_uid=owner_uid,
        cluster="dev",
        state="running",
        reason="",
        file_text='base = "demo.toml"\n',
        base_text="[run]\n",
        settings={"limits": {"max_jobs": 2}, "rerun": False},
        created_at=T0,
        updated_at=T0,
    )


def job(key: str, seq: int, campaign_id: str = "c0ffee000001") -> StoredJob:
    return StoredJob(
        campaign_id=campaign_id,
        job_key=key,
        seq=seq,
        recipe_id=key * 2,
        topology="2P+2D",
        concurrencies=(1, 2, 4),
        to_run=(1, 2, 4),
        matrix_values=(("topology.prefill_nodes", 2), ("benchmark.isl_osl", [64, 16])),
        nodes=4,
        gpus=32,
        workload=80,
        time_limit_s=300,
        spec_toml="[run]\n",
        state="waiting",
        run_id=None,
        submissions=0,
        reason="",
        updated_at=T0,
    )


@pytest_asyncio.fixture
async def store(journal_target: JournalTarget) -> AsyncIterator[CampaignStore]:
    """The campaign tables of a new journal on each backend."""
    async with await journal_target.open() as j:
        yield CampaignStore(j)


@pytest.mark.asyncio
async def test_a_campaign_and_its_jobs_go_in_together_and_read_back(store: CampaignStore) -> None:
    await store.insert(campaign(), [job("b", 1), job("a", 0)])
    got = await store.get("c0ffee000001")
    assert got == campaign()
    jobs = await store.jobs("c0ffee000001")
    assert [j.job_key for j in jobs] == ["a", "b"]  # expansion order, not insertion order
    assert jobs[0] == job("a", 0)
    assert [c.campaign_id for c in await store.campaigns(owner_uid=1000)] == ["c0ffee000001"]
    assert await store.campaigns(owner_uid=1001) == []


@pytest.mark.asyncio
async def test_a_campaign_id_taken_and_a_bad_job_leave_nothing_behind(
    store: CampaignStore,
) -> None:
    await store.insert(campaign(), [job("a", 0)])
    with pytest.raises(JournalConflict, match="already holds campaign c0ffee000001"):
        await store.insert(campaign(), [])
    # Two jobs with one key: the whole campaign is refused, none of it stays.
    with pytest.raises(JournalError):
        await store.insert(campaign("c0ffee000002"), [job("a", 0, "c0ffee000002")] * 2)
    assert await store.get("c0ffee000002") is None
    assert await store.jobs("c0ffee000002") == []


@pytest.mark.asyncio
async def test_a_job_gets_its_run_id_and_points_and_counts_its_runs(store: CampaignStore) -> None:
    await store.insert(campaign(), [job("a", 0)])
    await store.set_job(
        "c0ffee000001", "a", state="submitted", reason="", run_id="0123456789ab", to_run=(4, 1)
    )
    (a,) = await store.jobs("c0ffee000001")
    assert (a.state, a.run_id, a.to_run, a.submissions) == ("submitted", "0123456789ab", (1, 4), 1)
    await store.set_job("c0ffee000001", "a", state="succeeded", reason="done")
    (a,) = await store.jobs("c0ffee000001")
    assert (a.state, a.run_id, a.submissions, a.reason) == ("succeeded", "0123456789ab", 1, "done")
    with pytest.raises(JournalError, match="has no job z"):
        await store.set_job("c0ffee000001", "z", state="waiting", reason="")
    await store.set_state("c0ffee000001", "finished", "")
    got = await store.get("c0ffee000001")
    assert got is not None and got.state == "finished" and got.updated_at > T0
    with pytest.raises(JournalError, match="no campaign nope"):
        await store.set_state("nope", "finished", "")


@pytest.mark.asyncio
async def test_the_ledger_keeps_each_runs_proof_and_forgets_one_on_request(
    store: CampaignStore,
) -> None:
    p = VerifiedPoint("r" * 64, 4, "0123456789ab", "c0ffee000001", "results/c4.json", "ab" * 32, T0)
    assert await store.add_verified([p]) == 1
    later = replace(p, run_id="ba9876543210", verified_at=T0 + timedelta(hours=1))
    assert await store.add_verified([later, replace(p, concurrency=8), p]) == 2
    got = await store.verified(["r" * 64, "x" * 64])
    assert got[("r" * 64, 4)] == (p, later)  # every run's proof, oldest first, each once
    assert set(got) == {("r" * 64, 4), ("r" * 64, 8)}
    await store.forget_verified([("r" * 64, 4, "0123456789ab")])  # that run's proof only
    assert await store.verified(["r" * 64]) == {
        ("r" * 64, 4): (later,),
        ("r" * 64, 8): (replace(p, concurrency=8),),
    }
    # Many recipes at once (more than SQLite's bound parameters in one statement).
    assert await store.verified(f"{i:064x}" for i in range(1500)) == {}


@pytest.mark.asyncio
async def test_a_version_8_ledger_migrates_keeping_its_proofs(tmp_path: Path) -> None:
    # Version 8 kept one proof per point; version 9 keeps its rows and takes a second run's.
    path = tmp_path / "journal.db"
    p = VerifiedPoint("r" * 64, 4, "0123456789ab", "c0ffee000001", "results/c4.json", "ab" * 32, T0)
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        for statement in (s for step in MIGRATIONS[:8] for s in step):
            conn.execute(statement)
        conn.execute(
            "INSERT INTO verified_points VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                *(p.recipe_id, 4, p.run_id, p.campaign_id, p.result_file, p.sha256),
                iso(T0, path, "t"),
            ),
        )
        conn.execute("PRAGMA user_version = 8")
        conn.execute("COMMIT")
    async with await Journal.open(path) as j:
        store = CampaignStore(j)
        assert await store.verified(["r" * 64]) == {("r" * 64, 4): (p,)}
        later = replace(p, run_id="ba9876543210", verified_at=T0 + timedelta(hours=1))
        assert await store.add_verified([later]) == 1
        assert await store.verified(["r" * 64]) == {("r" * 64, 4): (p, later)}
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) == 10
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.mark.asyncio
async def test_a_corrupt_job_row_is_a_journal_error_naming_it(store: CampaignStore) -> None:
    await store.insert(campaign(), [job("a", 0)])
    await store._journal.write(
        "test", lambda db: db.execute("UPDATE campaign_jobs SET concurrencies = '[1, \"x\"]'")
    )
    with pytest.raises(JournalError, match="not integers"):
        await store.jobs("c0ffee000001")
