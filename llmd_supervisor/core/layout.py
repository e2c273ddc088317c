"""Every name and path of one run, in one place (pure).

Remote paths (what the job writes, as the nodes and Slurm see them) are POSIX strings; local
paths (the daemon's archive and its log copies) are `Path`s. The node side agrees on the
names in `llmd_supervisor.node.common`; this module builds the paths from them.

Layout, for log directory ``L``, job name ``N`` and job id ``J``:
  * ``L/N-J.out``, ``L/N-J.err``   -- the batch logs (sbatch ``--output=L/%x-%j.out``)
  * ``L/.bench_done.J``            -- the completion marker
  * ``L/J/``                       -- the job directory: per-rank logs and status files
  * ``L/J/bench/c<N>.json|.log``   -- each benchmark point's result and client log
and in the run's archive directory ``A``:
  * ``A/logs/attempt<K>/<name>``   -- byte-exact copies of attempt K's logs, by file name
  * ``A/results/c<N>.json|.log``   -- the benchmark's raw result files and point logs
  * ``A/results.json``             -- their normalised table
  * ``A/ranks/<name>``             -- each rank's last status file and diagnostic
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

    # --- written by the job (remote paths) ---------------------------------------------

    def batch_log_names(self, job_id: str) -> tuple[str, str]:
        """The batch .out and .err file names (as sbatch expands the patterns)."""
        return f"{self.job_name}-{job_id}.out", f"{self.job_name}-{job_id}.err"

    def batch_logs(self, job_id: str) -> dict[str, str]:
        """Local copy name -> remote path of the batch .out and .err."""
        return {name: f"{self.log_dir}/{name}" for name in self.batch_log_names(job_id)}

    def batch_out(self, job_id: str) -> str:
        """The batch .out's remote path (it appears when the job starts)."""
        return f"{self.log_dir}/{self.batch_log_names(job_id)[0]}"

    def job_dir(self, job_id: str) -> str:
        return f"{self.log_dir}/{job_id}"

    def status_file(self, job_id: str, rank: int) -> str:
        return f"{self.job_dir(job_id)}/{common.status_name(rank)}"

    def marker(self, job_id: str) -> str:
        return f"{self.log_dir}/{common.marker_name(job_id)}"

    def diag_file(self, job_id: str, rank: int) -> str:
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

    def batch_copy(self, attempt: int, job_id: str) -> Path:
        """The local copy of the batch .out of an attempt."""
        return self.copies(attempt) / self.batch_log_names(job_id)[0]

    @property
    def results_dir(self) -> Path:
        """The benchmark's raw result files and point logs, byte-exact (`results/c<N>.json`)."""
        return self.archive_dir / RESULTS

    @property
    def results_table(self) -> Path:
        """The normalised results table (`core.results.results_table`)."""
        return self.archive_dir / "results.json"

    @property
    def ranks_dir(self) -> Path:
        """Each rank's last status file and diagnostic."""
        return self.archive_dir / "ranks"
