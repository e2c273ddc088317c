"""The benchmark report's pure parts: chart models, tables and HTML pieces of runs' and
campaigns' results, shared by ``llmd-supervisor report`` / ``campaign report`` (one HTML
file) and the daemon's dashboard (pages served live).

Every plotted point is its own SVG group carrying ``class="point"``, ``data-chart``,
``data-run``, ``data-concurrency``, ``data-x`` and ``data-y`` (`adapters.web.chart_svg` draws
them), so what a chart shows can be checked from the page. The charts: total throughput
per GPU against interactivity (1000 / median TPOT in ms, the chart InferenceX publishes;
runs whose GPU count is unknown are left out of it, never plotted as totals on its axis),
total throughput against interactivity (every run), and median TTFT and TPOT against
concurrency, one line per run; for a campaign, throughput per GPU against interactivity
with one line per topology and the Pareto frontier marked.

What a job wrote reaches the report through its results (file names, numbers), so the
report takes nothing as given: text is escaped as the daemon escapes what a job writes
(`core.run.jobtext`: a name that is not UTF-8, or holds control characters, shows them as
backslash escapes) and then HTML-escaped, and a chart places only a concurrency from 1 to
`MAX_CONCURRENCY` and values from 0 to `MAX_VALUE`. What it leaves out is named in a note
beside the chart; the evidence tables still show every point. Pure: no matplotlib here.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Callable, Sequence

from llmd_supervisor.core.campaign.views import CampaignJobResults
from llmd_supervisor.core.protocol.runs import PointView, RunResults
from llmd_supervisor.core.protocol.runs import PointView as ResultPoint
from llmd_supervisor.core.results.evidence import LATENCIES
from llmd_supervisor.core.results.values import (
    gpu_text,
    interactivity,
    latency,
    no_results_reason,
    per_gpu_total,
    points_text,
)
from llmd_supervisor.core.run.jobtext import job_text

# What a chart places. No benchmark runs a million requests at once or measures 10**12
# tokens/s or ms; beyond these matplotlib fails (float(10**400) overflows, and an axis up
# to 1.7e308 overflows while it picks its ticks).
MAX_CONCURRENCY = 2**20
MAX_VALUE = 1e12
NOTES_SHOWN = 20  # notes per chart; the rest are counted

# matplotlib's tab10, fixed here so that a run has one colour in every chart.
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


@dataclasses.dataclass(frozen=True)
class Series:
    """One run's line in one chart: (x, y, concurrency) in concurrency order."""

    run: str
    label: str
    color: str
    points: tuple[tuple[float, float, int], ...]


@dataclasses.dataclass(frozen=True)
class Chart:
    chart_id: str
    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    log_x: bool = False
    left_out: tuple[str, ...] = ()  # one sentence per run not plotted
    zero_y: bool = False  # a throughput: its axis starts at zero


def chart_data(chart: Chart) -> dict[str, object]:
    """`chart` as `report --json` prints it: its axes and each run's points, without the
    drawing's colours."""
    return {
        "id": chart.chart_id,
        "title": chart.title,
        "x": chart.xlabel,
        "y": chart.ylabel,
        "log_x": chart.log_x,
        "series": [
            {
                "run": s.run,
                "label": s.label,
                "points": [{"x": x, "y": y, "concurrency": c} for x, y, c in s.points],
            }
            for s in chart.series
        ],
        "left_out": list(chart.left_out),
    }


def escaped_run(r: RunResults) -> RunResults:
    """`r` with every text field escaped as `job_text` does (numbers are bounded where they
    are plotted)."""
    out = r.copy()
    out["run"], out["state"], out["reason"] = (job_text(r[k]) for k in ("run", "state", "reason"))
    out["outcome"] = None if r["outcome"] is None else job_text(r["outcome"])
    table = r["results"]
    if table is not None:
        points = []
        for p in table["points"]:
            q = p.copy()
            q["file"] = job_text(p["file"])
            q["problem"] = None if p["problem"] is None else job_text(p["problem"])
            points.append(q)
        escaped = table.copy()
        escaped["format"], escaped["points"] = job_text(table["format"]), points
        out["results"] = escaped
    return out


