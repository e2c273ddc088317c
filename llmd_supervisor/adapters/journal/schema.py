"""The run journal's schema, as ordered, hand-written migrations for each backend.

`MIGRATIONS` is SQLite's (`adapters.journal.store` applies them; ``PRAGMA user_version`` says
how many have been), `POSTGRES_MIGRATIONS` PostgreSQL's (`adapters.journal.pg`; its
``schema_version`` table says). Version N is the same schema on both
(`core.journal.schema_versions.VERSIONS` names each); PostgreSQL keeps two more things of its own:
the ``schema_version`` table, and leadership's ``leader_lease`` table with the fence on
every journal table (`core.ha.lease`, `core.ha.fencing`: version 7; SQLite has one daemon and
no lease, so its version 7 changes nothing but the number).
"""

from __future__ import annotations

from typing import Final

from llmd_supervisor.core.ha.fencing import (
    CLUSTER_FROM_PARENT,
    CLUSTER_FUNCTION_SQL,
    CLUSTER_TABLES,
    FENCE_FUNCTION,
    FENCE_FUNCTION_SQL,
    FENCED_TABLES,
    cluster_trigger_sql,
    fence_trigger_sql,
)
from llmd_supervisor.core.ha.lease import LEASE_TABLE_DDL

__all__ = ["MIGRATIONS", "POSTGRES_MIGRATIONS", "TABLES"]

# Every table of the journal at the current version, parents before children (the order
# `journal migrate` copies them in): every one is written by the leader, so fenced.
TABLES: Final = FENCED_TABLES

# What a write of a run changes (every column but its row id and ``changed``).
_RUN_FIELDS: Final = (
    "job_name, state, attempt, slurm_job_id, nodes, cancel_requested, outcome, reason, "
    "owner_uid, cluster, spec_toml, script, log_dir, archive_dir, created_at, updated_at, "
    "submission"
)

