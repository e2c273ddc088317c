"""`llmd-supervisor results`: tables, CSV, JSON, InferenceX's aggregate fields and the
regression gate, from sample ``results`` replies (pure functions; no daemon)."""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import io
import json
from pathlib import Path

import pytest

from llmd_supervisor.cli.inferencex_agg import (
    AGG_DEPLOYMENT_FIELDS,
    AGG_POWER,
    AGG_STATS,
    inferencex_agg,
    write_agg,
)
from llmd_supervisor.cli.main import main
from llmd_supervisor.cli.results import (
    EXIT_REGRESSION,
    compare,
    read_run_results,
    render_csv,
    render_json,
    render_text,
    show,
)
from llmd_supervisor.core.protocol.runs import RunResults
from llmd_supervisor.core.results.evidence import LATENCIES
from llmd_supervisor.errors import SummaryError

CONCURRENCIES = (1, 16, 64)


def _lat(median: float) -> dict[str, float]:
    return {"mean": median * 1.1, "median": median, "p99": median * 3.0}


def _point(
    conc: int, out_tps: float, ttft: float, tpot: float, gpus: int | None
) -> dict[str, object]:
    prompts = max(16, conc * 10)
    total = out_tps * 2.0  # ISL = OSL: as many input as output tokens
    duration = prompts * 1024 / out_tps
    return {
        "concurrency": conc,
        "num_prompts": prompts,
        "completed": prompts,
        "failed": 0,
        "duration_s": duration,
        "request_throughput": prompts / duration,
        "output_throughput": out_tps,
        "total_token_throughput": total,
        "input_throughput": total - out_tps,
        "output_throughput_per_gpu": out_tps / gpus if gpus else None,
        "total_token_throughput_per_gpu": total / gpus if gpus else None,
        "input_throughput_per_gpu": (total - out_tps) / gpus if gpus else None,
        "ttft_ms": _lat(ttft),
        "tpot_ms": _lat(tpot),
        "itl_ms": _lat(tpot * 0.98),
        "e2el_ms": _lat(ttft + tpot * 1023),
        "file": f"results/c{conc}.json",
        "valid": True,
        "problem": None,
    }


def run_8gpu() -> dict[str, object]:
    """A succeeded 2P+2D run on 8 GPUs (vLLM's client), 3 points."""
    return {
        "run": "3f2a9c01aa",
        "state": "finished",
        "outcome": "succeeded",
        "reason": "State COMPLETED ExitCode 0:0 read twice alike; marker rc 0 for job 4242",
        "results": {
            "format": "vllm",
            "gpus": 8,
            "points": [
                _point(1, 1000.0, 40.0, 8.0, 8),
                _point(16, 10000.0, 90.0, 11.5, 8),
                _point(64, 24000.0, 310.0, 16.0, 8),
            ],
        },
    }


def run_unknown_gpus() -> dict[str, object]:
    """A succeeded run whose GPU count the parser did not know (InferenceX's client)."""
    return {
        "run": "7c1d0e02bb",
        "state": "finished",
        "outcome": "succeeded",
        "reason": "State COMPLETED ExitCode 0:0 read twice alike; marker rc 0 for job 4250",
        "results": {
            "format": "inferencex",
            "gpus": None,
            "points": [
                _point(1, 950.0, 42.0, 8.2, None),
                _point(16, 9700.0, 95.0, 12.0, None),
                _point(64, 22000.0, 330.0, 17.0, None),
            ],
        },
    }


def run_failed() -> dict[str, object]:
    return {
        "run": "9e4b7a03cc",
        "state": "finished",
        "outcome": "failed",
        "reason": "marker rc=7 from rank 2",
        "results": None,
    }


def samples() -> list[RunResults]:
    return [read_run_results(r) for r in (run_8gpu(), run_unknown_gpus(), run_failed())]


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"json": False, "csv": False, "format": None, "max_regression": None}
    return argparse.Namespace(**(base | kw))


