"""The fencing rule (`core.ha.fencing`): which writes are accepted, and the SQL that makes
PostgreSQL apply the same rule to every write."""

from __future__ import annotations

import re

import pytest

from llmd_supervisor.adapters.journal.schema import MIGRATIONS
from llmd_supervisor.core.ha.fencing import (
    CLUSTER_TABLES,
    FENCE_FUNCTION_SQL,
    FENCED_TABLES,
    NO_EPOCH_SQLSTATE,
    SET_WRITER_SQL,
    SINGLE_NODE_EPOCH,
    STALE_EPOCH_SQLSTATE,
    TEAM_TABLES,
    Fence,
    Writer,
    check_write,
    cluster_trigger_sql,
    fence_trigger_sql,
)
from llmd_supervisor.core.ha.lease import LEASE_TABLE
from llmd_supervisor.errors import FencedWrite

S = SINGLE_NODE_EPOCH
WRITES = [
    ("the leader's write", Writer("a", 5), 5, Fence.ACCEPTED),
    ("a deposed leader's write", Writer("a", 4), 5, Fence.STALE),
    ("a write from the future", Writer("a", 6), 5, Fence.STALE),
    ("a cluster without a lease", Writer("b", 1), None, Fence.STALE),
    ("no epoch stated", Writer("a", None), 5, Fence.NO_EPOCH),
    ("no cluster stated", Writer(None, 5), 5, Fence.NO_EPOCH),
    ("an empty cluster (left by an earlier transaction)", Writer("", 5), 5, Fence.NO_EPOCH),
    ("single node: SQLite's writer and lease", Writer("a", S), S, Fence.ACCEPTED),
    ("a single-node writer on a shared journal", Writer("a", S), 1, Fence.STALE),
]
ROWS = [
    ("its own cluster's row", Writer("a", 5), ("a",), Fence.ACCEPTED),
    ("another cluster's row", Writer("a", 5), ("b",), Fence.WRONG_CLUSTER),
    ("a row moved to another cluster", Writer("a", 5), ("a", "b"), Fence.WRONG_CLUSTER),
    ("a row moved from another cluster", Writer("a", 5), ("b", "a"), Fence.WRONG_CLUSTER),
    ("a team row (no cluster)", Writer("a", 5), (), Fence.ACCEPTED),
    ("a maintenance writer (journal migrate)", Writer("@m", 5), ("a", "b"), Fence.ACCEPTED),
    ("a stale writer's own row: stale first", Writer("a", 4), ("a",), Fence.STALE),
]


@pytest.mark.parametrize(
    ("writer", "rows", "fence"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_check_write_of_a_cluster_s_row(
    writer: Writer, rows: tuple[str, ...], fence: Fence
) -> None:
    assert check_write(writer, 5, rows).fence is fence


def test_a_wrong_cluster_refusal_names_the_row_s_cluster() -> None:
    error = FencedWrite("postgresql://db/llmd", "gpu-a", 4, 4, "gpu-b")
    assert "touched a row of cluster 'gpu-b'" in str(error)
    assert "cluster's leader writes only its own cluster's rows" in str(error)


@pytest.mark.parametrize(
    ("writer", "lease_epoch", "fence"), [w[1:] for w in WRITES], ids=[w[0] for w in WRITES]
)
def test_check_write(writer: Writer, lease_epoch: int | None, fence: Fence) -> None:
    verdict = check_write(writer, lease_epoch)
    assert verdict.fence is fence
    assert verdict.accepted is (fence is Fence.ACCEPTED)


def test_a_refusal_names_both_epochs() -> None:
    assert check_write(Writer("gpu-a", 4), 5).why == (
        "epoch 4 for cluster 'gpu-a', whose lease is at epoch 5"
    )
    error = FencedWrite("postgresql://db/llmd", "gpu-a", 4, 5)
    assert str(error) == (
        "Journal postgresql://db/llmd could not write for cluster 'gpu-a': the write "
        "carried epoch 4 but the cluster's lease is at epoch 5 (another daemon leads it "
        "now); this daemon stops acting for the cluster."
    )


def test_every_table_the_journal_creates_is_fenced() -> None:
    created = {
        m.group(1)
        for step in MIGRATIONS
        for statement in step
        for m in [re.search(r"CREATE TABLE (\w+)", statement)]
        if m
    }
    dropped = {
        m.group(1)
        for step in MIGRATIONS
        for statement in step
        for m in [re.search(r"DROP TABLE (?:IF EXISTS )?(\w+)", statement)]
        if m
    }
    renamed = {
        m.group(1): m.group(2)
        for step in MIGRATIONS
        for statement in step
        for m in [re.search(r"ALTER TABLE (\w+) RENAME TO (\w+)", statement)]
        if m
    }
    tables = {renamed.get(t, t) for t in created - dropped}
    assert set(FENCED_TABLES) == tables - {"journal_clock"}  # SQLite's own
    assert LEASE_TABLE not in FENCED_TABLES


def test_the_trigger_applies_check_write() -> None:
    flat = " ".join(FENCE_FUNCTION_SQL.split())
    assert "current_setting('llmd.cluster', true)" in flat
    assert "current_setting('llmd.epoch', true)" in flat
    assert "coalesce(writer_cluster, '') = '' OR coalesce(writer_epoch, '') = ''" in flat
    assert f"FROM {LEASE_TABLE} WHERE cluster = writer_cluster FOR SHARE" in flat
    assert "lease_epoch IS NULL OR lease_epoch <> writer_epoch::bigint" in flat
    assert f"ERRCODE = '{STALE_EPOCH_SQLSTATE}'" in flat
    assert f"ERRCODE = '{NO_EPOCH_SQLSTATE}'" in flat
    for code in (STALE_EPOCH_SQLSTATE, NO_EPOCH_SQLSTATE):
        assert re.fullmatch(r"[0-9A-Z]{5}", code) and not code.startswith(("0", "P0"))
    assert "set_config('llmd.cluster', %(cluster)s, true)" in SET_WRITER_SQL
    assert "set_config('llmd.epoch', %(epoch)s, true)" in SET_WRITER_SQL


def test_trigger_ddl() -> None:
    assert fence_trigger_sql("runs") == (
        "CREATE TRIGGER runs_fence BEFORE INSERT OR UPDATE OR DELETE ON runs "
        "FOR EACH ROW EXECUTE FUNCTION llmd_fence('cluster')"
    )
    assert fence_trigger_sql("outbox_events") == (
        "CREATE TRIGGER outbox_events_fence BEFORE INSERT OR UPDATE OR DELETE ON "
        "outbox_events FOR EACH ROW EXECUTE FUNCTION llmd_fence()"
    )
    assert set(CLUSTER_TABLES) | set(TEAM_TABLES) == set(FENCED_TABLES)
    assert cluster_trigger_sql("events").startswith("CREATE TRIGGER events_cluster BEFORE")
    with pytest.raises(ValueError, match="not a fenced"):
        fence_trigger_sql("leader_lease")
