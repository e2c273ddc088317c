"""Benchmark results through the daemon on the real cluster (issue 2.3): the demo run's
points are collected, archived byte-exact and shown; each stand-in benchmark fault that
exits 0 (no output, half the requests failing, no result file) makes the run `failed`,
naming the point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, demo_spec, run_to_end

PORT = 8900
DEMO_POINTS = {1: 4, 2: 8, 4: 16}  # concurrency -> prompts (prompts_multiplier = 4)


def test_the_demo_runs_results_are_archived_byte_exact_and_shown(
    daemon: Daemon, shared_tmp: Path
) -> None:
    final = run_to_end(daemon, demo_spec(shared_tmp, port=PORT))
    assert final["outcome"] == "succeeded", final["reason"]
    run, job = str(final["run"]), str(final["slurm_job_id"])
    shown = json.loads(daemon.cli("results", run, "--json").stdout)
    table = shown["runs"][0]["results"]
    points = {p["concurrency"]: p for p in table["points"]}
    assert {c: (p["num_prompts"], p["completed"]) for c, p in points.items()} == {
        c: (n, n) for c, n in DEMO_POINTS.items()
    }
    assert all(p["valid"] and p["output_throughput"] > 0 for p in points.values())
    archive = Path(str(final["archive"]))
    for c in DEMO_POINTS:
        node_side = shared_tmp / job / "bench" / f"c{c}.json"
        assert (archive / "results" / f"c{c}.json").read_bytes() == node_side.read_bytes()
        assert (archive / "results" / f"c{c}.log").exists()
    assert sorted(p.name for p in (archive / "ranks").iterdir()) == [
        f"rank{r}.status.json" for r in range(4)
    ]
    receipt = json.loads((archive / "receipt.json").read_text())
    assert receipt["benchmark"]["ok"] is True
    assert [p["concurrency"] for p in receipt["benchmark"]["points"]] == sorted(DEMO_POINTS)
    headline = daemon.status(run)["headline"]
    assert isinstance(headline, dict) and headline["concurrency"] in DEMO_POINTS
    table_text = daemon.cli("results", run).stdout
    assert all(f"{n}" in table_text for n in DEMO_POINTS.values()), table_text


@pytest.mark.parametrize(
    ("knob", "reason"),
    [
        ("LLMD_FAKE_BENCH_ZERO_OUTPUT", "benchmark c=1: 0 output tokens (min 1); results/c1.json"),
        (
            "LLMD_FAKE_BENCH_FAIL_FRACTION",
            "benchmark c=1: 2 of 4 requests completed (min 4); results/c1.json",
        ),
        ("LLMD_FAKE_BENCH_NO_RESULT", "benchmark c=1: no result file; results/c1.json"),
    ],
)
def test_a_benchmark_that_exits_0_with_bad_numbers_fails_the_run_naming_the_point(
    daemon: Daemon, shared_tmp: Path, knob: str, reason: str
) -> None:
    value = "0.5" if knob.endswith("FRACTION") else "1"
    final = run_to_end(
        daemon, demo_spec(shared_tmp, port=PORT + 10, tables={"bench": {knob: value}})
    )
    assert final["outcome"] == "failed", final
    assert str(final["reason"]).startswith(reason), final["reason"]
    assert "State=COMPLETED ExitCode=0:0" in str(final["reason"])  # Slurm alone said success