def _show(
    runs: list[RunResults], baseline: RunResults | None = None, **kw: object
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = show(_args(**kw), runs, baseline, out, err)
    return status, out.getvalue(), err.getvalue()


# --- reading ------------------------------------------------------------------------------


def test_a_reply_of_the_wrong_shape_is_refused_with_a_sentence() -> None:
    bad = run_8gpu()
    del bad["results"]["points"][0]["ttft_ms"]  # type: ignore[index]
    with pytest.raises(SummaryError, match=r"ResultsTable\.points\[0\]\.ttft_ms is missing"):
        read_run_results(bad)


def test_a_whole_latency_dict_may_be_null() -> None:
    r = run_8gpu()
    r["results"]["points"][0]["itl_ms"] = None  # type: ignore[index]
    text = render_text([read_run_results(r)])
    assert "ITL med" in text


# --- the table ----------------------------------------------------------------------------


def test_text_shows_one_block_per_run_within_100_columns() -> None:
    text = render_text(samples())
    assert all(len(line) <= 100 for line in text.splitlines()), text
    blocks = text.split("\n\n")
    assert len(blocks) == 3
    a, b, c = blocks
    assert a.startswith(
        "run 3f2a9c01aa: finished, succeeded\n"
        "  reason: State COMPLETED ExitCode 0:0 read twice alike; marker rc 0 for job 4242\n"
    )
    assert "vllm client, 8 GPUs, 3 points" in a
    assert "tot/GPU" in a and "out/GPU" in a
    # c=64: 24000 out tok/s, 48000 total, 6000 total per GPU, 3000 output per GPU
    row = next(line.split() for line in a.splitlines() if line.split()[:2] == ["64", "640"])
    assert row[-4:] == ["24000", "48000", "6000", "3000"]
    lat = [line.split() for line in a.splitlines()[a.splitlines().index("  latency (ms)") :]]
    metrics = ("TTFT", "TPOT", "ITL", "E2EL")
    assert lat[1] == ["conc", *(m for metric in metrics for m in (metric, "med", "p99"))]
    assert lat[2][:5] == ["1", "40.0", "120", "8.00", "24.0"]
    assert "GPU count unknown" in b and "tot/GPU" not in b
    assert c.splitlines() == [
        "run 9e4b7a03cc: finished, failed",
        "  reason: marker rc=7 from rank 2",
        "  no results: its archive holds no results table (the run failed: marker rc=7 from "
        "rank 2)",
    ]


def test_an_invalid_point_is_marked_with_its_problem() -> None:
    r = run_8gpu()
    point = r["results"]["points"][2]  # type: ignore[index]
    point |= {"valid": False, "problem": "12 of 640 requests failed", "completed": 628}
    text = render_text([read_run_results(r)])
    assert "  ! c=64 is not valid: 12 of 640 requests failed (results/c64.json)" in text
    assert any(line.split()[:1] == ["64!"] for line in text.splitlines())


def test_csv_has_one_row_per_run_and_point() -> None:
    status, out, _ = _show(samples(), csv=True)
    assert status == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["run"], r["concurrency"]) for r in rows] == [
        ("3f2a9c01aa", "1"),
        ("3f2a9c01aa", "16"),
        ("3f2a9c01aa", "64"),
        ("7c1d0e02bb", "1"),
        ("7c1d0e02bb", "16"),
        ("7c1d0e02bb", "64"),
        ("9e4b7a03cc", ""),
    ]
    assert rows[2]["total_token_throughput_per_gpu"] == "6000.0"
    assert rows[2]["ttft_ms_median"] == "310.0" and rows[2]["tpot_ms_p99"] == "48.0"
    assert rows[2]["gpus"] == "8" and rows[3]["gpus"] == ""
    assert rows[3]["total_token_throughput_per_gpu"] == ""
    assert rows[6]["outcome"] == "failed" and rows[6]["reason"] == "marker rc=7 from rank 2"
    assert rows[0]["valid"] == "true" and rows[0]["file"] == "results/c1.json"


