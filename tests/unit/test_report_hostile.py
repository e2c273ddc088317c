"""`llmd-supervisor report` on what a job may have put into its results: a file name that
is not UTF-8, a concurrency of 10**400, values of 1.7e308. The file is still written; what
no chart can place is left out of the charts with a note saying why, and the evidence
table still shows it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from llmd_supervisor.cli import report
from llmd_supervisor.cli import results as results_cli
from llmd_supervisor.cli.results import read_run_results
from llmd_supervisor.core.protocol.runs import RunResults
from tests.unit.test_report import _parse
from tests.unit.test_results_cli import run_8gpu

pytestmark = pytest.mark.timeout(60)

Mutate = Callable[[dict[str, object]], None]


def _hostile(mutate: Mutate) -> RunResults:
    r = run_8gpu()
    mutate(r)
    return read_run_results(r)


def _point(r: dict[str, object], i: int) -> dict[str, object]:
    table = r["results"]
    assert isinstance(table, dict)
    point = table["points"][i]
    assert isinstance(point, dict)
    return point


def _write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[RunResults]) -> str:
    """What `cmd_report` writes for `runs` (the daemon's reply stood in for)."""
    monkeypatch.setattr(results_cli, "fetch_results", lambda *_: runs)
    out = tmp_path / "report.html"
    args = argparse.Namespace(runs=["r"], output=out, socket=tmp_path / "s", json=False)
    assert report.cmd_report(args) == 0
    return out.read_bytes().decode("utf-8")  # strict: the file is UTF-8 throughout


def test_a_file_name_that_is_not_utf8_is_written_with_backslash_escapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # jobfiles.py decodes a remote name with surrogateescape: byte 0xff is U+DCFF.
    def mutate(r: dict[str, object]) -> None:
        _point(r, 0)["file"] = "results/c\udcff\x1b[2J.json"
        _point(r, 1)["problem"] = "lone \ud800 surrogate"
        _point(r, 1)["valid"] = False

    text = _write(tmp_path, monkeypatch, [_hostile(mutate)])
    assert "results/c\\udcff\\x1b[2J.json" in text
    assert "lone \\ud800 surrogate" in text
    assert "\x1b" not in text


def test_a_concurrency_beyond_any_chart_is_left_out_of_the_charts_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Accepted for a foreign job (its result file says so); float() of it overflows.
    text = _write(
        tmp_path, monkeypatch, [_hostile(lambda r: _point(r, 2).update(concurrency=10**400))]
    )
    page = _parse(text)
    assert {int(p["data-concurrency"]) for p in page.points} == {1, 16}
    assert "Left out of every chart: run 3f2a9c01aa, the point of concurrency 1.000e+400" in text
    assert "results/c64.json" in text  # its row is still in the table, its file named
    assert "1.000e+400" in text and "0" * 400 not in text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("total_token_throughput_per_gpu", 1.7e308),
        ("tpot", 1.7e308),
        ("ttft", 1.7e308),
        ("ttft", -1.7e308),
        ("total_token_throughput_per_gpu", math.inf),
    ],
)
def test_values_beyond_any_chart_are_left_out_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: float
) -> None:
    def mutate(r: dict[str, object]) -> None:
        point = _point(r, 1)
        if field in ("ttft", "tpot"):
            latency = point[f"{field}_ms"]
            assert isinstance(latency, dict)
            latency["median"] = value
        else:
            point[field] = value

    runs = [_hostile(mutate), read_run_results(run_8gpu() | {"run": "0a0a0a0a0a"})]
    text = _write(tmp_path, monkeypatch, runs)
    page = _parse(text)
    plotted = {(p["data-chart"], p["data-run"], p["data-concurrency"]) for p in page.points}
    assert len(plotted) == 2 * 3 * 4 - 1  # the one point with the value, in one chart
    assert "Not plotted: run 3f2a9c01aa c=16:" in text
    assert "beyond what a chart can place (0 to 1e+12)" in text
    assert "1.7e+308" in text or "inf" in text
    assert "0" * 300 not in text  # the table shows the value compactly


def test_an_integer_too_large_for_a_float_is_infinite_not_a_traceback() -> None:
    # JSON allows it; float() of it overflows (json.loads("1e400") is inf too).
    r = _hostile(lambda r: _point(r, 0).update(output_throughput=10**400))
    assert r["results"] is not None
    assert r["results"]["points"][0]["output_throughput"] == math.inf