# Ordered migrations: MIGRATIONS[i] takes the schema from user_version i to i + 1. Append
# only; never edit a migration that has shipped. Each is a sequence of single statements
# (executescript() would commit on its own and break the enclosing transaction).
MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (
        """
        CREATE TABLE runs (
            run_id           TEXT PRIMARY KEY NOT NULL,
            job_name         TEXT NOT NULL UNIQUE,
            state            TEXT NOT NULL,
            attempt          INTEGER NOT NULL CHECK (attempt >= 1),
            slurm_job_id     TEXT,
            nodes            TEXT NOT NULL,  -- JSON array of host names
            cancel_requested INTEGER NOT NULL CHECK (cancel_requested IN (0, 1)),
            outcome          TEXT,
            reason           TEXT NOT NULL,
            owner_uid        INTEGER NOT NULL,
            cluster          TEXT NOT NULL,
            spec_toml        TEXT NOT NULL,
            script           TEXT NOT NULL,
            log_dir          TEXT NOT NULL,
            archive_dir      TEXT NOT NULL,
            created_at       TEXT NOT NULL,  -- UTC ISO 8601, fixed width
            updated_at       TEXT NOT NULL
        )
        """,
        "CREATE INDEX runs_by_created ON runs (created_at)",
        "CREATE INDEX runs_by_owner ON runs (owner_uid, created_at)",
        """
        CREATE TABLE transitions (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            seq    INTEGER NOT NULL CHECK (seq >= 0),
            state  TEXT NOT NULL,
            at     TEXT NOT NULL,
            event  TEXT NOT NULL,
            PRIMARY KEY (run_id, seq)
        )
        """,
        """
        CREATE TABLE events (
            id     INTEGER PRIMARY KEY AUTOINCREMENT,
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            at     TEXT NOT NULL,
            kind   TEXT NOT NULL,
            fields TEXT NOT NULL  -- JSON object
        )
        """,
        "CREATE INDEX events_by_run ON events (run_id, id)",
        """
        CREATE TABLE log_offsets (
            run_id      TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            name        TEXT NOT NULL,
            byte_offset INTEGER NOT NULL CHECK (byte_offset >= 0),
            updated_at  TEXT NOT NULL,
            PRIMARY KEY (run_id, name)
        )
        """,
    ),
    # 1 -> 2: the log copies' own sizes are the resume offsets; the table was never read.
    ("DROP TABLE IF EXISTS log_offsets",),
    # 2 -> 3: retries (a run's submissions) and node quarantine per cluster (core.run.retry_policy).
    (
        "ALTER TABLE runs ADD COLUMN submission INTEGER NOT NULL DEFAULT 1 CHECK (submission >= 1)",
        """
        CREATE TABLE quarantine (
            cluster  TEXT NOT NULL,
            node     TEXT NOT NULL,
            failures INTEGER NOT NULL CHECK (failures >= 1),
            reason   TEXT NOT NULL,
            run_id   TEXT NOT NULL,
            since    TEXT NOT NULL,
            until    TEXT NOT NULL,
            PRIMARY KEY (cluster, node)
        )
        """,
    ),
    # 3 -> 4: node failures one row each, with their owner and evidence (retry_policy counts
    # them per owner; a job's own word never keeps a node from everyone). A counted record
    # of version 3 becomes one failure its run's owner's job told of (what it was cannot
    # be told apart any more).
    (
        """
        CREATE TABLE node_failures (
            id        INTEGER PRIMARY KEY AUTOINCREMENT,
            cluster   TEXT NOT NULL,
            node      TEXT NOT NULL,
            owner_uid INTEGER NOT NULL,
            run_id    TEXT NOT NULL,
            attempt   INTEGER NOT NULL CHECK (attempt >= 1),
            evidence  TEXT NOT NULL CHECK (evidence IN ('observed', 'inferred')),
            reason    TEXT NOT NULL,
            at        TEXT NOT NULL,  -- UTC ISO 8601, fixed width
            UNIQUE (cluster, node, run_id, attempt)
        )
        """,
        "CREATE INDEX node_failures_by_at ON node_failures (cluster, at)",
        """
        INSERT INTO node_failures (cluster, node, owner_uid, run_id, attempt, evidence, reason, at)
        SELECT q.cluster, q.node, COALESCE(r.owner_uid, -1), q.run_id, 1, 'inferred', q.reason,
               q.since
        FROM quarantine AS q LEFT JOIN runs AS r ON r.run_id = q.run_id
        """,
        "DROP TABLE quarantine",
    ),
    # 4 -> 5: campaigns (adapters.journal.campaign_store): a campaign, its jobs (one recipe's points
    # each, with the run that runs them) and the ledger of verified points, shared by every
    # campaign (a point verified once is never paid for again).
    (
        """
        CREATE TABLE campaigns (
            campaign_id TEXT PRIMARY KEY NOT NULL,
            name        TEXT NOT NULL,
            owner_uid   INTEGER NOT NULL,
            cluster     TEXT NOT NULL,
            state       TEXT NOT NULL,
            reason      TEXT NOT NULL,
            file_text   TEXT NOT NULL,
            base_text   TEXT NOT NULL,
            settings    TEXT NOT NULL,  -- JSON object: limits, rerun
            created_at  TEXT NOT NULL,  -- UTC ISO 8601, fixed width
            updated_at  TEXT NOT NULL
        )
        """,
        "CREATE INDEX campaigns_by_created ON campaigns (created_at)",
        """
        CREATE TABLE campaign_jobs (
            campaign_id   TEXT NOT NULL REFERENCES campaigns (campaign_id) ON DELETE CASCADE,
            job_key       TEXT NOT NULL,
            seq           INTEGER NOT NULL CHECK (seq >= 0),
            recipe_id     TEXT NOT NULL,
            topology      TEXT NOT NULL,
            concurrencies TEXT NOT NULL,  -- JSON array: every point of the job
            to_run        TEXT NOT NULL,  -- JSON array: the points its run runs
            matrix_values TEXT NOT NULL,  -- JSON array of [key, value]
            nodes         INTEGER NOT NULL,
            gpus          INTEGER NOT NULL,
            workload      INTEGER NOT NULL,
            time_limit_s  INTEGER NOT NULL,
            spec_toml     TEXT NOT NULL,
            state         TEXT NOT NULL,
            run_id        TEXT,
            submissions   INTEGER NOT NULL CHECK (submissions >= 0),  -- runs made for it
            reason        TEXT NOT NULL,
            updated_at    TEXT NOT NULL,
            PRIMARY KEY (campaign_id, job_key),
            UNIQUE (run_id)
        )
        """,
        """
        CREATE TABLE verified_points (
            recipe_id   TEXT NOT NULL,
            concurrency INTEGER NOT NULL CHECK (concurrency >= 1),
            run_id      TEXT NOT NULL,
            campaign_id TEXT,
            result_file TEXT NOT NULL,  -- the archived result, relative to the run's archive
            sha256      TEXT NOT NULL,
            verified_at TEXT NOT NULL,
            PRIMARY KEY (recipe_id, concurrency)
        )
        """,
    ),
    # 5 -> 6: the outbox of outbound events (adapters.outbox.store, DESIGN.md section 13): an
    # event row is written in the transaction of the transition it reports, with one
    # delivery row per destination. (`events` is the runs' own event log, older than this.)
    (
        """
        CREATE TABLE outbox_events (
            event_id   TEXT PRIMARY KEY NOT NULL,  -- core.events.model.event_id: stable
            type       TEXT NOT NULL,
            subject    TEXT NOT NULL,  -- run/<id>, campaign/<id>, ...
            seq        TEXT NOT NULL,
            body       BLOB NOT NULL,  -- what every attempt sends (core.events.model.encode)
            created_at TEXT NOT NULL   -- UTC ISO 8601, fixed width
        )
        """,
        "CREATE INDEX outbox_events_by_subject ON outbox_events (subject, created_at)",
        """
        CREATE TABLE deliveries (
            event_id    TEXT NOT NULL REFERENCES outbox_events (event_id) ON DELETE CASCADE,
            destination TEXT NOT NULL,
            status      TEXT NOT NULL
                CHECK (status IN ('queued', 'retrying', 'delivered', 'dead', 'disabled')),
            attempts    INTEGER NOT NULL CHECK (attempts >= 0),
            next_at     TEXT,  -- when the next attempt is due (queued, retrying)
            last_error  TEXT NOT NULL,
            updated_at  TEXT NOT NULL,
            payload     BLOB,  -- what this destination gets (Slack); NULL: the event's body
            PRIMARY KEY (event_id, destination)
        )
        """,
        "CREATE INDEX deliveries_due ON deliveries (status, next_at)",
        """
        CREATE TABLE disabled_destinations (
            destination TEXT PRIMARY KEY NOT NULL,
            reason      TEXT NOT NULL,
            since       TEXT NOT NULL
        )
        """,
    ),
    # 6 -> 7: the fence (core.ha.fencing) is PostgreSQL's alone: one daemon owns an SQLite
    # journal, whose writes carry the single-node epoch and are always accepted.
    (),
    # 7 -> 8: a run's ``changed`` (`Journal.runs_changed_since`): a counter of the journal's
    # own, bumped by every write of a run (SQLite writes one transaction at a time, so its
    # order is commit order); `journal_horizon` is the next value. (The fence's row
    # clusters are PostgreSQL's alone, as in step 7.)
    (
        "ALTER TABLE runs ADD COLUMN changed INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX runs_by_change ON runs (changed)",
        "CREATE TABLE journal_clock (one INTEGER PRIMARY KEY CHECK (one = 1), n INTEGER NOT NULL)",
        "INSERT INTO journal_clock (one, n) VALUES (1, 0)",
        "CREATE VIEW journal_horizon AS SELECT n + 1 AS horizon FROM journal_clock",
        *(
            f"""
            CREATE TRIGGER runs_changed_{when} AFTER {event} ON runs
            BEGIN
                UPDATE journal_clock SET n = n + 1;
                UPDATE runs SET changed = (SELECT n FROM journal_clock) WHERE rowid = NEW.rowid;
            END
            """
            for when, event in (("insert", "INSERT"), ("update", f"UPDATE OF {_RUN_FIELDS}"))
        ),
    ),
    # 8 -> 9: the ledger keeps each run's proof of a point (primary key with the run id):
    # a user who may not see the run that proved a point first runs it and reuses its own
    # proof from then on. SQLite cannot change a primary key: a new table takes the rows.
    (
        """
        CREATE TABLE verified_points_9 (
            recipe_id   TEXT NOT NULL,
            concurrency INTEGER NOT NULL CHECK (concurrency >= 1),
            run_id      TEXT NOT NULL,
            campaign_id TEXT,
            result_file TEXT NOT NULL,  -- the archived result, relative to the run's archive
            sha256      TEXT NOT NULL,
            verified_at TEXT NOT NULL,
            PRIMARY KEY (recipe_id, concurrency, run_id)
        )
        """,
        "INSERT INTO verified_points_9 SELECT recipe_id, concurrency, run_id, campaign_id,"
        " result_file, sha256, verified_at FROM verified_points",
        "DROP TABLE verified_points",
        "ALTER TABLE verified_points_9 RENAME TO verified_points",
    ),
    # 9 -> 10: a run's kind (`core.run.kinds`: spec, script or adopted), chosen once when
    # it is accepted; a row journaled before is filled from its spec text (JSON is a
    # foreign spec, adopted when its ``kind`` says "adopt"). Not one of the fields whose
    # write bumps ``changed``: it never changes.
    (
        "ALTER TABLE runs ADD COLUMN kind TEXT NOT NULL DEFAULT 'spec'",
        "UPDATE runs SET kind = CASE"
        " WHEN NOT json_valid(spec_toml) THEN 'script'"
        " WHEN json_extract(spec_toml, '$.foreign.kind') = 'adopt' THEN 'adopted'"
        " ELSE 'script' END"
        " WHERE ltrim(spec_toml, ' ' || char(9, 10, 13)) LIKE '{%'",
    ),
)


