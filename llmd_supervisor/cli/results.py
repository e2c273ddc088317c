"""``llmd-supervisor results``: a run's benchmark results table, as operators read it.

The daemon's ``results`` op answers, for a run ref, the run's verdict and the normalised
table its archive holds (``results.json``, one point per concurrency). Everything here
but `cmd_results` is a pure function of those dicts: tables for the terminal, CSV, JSON,
InferenceX's aggregate fields, and the regression gate against a baseline run.

Exit status: 0; 4 (`EXIT_REGRESSION`) when ``--baseline`` finds a regression or a missing
point; 2 for a usage or request error (unknown run, a baseline without results); 3 when
the daemon cannot be reached or answers something that is not a results table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypedDict

from llmd_supervisor.cli import offline
from llmd_supervisor.core.protocol.runs import PointView as ResultPoint
from llmd_supervisor.core.protocol.runs import ResultsTable, RunResults, UsageView, read
from llmd_supervisor.core.results.evidence import LATENCIES, NUMBER_FIELDS
from llmd_supervisor.core.results.values import (
    STATS,
    field_of,
    gpu_text,
    latency,
    no_results_reason,
    per_gpu_total,
    points_text,
    verdict_line,
)
from llmd_supervisor.errors import OfflineError, SupervisorError

# Not used by any other command (0, 1, 2, 3, 10-15 and 130 are).
EXIT_REGRESSION = 4


class _RunHead(TypedDict):
    run: str
    state: str
    outcome: str | None
    reason: str


class RegressionView(TypedDict):
    """One `Regression` in ``results --json --baseline``'s ``regressions``."""

    run: str
    concurrency: int | None
    kind: str
    detail: str
    baseline: float | None
    value: float | None
    change_pct: float | None


class _ResultsDoc(TypedDict):
    runs: list[RunResults]


class ResultsDoc(_ResultsDoc, total=False):
    """What ``results --json`` prints: the runs' results, and with ``--baseline`` the
    baseline's and what regressed."""

    baseline: RunResults
    regressions: list[RegressionView]


class ResultsError(SupervisorError):
    """The results cannot be compared as asked."""


def read_run_results(value: object) -> RunResults:
    """`value` (a decoded ``results`` reply) checked as `RunResults`; raise SummaryError.
    The table is checked on its own, so that an error names the field that is wrong."""
    head = read(_RunHead, value)
    table = value.get("results") if isinstance(value, dict) else None
    out: RunResults = {
        "run": head["run"],
        "state": head["state"],
        "outcome": head["outcome"],
        "reason": head["reason"],
        "results": None if table is None else read(ResultsTable, table),
    }
    usage = value.get("usage") if isinstance(value, dict) else None
    if usage is not None:
        out["usage"] = read(UsageView, usage)
    return out


# --- values -------------------------------------------------------------------------------


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _wrapped(text: str) -> list[str]:
    # On a terminal, its width; into a pipe or a file, 98 columns whatever COLUMNS says.
    width = max(60, shutil.get_terminal_size().columns - 2) if sys.stdout.isatty() else 98
    return textwrap.wrap(text, width=width, initial_indent="  ", subsequent_indent="      ")


def _columns(rows: list[list[str]], least: list[int]) -> list[str]:
    """Rows right-aligned in columns as wide as their widest cell (at least `least`, one
    blank between): a large number widens its column instead of shifting the rest."""
    widths = [max(w, *(len(row[i]) + 1 for row in rows)) for i, w in enumerate(least)]
    return ["  " + "".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]


# --- text ---------------------------------------------------------------------------------


def render_text(runs: Sequence[RunResults], *, baseline: RunResults | None = None) -> str:
    """One block per run (the baseline's first), readable in 100 columns."""
    blocks = []
    if baseline is not None:
        blocks.append(_block(baseline, label="baseline "))
    blocks.extend(_block(r) for r in runs)
    return "\n".join(blocks)


