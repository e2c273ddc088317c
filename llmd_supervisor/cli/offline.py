"""`results`, `report` and `status` without a daemon: read from a run's archive.

`--archive DIR` names a run's archive directory (the one holding its ``receipt.json``) or a
directory of them (the daemon's archive root, ``<state_dir>/archive`` by default, where
each run's archive is named by its run id); `--state-dir DIR` names the daemon's state
directory (its archive root is ``DIR/archive``). Nothing is written and no socket is
opened: this is how a run is looked at again after the quickstart's daemon stopped, on
another machine, or from a copied archive. Every read is bounded; what the archive does
not hold is said, never guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from llmd_supervisor.core.protocol.runs import RunResults
from llmd_supervisor.core.protocol.runs import UsageView as Usage
from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.core.spec.foreign import ForeignSpec, Watch
from llmd_supervisor.core.spec.runspec import NAME_RE
from llmd_supervisor.core.verdict.usage import split as split_usage
from llmd_supervisor.errors import ControlError, OfflineError
from llmd_supervisor.supervision.control.views import results_table_of

RECEIPT = "receipt.json"
RECEIPT_MAX = 16 << 20  # bytes of a receipt read (its raw records are bounded already)
RUN_ID_RE = re.compile(r"[0-9a-f]{12}")  # a run id (supervision.run.driver)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`--archive DIR` and `--state-dir DIR` (either one; no daemon is asked then)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--archive",
        type=Path,
        metavar="DIR",
        help="read the run from its archive directory, or from DIR/RUN (no daemon needed)",
    )
    where.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="read the run from the daemon's state directory's archive, DIR/archive/RUN"
        " (the archive directory itself is taken too)",
    )


def wanted(args: argparse.Namespace) -> bool:
    """Whether the command reads archives instead of asking the daemon."""
    return args.archive is not None or args.state_dir is not None


ARCHIVES_SCANNED = 100_000  # run archives looked at for a Slurm job id


def archive_root(args: argparse.Namespace) -> Path:
    """Where the run archives are: --archive DIR, or --state-dir DIR's ``archive``; either
    one given the other kind of directory (a state directory as --archive, the archive
    root or a run's archive as --state-dir) is taken for what it is."""
    given: Path = args.archive if args.archive is not None else args.state_dir
    below = given / "archive"
    if (given / RECEIPT).is_file() or not below.is_dir():
        return given  # a run's own archive, or an archive root (or nothing: said later)
    return below


def _run_id_of(root: Path, ref: str) -> str:
    """The run id `ref` names: itself, its Slurm job name (``PREFIX-<run id>``,
    ``adopted-<run id>``), or a Slurm job id of one archived run (ambiguity refused)."""
    if (root / ref / RECEIPT).is_file():
        return ref
    _, dash, tail = ref.rpartition("-")
    if dash and RUN_ID_RE.fullmatch(tail) and (root / tail / RECEIPT).is_file():
        return tail
    if root.is_dir():
        found = sorted(_runs_of_job(root, ref))
        if len(found) == 1:
            return found[0]
        if found:
            raise OfflineError(
                f"{ref} names {len(found)} archived runs ({', '.join(found[:10])});"
                " give the run id."
            )
    return ref


def _runs_of_job(root: Path, ref: str) -> list[str]:
    """The archived runs under `root` whose receipt names Slurm job id or job name `ref`
    (any attempt's)."""
    found = []
    with os.scandir(root) as entries:
        for n, entry in enumerate(entries):
            if n >= ARCHIVES_SCANNED:
                break
            if not RUN_ID_RE.fullmatch(entry.name):
                continue
            try:
                receipt = receipt_of(Path(entry.path))
            except OfflineError:
                continue
            attempts = receipt.get("attempts")
            rows = (
                [a for a in attempts if isinstance(a, dict)] if isinstance(attempts, list) else []
            )
            names = {str(receipt.get("job_id"))}
            names |= {str(a.get(k)) for a in rows for k in ("slurm_job_id", "job_name")}
            if ref in names:
                found.append(entry.name)
    return found


def archive_of(args: argparse.Namespace, ref: str) -> Path:
    """The archive directory of run `ref` (its run id, job name or Slurm job id) under the
    command's --archive / --state-dir."""
    root = archive_root(args)
    if (root / RECEIPT).is_file() and root.name == ref:
        return root
    if os.sep in ref or ref in ("", ".", ".."):
        raise OfflineError(
            f"Run {ref!r} is not a run id, job name or Slurm job id; give one of them"
            f" (a run id is a directory of {root})."
        )
    if not (root / RECEIPT).is_file():
        ref = _run_id_of(root, ref)
    found = root / ref
    if not (found / RECEIPT).is_file():
        if (root / RECEIPT).is_file():
            raise OfflineError(f"{root} is the archive of run {root.name}, not of run {ref}.")
        raise OfflineError(
            f"No archive of run {ref} in {root} (no {RECEIPT} in {found}, and no archived"
            " run has that job name or Slurm job id); give the daemon's state directory, its"
            " archive root (<state_dir>/archive) or the run's own directory."
        )
    return found


def receipt_of(archive: Path) -> Mapping[str, object]:
    """The run's archived receipt: a JSON object with an `outcome`, as whichever daemon
    version archived it wrote it (its other fields are checked where they are read)."""
    path = archive / RECEIPT
    try:
        with path.open("rb") as f:
            data = f.read(RECEIPT_MAX + 1)
    except OSError as exc:
        raise OfflineError(f"{path} cannot be read ({exc.strerror}).") from None
    if len(data) > RECEIPT_MAX:
        raise OfflineError(f"{path} is larger than {RECEIPT_MAX} bytes.")
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise OfflineError(f"{path} is not JSON ({exc}).") from None
    if not isinstance(value, dict) or not isinstance(value.get("outcome"), str):
        raise OfflineError(f"{path} is not a run's receipt (no outcome).")
    return value


def run_results(args: argparse.Namespace, ref: str) -> RunResults:
    """What the daemon's `results` would answer for a finished run, from its archive."""
    archive = archive_of(args, ref)
    return _results(archive, receipt_of(archive))


def _results(archive: Path, receipt: Mapping[str, object]) -> RunResults:
    try:
        table = results_table_of(archive / "results.json")
    except ControlError as exc:
        raise OfflineError(exc.message) from None
    attempts = receipt.get("attempts")
    rows = [a for a in attempts if isinstance(a, dict)] if isinstance(attempts, list) else []
    outcome = str(receipt["outcome"])
    decided_at = receipt.get("decided_at")
    return {
        "run": archive.name,
        "state": outcome,  # an archived run is final: its state is its outcome
        "outcome": outcome,
        "reason": job_text(str(receipt.get("reason", ""))),
        "results": table,  # checked as it was read
        "usage": split_usage(rows),
        "finished_at": decided_at if isinstance(decided_at, str) else None,
    }


SPEC_MAX = 1 << 20  # bytes of an archived spec.toml or foreign.json read for the run's name


def run_name(archive: Path) -> str:
    """What `list` calls the archived run (`[run] name` of its ``spec.toml``, its script's
    file name or ``adopted-JOBID`` from its ``foreign.json``); "" when it says none or
    cannot be read."""
    try:
        if (archive / "spec.toml").is_file():
            with (archive / "spec.toml").open("rb") as f:
                run = tomllib.loads(f.read(SPEC_MAX).decode("utf-8")).get("run")
            name = run.get("name") if isinstance(run, dict) else None
            return name if isinstance(name, str) and NAME_RE.fullmatch(name) else ""
        with (archive / "foreign.json").open("rb") as f:
            body = json.loads(f.read(SPEC_MAX)).get("foreign")
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(body, dict) or body.get("kind") not in ("script", "adopt"):
        return ""
    return ForeignSpec(
        kind=body["kind"],
        watch=Watch(str(archive)),
        script_name=str(body.get("script_name") or ""),
        job_id=str(body.get("job_id")),
    ).name()


def print_status(args: argparse.Namespace, ref: str, out: IO[str]) -> None:
    """`status` of a finished run from its archive: its job, nodes, outcome, best point."""
    from llmd_supervisor.core.results.values import gpu_text

    archive = archive_of(args, ref)
    receipt = receipt_of(archive)
    results = _results(archive, receipt)  # the receipt read once
    attempts = receipt.get("attempts")
    last = attempts[-1] if isinstance(attempts, list) and attempts else {}
    nodes = last.get("nodes") if isinstance(last, dict) else None
    name = run_name(archive)
    print(
        f"run {archive.name}{f' {name}' if name else ''}: {results['outcome']} (from its"
        " archive; no daemon asked)",
        file=out,
    )
    print(
        f"  slurm job {job_text(str(receipt.get('job_id', '-')))},"
        f" attempt {receipt.get('attempt', '-')}",
        file=out,
    )
    if isinstance(nodes, list) and nodes:
        print(f"  nodes {','.join(job_text(str(n)) for n in nodes)}", file=out)
    print(f"  outcome {results['outcome']}: {results['reason']}", file=out)
    table = results["results"]
    valid = [p for p in table["points"] if p["valid"]] if table else []
    if table and valid:
        best = max(valid, key=lambda p: p["total_token_throughput"] or 0.0)
        print(
            f"  best point c={best['concurrency']}: {best['total_token_throughput'] or 0:.1f}"
            f" tok/s total, {best['output_throughput'] or 0:.1f} tok/s output"
            f" ({gpu_text(table)})",
            file=out,
        )
    usage: Usage | None = results.get("usage")
    if usage is not None:
        print(
            f"  GPU-hours {usage['gpu_hours_useful']:.2f} useful,"
            f" {usage['gpu_hours_lost']:.2f} lost",
            file=out,
        )
    print(f"  archive {archive}", file=out)
