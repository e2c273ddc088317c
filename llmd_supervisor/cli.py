"""The ``llmd-supervisor`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmd_supervisor import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmd-supervisor",
        description="Supervise multi-node llm-d benchmark allocations on Slurm.",
    )
    parser.add_argument("--version", action="version", version=f"llmd-supervisor {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
