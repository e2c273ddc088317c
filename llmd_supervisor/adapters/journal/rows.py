"""Rows of the run journal: the records it keeps and their (de)serialisation.

Pure conversions between :class:`~llmd_supervisor.core.run.lifecycle.Run` plus
:class:`RunMeta` and the journal's rows, and the statements that read and write them on
a connection the caller holds (inside its transaction; either backend,
`adapters.journal.db`). Corrupt rows raise :class:`JournalError` naming the database
(``path``: its file or URL) and the operation; driver errors propagate to the caller,
which turns them into JournalError.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, TypeVar

from llmd_supervisor.adapters.journal.db import Db
from llmd_supervisor.core.run.lifecycle import Run, RunState, Transition
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import JournalError

_T = TypeVar("_T")

RUN_COLUMNS: Final = (
    "run_id, job_name, state, attempt, slurm_job_id, nodes, cancel_requested, outcome, "
    "reason, owner_uid, cluster, spec_toml, script, log_dir, archive_dir, created_at, "
    "submission, kind"
)


@dataclass(frozen=True)
class RunMeta:
    """What the journal keeps about a run besides its state-machine record."""

    owner_uid: int
    cluster: str
    spec_toml: str
    script: str  # the rendered sbatch script
    log_dir: str  # the run's log directory on the cluster's shared filesystem
    archive_dir: str  # local archive directory for this run
    created_at: datetime
    kind: str = "spec"  # the run's kind (`core.run.kinds`: spec, script or adopted)


@dataclass(frozen=True)
class StoredRun:
    """A run as read back from the journal."""

    run: Run  # transitions included
    meta: RunMeta


def run_values(run: Run) -> tuple[object, ...]:
    return (
        run.run_id,
        run.job_name,
        run.state.value,
        run.attempt,
        run.slurm_job_id,
        json.dumps(list(run.nodes)),
        int(run.cancel_requested),
        None if run.outcome is None else run.outcome.value,
        run.reason,
        run.submission,
    )


def transition_rows(
    run: Run, start: int, path: str | Path, operation: str
) -> list[tuple[str, int, str, str, str]]:
    return [
        (run.run_id, seq, t.state.value, iso(t.at, path, operation), t.event)
        for seq, t in enumerate(run.transitions)
        if seq >= start
    ]


def insert_transitions(
    conn: Db, run_id: str, rows: Iterable[tuple[str, int, str, str, str]]
) -> None:
    conn.executemany(
        "INSERT INTO transitions (run_id, seq, state, at, event) VALUES (?, ?, ?, ?, ?)",
        list(rows),
    )


def load_transitions(
    conn: Db, run_id: str, path: str | Path, operation: str
) -> tuple[Transition, ...]:
    rows = conn.execute(
        "SELECT state, at, event FROM transitions WHERE run_id = ? ORDER BY seq", (run_id,)
    ).fetchall()
    return tuple(_transition(row, path, operation) for row in rows)


def load_runs(
    conn: Db, where: str, params: Sequence[object], path: str | Path, operation: str
) -> list[StoredRun]:
    rows = conn.execute(
        f"SELECT {RUN_COLUMNS} FROM runs WHERE {where} ORDER BY created_at, rowid", params
    ).fetchall()
    if not rows:
        return []
    by_run: dict[str, list[Transition]] = {row[0]: [] for row in rows}
    for run_id, state, at, event in conn.execute(
        f"SELECT run_id, state, at, event FROM transitions WHERE run_id IN "
        f"(SELECT run_id FROM runs WHERE {where}) ORDER BY run_id, seq",
        params,
    ):
        by_run[run_id].append(_transition((state, at, event), path, operation))
    return [_stored_run(row, tuple(by_run[row[0]]), path, operation) for row in rows]


def _stored_run(
    row: Sequence[Any], transitions: tuple[Transition, ...], path: str | Path, operation: str
) -> StoredRun:
    (
        run_id,
        job_name,
        state,
        attempt,
        slurm_job_id,
        nodes,
        cancel_requested,
        outcome,
        reason,
        owner_uid,
        cluster,
        spec_toml,
        script,
        log_dir,
        archive_dir,
        created_at,
        submission,
        kind,
    ) = row
    try:
        run = Run(
            run_id=run_id,
            job_name=job_name,
            state=RunState(state),
            attempt=int(attempt),
            slurm_job_id=slurm_job_id,
            nodes=tuple(str(n) for n in decode_json(nodes, list, path, operation)),
            cancel_requested=bool(cancel_requested),
            outcome=None if outcome is None else Outcome(outcome),
            reason=reason,
            transitions=transitions,
            submission=int(submission),
        )
    except ValueError as exc:
        raise JournalError(str(path), operation, f"run {run_id} has a corrupt row: {exc}") from exc
    meta = RunMeta(
        owner_uid=int(owner_uid),
        cluster=cluster,
        spec_toml=spec_toml,
        script=script,
        log_dir=log_dir,
        archive_dir=archive_dir,
        created_at=parse_time(created_at, path, operation),
        kind=kind,
    )
    return StoredRun(run=run, meta=meta)


def _transition(row: Sequence[Any], path: str | Path, operation: str) -> Transition:
    state, at, event = row
    try:
        return Transition(RunState(state), parse_time(at, path, operation), event)
    except ValueError as exc:
        raise JournalError(str(path), operation, f"corrupt transition row: {exc}") from exc


def decode_json(text: str, kind: type[_T], path: str | Path, operation: str) -> _T:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise JournalError(str(path), operation, f"corrupt JSON {text!r}: {exc}") from exc
    if not isinstance(value, kind):
        raise JournalError(
            str(path), operation, f"corrupt JSON {text!r}: expected a {kind.__name__}"
        )
    return value


def check_consistent(path: str | Path, operation: str, run: Run) -> None:
    if run.transitions and run.transitions[-1].state is not run.state:
        raise JournalError(
            str(path),
            operation,
            f"the run is in state {run.state.value!r} but its last transition is to "
            f"{run.transitions[-1].state.value!r}",
        )


def iso(moment: datetime, path: str | Path, operation: str) -> str:
    """Fixed-width UTC ISO 8601, so text order is time order."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise JournalError(
            str(path), operation, f"time {moment.isoformat()} has no timezone; refusing to guess"
        )
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def parse_time(text: str, path: str | Path, operation: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise JournalError(str(path), operation, f"corrupt time {text!r}") from exc
    if moment.tzinfo is None:
        raise JournalError(str(path), operation, f"stored time {text!r} has no timezone")
    return moment.astimezone(UTC)