def test_json_prints_the_tables() -> None:
    status, out, _ = _show(samples(), json=True)
    assert status == 0
    doc = json.loads(out)
    assert [r["run"] for r in doc["runs"]] == ["3f2a9c01aa", "7c1d0e02bb", "9e4b7a03cc"]
    assert doc["runs"][0] == read_run_results(run_8gpu())
    assert doc["runs"][2]["results"] is None
    assert "regressions" not in doc


# --- the regression gate ------------------------------------------------------------------


def _slower(factor: float, conc: int = 16) -> RunResults:
    """run_8gpu with output throughput at `conc` multiplied by `factor`."""
    r = copy.deepcopy(run_8gpu())
    r["run"] = "candidate01"
    for p in r["results"]["points"]:  # type: ignore[index]
        if p["concurrency"] == conc:
            p["output_throughput"] *= factor
    return read_run_results(r)


def test_a_20_percent_throughput_drop_is_a_regression_at_10_not_at_30() -> None:
    base = read_run_results(run_8gpu())
    status, out, _ = _show([_slower(0.8)], base, max_regression=10.0)
    assert status == EXIT_REGRESSION == 4
    lines = [line for line in out.splitlines() if line.startswith("REGRESSION")]
    assert lines == [
        "REGRESSION run candidate01 c=16: output throughput 10000 -> 8000 tok/s "
        "(-20.0 %, limit 10 %)"
    ]
    assert "1 regression(s) against baseline run 3f2a9c01aa (more than 10 %)." in out
    assert out.startswith("baseline run 3f2a9c01aa")  # the baseline's table comes first

    status, out, _ = _show([_slower(0.8)], base, max_regression=30.0)
    assert status == 0
    assert "REGRESSION" not in out
    assert "No regression against baseline run 3f2a9c01aa" in out


def test_latency_rises_are_regressions_and_improvements_are_not() -> None:
    base = read_run_results(run_8gpu())
    r = copy.deepcopy(run_8gpu())
    points = r["results"]["points"]  # type: ignore[index]
    points[0]["ttft_ms"]["median"] = 40.0 * 1.25  # +25 %
    points[1]["tpot_ms"]["median"] = 11.5 * 1.15  # +15 %
    points[2]["output_throughput"] = 24000.0 * 1.5  # better
    points[2]["ttft_ms"]["median"] = 310.0 * 0.5  # better
    found = compare(base, read_run_results(r), 10.0)
    assert [(g.concurrency, g.kind) for g in found] == [(1, "ttft_median"), (16, "tpot_median")]
    assert found[0].change_pct == pytest.approx(25.0)
    assert found[0].baseline == 40.0 and found[0].value == 50.0
    assert compare(base, read_run_results(r), 30.0) == []


def test_a_missing_an_invalid_point_and_no_results_are_regressions() -> None:
    base = read_run_results(run_8gpu())
    r = copy.deepcopy(run_8gpu())
    points = r["results"]["points"]  # type: ignore[index]
    points[1] |= {"valid": False, "problem": "the result file is not JSON"}
    del points[2]
    found = compare(base, read_run_results(r), 10.0)
    assert [g.line() for g in found] == [
        "REGRESSION run 3f2a9c01aa c=16: the point is not valid: the result file is not JSON",
        "REGRESSION run 3f2a9c01aa c=64: no point (the baseline has one)",
    ]
    # --json shows every field of a regression
    assert [g.as_dict() for g in found] == [dataclasses.asdict(g) for g in found]
    status, out, _ = _show([read_run_results(run_failed())], base, max_regression=50.0)
    assert status == EXIT_REGRESSION
    assert (
        "REGRESSION run 9e4b7a03cc: no results: its archive holds no results table "
        "(the run failed: marker rc=7 from rank 2)"
    ) in out


