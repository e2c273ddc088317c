"""A run's journal events read through one parser (records.parse_event, issue 4.2 item 4):
each kind typed, what an older daemon wrote kept, an unknown kind kept as Unknown, and no
payload a journal can hold makes it raise."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

from llmd_supervisor.core.verdict.judge import Hang, NodeReport, Reach
from llmd_supervisor.errors import RemoteError
from llmd_supervisor.supervision.run.records import (
    ATTEMPT_EVENT,
    HELD_EVENT,
    JOB_FILES_EVENT,
    KILL_EVENT,
    LOG_CAPPED_EVENT,
    LOG_REFUSED_EVENT,
    NODE_UNREACHABLE_EVENT,
    RECEIPT_EVENT,
    STAGE_OVERDUE_EVENT,
    TERM_EVENT,
    TRANSITION_EVENT,
    AttemptEnded,
    CancelSent,
    JobFilesNoted,
    LogCapped,
    LogRefused,
    NodeUnreachable,
    ReceiptNoted,
    RunHeld,
    StageOverdue,
    Transitioned,
    Unknown,
    last_receipt,
    of_type,
    parse_event,
    parsed,
)

AT = "2026-12-07T00:00:00+00:00"
KINDS = [
    ATTEMPT_EVENT,
    RECEIPT_EVENT,
    HELD_EVENT,
    JOB_FILES_EVENT,
    STAGE_OVERDUE_EVENT,
    NODE_UNREACHABLE_EVENT,
    TERM_EVENT,
    KILL_EVENT,
    TRANSITION_EVENT,
    LOG_REFUSED_EVENT,
    LOG_CAPPED_EVENT,
]


def test_each_kind_reads_typed() -> None:
    overdue = {"node": "node2", "rank": 1, "stage": "engines-healthy", "deadline_s": 600,
               "over_s": 75.5, "attempt": 2, "at": AT, "kind": STAGE_OVERDUE_EVENT}  # fmt: skip
    got = parse_event(STAGE_OVERDUE_EVENT, overdue)
    assert got == StageOverdue(Hang("node2", 1, "engines-healthy", 600, 75.5, overdue), 2)
    refused = str(RemoteError("node3", "connecting", "Connection refused"))
    assert parse_event(
        NODE_UNREACHABLE_EVENT, {"node": "node3", "error": refused, "attempt": 1}
    ) == NodeUnreachable(NodeReport("node3", Reach.NO_SSH, refused), 1)
    stale = {"node": "node3", "error": "rank 2's status file was last updated 75 s ago"}
    assert parse_event(NODE_UNREACHABLE_EVENT, stale) == NodeUnreachable(
        NodeReport("node3", Reach.SILENT, stale["error"]), None
    )
    assert parse_event(
        HELD_EVENT, {"reason": "r", "submission": 2, "until": AT, "at": AT}
    ) == RunHeld(2, "r", AT, datetime(2026, 12, 7, tzinfo=UTC))
    assert parse_event(
        TERM_EVENT, {"slurm_job_id": "42", "grace_s": 30, "delivered": False, "for": "cancel"}
    ) == CancelSent(TERM_EVENT, "42", "cancel", False)
    assert parse_event(TRANSITION_EVENT, {"from": "running", "to": "verifying", "event": "E"}) == (
        Transitioned("running", "verifying", "E")
    )
    assert parse_event(RECEIPT_EVENT, {"receipt": {"outcome": "failed"}}) == ReceiptNoted(
        {"outcome": "failed"}
    )
    files = parse_event(JOB_FILES_EVENT, {"batch_logs": ["a.out"], "submit_time": AT})
    assert files == JobFilesNoted({"batch_logs": ["a.out"], "submit_time": AT, "user_id": None})
    assert parse_event(LOG_CAPPED_EVENT, {"copy": "c", "size": 9}) == LogCapped(
        {"copy": "c", "size": 9}
    )
    assert parse_event(LOG_REFUSED_EVENT, {"path": "p", "reason": "r"}) == LogRefused(
        {"path": "p", "reason": "r"}
    )
    ended = parse_event(ATTEMPT_EVENT, {"attempt": 1, "submission": 1, "retried": True})
    assert isinstance(ended, AttemptEnded) and ended.entry["retried"] is True


def test_what_an_older_daemon_wrote_reads_as_it_did() -> None:
    # no `submission` on a hold, no `delivered` on a TERM, no `attempt` on a report
    assert parse_event(HELD_EVENT, {"reason": "r", "at": "yesterday"}) == RunHeld(
        1, "r", None, None
    )
    assert parse_event(TERM_EVENT, {"slurm_job_id": 42}) == CancelSent(TERM_EVENT, "42", None, True)
    assert parse_event(NODE_UNREACHABLE_EVENT, {"node": "n1"}) == NodeUnreachable(
        NodeReport("n1", Reach.SILENT, ""), None
    )


def test_an_unknown_kind_is_kept_and_readers_skip_it() -> None:
    payload = {"at": AT, "kind": "agent.future", "x": [1]}
    assert parse_event("agent.future", payload) == Unknown("agent.future", payload)
    events: list[Mapping[str, object]] = [
        payload,
        {"at": AT, "kind": RECEIPT_EVENT, "receipt": {"outcome": "succeeded"}},
        {"at": AT, "kind": RECEIPT_EVENT, "receipt": {"outcome": "failed"}},
        {"at": AT},  # no kind at all
    ]
    typed = parsed(events)
    assert [type(e) for e in typed] == [Unknown, ReceiptNoted, ReceiptNoted, Unknown]
    assert len(of_type(typed, ReceiptNoted)) == 2
    assert last_receipt(events) == {"outcome": "failed"}
    assert last_receipt([*events, {"kind": RECEIPT_EVENT, "receipt": "text"}]) is None


HOSTILE: list[Any] = [None, True, -1, 1.5, "x" * 300, [], {}, [None], {"a": None}, "\x1b[2J"]


@pytest.mark.parametrize("kind", KINDS)
def test_no_payload_a_journal_can_hold_makes_the_parser_raise(kind: str) -> None:
    fields = ["attempt", "submission", "node", "rank", "stage", "deadline_s", "over_s",
              "error", "reason", "until", "at", "slurm_job_id", "for", "delivered", "from",
              "to", "event", "receipt", "batch_logs", "submit_time", "user_id", "copy",
              "size", "path", "nodes", "retried", "unplaced", "elapsed_s"]  # fmt: skip
    for value in HOSTILE:
        payload = json.loads(json.dumps({f: value for f in fields}))
        assert not isinstance(parse_event(kind, payload), Unknown)
        assert not isinstance(parse_event(kind, {}), Unknown)