# PostgreSQL: POSTGRES_MIGRATIONS[i] takes the schema from version i to i + 1, like
# MIGRATIONS, and is applied with every other step in one transaction. No PostgreSQL
# journal existed before version 6, so the steps before it are empty and step 6 creates
# the schema of version 6 as a whole: a new database goes from 0 to the current version in
# one transaction and never stops in between. From version 7 on, each step has its DDL
# here and its SQLite twin in MIGRATIONS. Append only.
#
# Types follow the SQLite schema so that both read back the same rows (adapters.journal.db):
# times are fixed-width UTC ISO 8601 text, JSON is text, flags are 0/1 integers; text that
# is ordered or compared (ids, times) has COLLATE "C", byte order, as SQLite compares.
# ``runs.rowid`` stands for SQLite's implicit row id (insertion order breaks ties).
_POSTGRES_6: Final = (
    """
    CREATE TABLE runs (
        rowid            bigint GENERATED BY DEFAULT AS IDENTITY UNIQUE,
        run_id           text COLLATE "C" PRIMARY KEY,
        job_name         text COLLATE "C" NOT NULL UNIQUE,
        state            text NOT NULL,
        attempt          integer NOT NULL CHECK (attempt >= 1),
        slurm_job_id     text,
        nodes            text NOT NULL,  -- JSON array of host names
        cancel_requested integer NOT NULL CHECK (cancel_requested IN (0, 1)),
        outcome          text,
        reason           text NOT NULL,
        owner_uid        bigint NOT NULL,
        cluster          text COLLATE "C" NOT NULL,
        spec_toml        text NOT NULL,
        script           text NOT NULL,
        log_dir          text NOT NULL,
        archive_dir      text NOT NULL,
        created_at       text COLLATE "C" NOT NULL,  -- UTC ISO 8601, fixed width
        updated_at       text COLLATE "C" NOT NULL,
        submission       integer NOT NULL DEFAULT 1 CHECK (submission >= 1)
    )
    """,
    "CREATE INDEX runs_by_created ON runs (created_at)",
    "CREATE INDEX runs_by_owner ON runs (owner_uid, created_at)",
    """
    CREATE TABLE transitions (
        run_id text COLLATE "C" NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
        seq    integer NOT NULL CHECK (seq >= 0),
        state  text NOT NULL,
        at     text COLLATE "C" NOT NULL,
        event  text NOT NULL,
        PRIMARY KEY (run_id, seq)
    )
    """,
    """
    CREATE TABLE events (
        id     bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        run_id text COLLATE "C" NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
        at     text COLLATE "C" NOT NULL,
        kind   text COLLATE "C" NOT NULL,
        fields text NOT NULL  -- JSON object
    )
    """,
    "CREATE INDEX events_by_run ON events (run_id, id)",
    """
    CREATE TABLE node_failures (
        id        bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        cluster   text COLLATE "C" NOT NULL,
        node      text COLLATE "C" NOT NULL,
        owner_uid bigint NOT NULL,
        run_id    text COLLATE "C" NOT NULL,
        attempt   integer NOT NULL CHECK (attempt >= 1),
        evidence  text NOT NULL CHECK (evidence IN ('observed', 'inferred')),
        reason    text NOT NULL,
        at        text COLLATE "C" NOT NULL,  -- UTC ISO 8601, fixed width
        UNIQUE (cluster, node, run_id, attempt)
    )
    """,
    "CREATE INDEX node_failures_by_at ON node_failures (cluster, at)",
    """
    CREATE TABLE campaigns (
        campaign_id text COLLATE "C" PRIMARY KEY,
        name        text NOT NULL,
        owner_uid   bigint NOT NULL,
        cluster     text COLLATE "C" NOT NULL,
        state       text NOT NULL,
        reason      text NOT NULL,
        file_text   text NOT NULL,
        base_text   text NOT NULL,
        settings    text NOT NULL,  -- JSON object: limits, rerun
        created_at  text COLLATE "C" NOT NULL,  -- UTC ISO 8601, fixed width
        updated_at  text COLLATE "C" NOT NULL
    )
    """,
    "CREATE INDEX campaigns_by_created ON campaigns (created_at)",
    """
    CREATE TABLE campaign_jobs (
        campaign_id   text COLLATE "C" NOT NULL
            REFERENCES campaigns (campaign_id) ON DELETE CASCADE,
        job_key       text COLLATE "C" NOT NULL,
        seq           integer NOT NULL CHECK (seq >= 0),
        recipe_id     text COLLATE "C" NOT NULL,
        topology      text NOT NULL,
        concurrencies text NOT NULL,  -- JSON array: every point of the job
        to_run        text NOT NULL,  -- JSON array: the points its run runs
        matrix_values text NOT NULL,  -- JSON array of [key, value]
        nodes         integer NOT NULL,
        gpus          integer NOT NULL,
        workload      integer NOT NULL,
        time_limit_s  bigint NOT NULL,
        spec_toml     text NOT NULL,
        state         text NOT NULL,
        run_id        text COLLATE "C",
        submissions   integer NOT NULL CHECK (submissions >= 0),
        reason        text NOT NULL,
        updated_at    text COLLATE "C" NOT NULL,
        PRIMARY KEY (campaign_id, job_key),
        UNIQUE (run_id)
    )
    """,
    """
    CREATE TABLE verified_points (
        recipe_id   text COLLATE "C" NOT NULL,
        concurrency integer NOT NULL CHECK (concurrency >= 1),
        run_id      text COLLATE "C" NOT NULL,
        campaign_id text COLLATE "C",
        result_file text NOT NULL,  -- the archived result, relative to the run's archive
        sha256      text NOT NULL,
        verified_at text COLLATE "C" NOT NULL,
        PRIMARY KEY (recipe_id, concurrency)
    )
    """,
    """
    CREATE TABLE outbox_events (
        event_id   text COLLATE "C" PRIMARY KEY,  -- core.events.model.event_id: stable
        type       text NOT NULL,
        subject    text COLLATE "C" NOT NULL,  -- run/<id>, campaign/<id>, ...
        seq        text NOT NULL,
        body       bytea NOT NULL,  -- what every attempt sends (core.events.model.encode)
        created_at text COLLATE "C" NOT NULL  -- UTC ISO 8601, fixed width
    )
    """,
    "CREATE INDEX outbox_events_by_subject ON outbox_events (subject, created_at)",
    """
    CREATE TABLE deliveries (
        event_id    text COLLATE "C" NOT NULL
            REFERENCES outbox_events (event_id) ON DELETE CASCADE,
        destination text COLLATE "C" NOT NULL,
        status      text NOT NULL
            CHECK (status IN ('queued', 'retrying', 'delivered', 'dead', 'disabled')),
        attempts    integer NOT NULL CHECK (attempts >= 0),
        next_at     text COLLATE "C",  -- when the next attempt is due (queued, retrying)
        last_error  text NOT NULL,
        updated_at  text COLLATE "C" NOT NULL,
        payload     bytea,  -- what this destination gets (Slack); NULL: the event's body
        PRIMARY KEY (event_id, destination)
    )
    """,
    "CREATE INDEX deliveries_due ON deliveries (status, next_at)",
    """
    CREATE TABLE disabled_destinations (
        destination text COLLATE "C" PRIMARY KEY,
        reason      text NOT NULL,
        since       text COLLATE "C" NOT NULL
    )
    """,
    # Leadership's lease (core.ha.lease); the fence that reads it is step 7's.
    LEASE_TABLE_DDL,
)

