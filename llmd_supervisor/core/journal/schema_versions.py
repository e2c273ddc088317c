"""Which migrations a journal needs, for either backend (pure: the decision only).

The journal's schema has one version number for both backends: version N is the schema
after N migrations (`VERSIONS`; version 0 is an empty database). SQLite keeps the number
in ``PRAGMA user_version`` (adapters/journal/store.py applies adapters/journal/schema.py's
steps); PostgreSQL keeps it in a one-row ``schema_version`` table and has hand-written
DDL of its own for each step. `plan(db_version, code_version)` decides:

* equal: nothing to do;
* older: apply steps ``db_version + 1 .. code_version`` in ONE transaction (PostgreSQL:
  under ``pg_advisory_xact_lock(MIGRATION_LOCK_KEY)``, reading the version again under
  the lock and planning again, so that two daemons starting together migrate once);
* newer: refuse to start, saying so (`errors.JournalSchemaTooNew`): a daemon never writes
  a schema it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "CODE_VERSION",
    "MIGRATION_LOCK_KEY",
    "SCHEMA_VERSION_TABLE_DDL",
    "VERSIONS",
    "Apply",
    "Plan",
    "Refuse",
    "UpToDate",
    "plan",
]

# What each version added; VERSIONS[n - 1] is version n (adapters/journal/schema.py's
# MIGRATIONS[n - 1] takes SQLite from n - 1 to n). Append only, with that tuple.
VERSIONS: Final = (
    "runs, their transitions and events",
    "log offsets dropped: the log copies' sizes are the resume offsets",
    "retries (a run's submissions) and node quarantine per cluster",
    "node failures one row each, with their owner and evidence",
    "campaigns, their jobs and the ledger of verified points",
    "the outbox: outbound events and their deliveries per destination",
    "the fence: a shared journal accepts writes only from its cluster's current leader",
    "the fence checks each row's cluster; a run's change counter (reads of what changed)",
    "the ledger keeps every run's proof of a point, not only the first run's",
    "a run's kind (spec, script or adopted), filled from the spec text for older runs",
)
CODE_VERSION: Final = len(VERSIONS)

# pg_advisory_xact_lock's bigint key for migrations: the bytes "llmd-mig".
MIGRATION_LOCK_KEY: Final = 0x6C6C_6D64_2D6D_6967

SCHEMA_VERSION_TABLE_DDL: Final = """
CREATE TABLE schema_version (
    one     boolean PRIMARY KEY DEFAULT true CHECK (one),
    version integer NOT NULL CHECK (version >= 0)
)
"""


@dataclass(frozen=True)
class UpToDate:
    version: int


@dataclass(frozen=True)
class Apply:
    """Apply ``steps`` (version numbers reached, in order) in one transaction."""

    from_version: int
    to_version: int
    steps: tuple[int, ...]

    def summary(self) -> str:
        what = "; ".join(f"{n}: {VERSIONS[n - 1]}" for n in self.steps)
        return (
            f"migrating the journal from version {self.from_version} to {self.to_version} ({what})"
        )


@dataclass(frozen=True)
class Refuse:
    db_version: int
    code_version: int
    why: str


Plan = UpToDate | Apply | Refuse


def plan(db_version: int, code_version: int = CODE_VERSION) -> Plan:
    """What to do with a journal at `db_version` for code that knows `code_version`."""
    if not 0 <= code_version <= len(VERSIONS):
        raise ValueError(f"code version {code_version} is not one of 0..{len(VERSIONS)}")
    if db_version < 0:
        return Refuse(
            db_version,
            code_version,
            f"the journal's schema version {db_version} is not a version; it was not "
            "written by llmd-supervisor",
        )
    if db_version > code_version:
        return Refuse(
            db_version,
            code_version,
            f"the journal's schema is version {db_version}, newer than this daemon's "
            f"{code_version}; upgrade llmd-supervisor",
        )
    if db_version == code_version:
        return UpToDate(db_version)
    return Apply(db_version, code_version, tuple(range(db_version + 1, code_version + 1)))
