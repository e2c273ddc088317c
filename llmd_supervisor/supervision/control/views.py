"""What the control API shows of a run: its brief (`list`) and its summary (`status`,
`wait`, ...), bounded whatever the run's history and evidence, built from what the API
reads of a run handle (the protocols here)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Final, Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread

from llmd_supervisor.adapters.control.protocol import DEFAULT_MAX_MESSAGE
from llmd_supervisor.core.protocol.runs import (
    AttemptView,
    Headline,
    NodeView,
    ResultsTable,
    RunBrief,
    RunResults,
    RunSummary,
    headline,
    read,
)
from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.run.lifecycle import Run
from llmd_supervisor.core.verdict.usage import split as split_usage
from llmd_supervisor.errors import (
    ControlError,
    SummaryError,
)

RESULTS_TABLE_MAX: Final = DEFAULT_MAX_MESSAGE // 2  # a results.json the reply carries
ATTEMPTS_SHOWN: Final = 20  # a summary's last attempts at most
SHOWN_LINE_MAX: Final = 200  # characters of a summary's last log line and a brief's reason
BRIEF_NODES_MAX: Final = 256


# --------------------------------------------------------------------------- what it reads


class HealthView(Protocol):
    """What the API reads of a node's heartbeat state."""

    @property
    def rank(self) -> int: ...
    @property
    def reachable(self) -> bool: ...
    @property
    def agent_state(self) -> str: ...


class MetaView(Protocol):
    """What the API reads of a run's journaled metadata."""

    @property
    def owner_uid(self) -> int: ...
    @property
    def cluster(self) -> str: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def archive_dir(self) -> str: ...
    @property
    def log_dir(self) -> str: ...


class HandleView(Protocol):
    """What the API reads of a run handle: its record, and the event set on every change."""

    @property
    def run(self) -> Run: ...
    @property
    def meta(self) -> MetaView: ...
    @property
    def health(self) -> Mapping[str, HealthView]: ...
    @property
    def changed(self) -> anyio.Event: ...
    @property
    def layout(self) -> RunLayout: ...
    @property
    def history(self) -> Sequence[Mapping[str, object]]: ...
    @property
    def sigterm_grace_s(self) -> int: ...
    @property
    def held_until(self) -> datetime | None: ...
    @property
    def name(self) -> str: ...


# --------------------------------------------------------------------------- summaries


def run_summary(h: HandleView, now: datetime) -> RunSummary:
    """The run as the control socket shows it: its brief, whole, and its evidence."""
    run = h.run
    health: dict[str, NodeView] = {
        node: {"rank": n.rank, "reachable": n.reachable, "agent_state": n.agent_state}
        for node, n in h.health.items()
    }
    return {
        **run_brief(h, now),
        "reason": run.reason,  # whole, and every node: one run's summary
        "nodes": list(run.nodes),
        "log_dir": h.meta.log_dir,
        "health": health,
        "transitions": [
            {"state": t.state.value, "at": t.at.isoformat(), "event": t.event}
            for t in run.transitions
        ],
        "last_log_line": _last_line(h.layout.batch_copy(run.attempt, run.slurm_job_id))
        if run.slurm_job_id is not None
        else "",
        "headline": _headline(h.layout.results_table) if run.state.is_final else None,
        "attempts": [_attempt(e) for e in h.history[-ATTEMPTS_SHOWN:]],
        "usage": split_usage(h.history),
        "sigterm_grace_s": h.sigterm_grace_s,
        "held_until": h.held_until.isoformat() if h.held_until is not None else None,
    }


