"""Garbage in never crashes: a typed parse error, UNKNOWN, or a named status, nothing else."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmd_supervisor.core.slurm.parse import (
    JobState,
    parse_exit_code,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_config,
    parse_scontrol_job,
    parse_squeue,
    parse_state,
)
from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.core.verdict.decide import (
    Outcome,
    QueryOutcome,
    VerdictState,
    decide,
    observe,
    sacct_query,
    scontrol_query,
)
from llmd_supervisor.core.verdict.marker import MarkerStatus, read_marker
from llmd_supervisor.errors import SlurmParseError, SpecError

EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T0 = datetime(2026, 11, 30, tzinfo=UTC)

# Random text, bytes decoded as a caller would, and text built from Slurm-ish pieces so
# the parsers' deeper branches are reached, not only the first rejection.
SLURM_PIECES = st.sampled_from(
    [
        "|", "=", " ", "\n", ":", "0", "1", "42", "42.batch", "COMPLETED", "CANCELLED by 0",
        "FAILED", "0:0", "1:0", "JobId=", "JobState=", "ExitCode=", "Restarts=", "MinJobAge",
        " = ", "sec", "AccountingStorageType", "Command=", "Comment=", "None", "+", ";",
        "Invalid job id specified", "\x00", "é", "٣",
    ]
)  # fmt: skip
TEXT = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=300).map(lambda b: b.decode("utf-8", errors="replace")),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    st.lists(SLURM_PIECES, max_size=40).map("".join),
)

PARSERS: list[Callable[[str], object]] = [
    parse_exit_code,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_config,
    parse_scontrol_job,
    parse_squeue,
]


@EXAMPLES
@given(TEXT)
def test_parsers_raise_only_parse_errors(text: str) -> None:
    for parser in PARSERS:
        with contextlib.suppress(SlurmParseError):
            parser(text)


@EXAMPLES
@given(TEXT)
def test_parse_state_never_raises(text: str) -> None:
    parsed = parse_state(text)
    assert parsed.raw == text
    if parsed.state is JobState.COMPLETED and parsed.exact:
        assert text.strip() == "COMPLETED"


@EXAMPLES
@given(st.one_of(st.none(), st.binary(max_size=300), TEXT.map(str.encode)))
def test_marker_never_raises(data: bytes | None) -> None:
    reading = read_marker(data, "42")
    assert (reading.marker is not None) is (reading.status is MarkerStatus.OK)


@EXAMPLES
@given(TEXT, TEXT, st.integers(min_value=0, max_value=2))
def test_queries_and_verdict_never_raise_nor_succeed_on_garbage(
    stdout: str, stderr: str, returncode: int
) -> None:
    state = VerdictState("42", T0)
    for make in (sacct_query, scontrol_query, sacct_query, scontrol_query):
        query = make("42", taken_at=T0, returncode=returncode, stdout=stdout, stderr=stderr)
        assert (query.record is not None) is (query.outcome is QueryOutcome.RECORD)
        state = observe(state, query)
    for marker in (read_marker(None, "42"), read_marker(stdout.encode(), "42")):
        verdict = decide(
            state, marker, cancel_requested=False, accounting_disabled=False,
            now=T0, deadline=T0,
        )  # fmt: skip
        if verdict.outcome is Outcome.SUCCEEDED:
            # Only reachable if the garbage happened to be a real COMPLETED 0:0 record.
            assert marker.marker is not None and marker.marker.rc == 0
            assert "COMPLETED" in stdout


# Run spec text: TOML-ish pieces (structure, strings of every kind, escapes, comments, big
# numbers, a lone surrogate) around the demo's own lines, so deep nesting, dotted keys and
# broken strings all occur; load_spec raises SpecError or returns a spec, nothing else.
DEMO_LINES = (Path(__file__).resolve().parents[2] / "deploy/llm-d/demo.toml").read_text()
TOML_PIECES = st.sampled_from(
    [
        "[", "]", "[[", "]]", "{", "}", "=", ".", ",", " ", "\n", "#", '"', "'", '"""', "'''",
        "\\", "\\u00e9", "a", "run", "slurm", "extra_args", "x", "1", "-1", "1.5", "0x",
        "9" * 40, "f" * 30, "inf", "nan", "true", "1979-05-27T07:32:00Z", "\ud800", "\x00",
        '"--export-file=/etc/shadow"', '"/:/host"', '"-c"', "é",
    ]
)  # fmt: skip
SPEC_TEXT = st.one_of(
    st.text(max_size=300),
    st.lists(TOML_PIECES, max_size=80).map("".join),
    st.tuples(
        st.integers(min_value=0, max_value=len(DEMO_LINES)), st.lists(TOML_PIECES, max_size=30)
    ).map(lambda t: DEMO_LINES[: t[0]] + "".join(t[1]) + DEMO_LINES[t[0] :]),
)


@EXAMPLES
@given(SPEC_TEXT)
def test_load_spec_raises_only_spec_errors(text: str) -> None:
    with contextlib.suppress(SpecError):
        load_spec(text)