def _block(r: RunResults, *, label: str = "") -> str:
    lines = [label + verdict_line(r)]
    if r["reason"]:
        lines += _wrapped(f"reason: {r['reason']}")
    usage = r.get("usage")
    if usage and usage["gpu_hours_lost"] + usage["node_hours_lost"] > 0:
        lines.append(
            f"  GPU-hours {usage['gpu_hours_useful']:.2f} useful, {usage['gpu_hours_lost']:.2f}"
            f" lost to failed attempts"
        )
    table = r["results"]
    if table is None or not table["points"]:
        lines += _wrapped(f"no results: {no_results_reason(r)}")
        return "\n".join(lines) + "\n"
    gpus = table["gpus"]
    points = sorted(table["points"], key=lambda p: p["concurrency"])
    lines.append(f"  {table['format']} client, {gpu_text(table)}, {points_text(len(points))}")
    head = ["conc", "prompts", "done", "failed", "req/s", "out tok/s", "tot tok/s"]
    widths = [6, 8, 7, 7, 8, 10, 10]
    if gpus:
        head += ["tot/GPU", "out/GPU"]
        widths += [9, 9]
    rows = [head]
    for p in points:
        row = [
            f"{p['concurrency']}{'' if p['valid'] else '!'}",
            _fmt(p["num_prompts"]),
            _fmt(p["completed"]),
            _fmt(p["failed"]),
            _fmt(p["request_throughput"]),
            _fmt(p["output_throughput"]),
            _fmt(p["total_token_throughput"]),
        ]
        if gpus:
            row += [_fmt(per_gpu_total(p, gpus)), _fmt(p["output_throughput_per_gpu"])]
        rows.append(row)
    lines += _columns(rows, widths)
    lat_head = ["conc"]
    for metric in LATENCIES:
        lat_head += [f"{metric.upper()} med", "p99"]
    lat_widths = [6] + [11, 9] * len(LATENCIES)
    lines.append("  latency (ms)")
    lat_rows = [lat_head]
    for p in points:
        row = [f"{p['concurrency']}{'' if p['valid'] else '!'}"]
        for metric in LATENCIES:
            row += [_fmt(latency(p, metric, "median")), _fmt(latency(p, metric, "p99"))]
        lat_rows.append(row)
    lines += _columns(lat_rows, lat_widths)
    for p in points:
        if not p["valid"]:
            problem = p["problem"] or "marked invalid by the results parser"
            lines += _wrapped(f"! c={p['concurrency']} is not valid: {problem} ({p['file']})")
    return "\n".join(lines) + "\n"


# --- machine formats ----------------------------------------------------------------------

CSV_FIELDS = (
    "run",
    "state",
    "outcome",
    "reason",
    "format",
    "gpus",
    "concurrency",
    *NUMBER_FIELDS,
    *(f"{m}_ms_{s}" for m in LATENCIES for s in STATS),
    "valid",
    "problem",
    "file",
)