# 6 -> 7: the fence (core.ha.fencing): every journal table refuses a row written by a
# transaction that did not state the writer's cluster and its current lease epoch
# (`core.ha.fencing.SET_WRITER_SQL`). Creating a trigger fires none, so this step (and the
# rest of the migration transaction) writes no fenced row. A later step that INSERTs,
# UPDATEs or DELETEs rows of a fenced table runs after this one in the same transaction,
# which states no writer: it must disable the table's trigger around its statement
# (``ALTER TABLE ... DISABLE TRIGGER <table>_fence`` ... ``ENABLE TRIGGER``).
# The fence as version 7 made it (frozen: `core.ha.fencing` holds the current one).
_FENCE_FUNCTION_7: Final = """
CREATE OR REPLACE FUNCTION llmd_fence() RETURNS trigger
LANGUAGE plpgsql AS $fence$
DECLARE
    writer_cluster text := current_setting('llmd.cluster', true);
    writer_epoch   text := current_setting('llmd.epoch', true);
    lease_epoch    bigint;
BEGIN
    IF coalesce(writer_cluster, '') = '' OR coalesce(writer_epoch, '') = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'LD002',
            MESSAGE = format('journal write to %s refused: the transaction did not state '
                             'its cluster and epoch', TG_TABLE_NAME);
    END IF;
    SELECT epoch INTO lease_epoch FROM leader_lease
        WHERE cluster = writer_cluster FOR SHARE;
    IF lease_epoch IS NULL OR lease_epoch <> writer_epoch::bigint THEN
        RAISE EXCEPTION USING
            ERRCODE = 'LD001',
            MESSAGE = format('journal write to %s refused: epoch %s for cluster %s, whose '
                             'lease is at epoch %s', TG_TABLE_NAME, writer_epoch,
                             writer_cluster, coalesce(lease_epoch::text, 'none')),
            DETAIL = format('cluster=%s writer_epoch=%s lease_epoch=%s', writer_cluster,
                            writer_epoch, coalesce(lease_epoch::text, ''));
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$fence$
"""
_POSTGRES_7: Final = (
    _FENCE_FUNCTION_7,
    *(
        f"CREATE TRIGGER {table}_fence BEFORE INSERT OR UPDATE OR DELETE ON {table} "
        f"FOR EACH ROW EXECUTE FUNCTION {FENCE_FUNCTION}()"
        for table in FENCED_TABLES
    ),
)

