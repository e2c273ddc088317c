"""The ``llmd-supervisor`` command line."""

from __future__ import annotations

import argparse
import re
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmd_supervisor import __version__
from llmd_supervisor.errors import SpecError

# A subcommand handler takes the parsed args and returns the process exit status.
Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmd-supervisor",
        description="Supervise multi-node llm-d benchmark allocations on Slurm.",
    )
    parser.add_argument("--version", action="version", version=f"llmd-supervisor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_render_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    handler: Handler = args.handler
    return handler(args)


# --- render -----------------------------------------------------------------------------


def _add_render_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "render",
        help="print the sbatch script for a run spec",
        description="Validate a run spec (TOML) and print the sbatch script it becomes.",
    )
    p.add_argument("spec", metavar="SPEC", type=Path, help="run spec TOML file")
    p.add_argument(
        "--job-name",
        default=None,
        help="Slurm job name (default: llmd-<spec name>-<random>; must be unique per run)",
    )
    p.set_defaults(handler=_cmd_render)


def _cmd_render(args: argparse.Namespace) -> int:
    """Print the batch script; a bad spec prints the SpecError to stderr and exits 2."""
    from llmd_supervisor.render import render_sbatch
    from llmd_supervisor.spec import load_spec

    path: Path = args.spec
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"llmd-supervisor render: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.")[:40] or "run"
    job_name = args.job_name or f"llmd-{stem}-{uuid.uuid4().hex[:8]}"
    try:
        script = render_sbatch(load_spec(text), job_name=job_name)
    except SpecError as exc:
        print(f"llmd-supervisor render: {path}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
