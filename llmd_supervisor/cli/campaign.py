"""``llmd-supervisor campaign ...``: a matrix of runs as one unit of work (DESIGN.md §12).

  campaign submit FILE [--export-env] [--dry-run] [--wait] [--rerun] [--max-points N]
  campaign status|wait|cancel|results ID
  campaign list

The client reads the campaign file and its base spec, or its batch script (the daemon may
not be able to read the user's files), and sends both, with the file's directory (a script
campaign's paths are relative to it) and, with `--export-env`, this shell's environment
(a script campaign's runs are submitted from it). `submit --dry-run` prints the expansion
(points, jobs, GPU-hours upper bound from the time limits; a script campaign's variables
per job) and submits nothing. `wait` (and
`submit --wait`) print a line whenever the counts change and end with the aggregated
table and an exit status: 0 every point verified or reused, 10 any point failed, blocked
or not run, 11 cancelled.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

from llmd_supervisor.adapters.control.client import ControlClient
from llmd_supervisor.cli.campaign_points import point_rows, values_text, varying
from llmd_supervisor.cli.common import _exits, _read, _run, fit_to_terminal
from llmd_supervisor.cli.inferencex_agg import write_agg
from llmd_supervisor.core.campaign.views import (
    CampaignDryRun,
    CampaignJobResults,
    CampaignList,
    CampaignResultsDone,
    CampaignStatus,
    DryRunJob,
)
from llmd_supervisor.core.protocol.runs import RunResults
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.errors import SpecError

__all__ = ["add_parsers"]

_POINT_ORDER = (
    "verified",
    "reused",
    "running",
    "queued",
    "blocked",
    "failed: workload",
    "failed: infrastructure",
    "failed: other",
    "cancelled",
)


def add_parsers(sub: argparse._SubParsersAction[Any], socket_default: Callable[[], Path]) -> None:
    top = sub.add_parser(
        "campaign",
        help="run a matrix of benchmark runs as one campaign",
        description=(
            "A campaign file names a base run spec and a [matrix] of spec fields (or a "
            "batch script and a [matrix] of its environment variables); every point "
            "(recipe, concurrency) is run once and never paid for twice: a point "
            "verified by any earlier run is reused. See README.md, Campaigns."
        ),
    )
    csub = top.add_subparsers(dest="campaign_op", metavar="OP", required=True)

    def common(name: str, help_: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = csub.add_parser(name, help=help_, description=help_)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "--socket", type=Path, default=socket_default(), help="daemon control socket"
        )
        return p

    p = common("submit", "expand a campaign file and submit its points")
    p.add_argument("file", metavar="FILE", type=Path, help="campaign TOML file")
    p.add_argument("--dry-run", action="store_true", help="print the expansion, submit nothing")
    p.add_argument(
        "--export-env",
        action="store_true",
        help="a script campaign's runs get this shell's environment, its variables over it "
        "(journaled, owner-only), as submit --script --export-env",
    )
    p.add_argument("--wait", action="store_true", help="wait for the campaign to end")
    p.add_argument("--rerun", action="store_true", help="run verified points again too")
    p.add_argument(
        "--max-points",
        type=int,
        default=None,
        help="refuse a campaign of more points than this (default, and at most: the"
        " daemon's [limits] campaign_max_points, 10000 unless its operator set another)",
    )
    p.add_argument("--cluster", default=None, help="configured cluster (default: the first)")
    p.set_defaults(handler=_cmd_submit)
    for name, help_ in (
        ("status", "a campaign's points per state, GPU-hours and ETA"),
        ("wait", "wait for a campaign to end; exit 0 when every point is verified"),
        ("cancel", "cancel a campaign: its runs get TERM, nothing more is submitted"),
    ):
        p = common(name, help_)
        p.add_argument("campaign", metavar="ID", help="campaign id or name")
        p.set_defaults(handler=_cmd_simple)
    p = common("results", "one row per point, with provenance (run, job, recipe id)")
    p.add_argument("campaign", metavar="ID", help="campaign id or name")
    p.add_argument(
        "--format",
        choices=("table", "csv", "inferencex-agg", "inferencex-agg-jsonl"),
        default="table",
        help="table (default), csv, or InferenceX's aggregate rows",
    )
    p.add_argument("--csv", dest="format", action="store_const", const="csv", help="--format csv")
    p.set_defaults(handler=_cmd_results)
    p = common(
        "report",
        "write the campaign's charts and points as one HTML file (--json: print its data,"
        " without matplotlib; both: the file too)",
    )
    p.add_argument("campaign", metavar="ID", help="campaign id or name")
    p.add_argument(
        "-o", "--output", type=Path, default=None, metavar="FILE", help="the HTML file to write"
    )
    p.set_defaults(handler=_cmd_report)
    p = common("list", "every campaign you may see")
    p.set_defaults(handler=_cmd_list)


# --- submit ---------------------------------------------------------------------------------


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"llmd-supervisor campaign: cannot read {what} {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _read_script(path: Path) -> str:
    """The batch script as it is on disk (no newline translation: its sha256 is part of
    every recipe id), at most foreign_spec.SCRIPT_MAX bytes."""
    try:
        with path.open("rb") as f:
            data = f.read(foreign_spec.SCRIPT_MAX + 1)
        if len(data) > foreign_spec.SCRIPT_MAX:
            raise ValueError(f"larger than {foreign_spec.SCRIPT_MAX} bytes")
        return data.decode("utf-8")
    except (OSError, ValueError) as exc:
        print(
            f"llmd-supervisor campaign: cannot read the batch script {path}: {exc}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def _exported(args: argparse.Namespace, script: bool) -> str | None:
    """This shell's environment as JSON (--export-env), the names left out said once."""
    if not args.export_env:
        return None
    if not script:
        print(
            "llmd-supervisor campaign submit: --export-env is for a campaign over a batch "
            'script (script = "job.slurm"); a run spec sets its variables in its [env]',
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        _, dropped = foreign_spec.exported_env(dict(os.environ))
    except SpecError as exc:
        print(f"llmd-supervisor campaign submit: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if dropped:
        print(
            "llmd-supervisor campaign submit: not exported (they would change what sbatch "
            f"runs or how): {', '.join(dropped)}",
            file=sys.stderr,
        )
    return json.dumps(dict(os.environ))


@_exits
def _cmd_submit(args: argparse.Namespace) -> int:
    path: Path = args.file
    text = _read_text(path, "the campaign file")
    try:
        from llmd_supervisor.core.campaign.expand import parse_campaign  # submit's alone (start-up)

        cf = parse_campaign(text, default_name=_stem(path))
    except SpecError as exc:
        print(f"llmd-supervisor campaign submit: {path}: {exc}", file=sys.stderr)
        return 2
    # The base spec or the script, relative to the campaign file.
    name = cf.script or cf.base
    assert name is not None
    other = path.parent / name if not Path(name).is_absolute() else Path(name)
    params: dict[str, object] = {
        "file_text": text,
        "base_text": _read_script(other) if cf.script else _read_text(other, "the base spec"),
        "file_path": str(path),
        "file_dir": os.path.dirname(os.path.abspath(path)),
        "export_env_json": _exported(args, cf.script is not None),
        "name": _stem(path),
        "dry_run": args.dry_run,
        "rerun": args.rerun,
        "max_points": args.max_points,
        "cluster": args.cluster,
    }

    async def go() -> Mapping[str, object]:
        async with ControlClient(args.socket) as c:
            return await c.call("campaign_submit", params)

    result = _run("campaign submit", go)
    if args.dry_run:
        plan = _read("campaign submit", CampaignDryRun, result)
        if args.json:
            print(json.dumps(plan, indent=2, sort_keys=True))
        else:
            print("\n".join(_dry_run_lines(plan)))
        return 0
    status = _read("campaign submit", CampaignStatus, result)
    print(f"{_status_line(status)}", file=sys.stderr if args.json or args.wait else sys.stdout)
    if not args.wait:
        if args.json:
            print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    return _wait_and_show(args, status["campaign"])


def _stem(path: Path) -> str:
    return (
        "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in path.stem)[:64] or "campaign"
    )


def _dry_run_lines(r: CampaignDryRun) -> list[str]:
    lines = [
        f"campaign {r['name']}: {r['points']} points in {r['jobs']} jobs over "
        f"{r['topologies']} topologies; {r['jobs_to_run']} jobs to run, "
        f"{r['reused_points']} points verified before (reused)",
        f"GPU-hours at most {r['gpu_hours_upper_bound']} (node-hours "
        f"{r['node_hours_upper_bound']}), from the time limits",
    ]
    if r["duplicates_merged"]:
        lines.append(f"{r['duplicates_merged']} duplicate points merged")
    jobs = r["job_list"]
    rows = [["job", "topology", "concurrencies", "reused", "values"]]
    keys = varying(j["values"] for j in jobs)
    for j in jobs:
        rows.append(
            [
                j["job"],
                j["topology"],
                ",".join(map(str, j["concurrencies"])),
                ",".join(map(str, j["reused"])) or "-",
                values_text(j["values"], keys),
            ]
        )
    lines += fit_to_terminal(_aligned(rows))
    if len(jobs) < r["jobs"]:
        lines.append(f"... and {r['jobs'] - len(jobs)} more jobs")
    lines += _reuse_lines(jobs)
    if r["script"]:
        lines += _env_lines(r, jobs)
    return lines


def _reuse_lines(jobs: Sequence[DryRunJob]) -> list[str]:
    """Why each point that some run verified is reused or runs again (a point no run has
    verified yet goes unsaid)."""
    lines = []
    for j in jobs:
        for note in j.get("reuse", []):
            if note["run"] is not None or not note["why"].startswith("no run has"):
                state = "reused" if note["run"] is not None else "runs"
                lines.append(f"job {j['job']} c={note['concurrency']}: {state}: {note['why']}")
    return ["reuse:", *(f"  {ln}" for ln in lines)] if lines else []


def _env_lines(r: CampaignDryRun, jobs: Sequence[DryRunJob]) -> list[str]:
    """A script campaign's variables: those every job shares, then each job's own (with
    its concurrencies' variable), as shell assignments."""
    with_env = [(j, j["env"]) for j in jobs if j["env"] is not None]
    envs = [env for _, env in with_env]
    if not envs:
        return []
    conc = r["concurrency_env"]
    shared = {
        k: v
        for k, v in envs[0].items()
        if k != conc and all(e.get(k) == v for e in envs[1:]) and len(envs) > 1
    }
    base = "this shell's environment" if r["export_env"] else "the daemon's environment"
    lines = [f"{r['script']} runs in {base}, with these variables over it:"]
    if shared:
        lines.append(f"  every job: {_assignments(shared)}")
    for j, env in with_env:
        own = {k: v for k, v in env.items() if k not in shared}
        lines.append(f"  job {j['job']}: {_assignments(own)}")
    without = r["jobs_without_time_limit"]
    if without:
        lines.append(
            f"{without} jobs have no --time (in sbatch_args or the script): the GPU-hours"
            " above count them as 0"
        )
    return lines


def _assignments(env: Mapping[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


# --- status, wait, cancel, list -------------------------------------------------------------


def _status_line(s: CampaignStatus) -> str:
    points = s["points"]
    counts = ", ".join(f"{points[k]} {k}" for k in _POINT_ORDER if points.get(k))
    line = f"campaign {s['campaign']} ({s['name']}): {s['state']}; {counts or 'no points'}"
    if s["eta_s"] is not None:
        line += f"; ETA {round(s['eta_s'] / 60, 1)} min"
    if s["qos"]:
        line += f"; {s['qos']}"
    return line


def _status_lines(s: CampaignStatus) -> list[str]:
    lines = [_status_line(s)]
    if s["reason"]:
        lines.append(f"  reason: {s['reason']}")
    lines.append(
        f"  {s['points_total']} points in {s['jobs_total']} jobs; GPU-hours useful "
        f"{s['gpu_hours_useful']}, lost {s['gpu_hours_lost']}"
    )
    for p in s["problems"]:
        lines.append(f"  {p['state']}: job {p['job']} ({p['topology']}): {p['reason']}")
    more = s["problems_total"] - len(s["problems"])
    if more > 0:
        lines.append(f"  ... and {more} more failed or blocked jobs")
    return lines


@_exits
def _cmd_simple(args: argparse.Namespace) -> int:
    if args.campaign_op == "wait":
        return _wait_and_show(args, args.campaign)

    async def go() -> Mapping[str, object]:
        async with ControlClient(args.socket) as c:
            return await c.call(f"campaign_{args.campaign_op}", {"campaign": args.campaign})

    command = f"campaign {args.campaign_op}"
    status = _read(command, CampaignStatus, _run(command, go))
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print("\n".join(_status_lines(status)))
    return 0


def _wait_and_show(args: argparse.Namespace, campaign: str) -> int:
    async def go() -> CampaignStatus:
        request = {"campaign": campaign}
        async with (
            ControlClient(args.socket) as c,
            aclosing(c.stream("campaign_wait", request)) as items,
        ):
            async for item in items:
                if "final" in item:
                    return _read("campaign wait", CampaignStatus, item["final"])
                if not args.json:
                    status = _read("campaign wait", CampaignStatus, item)
                    print(_status_line(status), file=sys.stderr, flush=True)
        raise AssertionError("the stream ended without a final item")

    final = _run("campaign wait", go)
    if args.json:
        print(json.dumps(final, indent=2, sort_keys=True))
    else:
        print("\n".join(_status_lines(final)))
        jobs, _ = _fetch_results(args.socket, final["campaign"])
        print("\n".join(fit_to_terminal(_points_table(jobs))))
    status = final["exit_status"]
    return status if status is not None else 10


@_exits
def _cmd_list(args: argparse.Namespace) -> int:
    async def go() -> Mapping[str, object]:
        async with ControlClient(args.socket) as c:
            return await c.call("campaign_list", {})

    listed = _read("campaign list", CampaignList, _run("campaign list", go))
    if args.json:
        print(json.dumps(listed, indent=2, sort_keys=True))
        return 0
    rows = [["campaign", "name", "state", "points", "settled", "cluster", "created"]]
    rows += [
        [
            c["campaign"],
            c["name"],
            c["state"],
            str(c["points"]),
            str(c["settled"]),
            c["cluster"],
            c["created_at"],
        ]
        for c in listed["campaigns"]
    ]
    print("\n".join(fit_to_terminal(_aligned(rows))))
    return 0


# --- results --------------------------------------------------------------------------------


def _fetch_results(
    socket: Path, campaign: str
) -> tuple[list[CampaignJobResults], CampaignResultsDone]:
    command = "campaign results"

    async def go() -> tuple[list[CampaignJobResults], CampaignResultsDone]:
        jobs: list[CampaignJobResults] = []
        request = {"campaign": campaign}
        async with (
            ControlClient(socket) as c,
            aclosing(c.stream("campaign_results", request)) as items,
        ):
            async for item in items:
                if "final" in item:
                    return jobs, _read(command, CampaignResultsDone, item["final"])
                jobs.append(_read(command, CampaignJobResults, item))
        raise AssertionError("the stream ended without a final item")

    return _run(command, go)


COLUMNS = (
    "topology",
    "values",
    "conc",
    "state",
    "run",
    "tok/s/gpu",
    "ttft p50 ms",
    "tpot p50 ms",
    "recipe",
    "reason",
)


def _num(value: object) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def _points_table(jobs: Sequence[CampaignJobResults]) -> list[str]:
    rows = [list(COLUMNS)]
    for r in point_rows(jobs):
        rows.append(
            [
                r["topology"],
                r["values"],
                str(r["concurrency"]),
                r["state"],
                r["run"] or "-",
                _num(r["total_token_throughput_per_gpu"]),
                _num(r["ttft_ms_median"]),
                _num(r["tpot_ms_median"]),
                r["recipe_id"][:12],
                r["reason"],
            ]
        )
    return _aligned(rows)


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


@_exits
def _cmd_results(args: argparse.Namespace) -> int:
    jobs, _ = _fetch_results(args.socket, args.campaign)
    if args.json:
        print(json.dumps({"points": point_rows(jobs)}, indent=2, sort_keys=True))
    elif args.format == "csv":
        rows = point_rows(jobs)
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["campaign"])
        writer.writeheader()
        writer.writerows(rows)
        sys.stdout.write(out.getvalue())
    elif args.format.startswith("inferencex-agg"):
        runs: dict[str, RunResults] = {}
        for job in jobs:
            for r in job["runs"]:
                runs[r["run"]] = r
        write_agg(args.format, runs.values(), sys.stdout, sys.stderr)
    else:
        print("\n".join(fit_to_terminal(_points_table(jobs))))
    return 0


@_exits
def _cmd_report(args: argparse.Namespace) -> int:
    from llmd_supervisor.adapters.fsutil import write_atomic
    from llmd_supervisor.cli.campaign_report import campaign_report_data, render_campaign_report
    from llmd_supervisor.cli.report import INSTALL_HINT

    output: Path | None = args.output
    if output is None and not args.json:
        print(
            "llmd-supervisor campaign report: give -o FILE (the HTML report) or --json (its"
            " data on stdout), or both.",
            file=sys.stderr,
        )
        return 2
    if output is not None:
        try:
            import matplotlib  # noqa: F401  (checked before the daemon is asked anything)
        except ImportError:
            print(INSTALL_HINT, file=sys.stderr)
            return 2

    async def status() -> Mapping[str, object]:
        async with ControlClient(args.socket) as c:
            return await c.call("campaign_status", {"campaign": args.campaign})

    summary = _read("campaign report", CampaignStatus, _run("campaign report", status))
    jobs, _ = _fetch_results(args.socket, summary["campaign"])
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    rows = point_rows(jobs)
    if output is not None:
        text = render_campaign_report(summary, jobs, rows, generated_at=now)
        try:
            write_atomic(output, text.encode("utf-8", "backslashreplace"))
        except OSError as exc:
            print(
                f"llmd-supervisor campaign report: could not write {output}: {exc}.",
                file=sys.stderr,
            )
            return 2
        # With --json, stdout carries the JSON alone.
        print(f"wrote {output}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        doc = campaign_report_data(summary, jobs, rows, generated_at=now)
        print(json.dumps(doc, indent=2, sort_keys=True))
    return 0
