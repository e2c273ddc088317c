"""Every way the completion marker can be wrong is its own named status."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from llmd_supervisor.core.run.jobtext import JOB_TEXT_MAX
from llmd_supervisor.core.verdict.marker import (
    MARKER_TEXT_MAX,
    MarkerStatus,
    marker_filename,
    read_marker,
)
from llmd_supervisor.node import common, marker_format
from llmd_supervisor.node.agent import marker as node_marker

JOB = "42"


def body(**override: object) -> bytes:
    fields: dict[str, object] = {
        "rc": 0,
        "job_id": JOB,
        "rank": 2,
        "reason": "sweep done",
        "finished_at": "2026-11-30T21:59:00.123+00:00",
    }
    fields.update(override)
    return json.dumps({k: v for k, v in fields.items() if v is not ...}).encode()


def test_filename() -> None:
    assert marker_filename("123") == ".bench_done.123"


def test_ok() -> None:
    reading = read_marker(body(rc=7, extra="kept"), JOB)
    assert reading.status is MarkerStatus.OK
    assert reading.ok
    assert reading.marker is not None
    assert reading.marker.rc == 7
    assert reading.marker.rank == 2
    assert reading.marker.reason == "sweep done"
    assert reading.marker.finished_at == datetime(2026, 11, 30, 21, 59, 0, 123000, tzinfo=UTC)
    assert reading.describe() == "marker rc=7 from rank 2: sweep done"
    assert reading.raw_text is not None and '"rc": 7' in reading.raw_text


def test_a_failed_marker_tells_its_own_reason_on_one_bounded_line() -> None:
    said = "rank 1 (prefill, node2:8330) failed:\n engine exited with rc 3 before the marker"
    reading = read_marker(body(rc=73, reason=said), JOB)
    assert reading.describe() == (  # the newline shows as its escape: still one line
        "marker rc=73 from rank 2: rank 1 (prefill, node2:8330) failed:\\n engine exited"
        " with rc 3 before the marker"
    )
    long = read_marker(body(rc=1, reason="x" * 5000), JOB).describe()
    assert len(long) < 400 and long.endswith("...")
    assert read_marker(body(rc=0, reason="ok"), JOB).describe() == "marker rc=0 from rank 2"


def test_as_the_node_agent_writes_it() -> None:
    data = (
        b'{"finished_at": "2026-11-30T21:59:00.123+00:00", "job_id": "42", '
        b'"rank": 0, "rc": 0, "reason": "ok"}\n'
    )
    assert read_marker(data, JOB).status is MarkerStatus.OK


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (None, MarkerStatus.MISSING),
        (b"", MarkerStatus.EMPTY),
        (b" \n\t", MarkerStatus.EMPTY),
        (b'{"rc": 0, "job_id": "4', MarkerStatus.TRUNCATED),
        (b"{", MarkerStatus.TRUNCATED),
        (b"done", MarkerStatus.NOT_JSON),
        (b"\xff\xfe{}", MarkerStatus.NOT_JSON),
        (b'{"rc": 0} trailing}', MarkerStatus.NOT_JSON),
        (b"[" * 100_000, MarkerStatus.NOT_JSON),
        (b"3.5", MarkerStatus.NOT_OBJECT),
        (b'["rc", 0]', MarkerStatus.NOT_OBJECT),
        (b"null", MarkerStatus.NOT_OBJECT),
        (body(rc=...), MarkerStatus.MISSING_FIELDS),
        (b"{}", MarkerStatus.MISSING_FIELDS),
        (body(job_id="41"), MarkerStatus.WRONG_JOB_ID),
        (body(job_id=42), MarkerStatus.BAD_FIELD),
        (body(rc=True), MarkerStatus.RC_NOT_INTEGER),
        (body(rc=False), MarkerStatus.RC_NOT_INTEGER),
        (body(rc=0.0), MarkerStatus.RC_NOT_INTEGER),
        (body(rc="0"), MarkerStatus.RC_NOT_INTEGER),
        (body(rc=None), MarkerStatus.RC_NOT_INTEGER),
        # No exit status: srun and Slurm's ExitCode would say 0 (the node agent's rule too).
        (body(rc=256), MarkerStatus.RC_NOT_INTEGER),
        (body(rc=-256), MarkerStatus.RC_NOT_INTEGER),
        (body(rc=-1), MarkerStatus.RC_NOT_INTEGER),
        (body(rc=2**32), MarkerStatus.RC_NOT_INTEGER),
        (b'{"rc": NaN, "job_id": "42", "rank": 0, "reason": "", "finished_at": "x"}',
         MarkerStatus.RC_NOT_INTEGER),
        (body(rank=-1), MarkerStatus.BAD_FIELD),
        (body(rank=True), MarkerStatus.BAD_FIELD),
        (body(reason=7), MarkerStatus.BAD_FIELD),
        (body(finished_at="yesterday"), MarkerStatus.BAD_FINISHED_AT),
        (body(finished_at=1700000000), MarkerStatus.BAD_FINISHED_AT),
    ],
)  # fmt: skip
def test_statuses(data: bytes | None, status: MarkerStatus) -> None:
    reading = read_marker(data, JOB)
    assert reading.status is status, reading.detail
    assert reading.marker is None
    assert not reading.ok
    assert reading.describe().startswith(f"marker {marker_filename(JOB)} ")
    assert (reading.raw_text is None) is (data is None)


def test_statuses_are_distinct_names() -> None:
    assert len({s.value for s in MarkerStatus}) == len(MarkerStatus)


def test_may_still_arrive() -> None:
    waiting = {s for s in MarkerStatus if s.may_still_arrive}
    assert waiting == {MarkerStatus.MISSING, MarkerStatus.EMPTY, MarkerStatus.TRUNCATED}


def test_describe_names_missing_file() -> None:
    assert read_marker(None, "7").describe() == "marker .bench_done.7 missing"


@pytest.mark.parametrize(
    ("data", "status", "rc"),
    [
        (b"0\n", MarkerStatus.OK, 0),
        (b"7\n", MarkerStatus.OK, 7),
        (b"255\n", MarkerStatus.OK, 255),
        (b"-1\n", MarkerStatus.RC_NOT_INTEGER, None),  # no exit status
        (b"256\n", MarkerStatus.RC_NOT_INTEGER, None),
        (b"4294967296\n", MarkerStatus.RC_NOT_INTEGER, None),
        (b"", MarkerStatus.EMPTY, None),
        (b"\n", MarkerStatus.EMPTY, None),
        (b"0", MarkerStatus.TRUNCATED, None),  # torn: the newline is not there yet
        (b"12", MarkerStatus.TRUNCATED, None),
        (b"0\n0\n", MarkerStatus.NOT_JSON, None),
        (b"00\n", MarkerStatus.NOT_JSON, None),
        (b"7 \n", MarkerStatus.NOT_OBJECT, None),
        (b"true\n", MarkerStatus.NOT_OBJECT, None),
    ],
)
def test_the_plain_integer_marker_of_inferencex(
    data: bytes, status: MarkerStatus, rc: int | None
) -> None:
    reading = read_marker(data, JOB)
    assert reading.status is status, reading.detail
    if rc is None:
        assert reading.marker is None
    else:
        assert reading.marker is not None
        assert (reading.marker.rc, reading.marker.format, reading.marker.rank) == (rc, "int", None)
        assert reading.describe() == f"marker rc={rc} (plain integer)"


# A marker's reason is valid JSON whatever it holds; what the daemon keeps of it is escaped
# and bounded once, here, so that it can be journaled and shown (issue 3.2 items 5 and 6).
HOSTILE_REASONS = [
    ("boom \ud800", "boom \\ud800"),
    ("\u001b[2K\u001b[1Goutcome succeeded", "\\x1b[2K\\x1b[1Goutcome succeeded"),
    ("\u001b]52;c;cm0gLXJmIH4=\u0007", "\\x1b]52;c;cm0gLXJmIH4=\\x07"),
    ("\u001b]0;title\u0007 bell", "\\x1b]0;title\\x07 bell"),
    ("cr\rover", "cr\\rover"),
    ("del\u007f c1\u009b2J", "del\\x7f c1\\x9b2J"),
    ("rtl \u202e", "rtl \\u202e"),
]


@pytest.mark.parametrize(("reason", "kept"), HOSTILE_REASONS)
def test_a_hostile_reason_is_kept_escaped(reason: str, kept: str) -> None:
    data = body(rc=1, reason=reason)  # json.dumps writes them as \u escapes
    assert data.isascii()
    reading = read_marker(data, JOB)
    assert reading.marker is not None, reading.detail
    assert reading.marker.reason == kept
    assert reading.describe() == f"marker rc=1 from rank 2: {kept}"
    for text in (reading.marker.reason, reading.describe(), reading.raw_text or ""):
        assert text.isprintable()
        text.encode("utf-8")


def test_a_huge_reason_and_text_are_bounded() -> None:
    reading = read_marker(body(rc=1, reason="\x1b[2K" * 10_000), JOB)
    assert reading.marker is not None
    assert len(reading.marker.reason) <= JOB_TEXT_MAX
    assert len(reading.describe()) < 400
    assert reading.raw_text is not None and len(reading.raw_text) <= MARKER_TEXT_MAX
    assert reading.raw_text.isprintable()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job_id", "4\x1b[2K" * 1000),
        ("job_id", ["\x07"] * 1000),
        ("rc", "\ud800" * 1000),
        ("rank", {"\x1b": "\x9b"}),
        ("reason", ["\x1b]52;c;eA==\x07"]),
        ("finished_at", "\x1b[1G" * 1000),
        ("finished_at", ["\x1b"]),
    ],
)
def test_a_bad_field_is_named_escaped_and_bounded(field: str, value: object) -> None:
    reading = read_marker(body(**{field: value}), JOB)
    assert reading.marker is None
    described = reading.describe()
    assert described.isprintable() and len(described) < 300, described


# --- one reader for the daemon and the node agent (node/marker_format.py) -------------------


@pytest.mark.parametrize(
    ("rc", "shown"),
    [(False, "False"), (True, "True"), (0.0, "0.0"), ("0", "'0'"), (256, "256"), (-1, "-1")],
)
def test_an_rc_that_is_no_exit_status_is_refused_by_both_sides_with_a_reason(
    rc: object, shown: str
) -> None:
    data = body(rc=rc)
    reading = read_marker(data, JOB)
    assert reading.status is MarkerStatus.RC_NOT_INTEGER
    assert reading.detail == f"rc {shown} is not an exit status (an integer from 0 to 255)"
    assert reading.describe() == f"marker .bench_done.{JOB} rc not integer: {reading.detail}"
    # The node agent reads the same bytes with the same rules (its values shown as JSON),
    # and a worker exits RC_BAD_MARKER (78) with that reason instead of int(rc).
    parsed = marker_format.parse(data, JOB)
    assert parsed.status == MarkerStatus.RC_NOT_INTEGER.value and parsed.rc is None
    assert parsed.detail.endswith("is not an exit status (an integer from 0 to 255)")
    assert node_marker.marker_exit(parsed) == (
        common.RC_BAD_MARKER,
        f"marker rc not integer: {parsed.detail}",
    )


@pytest.mark.parametrize(
    ("data", "rc", "fmt"),
    [(b"0\n", 0, "int"), (b"7\n", 7, "int"), (body(rc=0), 0, "json"), (body(rc=7), 7, "json")],
)
def test_the_int_and_the_json_marker_are_accepted_by_both_sides(
    data: bytes, rc: int, fmt: str
) -> None:
    reading = read_marker(data, JOB)
    assert reading.marker is not None and (reading.marker.rc, reading.marker.format) == (rc, fmt)
    parsed = marker_format.parse(data, JOB)
    assert parsed.ok and (parsed.rc, parsed.format) == (rc, fmt)
    assert node_marker.marker_exit(parsed)[0] == rc


def test_every_status_of_the_shared_reader_is_a_marker_status() -> None:
    shared = {
        v
        for k, v in vars(marker_format).items()
        if k.isupper() and isinstance(v, str) and k not in ("NO_EXIT_STATUS",)
    }
    assert shared <= {s.value for s in MarkerStatus}
    assert set(marker_format.MAY_STILL_ARRIVE) == {
        s.value for s in MarkerStatus if s.may_still_arrive
    }


@pytest.mark.parametrize(
    ("finished_at", "ok"),
    [
        ("2026-11-30T21:59:00.123+00:00", True),  # what the agent writes
        ("2026-11-30T21:59:00Z", True),  # Python 3.11 reads Z, 3.9 does not: taken as UTC
        ("2026-11-30 21:59:00+05:30", True),
        ("2026-11-30T21:59", True),
        ("2026-11-30", True),
        ("20261130T215900", False),  # 3.11's fromisoformat reads it, 3.9's does not
        ("2026-11-30T21:59:00.1234567", False),
        ("2026-13-01T00:00:00", False),
        ("2026-11-30T21:59:00+0000", False),
        ("\u0662\u0660\u0662\u0666-11-30", False),  # digits, but not ASCII ones
        ("yesterday", False),
    ],
)
def test_finished_at_is_read_alike_by_every_python_the_nodes_may_run(
    finished_at: str, ok: bool
) -> None:
    reading = read_marker(body(finished_at=finished_at), JOB)
    assert reading.ok is ok, reading.detail
    parsed = marker_format.parse(body(finished_at=finished_at), JOB)
    assert parsed.ok is ok
    if ok:
        assert reading.marker is not None
        assert reading.marker.finished_at == marker_format.parse_timestamp(finished_at)