def render_csv(runs: Sequence[RunResults]) -> str:
    """One row per run and point (a run without points: one row, its point fields empty)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in runs:
        base: dict[str, object] = {
            "run": r["run"],
            "state": r["state"],
            "outcome": r["outcome"] or "",
            "reason": r["reason"],
        }
        table = r["results"]
        if table is None or not table["points"]:
            writer.writerow(base)
            continue
        base |= {"format": table["format"], "gpus": _cell(table["gpus"])}
        for p in sorted(table["points"], key=lambda p: p["concurrency"]):
            row = dict(base)
            for key in CSV_FIELDS[6:18]:
                row[key] = _cell(field_of(p, key))
            for m in LATENCIES:
                for s in STATS:
                    row[f"{m}_ms_{s}"] = _cell(latency(p, m, s))
            row |= {"valid": str(p["valid"]).lower(), "problem": p["problem"] or ""}
            row["file"] = p["file"]
            writer.writerow(row)
    return out.getvalue()


def _cell(value: object) -> str:
    return "" if value is None else str(value)


def render_json(
    runs: Sequence[RunResults],
    *,
    baseline: RunResults | None = None,
    regressions: Sequence[Regression] | None = None,
) -> str:
    doc: ResultsDoc = {"runs": list(runs)}
    if baseline is not None:
        doc["baseline"] = baseline
    if regressions is not None:
        doc["regressions"] = [g.as_dict() for g in regressions]
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


# --- the regression gate ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Regression:
    """One way a run is worse than its baseline at one concurrency (or as a whole)."""

    run: str
    concurrency: int | None  # None: the run as a whole (it has no results)
    kind: str  # output_throughput | ttft_median | tpot_median | missing | invalid | no_results
    detail: str  # what was seen, one sentence without the run and concurrency
    baseline: float | None = None
    value: float | None = None
    change_pct: float | None = None

    def line(self) -> str:
        where = f"run {self.run}" + ("" if self.concurrency is None else f" c={self.concurrency}")
        return f"REGRESSION {where}: {self.detail}"

    def as_dict(self) -> RegressionView:
        return {
            "run": self.run,
            "concurrency": self.concurrency,
            "kind": self.kind,
            "detail": self.detail,
            "baseline": self.baseline,
            "value": self.value,
            "change_pct": self.change_pct,
        }


# (kind, what, unit, how the value is read, +1: a rise is worse, -1: a drop is worse)
_GATED: tuple[tuple[str, str, str, Callable[[ResultPoint], float | None], int], ...] = (
    ("output_throughput", "output throughput", "tok/s", lambda p: p["output_throughput"], -1),
    ("ttft_median", "median TTFT", "ms", lambda p: latency(p, "ttft", "median"), 1),
    ("tpot_median", "median TPOT", "ms", lambda p: latency(p, "tpot", "median"), 1),
)


def compare(baseline: RunResults, run: RunResults, max_regression_pct: float) -> list[Regression]:
    """`run`'s regressions against `baseline` at the same concurrencies.

    A regression: output throughput dropped, or median TTFT or TPOT rose, by more than
    `max_regression_pct` percent; a valid baseline point that the run lacks, has invalid,
    or lacks a gated value of. Baseline points that are invalid are not compared.
    Raise ResultsError when the baseline has no valid point to compare against.
    """
    base_points = {
        p["concurrency"]: p for p in (baseline["results"] or {"points": []})["points"] if p["valid"]
    }
    if not base_points:
        raise ResultsError(
            f"The baseline run {baseline['run']} has no valid results to compare against: "
            f"{no_results_reason(baseline)}."
        )
    table = run["results"]
    name = run["run"]
    if table is None or not table["points"]:
        return [Regression(name, None, "no_results", f"no results: {no_results_reason(run)}")]
    points = {p["concurrency"]: p for p in table["points"]}
    found: list[Regression] = []
    for conc, base in sorted(base_points.items()):
        point = points.get(conc)
        if point is None:
            found.append(Regression(name, conc, "missing", "no point (the baseline has one)"))
            continue
        if not point["valid"]:
            why = point["problem"] or "marked invalid by the results parser"
            found.append(Regression(name, conc, "invalid", f"the point is not valid: {why}"))
            continue
        for kind, what, unit, get, worse in _GATED:
            was, now = get(base), get(point)
            if was is None or was == 0:
                continue  # nothing to compare against
            if now is None:
                found.append(
                    Regression(name, conc, kind, f"no {what} (baseline {_fmt(was)} {unit})", was)
                )
                continue
            change = (now - was) / was * 100.0
            if change * worse > max_regression_pct:
                found.append(
                    Regression(
                        name,
                        conc,
                        kind,
                        f"{what} {_fmt(was)} -> {_fmt(now)} {unit} ({change:+.1f} %, "
                        f"limit {max_regression_pct:g} %)",
                        was,
                        now,
                        round(change, 3),
                    )
                )
    return found


def render_regressions(
    baseline: RunResults, regressions: Sequence[Regression], max_regression_pct: float
) -> str:
    against = f"against baseline run {baseline['run']}"
    last = (
        f"{len(regressions)} regression(s) {against} (more than {max_regression_pct:g} %)."
        if regressions
        else f"No regression {against} (none by more than {max_regression_pct:g} %)."
    )
    return "".join(f"{line}\n" for line in [*(g.line() for g in regressions), last])


# --- the command --------------------------------------------------------------------------

_EPILOG = f"""\
exit status:
  0   shown (and, with --baseline, no regression)
  {EXIT_REGRESSION}   --baseline: a regression or a missing point (one REGRESSION line each)
  2   usage or request error (unknown run, a baseline without valid results)
  3   the daemon is not reachable, or answered something that is not a results table
