"""The one sanitiser of job-written text (core/run/jobtext.py): hostile values in, text that
is safe to journal, log and show on a terminal out."""

from __future__ import annotations

import json
import sqlite3

import pytest

from llmd_supervisor.core.run.jobtext import CUT_MARK, JOB_TEXT_MAX, job_repr, job_text

# (what a job wrote, what the daemon keeps)
CASES = [
    ("sweep done", "sweep done"),
    ("", ""),
    ("naïve 日本語 ✓ emoji 🚀", "naïve 日本語 ✓ emoji 🚀"),
    ("back\\slash stays", "back\\slash stays"),
    ("boom \ud800", "boom \\ud800"),
    ("low \udcff and pair \ud83d\ude80", "low \\udcff and pair \\ud83d\\ude80"),
    (
        "\x1b[2K\x1b[1Goutcome succeeded",
        "\\x1b[2K\\x1b[1Goutcome succeeded",
    ),
    ("\x1b]52;c;cm0gLXJmIH4=\x07", "\\x1b]52;c;cm0gLXJmIH4=\\x07"),  # OSC 52: clipboard
    ("\x1b]0;fake title\x1b\\", "\\x1b]0;fake title\\x1b\\"),  # OSC 0 with ST
    ("bell\x07", "bell\\x07"),
    ("over\rwritten", "over\\rwritten"),
    ("two\nlines\tand a tab", "two\\nlines\\tand a tab"),
    ("nul\x00 del\x7f", "nul\\x00 del\\x7f"),
    ("c1 csi \x9b2J nel \x85", "c1 csi \\x9b2J nel \\x85"),
    ("rtl \u202egnp.exe", "rtl \\u202egnp.exe"),  # a bidi override reverses the display
    ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),
    ("line\u2028sep", "line\\u2028sep"),
    ("tag \U000e0041", "tag \\U000e0041"),  # invisible tag characters smuggle text
]


@pytest.mark.parametrize(("written", "kept"), CASES)
def test_hostile_text_is_escaped_visibly(written: str, kept: str) -> None:
    assert job_text(written) == kept


@pytest.mark.parametrize(("written", "kept"), CASES)
def test_what_is_kept_is_printable_and_fits_sqlite_json_and_a_utf8_terminal(
    written: str, kept: str
) -> None:
    text = job_text(written)
    assert text.isprintable()
    text.encode("utf-8")  # no lone surrogate
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text)
    with sqlite3.connect(":memory:") as db:
        db.execute("CREATE TABLE t (v TEXT)")
        db.execute("INSERT INTO t VALUES (?)", (json.dumps(text, ensure_ascii=False),))


def test_job_text_is_idempotent_on_what_it_kept() -> None:
    for written, _ in CASES:
        once = job_text(written)
        assert job_text(once) == once


@pytest.mark.parametrize(
    ("written", "limit", "kept"),
    [
        ("x" * JOB_TEXT_MAX, JOB_TEXT_MAX, "x" * JOB_TEXT_MAX),
        ("x" * (JOB_TEXT_MAX + 1), JOB_TEXT_MAX, "x" * (JOB_TEXT_MAX - 3) + CUT_MARK),
        ("abcdef", 6, "abcdef"),
        ("abcdefg", 6, "abc..."),
        ("ab\x1b", 6, "ab\\x1b"),  # the escape fits exactly
        ("abc\x1b", 6, "abc..."),  # an escape is never split
        ("\x1b\x1b", 6, "..."),
        ("a\ud800", 7, "a\\ud800"),
        ("ab\ud800", 7, "ab..."),
    ],
)
def test_the_length_is_bounded_and_an_escape_never_split(
    written: str, limit: int, kept: str
) -> None:
    assert job_text(written, limit) == kept
    assert len(kept) <= limit


def test_very_long_hostile_strings_are_bounded_quickly() -> None:
    huge = "\x1b[2K" * 4_000_000  # 16 M characters, all escapes
    text = job_text(huge)
    assert len(text) <= JOB_TEXT_MAX and text.endswith(CUT_MARK)
    assert text.startswith("\\x1b[2K\\x1b[2K")
    assert len(job_text("y" * 50_000_000)) == JOB_TEXT_MAX


def test_a_limit_without_room_is_refused() -> None:
    with pytest.raises(ValueError, match="no room"):
        job_text("abc", 3)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("node\x1b[1m", "'node\\x1b[1m'"),
        ("\ud800", "'\\ud800'"),
        (7.5, "7.5"),
        (None, "None"),
        (["\x07"], "['\\x07']"),
        ("z" * 500, "'" + "z" * 76 + CUT_MARK),
        (list(range(1000)), repr(list(range(1000)))[:77] + CUT_MARK),
    ],
)
def test_job_repr_shows_any_json_value_escaped_and_bounded(value: object, shown: str) -> None:
    assert job_repr(value) == shown
