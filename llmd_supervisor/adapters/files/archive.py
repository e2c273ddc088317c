"""The per-run archive: everything an operator needs to trust (or debug) an outcome.

Layout of `<archive_root>/<run_id>/`:
  spec.toml, job.sbatch        what was submitted
  logs/attempt<N>/             local copies of the batch .out/.err and per-rank logs
                               (written by the tailers while the run is live; the
                               names are core.run.layout's)
  marker.json                  the completion marker's bytes, when it existed
  results/c<N>.json, c<N>.log  each benchmark point's raw result and client log
  results.json                 the normalised results table (core.results.evidence)
  ranks/                       each rank's last status file and diagnostic
  scontrol-show-job.txt        the last `scontrol show job` record seen
  events.jsonl                 the run's journal events
  receipt.json                 the verdict's receipt (written last)

Modes follow the daemon's umask, which it sets to 077 when it starts
(`supervision.daemon.serve`): the daemon's account alone may read an archive.
`write_archive` fsyncs every file and directory it writes before returning; an OSError
(disk full, permissions) propagates and the caller must not declare the outcome.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from llmd_supervisor.adapters.fsutil import write_atomic
from llmd_supervisor.core.run.layout import LOGS


def run_dir(archive_root: Path, run_id: str) -> Path:
    return archive_root / run_id


def prepare(archive_root: Path, run_id: str, *, spec: tuple[str, str], script: str) -> Path:
    """Create the run's archive directory with what is known at submission: the spec as
    (file name, text) and the batch script as submitted (none for an adopted job)."""
    d = run_dir(archive_root, run_id)
    (d / LOGS).mkdir(parents=True, exist_ok=True)
    write_atomic(d / spec[0], spec[1].encode())
    if script:
        write_atomic(d / "job.sbatch", script.encode())
    return d


def write_part(archive_root: Path, run_id: str, name: str, data: bytes) -> Path:
    """One more file of the run's archive by relative name (an attempt's own receipt,
    ``attempt2/receipt.json``), written atomically."""
    parts = name.split("/")
    if len(parts) > 8 or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"archive file name {name!r} is not a plain relative path")
    path = run_dir(archive_root, run_id) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return path


def write_archive(
    archive_root: Path,
    run_id: str,
    *,
    receipt: Mapping[str, object],
    events: Sequence[Mapping[str, object]],
    marker: bytes | None,
    scontrol_snapshot: str | None,
    files: Mapping[str, bytes] | None = None,
) -> Path:
    """Complete (or rewrite: idempotent) the archive `prepare` started; the receipt goes
    last. `files` are more of the run's evidence by relative name (``results/c4.json``,
    ``ranks/rank0.status.json``, ``results.json``). Returns its path."""
    d = run_dir(archive_root, run_id)
    (d / LOGS).mkdir(parents=True, exist_ok=True)
    for name, data in (files or {}).items():
        parts = name.split("/")
        if len(parts) > 8 or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"archive file name {name!r} is not a plain relative path")
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(d / name, data)
    if marker is not None:
        write_atomic(d / "marker.json", marker)
    if scontrol_snapshot:
        write_atomic(d / "scontrol-show-job.txt", scontrol_snapshot.encode())
    lines = "".join(json.dumps(e, sort_keys=True, default=str) + "\n" for e in events)
    write_atomic(d / "events.jsonl", lines.encode())
    _fsync_tree(d / LOGS)
    write_atomic(
        d / "receipt.json", (json.dumps(receipt, indent=2, sort_keys=True) + "\n").encode()
    )
    return d


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root` and the directories themselves (the log copies)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
