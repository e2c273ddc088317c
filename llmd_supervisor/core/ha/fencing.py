"""The fencing rule: a journal write is accepted only from the cluster's current leader
(pure; the SQL is executed by the journal adapter).

Every journal write carries the writer's cluster and epoch (`core.ha.lease`); it is accepted
only if that epoch equals the epoch of the cluster's lease row at the time of the write
(`check_write`). A leader that stopped acting, or does not know yet that it lost the
lease, writes with a stale epoch and is refused, whatever it believes.

Whose rows (schema version 8): every row of a cluster's table (`CLUSTER_TABLES`) carries
its cluster, and a writer may insert, update or delete only rows of its own cluster (an
update that moves a row checks both its old and its new cluster): the leader of X that
writes a row of Y is refused (`Fence.WRONG_CLUSTER`) even with X's current epoch. Rows
that belong to no cluster (`TEAM_TABLES`: the outbox, its deliveries, the disabled
destinations and the ledger of verified points) are the team's: any cluster's current
leader may write them, a standby or a deposed leader none (the epoch check alone). Two
exceptions stated by name: a writer whose "cluster" is a maintenance pseudo cluster (a
name that begins with `MAINTENANCE_PREFIX`, which no configured cluster may have; `journal
migrate` copies every cluster's rows as one) may write every row while it holds that
pseudo cluster's lease; and SQLite has one daemon and no fence at all.

How PostgreSQL enforces it: a TRIGGER, not a ``WHERE`` clause in each statement.

* A trigger runs for every row any statement inserts, updates or deletes in a fenced
  table (`FENCED_TABLES`), including statements written after this module: no call site
  can forget the check, which the issue requires. A ``WHERE EXISTS (...epoch...)`` pattern
  would have to be repeated by every statement (and ``INSERT ... VALUES`` has no WHERE),
  and one forgotten statement would be an unfenced write.
* The writer states its cluster and epoch once per transaction (`SET_WRITER_SQL`,
  transaction-local settings). A transaction that forgot it is refused (fails closed):
  an unset setting reads as NULL, and after an earlier transaction of the same session
  set it, as ''; both are refused.
* The trigger reads the lease row ``FOR SHARE``. An acquisition updates that row, so it
  waits for every write transaction that already passed the check to commit, and a write
  that starts after the acquisition committed reads the new epoch: a stale write either
  commits before the new leader exists or not at all. (Renewals update the row too and
  so wait for in-flight writes of their own leader; writes are short, and the daemon's
  role gets ``idle_in_transaction_session_timeout`` so a stuck one cannot hold renewals
  for long.)
* The row's cluster is its ``cluster`` column. Child rows (a run's transitions and
  events, a campaign's jobs) have one too, which a trigger that runs before the fence
  copies from the parent (`CLUSTER_FROM_PARENT`), so the stores never write it and a
  child can never claim another cluster than its parent's.
* A refusal is ``RAISE`` with SQLSTATE `STALE_EPOCH_SQLSTATE`, `NO_EPOCH_SQLSTATE` or
  `WRONG_CLUSTER_SQLSTATE`, which abort the whole transaction; the adapter maps them to
  `errors.FencedWrite`.

The lease table itself is not fenced (acquisition and renewal are what change epochs);
``TRUNCATE`` is not granted to the daemon's role (row triggers do not see it).

SQLite (the single-node default) has no lease: one daemon owns its state directory. Its
writes carry `SINGLE_NODE_EPOCH` (0) and its "lease" is epoch 0 forever, so the same
`check_write` accepts them; no SQL is needed there. Epochs of a PostgreSQL lease start at
1, so a writer that believes it is single-node is refused by a shared journal.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from llmd_supervisor.core.ha.lease import LEASE_TABLE

__all__ = [
    "CLUSTER_FROM_PARENT",
    "CLUSTER_FUNCTION",
    "CLUSTER_FUNCTION_SQL",
    "CLUSTER_SETTING",
    "CLUSTER_TABLES",
    "EPOCH_SETTING",
    "FENCED_TABLES",
    "FENCE_FUNCTION",
    "FENCE_FUNCTION_SQL",
    "MAINTENANCE_PREFIX",
    "NO_EPOCH_SQLSTATE",
    "SET_WRITER_SQL",
    "SINGLE_NODE_EPOCH",
    "STALE_EPOCH_SQLSTATE",
    "TEAM_TABLES",
    "WRONG_CLUSTER_SQLSTATE",
    "Fence",
    "FenceVerdict",
    "Writer",
    "check_write",
    "cluster_trigger_sql",
    "fence_trigger_sql",
    "is_maintenance",
]

SINGLE_NODE_EPOCH: Final = 0  # SQLite's writers and its (implicit) lease

CLUSTER_SETTING: Final = "llmd.cluster"
EPOCH_SETTING: Final = "llmd.epoch"
# User-defined SQLSTATEs (class "LD" is not used by PostgreSQL).
STALE_EPOCH_SQLSTATE: Final = "LD001"
NO_EPOCH_SQLSTATE: Final = "LD002"
WRONG_CLUSTER_SQLSTATE: Final = "LD003"

# A writer "cluster" with this prefix is a maintenance writer (`journal migrate`): it may
# write every cluster's rows while it holds its own lease. Configured clusters may not
# begin with it (core.config).
MAINTENANCE_PREFIX: Final = "@"

# Every journal table, parents before children: a leader writes rows in each
# (adapters/journal/schema.py TABLES, version 6).
FENCED_TABLES: Final = (
    "runs",
    "transitions",
    "events",
    "node_failures",
    "campaigns",
    "campaign_jobs",
    "verified_points",
    "outbox_events",
    "deliveries",
    "disabled_destinations",
)
# The tables whose rows are one cluster's (their ``cluster`` column), and the team's.
CLUSTER_TABLES: Final = (
    "runs",
    "transitions",
    "events",
    "node_failures",
    "campaigns",
    "campaign_jobs",
)
TEAM_TABLES: Final = tuple(t for t in FENCED_TABLES if t not in CLUSTER_TABLES)
# Child tables: their ``cluster`` is the parent's (table, parent, key).
CLUSTER_FROM_PARENT: Final = (
    ("transitions", "runs", "run_id"),
    ("events", "runs", "run_id"),
    ("campaign_jobs", "campaigns", "campaign_id"),
)


def is_maintenance(cluster: str | None) -> bool:
    """Whether `cluster` names a maintenance writer (`MAINTENANCE_PREFIX`), not a cluster."""
    return bool(cluster) and str(cluster).startswith(MAINTENANCE_PREFIX)


@dataclass(frozen=True)
class Writer:
    """Who writes: the cluster a transaction's writes are for, and the epoch its writer
    acts with (None: the transaction did not say)."""

    cluster: str | None
    epoch: int | None


class Fence(StrEnum):
    """What the fence decided about one write."""

    ACCEPTED = "accepted"
    STALE = "stale"  # another epoch than the lease's (or the cluster has no lease)
    NO_EPOCH = "no_epoch"  # the transaction did not state its cluster and epoch
    WRONG_CLUSTER = "wrong_cluster"  # a row of another cluster than the writer's


@dataclass(frozen=True)
class FenceVerdict:
    fence: Fence
    why: str

    @property
    def accepted(self) -> bool:
        return self.fence is Fence.ACCEPTED


def check_write(
    writer: Writer, lease_epoch: int | None, row_clusters: tuple[str, ...] = ()
) -> FenceVerdict:
    """Whether a write by `writer` is accepted when the writer's cluster's lease row has
    `lease_epoch` (None: the cluster has no lease row) and the row written belongs to
    `row_clusters` (its old and new cluster; none: a row of the team, `TEAM_TABLES`)."""
    if writer.cluster is None or writer.cluster == "" or writer.epoch is None:
        return FenceVerdict(Fence.NO_EPOCH, "the transaction did not state its cluster and epoch")
    if lease_epoch is None:
        return FenceVerdict(
            Fence.STALE,
            f"epoch {writer.epoch} for cluster {writer.cluster!r}, which has no lease",
        )
    if writer.epoch != lease_epoch:
        return FenceVerdict(
            Fence.STALE,
            f"epoch {writer.epoch} for cluster {writer.cluster!r}, whose lease is at epoch "
            f"{lease_epoch}",
        )
    if not is_maintenance(writer.cluster):
        for row_cluster in row_clusters:
            if row_cluster != writer.cluster:
                return FenceVerdict(
                    Fence.WRONG_CLUSTER,
                    f"a row of cluster {row_cluster!r} written by cluster "
                    f"{writer.cluster!r}'s leader",
                )
    return FenceVerdict(Fence.ACCEPTED, f"epoch {writer.epoch} is cluster {writer.cluster!r}'s")


# --- PostgreSQL ---------------------------------------------------------------------------

# First statement of every write transaction. Parameters: cluster (text), epoch (text:
# settings are strings). is_local = true: the settings end with the transaction.
SET_WRITER_SQL: Final = (
    f"SELECT set_config('{CLUSTER_SETTING}', %(cluster)s, true),"
    f" set_config('{EPOCH_SETTING}', %(epoch)s, true)"
)

FENCE_FUNCTION: Final = "llmd_fence"

# check_write, in PL/pgSQL. current_setting(name, true) is NULL when never set. A
# trigger of a cluster's table passes the argument 'cluster' (`fence_trigger_sql`): the
# row's cluster is then checked too, old and new.
FENCE_FUNCTION_SQL: Final = f"""
CREATE OR REPLACE FUNCTION {FENCE_FUNCTION}() RETURNS trigger
LANGUAGE plpgsql AS $fence$
DECLARE
    writer_cluster text := current_setting('{CLUSTER_SETTING}', true);
    writer_epoch   text := current_setting('{EPOCH_SETTING}', true);
    lease_epoch    bigint;
    row_cluster    text;