# 7 -> 8: (a) the fence compares each row's cluster with its writer's (`core.ha.fencing`):
# the child tables get the ``cluster`` column of their parent (filled from it for the
# rows there are, with the fence off around that UPDATE as step 7 says, then by a
# trigger), and the cluster tables' fences get the argument that checks it. (b) a run's
# ``changed``: the id of the transaction that last wrote it, and `JOURNAL_HORIZON`'s view
# of what a reader has seen (`adapters.journal.store.Journal.runs_changed_since`).
_POSTGRES_8: Final = (
    FENCE_FUNCTION_SQL,
    CLUSTER_FUNCTION_SQL,
    *(
        statement
        for child, parent, key in CLUSTER_FROM_PARENT
        for statement in (
            f'ALTER TABLE {child} ADD COLUMN cluster text COLLATE "C"',
            f"ALTER TABLE {child} DISABLE TRIGGER {child}_fence",
            f"UPDATE {child} AS c SET cluster = p.cluster FROM {parent} AS p "
            f"WHERE p.{key} = c.{key}",
            f"ALTER TABLE {child} ENABLE TRIGGER {child}_fence",
            f"ALTER TABLE {child} ALTER COLUMN cluster SET NOT NULL",
            cluster_trigger_sql(child),
        )
    ),
    *(
        statement
        for table in CLUSTER_TABLES
        for statement in (f"DROP TRIGGER {table}_fence ON {table}", fence_trigger_sql(table))
    ),
    "ALTER TABLE runs ADD COLUMN changed bigint NOT NULL DEFAULT 0",
    "CREATE INDEX runs_by_change ON runs (changed)",
    """
    CREATE FUNCTION llmd_run_changed() RETURNS trigger LANGUAGE plpgsql AS $changed$
    BEGIN
        NEW.changed := pg_current_xact_id()::text::bigint;
        RETURN NEW;
    END
    $changed$
    """,
    "CREATE TRIGGER runs_changed BEFORE INSERT OR UPDATE ON runs "
    "FOR EACH ROW EXECUTE FUNCTION llmd_run_changed()",
    # Every transaction that commits a run this snapshot does not see has an id at least
    # its xmin (in progress when it was taken, or begun after).
    "CREATE VIEW journal_horizon AS "
    "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS horizon",
)

