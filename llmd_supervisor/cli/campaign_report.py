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
from collections.abc import Callable, Sequence

from llmd_supervisor.adapters.web.chart_svg import chart_svg
from llmd_supervisor.cli.campaign_points import PointRow
from llmd_supervisor.core.campaign.views import CampaignJobResults, CampaignStatus
from llmd_supervisor.core.results.report_html import (
    REPORT_CSS,
    SETTLED,
    Chart,
    campaign_charts,
    chart_data,
    chart_parts,
    pareto,
)
from llmd_supervisor.core.run.jobtext import job_text

__all__ = ["campaign_charts", "campaign_report_data", "pareto", "render_campaign_report"]


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


def campaign_report_data(
    status: CampaignStatus,
    jobs: Sequence[CampaignJobResults],
    rows: Sequence[PointRow],
    *,
    generated_at: str,
) -> dict[str, object]:
    """What the report shows, as data (`campaign report --json`): the campaign's status,
    every point's row as `campaign results --json` prints it, and each chart's points."""
    return {
        "generated_at": generated_at,
        "campaign": status,
        "points": list(rows),
        "charts": [chart_data(c) for c in campaign_charts(jobs)],
    }


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
        f"<style>{REPORT_CSS}</style></head><body>",
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
