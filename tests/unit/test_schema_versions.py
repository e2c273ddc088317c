"""The migration planner (`core.journal.schema_versions`): nothing, steps N+1..M, or a refusal,
on today's SQLite numbering."""

from __future__ import annotations

import pytest

from llmd_supervisor.adapters.journal.schema import MIGRATIONS
from llmd_supervisor.adapters.journal.store import SCHEMA_VERSION
from llmd_supervisor.core.journal.schema_versions import (
    CODE_VERSION,
    MIGRATION_LOCK_KEY,
    VERSIONS,
    Apply,
    Plan,
    Refuse,
    UpToDate,
    plan,
)
from llmd_supervisor.errors import JournalSchemaTooNew


def test_the_numbering_is_the_sqlite_journal_s() -> None:
    assert CODE_VERSION == SCHEMA_VERSION == len(MIGRATIONS) == len(VERSIONS) == 10


PLANS: list[tuple[str, int, int, Plan]] = [
    ("empty database", 0, 5, Apply(0, 5, (1, 2, 3, 4, 5))),
    ("one behind", 4, 5, Apply(4, 5, (5,))),
    ("several behind", 2, 5, Apply(2, 5, (3, 4, 5))),
    ("current", 5, 5, UpToDate(5)),
    ("empty for code of version 0", 0, 0, UpToDate(0)),
    (
        "newer",
        7,
        5,
        Refuse(
            7,
            5,
            "the journal's schema is version 7, newer than this daemon's 5; "
            "upgrade llmd-supervisor",
        ),
    ),
    (
        "newer by one for older code",
        4,
        3,
        Refuse(
            4,
            3,
            "the journal's schema is version 4, newer than this daemon's 3; "
            "upgrade llmd-supervisor",
        ),
    ),
    (
        "negative",
        -1,
        5,
        Refuse(
            -1,
            5,
            "the journal's schema version -1 is not a version; it was not written by "
            "llmd-supervisor",
        ),
    ),
]


@pytest.mark.parametrize(
    ("db", "code", "expected"), [p[1:] for p in PLANS], ids=[p[0] for p in PLANS]
)
def test_plan(db: int, code: int, expected: Plan) -> None:
    assert plan(db, code) == expected


def test_the_default_is_the_code_s_version() -> None:
    assert plan(SCHEMA_VERSION) == UpToDate(SCHEMA_VERSION)


def test_a_code_version_it_does_not_know_is_a_bug() -> None:
    unknown = CODE_VERSION + 1
    with pytest.raises(ValueError, match=f"code version {unknown}"):
        plan(0, unknown)


def test_an_upgrade_says_what_it_adds() -> None:
    step = plan(3, 5)
    assert isinstance(step, Apply)
    assert step.summary() == (
        "migrating the journal from version 3 to 5 (4: node failures one row each, with "
        "their owner and evidence; 5: campaigns, their jobs and the ledger of verified points)"
    )


def test_the_refusal_as_an_error() -> None:
    refused = plan(CODE_VERSION + 1)
    assert isinstance(refused, Refuse)
    error = JournalSchemaTooNew(
        "postgresql://llmd@db/llmd", refused.db_version, refused.code_version
    )
    assert str(error) == (
        "Journal postgresql://llmd@db/llmd could not be opened: " + refused.why + "."
    )


def test_the_advisory_lock_key() -> None:
    assert int.from_bytes(b"llmd-mig", "big") == MIGRATION_LOCK_KEY
    assert 0 < MIGRATION_LOCK_KEY < 2**63  # a PostgreSQL bigint
