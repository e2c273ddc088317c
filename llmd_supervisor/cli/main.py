"""The ``llmd-supervisor`` command line."""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from llmd_supervisor import __version__
from llmd_supervisor.cli.common import socket_default
from llmd_supervisor.errors import SpecError

if TYPE_CHECKING:
    from llmd_supervisor.core.spec.runspec import RunSpec

# A subcommand handler takes the parsed args and returns the process exit status.
Handler = Callable[[argparse.Namespace], int]


Subparsers: TypeAlias = "argparse._SubParsersAction[Any]"


def _add_run_commands(sub: Subparsers) -> None:
    from llmd_supervisor.cli.run_commands import add_parsers

    add_parsers(sub)


def _add_config(sub: Subparsers) -> None:
    from llmd_supervisor.cli.config import add_parsers

    add_parsers(sub)


def _add_results(sub: Subparsers) -> None:
    from llmd_supervisor.cli.results import add_parsers

    add_parsers(sub, socket_default)


def _add_report(sub: Subparsers) -> None:
    from llmd_supervisor.cli.report import add_parsers

    add_parsers(sub, socket_default)


def _add_campaign(sub: Subparsers) -> None:
    from llmd_supervisor.cli.campaign import add_parsers

    add_parsers(sub, socket_default)


def _add_events(sub: Subparsers) -> None:
    from llmd_supervisor.cli.events import add_parsers

    add_parsers(sub, socket_default)


def _add_journal(sub: Subparsers) -> None:
    from llmd_supervisor.cli.journal import add_parsers

    add_parsers(sub)