def _attempt(e: Mapping[str, object]) -> AttemptView:
    """One `attempt.ended` event as `status` shows it."""

    def text(key: str) -> str:
        return cut(str(e.get(key) or ""))

    def names(key: str) -> list[str]:
        value = e.get(key)
        return [str(n) for n in value[:BRIEF_NODES_MAX]] if isinstance(value, list) else []

    def number(key: str) -> float | None:
        value = e.get(key)
        return float(value) if isinstance(value, int | float) else None

    attempt, submission, job = e.get("attempt"), e.get("submission"), e.get("slurm_job_id")
    return {
        "attempt": attempt if isinstance(attempt, int) else 0,
        "submission": submission if isinstance(submission, int) else 0,
        "slurm_job_id": str(job) if job is not None else None,
        "nodes": names("nodes"),
        "outcome": text("outcome"),
        "reason": text("reason"),
        "cause": text("cause") or None,
        "implicated": names("implicated"),
        "retry": text("retry"),
        "node_hours": number("node_hours"),
        "gpu_hours": number("gpu_hours"),
    }


def _headline(path: Path) -> Headline | None:
    """The best point of an archived results table (read again only when it changed)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return _headline_of(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1024)
def _headline_of(path: Path, mtime_ns: int, size: int) -> Headline | None:
    try:
        table = results_table_of(path)
    except ControlError:
        return None
    return headline(table) if table is not None else None


def results_table_of(path: Path) -> ResultsTable | None:
    """The run's archived ``results.json`` (the daemon's own file), None until written."""
    try:
        with path.open("rb") as f:
            data = f.read(RESULTS_TABLE_MAX + 1)
    except FileNotFoundError:
        return None
    if len(data) > RESULTS_TABLE_MAX:
        raise ControlError("internal", f"{path} is larger than {RESULTS_TABLE_MAX} bytes.")
    try:
        return read(ResultsTable, json.loads(data))
    except (ValueError, SummaryError) as exc:
        raise ControlError("internal", f"{path} is not a results table ({exc}).") from exc


def run_brief(h: HandleView, now: datetime) -> RunBrief:
    """The run as ``list`` shows it: bounded whatever the run's history and evidence."""
    run = h.run
    return {
        "run": run.run_id,
        "job_name": run.job_name,
        "state": run.state.value,
        "outcome": run.outcome.value if run.outcome else None,
        "reason": cut(run.reason),
        "slurm_job_id": run.slurm_job_id,
        "attempt": run.attempt,
        "nodes": list(run.nodes[:BRIEF_NODES_MAX]),
        "nodes_healthy": sum(1 for n in h.health.values() if n.reachable),
        "cancel_requested": run.cancel_requested,
        "cluster": h.meta.cluster,
        "owner_uid": h.meta.owner_uid,
        "created_at": h.meta.created_at.isoformat(),
        "elapsed_s": round((run_end(run, now) - h.meta.created_at).total_seconds(), 1),
        "archive": h.meta.archive_dir,
        "name": h.name,
        "finished_at": run_end(run, now).isoformat() if run.state.is_final else None,
    }


def run_end(run: Run, now: datetime) -> datetime:
    """Until when a run's elapsed time counts: its final transition, or now."""
    return run.transitions[-1].at if run.state.is_final and run.transitions else now


def cut(text: str) -> str:
    return text if len(text) <= SHOWN_LINE_MAX else text[: SHOWN_LINE_MAX - 3] + "..."


def _last_line(path: Path | None) -> str:
    """The last non-empty line of a (local, small-read) log copy, or "": the job wrote it,
    so it is escaped and bounded (`core.run.jobtext`)."""
    if path is None:
        return ""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return job_text(next((line for line in reversed(lines) if line.strip()), ""), SHOWN_LINE_MAX)


async def run_results(handle: HandleView, now: datetime) -> RunResults:
    """A run's `results` reply: its verdict, results table, usage and end."""
    run = handle.run
    table = await anyio.to_thread.run_sync(results_table_of, handle.layout.results_table)
    return {
        "run": run.run_id,
        "state": run.state.value,
        "outcome": run.outcome.value if run.outcome else None,
        "reason": run.reason,
        "results": table,
        "usage": split_usage(handle.history),
        "finished_at": (run_end(run, now).isoformat() if run.state.is_final else None),
    }
