"""`campaign report`: its charts from a campaign's results (pure), the Pareto frontier, and
the HTML it writes (hostile text escaped)."""

from __future__ import annotations

from llmd_supervisor.cli.campaign_points import point_rows
from llmd_supervisor.cli.campaign_report import campaign_charts, pareto, render_campaign_report
from llmd_supervisor.core.campaign.views import CampaignJobResults, CampaignStatus
from llmd_supervisor.core.protocol.runs import LatencyView, PointView, RunResults


def _point(conc: int, tput: float, tpot: float, *, valid: bool = True) -> PointView:
    latency: LatencyView = {"mean": tpot, "median": tpot, "p99": tpot, "std": 0.0}
    return {
        "concurrency": conc,
        "num_prompts": 4 * conc,
        "completed": 4 * conc,
        "failed": 0,
        "duration_s": 1.0,
        "request_throughput": 1.0,
        "output_throughput": tput / 2,
        "total_token_throughput": tput,
        "input_throughput": tput / 2,
        "output_throughput_per_gpu": None,
        "total_token_throughput_per_gpu": None,
        "input_throughput_per_gpu": None,
        "ttft_ms": {**latency, "median": 10.0 * conc},
        "tpot_ms": latency,
        "itl_ms": latency,
        "e2el_ms": latency,
        "file": f"results/c{conc}.json",
        "valid": valid,
        "problem": None,
    }


def _job(key: str, topology: str, run: str, points: list[PointView]) -> CampaignJobResults:
    results: RunResults = {
        "run": run,
        "state": "succeeded",
        "outcome": "succeeded",
        "reason": "ok",
        "results": {
            "format": "vllm",
            "gpus": 8,
            "prefill_gpus": None,
            "decode_gpus": None,
            "deployment": None,
            "points": points,
        },
    }
    return {
        "campaign": "c0ffee000001",
        "job": key,
        "recipe_id": key * 4,
        "topology": topology,
        "values": {"topology.prefill_nodes": 1 if topology.startswith("1P") else 2},
        "state": "succeeded",
        "points": [
            {
                "concurrency": p["concurrency"],
                "state": "verified",
                "run": run,
                "reused_from": None,
                "reason": "",
            }
            for p in points
        ],
        "runs": [results],
    }


JOBS = [
    _job("aaa", "1P+1D", "run1", [_point(1, 800, 10.0), _point(4, 2400, 20.0)]),
    _job("bbb", "2P+1D", "run2", [_point(1, 400, 5.0), _point(4, 4000, 40.0, valid=False)]),
]


def test_the_pareto_frontier_keeps_the_points_nothing_beats_on_both_axes() -> None:
    pts = [(100.0, 50.0, 1), (50.0, 300.0, 4), (80.0, 40.0, 2), (50.0, 100.0, 8)]
    assert pareto(pts) == [(50.0, 300.0, 4), (100.0, 50.0, 1)]
    assert pareto([]) == []


def test_one_line_per_topology_and_the_frontier_over_every_valid_point() -> None:
    tput, ttft, tpot = campaign_charts(JOBS)
    lines = {s.label: s.points for s in tput.series}
    # interactivity = 1000 / TPOT; per GPU = total / 8 GPUs; the invalid point is left out
    assert lines["1P+1D"] == ((50.0, 300.0, 4), (100.0, 100.0, 1))
    assert lines["2P+1D"] == ((200.0, 50.0, 1),)
    assert lines["Pareto frontier"] == ((50.0, 300.0, 4), (100.0, 100.0, 1), (200.0, 50.0, 1))
    assert {s.label for s in ttft.series} == {"1P+1D aaa", "2P+1D bbb"}
    assert len(tpot.series) == 2


def test_the_report_escapes_what_a_job_wrote_and_lists_failed_points() -> None:
    jobs = [*JOBS, _job("ccc", "<script>x</script>", "run3", [])]
    jobs[2]["points"] = [
        {
            "concurrency": 8,
            "state": "blocked",
            "run": None,
            "reused_from": None,
            "reason": "canary aaa failed: <b>boom</b>",
        }
    ]
    status: CampaignStatus = {
        "campaign": "c0ffee000001",
        "name": "sweep",
        "state": "finished",
        "reason": "",
        "cluster": "dev",
        "owner_uid": 1000,
        "created_at": "2025-01-01T00:00:00+00:00",
        "updated_at": "2025-01-01T01:00:00+00:00",
        "points": {"verified": 4, "blocked": 1},
        "points_total": 5,
        "jobs": {"blocked": 1, "succeeded": 2},
        "jobs_total": 3,
        "gpu_hours_useful": 1.5,
        "gpu_hours_lost": 0.0,
        "eta_s": None,
        "qos": None,
        "problems": [],
        "problems_total": 1,
        "exit_status": 10,
    }
    text = render_campaign_report(
        status, jobs, point_rows(jobs), generated_at="now", svg=lambda c: f"<svg>{c.chart_id}</svg>"
    )
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert "&lt;b&gt;boom&lt;/b&gt;" in text
    assert "Failed and blocked points (1)" in text and "Every point (5)" in text
    assert "<svg>tput-vs-interactivity</svg>" in text


def test_matplotlib_draws_every_chart_with_its_points_tagged() -> None:
    from llmd_supervisor.cli.report import chart_svg

    for chart in campaign_charts(JOBS):
        svg = chart_svg(chart)
        assert svg.startswith("<svg") and svg.count('class="point"') == sum(
            len(s.points) for s in chart.series
        )