# 8 -> 9: the ledger keeps each run's proof of a point, as SQLite's step 9 (no row is
# written: the fence does not fire).
_POSTGRES_9: Final = (
    "ALTER TABLE verified_points DROP CONSTRAINT verified_points_pkey",
    "ALTER TABLE verified_points ADD PRIMARY KEY (recipe_id, concurrency, run_id)",
)

# 9 -> 10: a run's kind, as SQLite's step 10; the rows there are are filled with the
# fence and the change counter off around the UPDATE (step 7 says why; the kind never
# changes, so a reader of what changed has nothing new to read).
_POSTGRES_10: Final = (
    # IF NOT EXISTS: a journal taken back to an older version by hand (the tests') may
    # keep the column; the UPDATE below fills it again as it would be filled.
    "ALTER TABLE runs ADD COLUMN IF NOT EXISTS kind text COLLATE \"C\" NOT NULL DEFAULT 'spec'",
    """
    CREATE FUNCTION llmd_kind_10(spec text) RETURNS text LANGUAGE plpgsql AS $kind$
    BEGIN
        IF spec::jsonb -> 'foreign' ->> 'kind' = 'adopt' THEN
            RETURN 'adopted';
        END IF;
        RETURN 'script';
    EXCEPTION WHEN others THEN
        RETURN 'script';
    END
    $kind$
    """,
    "ALTER TABLE runs DISABLE TRIGGER runs_fence",
    "ALTER TABLE runs DISABLE TRIGGER runs_changed",
    "UPDATE runs SET kind = llmd_kind_10(spec_toml) "
    "WHERE ltrim(spec_toml, E' \\t\\n\\r') LIKE '{%'",
    "ALTER TABLE runs ENABLE TRIGGER runs_changed",
    "ALTER TABLE runs ENABLE TRIGGER runs_fence",
    "DROP FUNCTION llmd_kind_10(text)",
)

POSTGRES_MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (),
    (),
    (),
    (),
    (),
    _POSTGRES_6,
    _POSTGRES_7,
    _POSTGRES_8,
    _POSTGRES_9,
    _POSTGRES_10,
)
