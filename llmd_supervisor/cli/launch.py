"""The CLI's side of jobs the daemon did not render (`core.spec.foreign`): the options of
`submit --script` and `adopt`, the foreign spec they make (checked before it is sent),
and the `nodes` table."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Literal

from llmd_supervisor.cli.common import _Exit, unreadable
from llmd_supervisor.core.protocol.runs import NodesView
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.errors import SpecError, SupervisorError


def add_script_options(p: argparse.ArgumentParser) -> None:
    """`submit --script`'s own options."""
    p.add_argument(
        "--script",
        type=Path,
        default=None,
        metavar="JOB.sbatch",
        help="submit this batch script as it is (no SPEC); sbatch options after --",
    )
    p.add_argument("--chdir", default=None, metavar="DIR", help="sbatch's working directory")
    p.add_argument(
        "--export-env",
        action="store_true",
        help="the job gets this shell's environment (journaled, owner-only, until the run "
        "is archived)",
    )
    p.add_argument(
        "--job-name-prefix", default=None, metavar="P", help="the job is named P-<run id>"
    )


def add_watch_options(p: argparse.ArgumentParser) -> None:
    """What to watch in a job the daemon did not render (`submit --script`, `adopt`)."""
    g = p.add_argument_group("a job of your own launcher (with --script, and adopt)")
    g.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="the directory its logs, marker and results are under (default: --chdir, "
        "else the current directory); below the daemon's log_roots",
    )
    g.add_argument(
        "--logs",
        nargs="+",
        action="extend",
        default=[],
        metavar="GLOB",
        help="log files to copy, relative to --log-dir ({job_id}: the job id; wildcards "
        "in the last part), e.g. 'slurm_job-{job_id}_rank_*.log'",
    )
    g.add_argument("--marker", default=None, metavar="PATTERN", help="its completion marker file")
    g.add_argument(
        "--marker-format",
        choices=("json", "int", "none"),
        default=None,
        help="json: this project's protocol; int: the rc and a newline (InferenceX); "
        "none: no marker, Slurm's evidence alone (default: json with --marker, else none)",
    )
    g.add_argument(
        "--results",
        nargs="+",
        action="extend",
        default=[],
        metavar="GLOB",
        help="benchmark result files to archive (vLLM's JSON is also tabulated)",
    )
    g.add_argument(
        "--prefill-gpus",
        type=int,
        default=None,
        metavar="N",
        help="the prefill role's GPUs (all its nodes): output tok/s per GPU is divided by "
        "the decode GPUs and input tok/s by these, as InferenceX does (with --decode-gpus)",
    )
    g.add_argument(
        "--decode-gpus", type=int, default=None, metavar="M", help="the decode role's GPUs"
    )


def foreign_spec_json(
    args: argparse.Namespace, kind: Literal["script", "adopt"]
) -> tuple[str, tuple[str, ...]]:
    """The foreign spec as JSON, checked (SpecError), and the environment variables left
    out of it; OSError or UnicodeDecodeError when the script cannot be read."""
    script, name = "", ""
    if kind == "script":
        path: Path = args.script
        with path.open("rb") as f:
            data = f.read(foreign_spec.SCRIPT_MAX + 1)
        script, name = data.decode("utf-8"), path.name
    chdir = getattr(args, "chdir", None)
    chdir = os.path.abspath(chdir) if chdir else None
    fmt = args.marker_format or ("json" if args.marker else "none")
    spec = foreign_spec.ForeignSpec(
        kind=kind,
        watch=foreign_spec.Watch(
            log_dir=os.path.abspath(args.log_dir or chdir or os.getcwd()),
            logs=tuple(args.logs),
            marker=args.marker,
            marker_format=foreign_spec.MarkerFormat(fmt),
            results=tuple(args.results),
        ),
        script=script,
        script_name=name,
        chdir=chdir or (os.getcwd() if kind == "script" else None),
        env=dict(os.environ) if getattr(args, "export_env", False) else None,
        sbatch_args=tuple(getattr(args, "sbatch_args", ())),
        job_name_prefix=getattr(args, "job_name_prefix", None),
        job_id=getattr(args, "job_id", None),
        prefill_gpus=getattr(args, "prefill_gpus", None),
        decode_gpus=getattr(args, "decode_gpus", None),
    )
    text = foreign_spec.dump(spec)
    return text, foreign_spec.load(text).env_dropped


def nodes_table(view: NodesView) -> list[str]:
    """`nodes` as text: a line per node with failures counted, in columns as wide as
    their widest cell (the last, run and reason, as long as it is)."""
    head = ("CLUSTER", "NODE", "FOR", "FAILS", "STATE", "UNTIL", "RUN / REASON")
    rows = [head]
    for q in view["nodes"]:
        owner = q.get("owner_uid")
        rows.append(
            (
                q["cluster"],
                q["node"],
                "everyone" if owner is None else f"uid {owner}",
                str(q["failures"]),
                "quarantined" if q["active"] else "counted",
                q["until"],
                f"{q['run'] or '-'} {q['reason']}".rstrip(),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return [
        " ".join(
            cell.rjust(w) if i == 3 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=False))
        )
        + " "
        + row[-1]
        for row in rows
    ]


def _option_error(exc: SpecError) -> str:
    """A foreign spec's error as the command line's (its fields are options, not a spec's)."""
    if exc.field == "SBATCH-ARGS":
        what = f"The sbatch option {exc.value!r} (after --)"
    elif exc.field == "JOBID":
        what = f"The job id {exc.value!r}"
    elif exc.field.startswith("--"):
        what = f"The option {exc.field} {exc.value!r}"
    else:
        return str(exc)
    return f"{what} is not accepted: {exc.hint}."


def checked_spec(args: argparse.Namespace, kind: Literal["script", "adopt"]) -> str:
    """The foreign spec JSON the daemon takes, checked here first (exit 2 when bad)."""
    command = "submit" if kind == "script" else "adopt"
    try:
        text, dropped = foreign_spec_json(args, kind)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"llmd-supervisor {command}: {unreadable('batch script', args.script, exc)}",
              file=sys.stderr)  # fmt: skip
        raise _Exit(2) from None
    except SpecError as exc:
        print(f"llmd-supervisor {command}: {_option_error(exc)}", file=sys.stderr)
        raise _Exit(2) from None
    except SupervisorError as exc:
        print(f"llmd-supervisor {command}: {exc}", file=sys.stderr)
        raise _Exit(2) from None
    if dropped:
        print(
            f"llmd-supervisor {command}: not exported (they would change what sbatch runs or "
            f"how): {', '.join(dropped)}",
            file=sys.stderr,
        )
    return text