def test_regressions_with_json_and_csv() -> None:
    base = read_run_results(run_8gpu())
    status, out, err = _show([_slower(0.5)], base, max_regression=10.0, json=True)
    assert status == EXIT_REGRESSION and err == ""
    doc = json.loads(out)
    assert doc["baseline"]["run"] == "3f2a9c01aa"
    assert doc["regressions"] == [
        {
            "run": "candidate01",
            "concurrency": 16,
            "kind": "output_throughput",
            "detail": "output throughput 10000 -> 5000 tok/s (-50.0 %, limit 10 %)",
            "baseline": 10000.0,
            "value": 5000.0,
            "change_pct": -50.0,
        }
    ]
    status, out, err = _show([_slower(0.5)], base, max_regression=10.0, csv=True)
    assert status == EXIT_REGRESSION
    assert "REGRESSION" not in out and "REGRESSION run candidate01 c=16" in err


def test_a_baseline_without_results_is_a_request_error() -> None:
    status, out, err = _show(
        [read_run_results(run_8gpu())], read_run_results(run_failed()), max_regression=10.0
    )
    assert status == 2 and out == ""
    assert err == (
        "llmd-supervisor results: The baseline run 9e4b7a03cc has no valid results to compare "
        "against: its archive holds no results table (the run failed: marker rc=7 from rank "
        "2).\n"
    )


# --- InferenceX's aggregate fields --------------------------------------------------------

