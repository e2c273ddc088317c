"""Every name and path of one run, in one place (pure).

Remote paths (what the job writes, as the nodes and Slurm see them) are POSIX strings; local
paths (the daemon's archive and its log copies) are `Path`s. The node side agrees on the
names in `llmd_supervisor.node.common`; this module builds the paths from them.

Layout, for log directory ``L``, job name ``N`` and job id ``J``:
  * ``L/N-J.out``, ``L/N-J.err``   -- the batch logs (sbatch ``--output=L/%x-%j.out``)
  * ``L/.bench_done.J``            -- the completion marker
  * ``L/J/``                       -- the job directory: per-rank logs and status files
  * ``L/J/bench/c<N>.json|.log``   -- each benchmark point's result and client log
A foreign job (`core.spec.foreign`: a user's batch script, an adopted job) has its own names:
its `Watch` says which files below ``L`` are its logs, marker and results, and its batch
logs are where ``scontrol show job`` says (`batch_paths`). It has no status files.

and in the run's archive directory ``A``:
  * ``A/logs/attempt<K>/<name>``   -- byte-exact copies of attempt K's logs, by file name
  * ``A/results/c<N>.json|.log``   -- the benchmark's raw result files and point logs
  * ``A/results.json``             -- their normalised table
  * ``A/ranks/<name>``             -- each rank's last status file and diagnostic
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path

from llmd_supervisor.core.spec.foreign import MarkerFormat, Watch
from llmd_supervisor.node import common

LOGS = "logs"
RESULTS = "results"


def batch_log_patterns(log_dir: str) -> tuple[str, str]:
    """sbatch's ``--output`` and ``--error`` patterns for a run's log directory."""
    return f"{log_dir}/%x-%j.out", f"{log_dir}/%x-%j.err"


@dataclass(frozen=True)
class RunLayout:
    """Where one run's files are: written by its job, and copied by the daemon."""

    log_dir: str  # the job's log directory, as the nodes see it
    job_name: str
    archive_dir: Path  # this run's archive directory on the daemon's machine
    watch: Watch | None = None  # a foreign job's files (None: a rendered run)
    batch_paths: tuple[str, ...] = ()  # a foreign job's StdOut and StdErr (scontrol)

    # --- written by the job (remote paths) ---------------------------------------------

    def batch_log_names(self, job_id: str) -> tuple[str, ...]:
        """The batch .out and .err file names (as sbatch expands the patterns)."""
        if self.watch is not None:
            return tuple(dict.fromkeys(posixpath.basename(p) for p in self.batch_paths))
        return f"{self.job_name}-{job_id}.out", f"{self.job_name}-{job_id}.err"

    def batch_logs(self, job_id: str) -> dict[str, str]:
        """Local copy name -> remote path of the batch .out and .err."""
        if self.watch is not None:
            return {posixpath.basename(p): p for p in reversed(self.batch_paths)}
        return {name: f"{self.log_dir}/{name}" for name in self.batch_log_names(job_id)}

    def batch_out(self, job_id: str) -> str | None:
        """The batch .out's remote path (it appears when the job starts); None: unknown."""
        if self.watch is not None:
            return self.batch_paths[0] if self.batch_paths else None
        return f"{self.log_dir}/{self.batch_log_names(job_id)[0]}"

    def log_dirs(self, job_id: str, rank: int | None) -> tuple[str, ...]:
        """The directories listed for rank `rank`'s logs (None: every rank's). A foreign
        job's logs are all copied through the first node: its names carry no rank."""
        if self.watch is None:
            return (self.job_dir(job_id),)
        return self.watch.dirs(self.watch.logs, job_id) if rank in (0, None) else ()

    def log_copy_name(self, job_id: str, rank: int | None, directory: str, name: str) -> str | None:
        """The copy name of `directory/name` if it is a log of rank `rank` (None: of any
        rank) to copy, else None."""
        if self.watch is None:
            return name if self.is_rank_log(name, rank) else None
        if self.watch.matching(self.watch.logs, job_id, directory, name):
            return self.watch.copy_name(f"{directory}/{name}")
        return None

    def streamed(self, copy_name: str, rank: int | None) -> bool:
        """Whether `logs` shows a copy (its name below the attempt's directory): the batch
        logs without a rank, that rank's logs with one (a foreign job: all its other logs)."""
        base = posixpath.basename(copy_name)
        if self.watch is None:
            return self.is_batch_log(base) if rank is None else self.is_rank_log(base, rank)
        batch = base in self.batch_log_names("") and "/" not in copy_name
        return batch if rank is None else not batch

    def job_dir(self, job_id: str) -> str:
        return f"{self.log_dir}/{job_id}"

    def status_file(self, job_id: str, rank: int) -> str | None:
        """A rank's status file (None: a foreign job writes none)."""
        if self.watch is not None:
            return None
        return f"{self.job_dir(job_id)}/{common.status_name(rank)}"

    def marker(self, job_id: str) -> str | None:
        """The completion marker (None: the run uses no marker protocol)."""
        if self.watch is not None:
            return self.watch.marker_path(job_id)
        return f"{self.log_dir}/{common.marker_name(job_id)}"

    @property
    def marker_format(self) -> MarkerFormat:
        return MarkerFormat.ANY if self.watch is None else self.watch.marker_format

    def diag_file(self, job_id: str, rank: int) -> str | None:
        if self.watch is not None:
            return None
        return f"{self.job_dir(job_id)}/{common.diag_name(rank)}"

    def bench_files(self, job_id: str, concurrency: int) -> tuple[str, str]:
        """A benchmark point's result file and client log (remote paths)."""
        bench = f"{self.job_dir(job_id)}/{common.BENCH_DIR}"
        return (
            f"{bench}/{common.result_name(concurrency)}",
            f"{bench}/{common.bench_log_name(concurrency)}",
        )

    @staticmethod
    def is_batch_log(name: str) -> bool:
        """A batch .out or .err file name (the rest of a log directory is per rank)."""
        return name.endswith((".out", ".err")) and not name.startswith("rank")

    @staticmethod
    def is_rank_log(name: str, rank: int | None = None) -> bool:
        """A per-rank log file name (any rank, or this one), never a status file."""
        if rank is not None:
            return common.is_rank_log(name, rank)
        return name.startswith("rank") and not name.endswith(common.STATUS_SUFFIX)

    # --- the daemon's copies (local paths) ---------------------------------------------

    @property
    def logs_root(self) -> Path:
        """Every attempt's log copies (what `logs` streams)."""
        return self.archive_dir / LOGS

    def copies(self, attempt: int) -> Path:
        """The directory of attempt `attempt`'s log copies."""
        return self.logs_root / f"attempt{attempt}"

    def batch_copy(self, attempt: int, job_id: str) -> Path | None:
        """The local copy of the batch .out of an attempt (None: not known)."""
        names = self.batch_log_names(job_id)
        return self.copies(attempt) / names[0] if names else None

    @property
    def results_dir(self) -> Path:
        """The benchmark's raw result files and point logs, byte-exact (`results/c<N>.json`)."""
        return self.archive_dir / RESULTS

    @property
    def results_table(self) -> Path:
        """The normalised results table (`core.results.evidence.results_table`)."""
        return self.archive_dir / "results.json"

    @property
    def ranks_dir(self) -> Path:
        """Each rank's last status file and diagnostic."""
        return self.archive_dir / "ranks"
