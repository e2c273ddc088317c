"""``llmd-supervisor report``: runs' verdicts, evidence tables and charts in one HTML file.

The file is self-contained (no network, no scripts, no fonts or images from elsewhere):
the charts are inline SVG drawn by matplotlib, an optional dependency (the ``report``
extra). The charts, tables and escaping are `core.results.report_html`'s (the daemon's dashboard
shows the same), drawn by `adapters.web.chart_svg`.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmd_supervisor.adapters.web.chart_svg import chart_svg
from llmd_supervisor.cli import offline
from llmd_supervisor.core.protocol.runs import RunResults
from llmd_supervisor.core.results.report_html import (
    MAX_CONCURRENCY,
    MAX_VALUE,
    PALETTE,
    REPORT_CSS,
    Chart,
    build_charts,
    chart_data,
    chart_parts,
    escaped_run,
    left_out_of_every_chart,
    notes,
    run_section,
    run_title,
)

__all__ = [
    "INSTALL_HINT",
    "MAX_CONCURRENCY",
    "MAX_VALUE",
    "PALETTE",
    "build_charts",
    "chart_svg",
    "render_report",
    "report_data",
    "run_title",
]

INSTALL_HINT = (
    "llmd-supervisor report: matplotlib is not installed, and the report needs it; install "
    "the package's report extra: pip install 'llmd-supervisor[report]' "
    "(from a checkout: pip install -e '.[report]')."
)


def render_report(
    runs: Sequence[RunResults], *, generated_at: str, svg: Callable[[Chart], str] = chart_svg
) -> str:
    """The whole HTML document for `runs`."""
    runs = [escaped_run(r) for r in runs]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>llm-d benchmark report</title>",
        f"<style>{REPORT_CSS}</style></head><body>",
        "<h1>llm-d benchmark report</h1>",
        f'<p class="note">Generated {html.escape(generated_at)} by llmd-supervisor for '
        f"{len(runs)} run(s).</p>",
        "<h2>Verdicts</h2><ul>",
    ]
    for r in runs:
        parts.append(
            f'<li><a href="#run-{html.escape(r["run"], quote=True)}">{html.escape(r["run"])}</a>: '
            f"<b>{html.escape(r['outcome'] or r['state'])}</b> "
            f'<span class="title">{html.escape(run_title(r))}</span>: '
            f"{html.escape(r['reason'])}</li>"
        )
    parts.append("</ul><h2>Charts</h2>")
    parts += notes("Left out of every chart", left_out_of_every_chart(runs))
    parts += chart_parts(build_charts(runs), svg)
    parts.extend(run_section(r) for r in runs)
    parts.append("</body></html>\n")
    return "\n".join(parts)


def report_data(runs: Sequence[RunResults], *, generated_at: str) -> dict[str, object]:
    """What the report shows, as data (`report --json`): each run's verdict and results as
    `results --json` prints them, each chart's points, and what no chart could place."""
    return {
        "generated_at": generated_at,
        "runs": list(runs),
        "charts": [chart_data(c) for c in build_charts(runs)],
        "left_out": left_out_of_every_chart(runs),
    }


# --- the command --------------------------------------------------------------------------


def add_parsers(sub: argparse._SubParsersAction[Any], socket_default: Callable[[], Path]) -> None:
    p = sub.add_parser(
        "report",
        help="write runs' verdicts, results and charts as one self-contained HTML file",
        description=(
            "Write one HTML file (no network needed to view it) with each run's verdict, "
            "its evidence table, and charts: total throughput per GPU (runs with a known "
            "GPU count) and total throughput against interactivity, and median TTFT and "
            "TPOT against concurrency, one line per run. "
            "Needs matplotlib (pip install 'llmd-supervisor[report]'). "
            "--json prints the same data instead (or besides, with -o), without matplotlib."
        ),
    )
    p.add_argument("runs", metavar="RUN", nargs="+", help="run id, job name or Slurm job id")
    p.add_argument(
        "-o", "--output", type=Path, default=None, metavar="FILE", help="the HTML file to write"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the report's data on stdout: each run's verdict and results, each"
        " chart's points (no matplotlib needed)",
    )
    p.add_argument("--socket", type=Path, default=socket_default(), help="daemon control socket")
    offline.add_arguments(p)
    p.set_defaults(handler=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from llmd_supervisor.adapters.fsutil import write_atomic
    from llmd_supervisor.cli.common import _Exit
    from llmd_supervisor.cli.results import fetch_results

    output: Path | None = args.output
    if output is None and not args.json:
        print(
            "llmd-supervisor report: give -o FILE (the HTML report) or --json (its data on"
            " stdout), or both.",
            file=sys.stderr,
        )
        return 2
    if output is not None:
        try:
            import matplotlib  # noqa: F401  (checked before the daemon is asked anything)
        except ImportError:
            print(INSTALL_HINT, file=sys.stderr)
            return 2
    try:
        runs = fetch_results("report", args, list(args.runs))
    except _Exit as exc:
        return exc.status
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if output is not None:
        text = render_report(runs, generated_at=now)
        try:
            write_atomic(output, text.encode("utf-8", "backslashreplace"))
        except OSError as exc:
            print(f"llmd-supervisor report: could not write {output}: {exc}.", file=sys.stderr)
            return 2
        # With --json, stdout carries the JSON alone.
        print(f"wrote {output}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        doc = report_data(runs, generated_at=now)
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0