# What a table of an older daemon holds of each latency: mean, median and p99.
AGG_FIELDS = {
    "run",
    "conc",
    "tput_per_gpu",
    "output_tput_per_gpu",
    "input_tput_per_gpu",
    *(f"{s}_{m}" for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
    "mean_intvty",
    "median_intvty",
    "p99_intvty",
    *AGG_POWER,
}


def test_inferencex_agg_names_and_units() -> None:
    """As tests/data/inferencex-agg/SOURCE.md says: latencies in seconds, interactivity
    1000 / TPOT (ms), throughputs per GPU."""
    rows = inferencex_agg(read_run_results(run_8gpu()))
    assert [r["conc"] for r in rows] == list(CONCURRENCIES)
    assert all(set(r) == AGG_FIELDS | set(AGG_DEPLOYMENT_FIELDS) for r in rows)
    # A table without a deployment (an older daemon's): its fields are there, null, and
    # the fingerprint "" as InferenceX writes it unset.
    assert all(rows[0][k] is None for k in AGG_DEPLOYMENT_FIELDS if k != "recipe_fingerprint")
    assert rows[0]["recipe_fingerprint"] == ""
    # No power telemetry: InferenceX's power step records it as not valid.
    assert (rows[0]["power_metric_schema_version"], rows[0]["power_valid"]) == (2, 0)
    c64 = rows[2]
    assert c64["tput_per_gpu"] == pytest.approx(48000.0 / 8)
    assert c64["output_tput_per_gpu"] == pytest.approx(24000.0 / 8)
    assert c64["input_tput_per_gpu"] == pytest.approx(24000.0 / 8)
    assert c64["median_ttft"] == pytest.approx(0.310)
    assert c64["p99_ttft"] == pytest.approx(0.930)
    assert c64["mean_tpot"] == pytest.approx(0.0176)
    assert c64["median_e2el"] == pytest.approx((310.0 + 16.0 * 1023) / 1000)
    assert c64["median_intvty"] == pytest.approx(1000.0 / 16.0)
    assert c64["p99_intvty"] == pytest.approx(1000.0 / 48.0)
    assert "intvty" not in c64  # InferenceX has no bare key (see SOURCE.md)


def test_inferencex_agg_carries_every_statistic_the_client_reported_and_no_other() -> None:
    """Each percentile of the table (`--metric-percentiles 90,99,99.9`) and std, in
    seconds, and interactivity for each TPOT one; a latency the client did not report
    (vLLM's default --percentile-metrics has no e2el) is left out, as InferenceX leaves
    it out; an interactivity of a TPOT of 0 is null."""
    r = run_8gpu()
    point = r["results"]["points"][2]  # type: ignore[index]
    for metric in ("ttft", "tpot", "itl"):
        view = point[f"{metric}_ms"]
        view["std"] = 2.0
        view["percentiles"] = {"p90": 20.0, "p99": view["p99"], "p99.9": 60.0}
    point["tpot_ms"]["percentiles"]["p90"] = 0.0
    point["e2el_ms"] = {"mean": None, "median": None, "p99": None, "std": None, "percentiles": {}}
    row = inferencex_agg(read_run_results(r))[2]
    assert {k for k in row if k.endswith(("_ttft", "_tpot", "_itl", "_e2el", "_intvty"))} == {
        f"{s}_{m}"
        for s in (*AGG_STATS, "p90", "p99", "p99.9")
        for m in ("ttft", "tpot", "itl", "intvty")
    }
    assert row["p99.9_ttft"] == pytest.approx(0.060) and row["std_itl"] == pytest.approx(0.002)
    assert row["p99_tpot"] == pytest.approx(0.048)
    assert row["p99.9_intvty"] == pytest.approx(1000.0 / 60.0)
    assert row["p90_tpot"] == 0.0 and row["p90_intvty"] is None


def test_a_foreign_jobs_rows_say_what_its_files_declared_and_null_for_the_rest() -> None:
    """A `submit --script` run with --prefill-gpus 16 --decode-gpus 8 on 3 nodes, whose
    client said --metadata hw=h200 prefill_tp=8 decode_tp=8: those fields, `disagg` from
    the roles, `is_multinode` from the nodes; nothing else guessed."""
    r = run_8gpu()
    r["results"] |= {  # type: ignore[operator]
        "gpus": 24,
        "prefill_gpus": 16,
        "decode_gpus": 8,
        "deployment": None,
        "declared": {
            "model": "deepseek-ai/DeepSeek-R1-0528",
            "hw": "h200",
            "prefill_tp": 8,
            "decode_tp": 8,
            "disagg": True,
            "is_multinode": True,
        },
    }
    (row, *_) = inferencex_agg(read_run_results(r))
    assert {k: row[k] for k in AGG_DEPLOYMENT_FIELDS if row[k] not in (None, "")} == {
        "model": "deepseek-ai/DeepSeek-R1-0528",
        "hw": "h200",
        "prefill_tp": 8,
        "decode_tp": 8,
        "disagg": True,
        "is_multinode": True,
        "num_prefill_gpu": 16,
        "num_decode_gpu": 8,
    }
    assert row["recipe_fingerprint"] == "" and row["prefill_ep"] is None
    assert "kv_p2p_transfer" not in row and "router" not in row  # InferenceX's optional ones
    err = io.StringIO()
    write_agg("inferencex-agg", [read_run_results(r)], io.StringIO(), err)
    said = err.getvalue()
    assert "its result files do not say decode_dcp_size, decode_dp_attention," in said
    assert "hw," not in said and "num_prefill_gpu" not in said
    assert "--metadata KEY=VALUE" in said


def test_the_roles_gpus_are_named_beside_the_count() -> None:
    r = run_8gpu()
    r["results"] |= {"gpus": 32, "prefill_gpus": 16, "decode_gpus": 16}  # type: ignore[operator]
    assert "  vllm client, 32 GPUs (16 prefill + 16 decode), 3 points" in render_text(
        [read_run_results(r)]
    )
    assert "  vllm client, 8 GPUs, 3 points" in render_text([read_run_results(run_8gpu())])


def test_inferencex_agg_output_skips_invalid_points_and_says_so() -> None:
    r = run_unknown_gpus()
    r["results"]["points"][0] |= {"valid": False, "problem": "no such file"}  # type: ignore[index]
    runs = [read_run_results(r), read_run_results(run_failed())]
    status, out, err = _show(runs, format="inferencex-agg")
    assert status == 0
    rows = json.loads(out)
    assert isinstance(rows, list) and [x["conc"] for x in rows] == [16, 64]
    assert rows[0]["tput_per_gpu"] is None and rows[0]["output_tput_per_gpu"] is None
    assert rows[0]["median_tpot"] == pytest.approx(0.012)
    assert "run 7c1d0e02bb: left out the invalid points c=1." in err
    assert "the GPU count is unknown" in err
    assert "it was not run from a spec" in err
    assert "run 9e4b7a03cc: its archive holds no results table" in err

    status, out, _ = _show(runs, format="inferencex-agg-jsonl")
    assert [json.loads(line)["conc"] for line in out.splitlines()] == [16, 64]


# --- the command line ---------------------------------------------------------------------


def test_baseline_needs_max_regression(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["results", "r1", "--baseline", "r0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "llmd-supervisor results: --baseline and --max-regression go together; "
        "give both or neither.\n"
    )


def test_a_negative_percentage_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["results", "r1", "--baseline", "r0", "--max-regression", "-5"])
    assert exc.value.code == 2
    assert "is not a percentage >= 0" in capsys.readouterr().err


def test_output_formats_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["results", "r1", "--json", "--csv"])
    assert exc.value.code == 2
    capsys.readouterr()