def _int_text(value: int) -> str:
    """`value` in digits, or as ``1.000e+400`` when it has more than 15."""
    digits = str(abs(value))
    if len(digits) <= 15:
        return str(value)
    return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"


def _placeable(p: ResultPoint) -> bool:
    return p["valid"] and 1 <= p["concurrency"] <= MAX_CONCURRENCY


def _valid_points(r: RunResults) -> list[ResultPoint]:
    """`r`'s valid points that a chart can place, in concurrency order."""
    table = r["results"]
    if table is None:
        return []
    return sorted((p for p in table["points"] if _placeable(p)), key=lambda p: p["concurrency"])


def left_out_of_every_chart(runs: Sequence[RunResults]) -> list[str]:
    """One sentence per valid point whose concurrency no chart can place."""
    out = []
    for r in runs:
        table = r["results"]
        for p in table["points"] if table else ():
            if p["valid"] and not _placeable(p):
                out.append(
                    f"run {r['run']}, the point of concurrency {_int_text(p['concurrency'])} "
                    f"({p['file']}): a chart places a concurrency from 1 to "
                    f"{MAX_CONCURRENCY:,}; the run's table shows the point"
                )
    return out


INTERACTIVITY = "interactivity (tok/s/user = 1000 / median TPOT in ms)"
NO_VALUES = "no valid point has the values this chart needs"


def _gpus_unknown(r: RunResults) -> str:
    if r["results"] is not None and r["results"]["gpus"]:
        return NO_VALUES
    return (
        "its GPU count is unknown, so it has no per-GPU throughput (the total-throughput "
        "chart shows it; a spec declares topology.gpus_per_node, or nominal_gpus_per_node "
        "for stand-ins)"
    )


def _series(
    runs: Sequence[RunResults],
    x: Callable[[RunResults, ResultPoint], float | None],
    y: Callable[[RunResults, ResultPoint], float | None],
    *,
    unknown: Callable[[RunResults], str] = lambda _: NO_VALUES,
) -> tuple[tuple[Series, ...], tuple[str, ...]]:
    series, left_out = [], []
    for i, r in enumerate(runs):
        pts = []
        for p in _valid_points(r):
            xv, yv = x(r, p), y(r, p)
            if xv is None or yv is None:
                continue  # not measured
            beyond = [v for v in (xv, yv) if not (math.isfinite(v) and 0 <= v <= MAX_VALUE)]
            if beyond:
                left_out.append(
                    f"run {r['run']} c={p['concurrency']}: {beyond[0]:.4g} is beyond what a "
                    f"chart can place (0 to {MAX_VALUE:g}); the run's table shows it"
                )
                continue
            pts.append((xv, yv, p["concurrency"]))
        if pts:
            series.append(Series(r["run"], r["run"], PALETTE[i % len(PALETTE)], tuple(pts)))
        elif r["results"] is None or not r["results"]["points"]:
            left_out.append(f"run {r['run']}: {no_results_reason(r)}")
        else:
            left_out.append(f"run {r['run']}: {unknown(r)}")
    return tuple(series), tuple(left_out)


def build_charts(runs: Sequence[RunResults]) -> list[Chart]:
    """The report's four charts (pure: no matplotlib needed). No axis holds per-GPU values
    and totals together: a run without a GPU count is in the total chart only."""

    def per_gpu(r: RunResults, p: ResultPoint) -> float | None:
        table = r["results"]
        return per_gpu_total(p, table["gpus"]) if table else None

    def total(_: RunResults, p: ResultPoint) -> float | None:
        return p["total_token_throughput"]

    def x_interactivity(_: RunResults, p: ResultPoint) -> float | None:
        return interactivity(p)

    def conc(_: RunResults, p: ResultPoint) -> float:
        return float(p["concurrency"])

    def median(metric: str) -> Callable[[RunResults, ResultPoint], float | None]:
        return lambda _, p: latency(p, metric, "median")

    charts = []
    s, out = _series(runs, x_interactivity, per_gpu, unknown=_gpus_unknown)
    charts.append(
        Chart(
            "tput-vs-interactivity",
            "Throughput per GPU against interactivity",
            INTERACTIVITY,
            "total tok/s per GPU",
            s,
            left_out=out,
            zero_y=True,
        )
    )
    s, out = _series(runs, x_interactivity, total)
    charts.append(
        Chart(
            "total-tput-vs-interactivity",
            "Total throughput against interactivity",
            INTERACTIVITY,
            "total tok/s (all GPUs)",
            s,
            left_out=out,
            zero_y=True,
        )
    )
    for metric in ("ttft", "tpot"):
        s, out = _series(runs, conc, median(metric))
        charts.append(
            Chart(
                f"{metric}-vs-concurrency",
                f"Median {metric.upper()} against concurrency",
                "concurrency (requests in flight)",
                f"median {metric.upper()} (ms)",
                s,
                log_x=True,
                left_out=out,
            )
        )
    return charts