BEGIN
    IF coalesce(writer_cluster, '') = '' OR coalesce(writer_epoch, '') = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = '{NO_EPOCH_SQLSTATE}',
            MESSAGE = format('journal write to %s refused: the transaction did not state '
                             'its cluster and epoch', TG_TABLE_NAME);
    END IF;
    SELECT epoch INTO lease_epoch FROM {LEASE_TABLE}
        WHERE cluster = writer_cluster FOR SHARE;
    IF lease_epoch IS NULL OR lease_epoch <> writer_epoch::bigint THEN
        RAISE EXCEPTION USING
            ERRCODE = '{STALE_EPOCH_SQLSTATE}',
            MESSAGE = format('journal write to %s refused: epoch %s for cluster %s, whose '
                             'lease is at epoch %s', TG_TABLE_NAME, writer_epoch,
                             writer_cluster, coalesce(lease_epoch::text, 'none')),
            DETAIL = format('cluster=%s writer_epoch=%s lease_epoch=%s', writer_cluster,
                            writer_epoch, coalesce(lease_epoch::text, ''));
    END IF;
    IF TG_NARGS > 0 AND left(writer_cluster, 1) <> '{MAINTENANCE_PREFIX}' THEN
        IF TG_OP = 'INSERT' THEN
            row_cluster := NEW.cluster;
        ELSE
            row_cluster := OLD.cluster;
            IF TG_OP = 'UPDATE' AND row_cluster IS NOT DISTINCT FROM writer_cluster THEN
                row_cluster := NEW.cluster;
            END IF;
        END IF;
        IF row_cluster IS DISTINCT FROM writer_cluster THEN
            RAISE EXCEPTION USING
                ERRCODE = '{WRONG_CLUSTER_SQLSTATE}',
                MESSAGE = format('journal write to %s refused: a row of cluster %s written '
                                 'by the leader of cluster %s', TG_TABLE_NAME,
                                 coalesce(row_cluster, 'none'), writer_cluster),
                DETAIL = format('cluster=%s writer_epoch=%s lease_epoch=%s row_cluster=%s',
                                writer_cluster, writer_epoch, lease_epoch,
                                coalesce(row_cluster, ''));
        END IF;
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$fence$
"""

CLUSTER_FUNCTION: Final = "llmd_row_cluster"

# A child row's cluster is its parent's (`CLUSTER_FROM_PARENT`; TG_ARGV[0] is the
# parent table). NULL when the parent is missing (the foreign key refuses the row then).
CLUSTER_FUNCTION_SQL: Final = f"""
CREATE OR REPLACE FUNCTION {CLUSTER_FUNCTION}() RETURNS trigger
LANGUAGE plpgsql AS $cluster$
BEGIN
    IF TG_ARGV[0] = 'runs' THEN
        SELECT cluster INTO NEW.cluster FROM runs WHERE run_id = NEW.run_id;
    ELSE
        SELECT cluster INTO NEW.cluster FROM campaigns WHERE campaign_id = NEW.campaign_id;
    END IF;
    RETURN NEW;
END
$cluster$
"""


def fence_trigger_sql(table: str) -> str:
    """The DDL that fences `table` (one of `FENCED_TABLES`); a cluster's table passes the
    trigger the argument 'cluster' (its rows' cluster is checked)."""
    if table not in FENCED_TABLES:
        raise ValueError(f"{table!r} is not a fenced journal table")
    argument = "'cluster'" if table in CLUSTER_TABLES else ""
    return (
        f"CREATE TRIGGER {table}_fence BEFORE INSERT OR UPDATE OR DELETE ON {table} "
        f"FOR EACH ROW EXECUTE FUNCTION {FENCE_FUNCTION}({argument})"
    )


def cluster_trigger_sql(table: str) -> str:
    """The DDL that gives a child table's rows their parent's cluster (before the fence:
    triggers of one event fire in name order, ``_cluster`` before ``_fence``)."""
    for child, parent, key in CLUSTER_FROM_PARENT:
        if child == table:
            return (
                f"CREATE TRIGGER {table}_cluster BEFORE INSERT OR UPDATE OF {key} ON {table} "
                f"FOR EACH ROW EXECUTE FUNCTION {CLUSTER_FUNCTION}('{parent}')"
            )
    raise ValueError(f"{table!r} takes no cluster from a parent")