def test_no_daemon_is_one_line_and_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["results", "r1", "r2", "--socket", str(tmp_path / "none.sock")])
    assert status == 3
    err = capsys.readouterr().err
    assert err.startswith("llmd-supervisor results: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_render_json_is_stable() -> None:
    assert render_json(samples()) == render_json(samples())
    assert render_csv(samples()).splitlines()[0].startswith("run,state,outcome,reason,format")


def test_a_point_without_its_result_file_shows_dashes_and_gates_as_invalid() -> None:
    """As core/results/evidence.py writes it: every number null, latencies all null."""
    r = run_8gpu()
    missing: dict[str, object] = dict.fromkeys(
        ("num_prompts", "completed", "failed", "duration_s", "request_throughput"), None
    )
    missing |= dict.fromkeys(
        ("output_throughput", "total_token_throughput", "input_throughput"), None
    )
    missing |= {f"{k}_per_gpu": None for k in ("output_throughput", "total_token_throughput")}
    missing |= {"input_throughput_per_gpu": None, "valid": False, "problem": "no result file"}
    missing |= {f"{m}_ms": dict.fromkeys(("mean", "median", "p99")) for m in LATENCIES}
    r["results"]["points"][1] |= missing  # type: ignore[index]
    table = read_run_results(r)
    text = render_text([table])
    row = next(line.split() for line in text.splitlines() if line.split()[:1] == ["16!"])
    assert row == ["16!"] + ["-"] * 8
    assert "  ! c=16 is not valid: no result file (results/c16.json)" in text
    found = compare(read_run_results(run_8gpu()), table, 10.0)
    assert [(g.concurrency, g.kind) for g in found] == [(16, "invalid")]
    assert [x["conc"] for x in inferencex_agg(table)] == [1, 64]


def test_a_wide_number_widens_its_column_instead_of_shifting_the_rest() -> None:
    from llmd_supervisor.cli.results import _columns

    rows = [["conc", "tot tok/s", "out/GPU"], ["1", "12345678901234", "5"], ["64", "7", "6"]]
    lines = _columns(rows, [6, 10, 9])
    ends = {len(line) for line in lines}
    assert len(ends) == 1  # every row as long: the columns line up
    assert [line.rstrip()[-1] for line in lines] == ["U", "5", "6"]


def test_one_point_is_one_point() -> None:
    r = run_8gpu()
    r["results"]["points"] = r["results"]["points"][:1]  # type: ignore[index]
    assert "  vllm client, 8 GPUs, 1 point\n" in render_text([read_run_results(r)])


def test_no_prefill_gpu_is_said_beside_the_null_per_gpu_fields() -> None:
    """`--prefill-gpus 0 --decode-gpus 8`: the per-GPU fields are null, and stderr says why."""
    r = run_unknown_gpus()
    r["results"] |= {"gpus": 8, "prefill_gpus": 0, "decode_gpus": 8}  # type: ignore[operator]
    err = io.StringIO()
    write_agg("inferencex-agg", [read_run_results(r)], io.StringIO(), err)
    assert "run 7c1d0e02bb: it has no prefill GPU, so the per-GPU fields are null" in err.getvalue()
