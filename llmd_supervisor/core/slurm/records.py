"""Batched Slurm output, one record per job row, a bad record isolated to its own job.

squeue and sacct print one line per job (and per step) with ``|`` between the columns and
the job id first. A line that does not start with a job id continues the record before it
(a line break inside its last column, the only one that may hold free text), so one
broken record can never take its neighbours with it: each record is parsed on its own,
and a record that does not parse is `Rejected` under its job id. Text before the first
record belongs to no job (``job_id`` None): the answer as a whole was not understood.

Pure: nothing here runs a command; no exception but SlurmParseError is raised.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar

from llmd_supervisor.errors import SlurmParseError

__all__ = ["Batch", "Rejected", "parse_batch"]

R = TypeVar("R")

# A record starts with a job id (array task ``12_3``, het component ``12+0``, step
# ``12.batch``) and the column separator; the job it belongs to is the leading number.
_RECORD_START = re.compile(r"([0-9]{1,18})(?:[._+][^|\s]*)?\|", re.ASCII)


@dataclass(frozen=True)
class Rejected:
    """One record that did not parse, and the job it belongs to (None: before any record)."""

    job_id: str | None
    text: str
    error: SlurmParseError


@dataclass(frozen=True)
class Batch(Generic[R]):
    """Every record of one batched answer: the rows that parsed, the records that did not."""

    rows: tuple[R, ...]
    rejected: tuple[Rejected, ...]
    texts: Mapping[str, str]  # job id -> its records, a line each, in printed order

    @property
    def rejected_jobs(self) -> frozenset[str]:
        """The jobs with a record that did not parse: nothing is known of them here."""
        return frozenset(r.job_id for r in self.rejected if r.job_id is not None)

    @property
    def stray(self) -> tuple[Rejected, ...]:
        """Text that belongs to no job (printed before the first record)."""
        return tuple(r for r in self.rejected if r.job_id is None)

    def text_of(self, job_id: str) -> str:
        """The records of `job_id` (its rows and its rejected ones), a line each, as printed:
        what the answer said about that job and nothing about any other."""
        return self.texts.get(job_id, "")

    def strict(self) -> list[R]:
        """The rows, or the first rejected record's SlurmParseError."""
        if self.rejected:
            raise self.rejected[0].error
        return list(self.rows)


def parse_batch(text: str, what: str, parse_record: Callable[[str], R]) -> Batch[R]:
    """Group `text` (the stdout of `what`) into records and parse each with `parse_record`
    (which raises SlurmParseError for a record it cannot read). Blank lines are skipped."""
    records: list[tuple[str | None, list[str]]] = []
    for line in text.split("\n"):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        start = _RECORD_START.match(line)
        if start is not None:
            records.append((start.group(1), [line]))
        elif records and records[-1][0] is not None:
            records[-1][1].append(line)  # a line break inside the record's last column
        else:
            records.append((None, [line]))
    rows: list[R] = []
    rejected: list[Rejected] = []
    texts: dict[str, list[str]] = {}
    for job_id, lines in records:
        joined = "\n".join(lines)
        if job_id is not None:
            texts.setdefault(job_id, []).append(joined + "\n")
        try:
            if job_id is None:
                raise SlurmParseError(what, joined, "expected each line to start with a job id")
            if len(lines) > 1:
                why = f"a line break inside the record of job {job_id} (a name holding one?)"
                raise SlurmParseError(what, joined, why)
            rows.append(parse_record(joined))
        except SlurmParseError as exc:
            rejected.append(Rejected(job_id, joined, exc))
    by_job = MappingProxyType({job: "".join(parts) for job, parts in texts.items()})
    return Batch(tuple(rows), tuple(rejected), by_job)