# The modules' parsers, in `--help`'s order; a command runs with only its own module
# imported (a command's start-up is most of a quick one's time: `campaign status` need not
# load the report's or the event sender's dependencies). The commands not named in
# _OWNER are run_commands' (tests/unit/test_cli_startup.py checks the table).
_ADDERS: tuple[Callable[[Subparsers], None], ...] = (
    _add_run_commands,
    _add_config,
    _add_results,
    _add_report,
    _add_campaign,
    _add_events,
    _add_journal,
)
_OWNER: dict[str, Callable[[Subparsers], None]] = {
    "render": lambda sub: None,  # this module's
    "verify": lambda sub: None,
    "config": _add_config,
    "results": _add_results,
    "report": _add_report,
    "campaign": _add_campaign,
    "events": _add_events,
    "journal": _add_journal,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command` (and render and verify) alone."""
    parser = argparse.ArgumentParser(
        prog="llmd-supervisor",
        description="Supervise multi-node llm-d benchmark allocations on Slurm.",
    )
    parser.add_argument("--version", action="version", version=f"llmd-supervisor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_render_parser(sub)
    _add_verify_parser(sub)
    adders = _ADDERS if command is None else (_OWNER.get(command, _add_run_commands),)
    for add in adders:
        add(sub)
    if command is not None and command not in sub.choices:
        return build_parser()  # not a command: argparse names them all
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words and not words[0].startswith("-") else None)
    sbatch_args: list[str] = []
    if words[:1] == ["submit"] and "--" in words:  # submit --script JOB -- SBATCH-ARGS
        cut = words.index("--")
        words, sbatch_args = words[:cut], words[cut + 1 :]
    if words[:1] == ["submit"]:
        args, unknown = parser.parse_known_args(words)
        if unknown and args.script is not None:  # sbatch's own options, given too early
            # `-N 3`: argparse takes the 3 for the SPEC (which --script does not take)
            extra = {*unknown, *([str(args.spec)] if args.spec is not None else [])}
            shown = " ".join(w for w in words if w in extra)
            print(
                f"llmd-supervisor submit: {shown}: not options of submit; sbatch options go"
                f" after `--`: llmd-supervisor submit --script {args.script} [submit's"
                f" options] -- {shown}",
                file=sys.stderr,
            )
            return 2
    args = parser.parse_args(words)
    if sbatch_args:
        args.sbatch_args = sbatch_args
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if words[:2] == ["campaign", "submit"] and _run_spec_given(args.file):
        return 2
    handler: Handler = args.handler
    return handler(args)


def _run_spec_given(path: Path) -> bool:
    """Whether `campaign submit` was given a run spec (said on stderr, naming `submit`)."""
    from llmd_supervisor.core.spec.file_kind import wrong_kind

    try:
        with path.open("rb") as f:
            text = f.read(1 << 20).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False  # the command says what is wrong with the file
    said = wrong_kind(text, str(path), "campaign file")
    if said is not None:
        print(f"llmd-supervisor campaign submit: {said}", file=sys.stderr)
    return said is not None


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
        help="Slurm job name (default: llmd-<[run] name or file name>-<the spec's sha256,"
        " 8 hex digits>, so the same spec renders the same bytes; a job submitted with sbatch"
        " by hand wants a name of its own per run)",
    )
    p.set_defaults(handler=_cmd_render)


def _cmd_render(args: argparse.Namespace) -> int:
    """Print the batch script; a bad spec prints the SpecError to stderr and exits 2."""
    from llmd_supervisor.cli.common import unreadable
    from llmd_supervisor.core.render.script import render_sbatch
    from llmd_supervisor.core.spec.file_kind import wrong_kind
    from llmd_supervisor.core.spec.runspec import load_spec

    path: Path = args.spec
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"llmd-supervisor render: {unreadable('run spec', path, exc)}", file=sys.stderr)
        return 2
    other = wrong_kind(text, str(path), "run spec")
    if other is not None:
        print(f"llmd-supervisor render: {other}", file=sys.stderr)
        return 2
    try:
        spec = load_spec(text)
        script = render_sbatch(spec, job_name=args.job_name or render_job_name(spec, path, text))
    except SpecError as exc:
        print(f"llmd-supervisor render: {path}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(script)
    return 0


def render_job_name(spec: RunSpec, path: Path, text: str) -> str:
    """`render`'s job name, from the spec alone (so the same spec renders the same bytes):
    ``llmd-<[run] name, else the file's name>-<sha256 of the text, 8 hex digits>``. The
    daemon names each submitted run itself (``llmd-<run id>``), unique per run."""
    name = spec.name or re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.") or "run"
    return f"llmd-{name[:40]}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


# --- verify -----------------------------------------------------------------------------

_VERIFY_EPILOG = """\
exit status:
  0   succeeded      State COMPLETED, ExitCode 0:0 (believed) and marker rc 0 for this job,
                     and (with results) every benchmark point passes the validity gate
  10  failed         anything else that is not one of the outcomes below
  11  cancelled      Slurm says CANCELLED (or the supervisor's cancel ended the run)
  12  timed_out      Slurm says TIMEOUT
  13  node_failed    Slurm says NODE_FAIL
  14  out_of_memory  Slurm says OUT_OF_MEMORY
  15  unverified     no believable terminal record before --timeout
  2   usage error
"""


def _add_verify_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "verify",
        help="verify a finished job's outcome from sacct/scontrol and its completion marker",
        description=(
            "Decide a finished job's outcome on positive evidence only: the allocation "
            "record (sacct, scontrol fallback) must read State=COMPLETED ExitCode=0:0 twice "
            "alike (or sacct and scontrol agree) and the completion marker must carry rc 0 "
            "for this job id. Slurm is asked again until that is settled or --timeout passes. "
            "Uses SLURM_CONF from the environment."
        ),
        epilog=_VERIFY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("job_id", metavar="JOBID", help="the Slurm job id (digits)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--marker", type=Path, help="path of the completion marker file")
    where.add_argument(
        "--log-dir", type=Path, help="the run's log directory (marker: .bench_done.JOBID in it)"
    )
    p.add_argument(
        "--results",
        type=Path,
        help="the benchmark's result files c<N>.json (default: JOBID/bench under --log-dir,"
        " when it exists); success then also needs every point to pass the validity gate",
    )
    p.add_argument(
        "--result-format",
        choices=("vllm", "inferencex"),
        default="vllm",
        help="the result files' format (vllm)",
    )
    p.add_argument("--receipt", type=Path, help="write the JSON receipt here (atomically)")
    p.add_argument("--json", action="store_true", help="print the receipt as JSON on stdout")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for settled evidence (120)"
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between queries (1)")
    p.add_argument(
        "--starttime", help="sacct --starttime (default: Slurm's, which with --jobs is epoch)"
    )
    p.add_argument(
        "--cancel-requested",
        action="store_true",
        help="the job was cancelled on purpose: an end the cancel explains is 'cancelled'",
    )
    p.set_defaults(handler=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    import json
    import os

    import anyio

    from llmd_supervisor.adapters.fsutil import write_atomic
    from llmd_supervisor.adapters.log import configure
    from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
    from llmd_supervisor.adapters.slurm.runner import LocalRunner, SlurmClient
    from llmd_supervisor.core.results.evidence import GateResult, Validity
    from llmd_supervisor.core.verdict.marker import marker_filename
    from llmd_supervisor.errors import SupervisorError
    from llmd_supervisor.supervision.run.bench_files import gate_dir
    from llmd_supervisor.supervision.run.verify_job import EXIT_CODES, DirectEvidence, verify_job

    job_id: str = args.job_id
    if not job_id.isdigit():
        print(f"llmd-supervisor verify: job id {job_id!r} is not a number", file=sys.stderr)
        return 2
    if args.timeout <= 0 or args.interval <= 0:
        print("llmd-supervisor verify: --timeout and --interval must be positive", file=sys.stderr)
        return 2
    configure()
    marker_path: Path = args.marker or args.log_dir / marker_filename(job_id)
    evidence = DirectEvidence(SlurmClient(LocalRunner()), starttime=args.starttime)

    where = str(marker_path.absolute())

    async def marker_bytes() -> bytes | None:  # never through a link, at most 64 KiB
        return await jobfiles.read_local(os.path.dirname(where), where, time_limit=30)

    results: Path | None = args.results
    if results is None and args.log_dir is not None and (args.log_dir / job_id / "bench").is_dir():
        results = args.log_dir / job_id / "bench"

    async def benchmark() -> GateResult:
        assert results is not None
        return await gate_dir(str(results.absolute()), args.result_format, Validity())

    async def run() -> Any:
        return await verify_job(
            evidence,
            job_id,
            marker_bytes=marker_bytes,
            benchmark=benchmark if results is not None else None,
            evidence_timeout=args.timeout,
            interval=args.interval,
            cancel_requested=args.cancel_requested,
        )

    result = anyio.run(run)
    text = json.dumps(result.receipt, indent=2, sort_keys=True) + "\n"
    if args.receipt is not None:
        try:
            write_atomic(args.receipt, text.encode())
        except OSError as exc:
            err = SupervisorError(f"Could not write the receipt to {args.receipt}: {exc}.")
            print(f"llmd-supervisor verify: {err}", file=sys.stderr)
            return EXIT_CODES[result.verdict.outcome] or 1
    if args.json:
        sys.stdout.write(text)
    else:
        print(f"job {job_id}: {result.verdict.outcome.value}: {result.verdict.reason}")
    return EXIT_CODES[result.verdict.outcome]


if __name__ == "__main__":
    sys.exit(main())