# --- HTML ---------------------------------------------------------------------------------

REPORT_CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; max-width: 1150px; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.8em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; } td.text { text-align: left; white-space: normal; }
tr.invalid td { background: #fde8e8; }
.scroll { overflow-x: auto; }
.verdict { padding: 0.4em 0.7em; border-left: 6px solid #999; background: #f6f6f6; }
.succeeded { border-color: #2ca02c; } .bad { border-color: #d62728; }
.chart svg { max-width: 100%; height: auto; }
.note { color: #555; font-size: 0.9em; }
"""

_COLUMNS: tuple[tuple[str, Callable[[ResultPoint, int | None], object]], ...] = (
    ("concurrency", lambda p, g: p["concurrency"]),
    ("prompts", lambda p, g: p["num_prompts"]),
    ("completed", lambda p, g: p["completed"]),
    ("failed", lambda p, g: p["failed"]),
    ("duration s", lambda p, g: p["duration_s"]),
    ("req/s", lambda p, g: p["request_throughput"]),
    ("output tok/s", lambda p, g: p["output_throughput"]),
    ("total tok/s", lambda p, g: p["total_token_throughput"]),
    ("input tok/s", lambda p, g: p["input_throughput"]),
    ("total tok/s/GPU", lambda p, g: per_gpu_total(p, g)),
    ("output tok/s/GPU", lambda p, g: p["output_throughput_per_gpu"]),
    ("input tok/s/GPU", lambda p, g: p["input_throughput_per_gpu"]),
    ("interactivity", lambda p, g: interactivity(p)),
)


def _num(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not abs(value) < 1e15:  # also inf and nan
            return f"{value:.4g}"
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return _int_text(value)
    return html.escape(str(value))


def _lat_getter(metric: str, stat: str) -> Callable[[ResultPoint, int | None], object]:
    return lambda p, g: latency(p, metric, stat)


def evidence_table(r: RunResults) -> str:
    table = r["results"]
    if table is None or not table["points"]:
        return f'<p class="note">No results: {html.escape(no_results_reason(r))}.</p>'
    columns = list(_COLUMNS)
    for metric in LATENCIES:
        for stat in ("mean", "median", "p99"):
            columns.append((f"{metric.upper()} {stat} ms", _lat_getter(metric, stat)))
    head = "".join(f"<th>{html.escape(name)}</th>" for name, _ in columns)
    rows = []
    for p in sorted(table["points"], key=lambda p: p["concurrency"]):
        cells = "".join(f"<td>{_num(get(p, table['gpus']))}</td>" for _, get in columns)
        problem = "valid" if p["valid"] else f"invalid: {p['problem'] or 'no reason given'}"
        cells += f'<td class="text">{html.escape(problem)}</td>'
        cells += f'<td class="text">{html.escape(p["file"])}</td>'
        rows.append(f'<tr class="{"valid" if p["valid"] else "invalid"}">{cells}</tr>')
    return (
        f'<div class="scroll"><table><tr>{head}<th>valid</th><th>file</th></tr>'
        + "".join(rows)
        + "</table></div>"
    )


def run_title(r: RunResults) -> str:
    """What a run was: model, topology (xPyD and GPUs), ISL/OSL and when it ended, from
    its results table's deployment, or what a foreign job's result files declared (the
    parts it does not say are left out)."""
    table = r["results"]
    d = table.get("deployment") if table is not None else None
    parts = []
    if d is not None:
        parts.append(d["model"])
        gpus = ""
        if d["num_prefill_gpu"] is not None and d["num_decode_gpu"] is not None:
            gpus = f", {d['num_prefill_gpu']}+{d['num_decode_gpu']} GPUs"
        parts.append(f"{d['prefill_num_workers']}P{d['decode_num_workers']}D{gpus}")
        parts.append(f"ISL {d['isl']} / OSL {d['osl']}")
    elif table is not None:  # a foreign job: what its result files declared
        said = table.get("declared") or {}
        if "model" in said:
            parts.append(said["model"])
        workers = (said.get("prefill_num_workers"), said.get("decode_num_workers"))
        topology = f"{workers[0]}P{workers[1]}D" if None not in workers else ""
        if table["gpus"]:
            topology = f"{topology}, {gpu_text(table)}" if topology else gpu_text(table)
        if topology:
            parts.append(topology)
        if "isl" in said and "osl" in said:
            parts.append(f"ISL {said['isl']} / OSL {said['osl']}")
    ended = r.get("finished_at")
    if ended:
        parts.append(f"ended {ended[:16].replace('T', ' ')} UTC")
    return " · ".join(parts)


def _chart_table(chart: Chart) -> str:
    """The plotted points of `chart` as a table below it (the numbers the eye reads off)."""
    head = "<tr><th>run</th><th>concurrency</th>"
    head += f"<th>{html.escape(chart.xlabel)}</th><th>{html.escape(chart.ylabel)}</th></tr>"
    rows = [
        f'<tr><td class="text">{html.escape(s.label)}</td><td>{conc}</td>'
        f"<td>{_num(x)}</td><td>{_num(y)}</td></tr>"
        for s in chart.series
        for x, y, conc in s.points
    ]
    return f'<div class="scroll"><table class="points">{head}{"".join(rows)}</table></div>'


def run_section(r: RunResults) -> str:
    outcome = r["outcome"]
    css = "succeeded" if outcome == "succeeded" else ("bad" if outcome else "")
    table = r["results"]
    meta = "no results table"
    if table is not None:
        meta = f"{table['format']} client, {gpu_text(table)}, {points_text(len(table['points']))}"
    return (
        f'<section id="run-{html.escape(r["run"], quote=True)}">'
        f"<h2>Run {html.escape(r['run'])}</h2>"
        f'<p class="title">{html.escape(run_title(r))}</p>'
        f'<div class="verdict {css}"><b>{html.escape(outcome or "no outcome yet")}</b> '
        f"(state {html.escape(r['state'])}): {html.escape(r['reason'] or 'no reason given')}"
        f'</div><p class="note">{html.escape(meta)}</p>{evidence_table(r)}</section>'
    )


def chart_parts(charts: Sequence[Chart], svg: Callable[[Chart], str]) -> list[str]:
    """Each chart's HTML: its SVG and table of plotted points, or that it has nothing to
    plot, then what it left out."""
    parts = []
    for chart in charts:
        if chart.series:
            parts.append(f'<div class="chart" id="{chart.chart_id}">{svg(chart)}</div>')
            parts.append(_chart_table(chart))
        else:
            parts.append(f'<p class="note">{html.escape(chart.title)}: nothing to plot.</p>')
        parts += notes("Not plotted", chart.left_out)
    return parts


def notes(head: str, notes: Sequence[str]) -> list[str]:
    shown = [f'<p class="note">{head}: {html.escape(why)}.</p>' for why in notes[:NOTES_SHOWN]]
    if len(notes) > NOTES_SHOWN:
        shown.append(f'<p class="note">{head}: {len(notes) - NOTES_SHOWN} more like these.</p>')
    return shown


SETTLED = ("verified", "reused")
Point = tuple[float, float, int]  # (x, y, concurrency)


def _placeable_xy(x: float | None, y: float | None) -> bool:
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
            if _placeable_xy(x, y):
                assert x is not None and y is not None
                by_topology.setdefault(job["topology"], []).append((x, y, p["concurrency"]))
            else:
                left_out.append(f"job {job['job']} c={p['concurrency']}: no per-GPU value")
            for metric in ("ttft", "tpot"):
                v = latency(p, metric, "median")
                if _placeable_xy(float(p["concurrency"]), v):
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
