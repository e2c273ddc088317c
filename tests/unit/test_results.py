"""Benchmark results: the two real formats, the validity gate, results.json, garbage."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd_supervisor.core.results.evidence import (
    FORMATS,
    MAX_RESULT_BYTES,
    PERCENTILES_MAX,
    GateResult,
    Point,
    ResultFormat,
    ResultProblem,
    Stats,
    Validity,
    gate,
    min_completed,
    parse_any,
    parse_result,
    parsed_from_json,
    parsed_to_json,
    results_table,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "results"
VLLM_C4 = (DATA / "vllm-serve-c4.json").read_bytes()
VLLM_C8 = (DATA / "vllm-serve-c8-failures.json").read_bytes()
IX_C32 = (DATA / "inferencex-c32.json").read_bytes()


def doc(raw: bytes = VLLM_C4, **changes: Any) -> bytes:
    """A real result with keys changed (value ... deletes the key)."""
    d = json.loads(raw)
    for k, v in changes.items():
        if v is ...:
            d.pop(k, None)
        else:
            d[k] = v
    return json.dumps(d).encode()


def point(raw: bytes = VLLM_C4, fmt: ResultFormat = "vllm", **changes: Any) -> Point:
    got = parse_result(doc(raw, **changes), fmt)
    assert isinstance(got, Point), got
    return got


def problem(data: bytes | str | None, fmt: ResultFormat = "vllm") -> ResultProblem:
    got = parse_result(data, fmt)
    assert isinstance(got, ResultProblem), got
    return got


# --- the real formats ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fmt", "conc", "prompts", "completed", "failed", "tokens"),
    [
        (VLLM_C4, "vllm", 4, 40, 40, 0, (40960, 2560)),
        (VLLM_C8, "vllm", 8, 80, 60, 20, (61440, 3840)),
        (IX_C32, "inferencex", 32, 320, 320, 0, (327680, 10240)),
        (VLLM_C8, "inferencex", 8, 80, 60, 20, (61440, 3840)),  # a failed key is believed
    ],
    ids=["vllm-c4", "vllm-c8-failures", "inferencex-c32", "vllm-file-read-as-inferencex"],
)
def test_real_files_parse(
    raw: bytes,
    fmt: ResultFormat,
    conc: int,
    prompts: int,
    completed: int,
    failed: int,
    tokens: tuple[int, int],
) -> None:
    p = parse_result(raw, fmt)
    assert isinstance(p, Point), p
    d = json.loads(raw)
    assert p.format == fmt
    assert (p.concurrency, p.num_prompts, p.completed, p.failed) == (
        conc,
        prompts,
        completed,
        failed,
    )
    assert (p.total_input_tokens, p.total_output_tokens) == tokens
    assert p.duration_s == d["duration"] > 0
    assert p.request_throughput == pytest.approx(completed / p.duration_s)
    assert p.total_token_throughput == pytest.approx(sum(tokens) / p.duration_s)
    assert p.input_throughput == pytest.approx(tokens[0] / p.duration_s)
    # vLLM's files were saved with --metric-percentiles 99, InferenceX's with 90,99,99.9.
    names = ("p90", "p99", "p99.9") if raw is IX_C32 else ("p99",)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = getattr(p, f"{metric}_ms")
        assert stats == Stats(
            d[f"mean_{metric}_ms"],
            d[f"median_{metric}_ms"],
            d[f"p99_{metric}_ms"],
            d[f"std_{metric}_ms"],
            tuple((name, d[f"{name}_{metric}_ms"]) for name in names),
        )


def test_inferencex_derives_failed_from_completed() -> None:
    p = point(IX_C32, "inferencex", completed=300)
    assert p.failed == 20


def test_inferencex_file_read_as_vllm_names_the_fix() -> None:
    got = problem(IX_C32, "vllm")
    assert got.kind == "missing_field"
    assert "'failed'" in got.detail and "result_format = 'inferencex'" in got.detail


def test_every_percentile_the_client_reported_is_kept() -> None:
    """`--metric-percentiles 50,90,99.9,99.99`: each is kept by its name, in order; a
    name no client writes, or one past PERCENTILES_MAX, is not read."""
    changes: dict[str, Any] = {
        "p99_ttft_ms": ...,
        "p50_ttft_ms": 10.0,
        **{"p99.99_ttft_ms": 40.0, "p99.9_ttft_ms": 30.0, "p90_ttft_ms": 20.0},
        **{"p99.x_ttft_ms": 1.0, "p101_ttft_ms": 1.0, "p90_ttft_s": 1.0, "pp90_ttft_ms": 1.0},
    }
    p = point(**changes)
    assert p.ttft_ms.p99 is None
    assert p.ttft_ms.percentiles == (
        ("p50", 10.0), ("p90", 20.0), ("p99.9", 30.0), ("p99.99", 40.0)
    )  # fmt: skip
    many_keys: dict[str, Any] = {f"p{n}_itl_ms": float(n) for n in range(30, 60)}
    many = point(**many_keys)
    assert [name for name, _ in many.itl_ms.percentiles] == [
        f"p{n}" for n in range(30, 30 + PERCENTILES_MAX)
    ]
    assert problem(doc(p90_e2el_ms="slow")).kind == "bad_value"
    assert point(p90_e2el_ms=None).e2el_ms.percentiles == (("p99", p.e2el_ms.p99),)


def test_optional_parts_of_a_real_result() -> None:
    # vLLM's default --percentile-metrics has no e2el; --metric-percentiles may lack 99
    p = point(
        mean_e2el_ms=..., median_e2el_ms=..., std_e2el_ms=..., p99_e2el_ms=..., p99_ttft_ms=...
    )
    assert p.e2el_ms == Stats(None, None, None)
    assert p.ttft_ms.p99 is None and p.ttft_ms.mean is not None
    assert point(max_concurrency=None).concurrency is None  # unbounded run
    assert point(request_rate=12.5).completed == 40
    # the stand-in's old key
    assert point(max_concurrency=..., concurrency=4).concurrency == 4
    assert point(completed=40.0, num_prompts=40.0).completed == 40


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (None, "missing"),
        (b"", "not_json"),
        (b"  \n", "not_json"),
        (b"\xff\xfe{", "not_json"),
        (b'{"completed": 1', "not_json"),
        (VLLM_C4 + b"\n" + VLLM_C4, "not_json"),  # --append-result
        (b"[" * 100_000, "not_json"),
        (b"[1, 2]", "not_object"),
        (b'"text"', "not_object"),
        (b"null", "not_object"),
        (b"{}", "missing_field"),
        (doc(completed=...), "missing_field"),
        (doc(duration=...), "missing_field"),
        (doc(total_output_tokens=...), "missing_field"),
        (doc(completed="40"), "bad_value"),
        (doc(completed=-1), "bad_value"),
        (doc(completed=True), "bad_value"),
        (doc(completed=39.5), "bad_value"),
        (doc(failed=None), "bad_value"),
        (doc(duration=-1.0), "bad_value"),
        (doc(output_throughput="fast"), "bad_value"),
        (doc(max_concurrency=0), "bad_value"),
        (doc(max_concurrency="4"), "bad_value"),
        (doc(mean_ttft_ms="slow"), "bad_value"),
        (doc(mean_ttft_ms=[1]), "bad_value"),
        (VLLM_C4.replace(b'"duration": ', b'"duration": NaN, "x": '), "bad_value"),
        (VLLM_C4.replace(b'"duration": ', b'"duration": Infinity, "x": '), "bad_value"),
        (VLLM_C4.replace(b'"duration": ', b'"duration": 1e999, "x": '), "bad_value"),
        (doc(completed=41), "inconsistent"),
        (doc(failed=1), "inconsistent"),
        (b" " * (MAX_RESULT_BYTES + 1), "too_large"),
    ],
)
def test_problems_are_named(data: bytes | None, kind: str) -> None:
    got = problem(data)
    assert got.kind == kind
    assert len(str(got)) < 200


def test_unknown_format_is_a_problem() -> None:
    assert problem(VLLM_C4, "sglang").kind == "bad_value"  # type: ignore[arg-type]


def test_any_format_is_the_first_that_parses_else_the_last_problem() -> None:
    assert parse_any(IX_C32, FORMATS) == point(IX_C32, "inferencex")
    assert parse_any(VLLM_C4, FORMATS) == point(VLLM_C4)
    assert parse_any(doc(completed=...), FORMATS) == ResultProblem(
        "missing_field", "no 'completed'"
    )
    assert parse_any(VLLM_C4, ()) == ResultProblem("bad_value", "unknown result format ''")


# --- across the result parser's process boundary ------------------------------------------


@pytest.mark.parametrize(
    "got",
    [
        point(),
        point(VLLM_C8),
        point(IX_C32, "inferencex"),
        point(max_concurrency=None),
        point(mean_ttft_ms=..., p99_itl_ms=...),
        ResultProblem("not_json", "empty file"),
        ResultProblem("refused", "parsing c4.json needs more than 512 MiB of memory"),
    ],
    ids=["vllm", "failures", "inferencex", "unbounded", "no-stats", "not-json", "refused"],
)
def test_a_parse_crosses_the_process_boundary_unchanged(got: Point | ResultProblem) -> None:
    assert parsed_from_json(json.loads(json.dumps(parsed_to_json(got)))) == got


def _crossed(**changes: Any) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(json.dumps(parsed_to_json(point())))
    value["point"].update(changes)
    return value


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        {"v": 2, "problem": {"kind": "missing", "detail": ""}},
        {"v": 1},
        {"v": 1, "problem": {"kind": "exploded", "detail": ""}},
        {"v": 1, "problem": {"kind": "missing", "detail": 7}},
        _crossed(format="sglang"),
        _crossed(concurrency=0),
        _crossed(concurrency=True),
        _crossed(completed=-1),
        _crossed(failed=False),
        _crossed(duration_s=None),
        _crossed(ttft_ms={"mean": 1.0}),
        _crossed(tpot_ms={"mean": "slow", "median": None, "p99": None}),
        _crossed(tpot_ms={"mean": 1.0, "median": None, "p99": None, "std": None, "x": 1}),
        *(
            _crossed(
                tpot_ms={"mean": 1.0, "median": None, "p99": None, "std": None, "percentiles": v}
            )
            for v in ({"p90": 1.0}, [["p90"]], [["p90", -1.0]], [["90", 1.0]], [["p1", 1.0]] * 17)
        ),
    ],
)
def test_anything_else_is_refused_at_the_process_boundary(value: object) -> None:
    with pytest.raises(ValueError, match=r"^(not a|neither)"):
        parsed_from_json(value)


def test_a_latency_without_percentiles_crosses_the_process_boundary() -> None:
    """What a parser of an older install sends: the latencies without `percentiles`."""
    value = _crossed()
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        del value["point"][metric]["percentiles"]
    got = parsed_from_json(value)
    assert isinstance(got, Point) and got.ttft_ms.percentiles == ()
    assert got.ttft_ms.p99 == point().ttft_ms.p99


def test_a_problem_detail_is_bounded_at_the_process_boundary() -> None:
    value = {"v": 1, "problem": {"kind": "refused", "detail": "x" * 5000}}
    got = parsed_from_json(value)
    assert isinstance(got, ResultProblem) and len(got.detail) == 1000


def test_min_completed_is_exact() -> None:
    assert min_completed(0.95, 320) == 304
    assert min_completed(0.95, 20) == 19
    assert min_completed(0.95, 1) == 1
    assert min_completed(1.0, 40) == 40
    assert min_completed(0.1, 30) == 3
    assert min_completed(0.7, 10) == 7


# --- the validity gate -----------------------------------------------------------------

V = Validity()


def pt(conc: int, n: int, **changes: Any) -> Point:
    """A believable vLLM point for concurrency `conc` with `n` prompts, all completed."""
    base = {
        "max_concurrency": conc,
        "num_prompts": n,
        "completed": n,
        "failed": 0,
        "total_output_tokens": 16 * n,
    }
    return point(**{**base, **changes})


EXPECTED = {1: 10, 4: 40, 32: 320}
ALL_FINE: dict[int, Point | ResultProblem | None] = {c: pt(c, n) for c, n in EXPECTED.items()}


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({}, None),
        ({32: None}, "benchmark c=32: no result file; results/c32.json"),
        ({32: ResultProblem("missing", "no result file")}, "benchmark c=32: no result file"),
        ({32: "drop"}, "benchmark c=32: no result file; results/c32.json"),
        (
            {32: pt(32, 320, total_output_tokens=0)},
            "benchmark c=32: 0 output tokens (min 1); results/c32.json",
        ),
        (
            {32: pt(32, 320, completed=0, failed=320)},
            "benchmark c=32: 0 of 320 requests completed (min 304); results/c32.json",
        ),
        (
            {32: pt(32, 320, completed=303, failed=17)},
            "benchmark c=32: 303 of 320 requests completed (min 304)",
        ),
        ({32: pt(32, 320, completed=304, failed=16)}, None),  # exactly the fraction
        (
            {4: parse_result(b"{not json", "vllm")},
            "benchmark c=4: unparsable result (not_json: ",
        ),
        (
            {4: pt(8, 40)},
            "benchmark c=4: result for the wrong concurrency (max_concurrency 8); results/c4.json",
        ),
        ({4: pt(4, 40, max_concurrency=None)}, "benchmark c=4: result for the wrong concurrency"),
        ({1: pt(1, 10, duration=0.0)}, "benchmark c=1: duration 0 s (must be > 0)"),
        (
            {1: ResultProblem("refused", "a symbolic link")},
            "benchmark c=1: result file refused (a symbolic link)",
        ),
        # the first failing point (by concurrency) is the one named
        ({32: None, 4: pt(4, 40, completed=0, failed=40)}, "benchmark c=4: 0 of 40 requests"),
        # a point for a concurrency nobody asked for is ignored
        ({64: None}, None),
        # a client that sent fewer prompts than asked is short
        ({32: pt(32, 100)}, "benchmark c=32: 100 of 320 requests completed (min 304)"),
    ],
)
def test_gate_truth_table(changes: dict[int, Any], reason: str | None) -> None:
    points = dict(ALL_FINE)
    for c, v in changes.items():
        if v == "drop":
            points.pop(c)
        else:
            points[c] = v
    got = gate(points, EXPECTED, V, {})
    assert got.ok is (reason is None)
    if reason is None:
        assert got.reason == "benchmark: 3 of 3 points valid"
    else:
        assert got.reason.startswith(reason), got.reason
        assert "\n" not in got.reason
    assert [e.concurrency for e in got.points] == [1, 4, 32]
    json.dumps(got.as_dict())  # the receipt's evidence is JSON


def test_gate_evidence_per_point() -> None:
    points = dict(ALL_FINE)
    points[4] = None
    got = gate(points, EXPECTED, V, {4: "results/bench-c4.json"})
    assert not got.ok and got.reason.endswith("; results/bench-c4.json")
    ev = {e["concurrency"]: e for e in got.as_dict()["points"]}
    assert ev[4] == {
        "concurrency": 4,
        "file": "results/bench-c4.json",
        "requested": 40,
        "min_completed": 38,
        "max_failed": 2,
        "result_concurrency": None,
        "num_prompts": None,
        "completed": None,
        "failed": None,
        "total_output_tokens": None,
        "duration_s": None,
        "valid": False,
        "problem": "no result file",
    }
    assert ev[32]["valid"] is True and ev[32]["problem"] is None
    assert ev[32]["completed"] == 320 and ev[32]["min_completed"] == 304


def test_gate_validity_knobs() -> None:
    short = {32: pt(32, 320, completed=300, failed=20)}
    assert not gate(short, {32: 320}, V, {}).ok
    assert gate(short, {32: 320}, Validity(min_completed_fraction=0.9), {}).ok
    strict = Validity(min_completed_fraction=0.9, max_failed=10)
    got = gate(short, {32: 320}, strict, {})
    assert got.reason == "benchmark c=32: 20 of 320 requests failed (max 10); results/c32.json"
    zero = {32: pt(32, 320, total_output_tokens=0)}
    assert gate(zero, {32: 320}, Validity(min_output_tokens=0), {}).ok
    few = {32: pt(32, 320, total_output_tokens=100)}
    assert not gate(few, {32: 320}, Validity(min_output_tokens=320 * 16), {}).ok


def test_gate_without_points_configured() -> None:
    got = gate({}, {}, V, {})
    assert not got.ok and got.points == ()


# --- results.json -----------------------------------------------------------------------

ROW_KEYS = {
    "concurrency",
    "num_prompts",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "input_throughput",
    "output_throughput_per_gpu",
    "total_token_throughput_per_gpu",
    "input_throughput_per_gpu",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "file",
    "valid",
    "problem",
}


def test_results_table_schema() -> None:
    points = dict(ALL_FINE)
    points[4] = parse_result(b"garbage", "vllm")
    g = gate(points, EXPECTED, V, {})
    table = results_table(g, 8)
    assert set(table) == {"format", "gpus", "prefill_gpus", "decode_gpus", "deployment", "points"}
    assert table["format"] == "vllm" and table["gpus"] == 8
    rows: list[dict[str, Any]] = table["points"]  # type: ignore[assignment]
    assert [r["concurrency"] for r in rows] == [1, 4, 32]
    assert all(set(r) == ROW_KEYS for r in rows)
    ok, bad = rows[2], rows[1]
    p = ALL_FINE[32]
    assert isinstance(p, Point)
    assert ok["valid"] is True and ok["problem"] is None and ok["file"] == "results/c32.json"
    assert ok["output_throughput_per_gpu"] == pytest.approx(p.output_throughput / 8)
    assert ok["total_token_throughput_per_gpu"] == pytest.approx(p.total_token_throughput / 8)
    assert ok["input_throughput"] == pytest.approx(p.total_token_throughput - p.output_throughput)
    assert ok["input_throughput_per_gpu"] == pytest.approx(ok["input_throughput"] / 8)
    assert set(ok["ttft_ms"]) == {"mean", "median", "p99", "std", "percentiles"}
    assert ok["ttft_ms"]["percentiles"] == {"p99": ok["ttft_ms"]["p99"]}
    assert bad["valid"] is False and bad["file"] == "results/c4.json"
    assert bad["problem"].startswith("unparsable result (not_json")
    assert all(bad[k] is None for k in ROW_KEYS - {"concurrency", "file", "valid", "problem"} - {
        "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"})  # fmt: skip
    assert bad["e2el_ms"] == {
        "mean": None, "median": None, "p99": None, "std": None, "percentiles": {}
    }  # fmt: skip
    json.dumps(table, allow_nan=False)


def test_results_table_gpus_and_format() -> None:
    g = gate({32: point(IX_C32, "inferencex")}, {32: 320}, V, {})
    assert g.ok
    for gpus in (None, 0):
        table = results_table(g, gpus)
        assert table["gpus"] is None and table["format"] == "inferencex"
        row = table["points"][0]
        assert row["output_throughput_per_gpu"] is None
        assert row["input_throughput_per_gpu"] is None
    nothing = gate({32: None}, {32: 320}, V, {})
    assert results_table(nothing, 4)["format"] == "vllm"
    assert results_table(nothing, 4, "inferencex")["format"] == "inferencex"
    assert results_table(nothing.points, None)["points"] == results_table(nothing, None)["points"]


# --- garbage never crashes --------------------------------------------------------------

KEYS = [
    "completed",
    "failed",
    "num_prompts",
    "max_concurrency",
    "concurrency",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "p99_e2el_ms",
]
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(["vllm", "inferencex"]))
def test_garbage_bytes_give_a_named_problem(data: bytes, fmt: ResultFormat) -> None:
    got = parse_result(data, fmt)
    assert isinstance(got, ResultProblem | Point)
    if isinstance(got, ResultProblem):
        assert got.kind and len(got.detail) < 300


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(KEYS), JSON_VALUES, max_size=len(KEYS)),
    st.sampled_from(["vllm", "inferencex"]),
)
def test_garbage_objects_give_a_point_or_a_problem(d: dict[str, Any], fmt: ResultFormat) -> None:
    base = json.loads(VLLM_C4)
    base.update(d)
    got = parse_result(json.dumps(base), fmt)
    assert isinstance(got, ResultProblem | Point)
    if isinstance(got, Point):
        assert 0 <= got.completed <= got.num_prompts and got.failed >= 0
        assert math.isfinite(got.duration_s) and got.duration_s >= 0
    g = gate({4: got}, {4: 40}, V, {})
    assert isinstance(g, GateResult)
    assert g.ok or g.reason.startswith("benchmark c=4: ")
    json.dumps(results_table(g, 2), allow_nan=False)


# --- the stand-in client writes what the parser reads -----------------------------------

NODE = Path(__file__).resolve().parents[2] / "llmd_supervisor" / "standins"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[str, str]]:
    """A prefill and a decode stand-in engine on 127.0.0.1 (stopped by PID afterwards)."""
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for role in ("prefill", "decode"):
            port = _free_port()
            argv = [sys.executable, str(NODE / "engine.py"), "--role", role]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--served-name", "m"]
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 20
        for url in urls:
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=1):
                        break
                except OSError:
                    assert time.monotonic() < deadline, f"{url} never healthy"
                    time.sleep(0.05)
        yield urls[0], urls[1]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


def bench(
    engines: tuple[str, str], tmp: Path, env: dict[str, str], *flags: str
) -> tuple[int, bytes | None]:
    out = tmp / "c4.json"
    argv = [sys.executable, str(NODE / "bench.py"), "--prefill-urls", engines[0]]
    argv += ["--decode-urls", engines[1], "--served-name", "m", "--num-prompts", "8"]
    argv += ["--input-len", "8", "--output-len", "4", *flags]
    if not flags:
        argv += ["--concurrency", "4", "--result-file", str(out)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMD_FAKE_")}
    done = subprocess.run(argv, env={**clean, **env}, capture_output=True, timeout=60)
    return done.returncode, out.read_bytes() if out.exists() else None


@pytest.mark.parametrize(
    ("env", "rc", "reason"),
    [
        ({}, 0, None),
        ({"LLMD_FAKE_BENCH_ZERO_OUTPUT": "1"}, 0, "benchmark c=4: 0 output tokens (min 1)"),
        (
            {"LLMD_FAKE_BENCH_FAIL_FRACTION": "0.5"},
            0,
            "benchmark c=4: 4 of 8 requests completed (min 8)",
        ),
        ({"LLMD_FAKE_BENCH_NO_RESULT": "1"}, 0, "benchmark c=4: no result file"),
        ({"LLMD_FAKE_BENCH_FAIL_CONCURRENCY": "4"}, 7, "benchmark c=4: unparsable result"),
    ],
    ids=["ok", "zero-output", "fail-fraction", "no-result", "fail-concurrency"],
)
def test_stand_in_results_through_the_gate(
    engines: tuple[str, str], tmp_path: Path, env: dict[str, str], rc: int, reason: str | None
) -> None:
    got_rc, data = bench(engines, tmp_path, env)
    assert got_rc == rc
    parsed = parse_result(data, "vllm")
    g = gate({4: parsed}, {4: 8}, V, {})
    assert g.ok is (reason is None), g.reason
    if reason is not None:
        assert g.reason.startswith(reason), g.reason
    else:
        assert isinstance(parsed, Point)
        assert (parsed.completed, parsed.failed, parsed.total_output_tokens) == (8, 0, 32)
        assert parsed.total_input_tokens == 64 and parsed.duration_s > 0
        assert all(s.p99 is not None for s in (parsed.ttft_ms, parsed.tpot_ms, parsed.e2el_ms))


def test_stand_in_keys_and_types_are_vllms(engines: tuple[str, str], tmp_path: Path) -> None:
    """The keys of a real vLLM save-result, with its types, and vLLM's flag names."""
    flags = ("--max-concurrency", "4", "--save-result", "--result-dir", str(tmp_path))
    rc, data = bench(engines, tmp_path, {}, *flags, "--result-filename", "c4.json")
    assert rc == 0 and data is not None
    ours = json.loads(data)
    real = json.loads(VLLM_C4)
    skipped = {"latencies", "queue_times", "max_output_tokens_per_s", "max_concurrent_requests"}
    skipped |= {"rtfx"} | {k for k in real if "client_queue_time" in k}
    for key, value in real.items():
        if key in skipped:
            continue
        assert key in ours, key
        if value is not None:
            assert type(ours[key]) is type(value), (key, ours[key], value)
    assert ours["max_concurrency"] == 4 and ours["request_rate"] == "inf"
