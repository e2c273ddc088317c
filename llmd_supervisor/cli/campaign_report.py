"""``llmd-supervisor campaign report ID -o report.html``: a campaign in one HTML file.

The charts of `cli.report` (inline SVG, no network), drawn over a campaign's points:
total throughput per GPU against interactivity with one line per topology and the Pareto
frontier of every verified or reused point marked (the chart InferenceX publishes), and
median TTFT and TPOT against concurrency with one line per job; then every point's row,
and the failed and blocked points with their reasons. Text is escaped as `cli.report`
escapes what a job wrote; numbers beyond what a chart can place are left out of it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from llmd_supervisor.cli.campaign_points import PointRow
from llmd_supervisor.cli.report import (
    _CSS,
    MAX_VALUE,
    PALETTE,
    Chart,
    Series,
    chart_parts,
    chart_svg,
)
from llmd_supervisor.cli.result_values import interactivity, latency, per_gpu_total
from llmd_supervisor.core.campaign_views import CampaignJobResults, CampaignStatus
from llmd_supervisor.core.jobtext import job_text
from llmd_supervisor.core.summary import PointView

__all__ = ["campaign_charts", "pareto", "render_campaign_report"]

SETTLED = ("verified", "reused")
Point = tuple[float, float, int]  # (x, y, concurrency)


def _placeable(x: float | None, y: float | None) -> bool:
    return all(v is not None and math.isfinite(v) and 0 <= v <= MAX_VALUE for v in (x, y))


def pareto(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both axes (higher is better on each), by x."""
    best: list[Point] = []
    for p in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not best or p[1] > best[-1][1]:
            best.append(p)
    return sorted(best)


def _settled_points(job: CampaignJobResults) -> list[tuple[PointView, int | None]]:
    """The job's verified or reused points' rows (with their run's GPU count)."""
    rows: dict[tuple[str, int], tuple[PointView, int | None]] = {}
    for r in job["runs"]:
        if r["results"] is not None:
            for p in r["results"]["points"]:
                rows[(r["run"], p["concurrency"])] = (p, r["results"]["gpus"])
    out = []
    for point in job["points"]:
        got = rows.get((str(point["run"]), point["concurrency"]))
        if point["state"] in SETTLED and got is not None and got[0]["valid"]:
            out.append(got)
    return out


def campaign_charts(jobs: Sequence[CampaignJobResults]) -> list[Chart]:
    """The report's charts (pure: no matplotlib needed)."""
    by_topology: dict[str, list[Point]] = {}
    per_job: dict[str, dict[str, list[Point]]] = {"ttft": {}, "tpot": {}}
    left_out: list[str] = []
    for job in jobs:
        label = f"{job['topology']} {job['job']}"
        for p, gpus in _settled_points(job):
            x, y = interactivity(p), per_gpu_total(p, gpus)
            if _placeable(x, y):
                assert x is not None and y is not None
                by_topology.setdefault(job["topology"], []).append((x, y, p["concurrency"]))
            else:
                left_out.append(f"job {job['job']} c={p['concurrency']}: no per-GPU value")
            for metric in ("ttft", "tpot"):
                v = latency(p, metric, "median")
                if _placeable(float(p["concurrency"]), v):
                    assert v is not None
                    per_job[metric].setdefault(label, []).append(
                        (float(p["concurrency"]), v, p["concurrency"])
                    )

    def series(groups: dict[str, list[Point]], key: Callable[[Point], float]) -> list[Series]:
        return [
            Series(name, job_text(name), PALETTE[i % len(PALETTE)], tuple(sorted(pts, key=key)))
            for i, (name, pts) in enumerate(groups.items())
        ]

    tput = series(by_topology, lambda p: p[0])
    front = pareto([p for s in tput for p in s.points])
    if front:
        tput.append(Series("pareto", "Pareto frontier", "#000000", tuple(front)))
    charts = [
        Chart(
            "tput-vs-interactivity",
            "Throughput per GPU against interactivity, one line per topology",
            "interactivity (tok/s/user = 1000 / median TPOT ms)",
            "total tok/s per GPU",
            tuple(tput),
            left_out=tuple(left_out),
            zero_y=True,
        )
    ]
    for metric in ("ttft", "tpot"):
        charts.append(
            Chart(
                f"{metric}-vs-concurrency",
                f"Median {metric.upper()} against concurrency, one line per job",
                "concurrency (requests in flight)",
                f"median {metric.upper()} (ms)",
                tuple(series(per_job[metric], lambda p: p[0])),
                log_x=True,
            )
        )
    return charts


def _cell(value: object) -> str:
    return html.escape(job_text(str(value)) if value is not None else "-")


_COLUMNS = ("topology", "values", "concurrency", "state", "run", "recipe_id", "reason")


def _cells(r: PointRow) -> tuple[object, ...]:
    """A row's values under `_COLUMNS`."""
    return (
        r["topology"],
        r["values"],
        r["concurrency"],
        r["state"],
        r["run"],
        r["recipe_id"],
        r["reason"],
    )


def _points_table(title: str, rows: Sequence[PointRow]) -> list[str]:
    head = "".join(f"<th>{c}</th>" for c in _COLUMNS)
    return [
        f"<h2>{title}</h2>",
        f'<div class="scroll"><table class="points"><tr>{head}</tr>',
        *(
            "<tr>" + "".join(f'<td class="text">{_cell(v)}</td>' for v in _cells(r)) + "</tr>"
            for r in rows
        ),
        "</table></div>",
    ]


def render_campaign_report(
    status: CampaignStatus,
    jobs: Sequence[CampaignJobResults],
    rows: Sequence[PointRow],
    *,
    generated_at: str,
    svg: Callable[[Chart], str] = chart_svg,
) -> str:
    """The whole HTML document for one campaign (`rows`: `campaign results`' point rows)."""
    points = status["points"]
    counts = ", ".join(f"{n} {html.escape(k)}" for k, n in points.items() if n)
    title = f"Campaign {status['name']} ({status['campaign']})"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_cell(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{_cell(title)}</h1>",
        f'<p class="note">Generated {html.escape(generated_at)} by llmd-supervisor: '
        f"{_cell(status['state'])}; {counts}; GPU-hours useful {status['gpu_hours_useful']}, "
        f"lost {status['gpu_hours_lost']}.</p>",
        "<h2>Charts</h2>",
    ]
    parts += chart_parts(campaign_charts(jobs), svg)
    failed = [r for r in rows if r["state"] not in (*SETTLED, "queued", "running")]
    parts += _points_table(f"Failed and blocked points ({len(failed)})", failed)
    parts += _points_table(f"Every point ({len(rows)})", rows)
    parts.append("</body></html>\n")
    return "\n".join(parts)