"""


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage >= 0")
    return value


def add_parsers(sub: argparse._SubParsersAction[Any], socket_default: Callable[[], Path]) -> None:
    p = sub.add_parser(
        "results",
        help="show runs' benchmark results; gate them against a baseline run",
        description=(
            "Show each run's verdict and its benchmark results (one point per concurrency). "
            "With --baseline and --max-regression, compare every run's points to the "
            "baseline's at the same concurrency: output throughput dropped, or median TTFT "
            "or TPOT rose, by more than PCT %, or a missing point is a regression."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", metavar="RUN", nargs="+", help="run id, job name or Slurm job id")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--json", action="store_true", help="the tables (and regressions) as JSON")
    how.add_argument("--csv", action="store_true", help="CSV, one row per run and point")
    how.add_argument(
        "--format",
        choices=["inferencex-agg", "inferencex-agg-jsonl"],
        default=None,
        help="InferenceX's aggregate fields per valid point: a JSON list (what its "
        "collect_results.py builds), or one JSON object per line",
    )
    p.add_argument("--baseline", metavar="RUN", default=None, help="the run to compare against")
    p.add_argument(
        "--max-regression",
        metavar="PCT",
        type=_percent,
        default=None,
        help="the largest change in percent that is not a regression (with --baseline)",
    )
    p.add_argument("--socket", type=Path, default=socket_default(), help="daemon control socket")
    offline.add_arguments(p)
    p.set_defaults(handler=cmd_results)


def fetch_results(command: str, args: argparse.Namespace, refs: Sequence[str]) -> list[RunResults]:
    """Each run's results: from its archive with --archive/--state-dir (exit 2 when one
    is not there), else from the daemon (one connection; exit 2/3 on failure)."""
    from llmd_supervisor.adapters.control.client import ControlClient
    from llmd_supervisor.cli.common import EXIT_DAEMON_UNREACHABLE, _Exit, _run

    if offline.wanted(args):
        try:
            return [offline.run_results(args, ref) for ref in refs]
        except OfflineError as exc:
            print(f"llmd-supervisor {command}: {exc}", file=sys.stderr)
            raise _Exit(2) from None
    socket_path: Path = args.socket

    async def go() -> list[Mapping[str, object]]:
        async with ControlClient(socket_path) as c:
            return [await c.call("results", {"run": ref}) for ref in refs]

    replies = _run(command, go)
    try:
        return [read_run_results(reply) for reply in replies]
    except SupervisorError as exc:  # a reply that is not a results table
        print(f"llmd-supervisor {command}: {exc}", file=sys.stderr)
        raise _Exit(EXIT_DAEMON_UNREACHABLE) from None


def cmd_results(args: argparse.Namespace) -> int:
    from llmd_supervisor.cli.common import _Exit

    if (args.baseline is None) != (args.max_regression is None):
        print(
            "llmd-supervisor results: --baseline and --max-regression go together; "
            "give both or neither.",
            file=sys.stderr,
        )
        return 2
    refs: list[str] = list(args.runs)
    if args.baseline is not None:
        refs.append(args.baseline)
    try:
        fetched = fetch_results("results", args, refs)
    except _Exit as exc:
        return exc.status
    runs, baseline = fetched[: len(args.runs)], None
    if args.baseline is not None:
        baseline = fetched[-1]
    return show(args, runs, baseline, sys.stdout, sys.stderr)


def show(
    args: argparse.Namespace,
    runs: Sequence[RunResults],
    baseline: RunResults | None,
    out: IO[str],
    err: IO[str],
) -> int:
    """Print `runs` as `args` ask and return the exit status (the testable half)."""
    regressions: list[Regression] | None = None
    if baseline is not None:
        try:
            regressions = [g for r in runs for g in compare(baseline, r, args.max_regression)]
        except ResultsError as exc:
            print(f"llmd-supervisor results: {exc}", file=err)
            return 2
    if args.json:
        out.write(render_json(runs, baseline=baseline, regressions=regressions))
    elif args.csv:
        out.write(render_csv(runs))
    elif args.format:
        from llmd_supervisor.cli.inferencex_agg import write_agg

        write_agg(args.format, runs, out, err)
    else:
        out.write(render_text(runs, baseline=baseline))
    if baseline is not None and regressions is not None:
        if not args.json:
            text = render_regressions(baseline, regressions, args.max_regression)
            if args.csv or args.format:
                err.write(text)  # stdout carries the machine-readable rows alone
            else:
                out.write("\n" + text)
        if regressions:
            return EXIT_REGRESSION
    return 0
