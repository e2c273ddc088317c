"""Takeover trials of two daemons on two logins (issue 3.7): what one trial measured, the
pure functions that measure it from the daemons' JSON logs and from sacct, and the
Markdown report of many trials (tests/perf/results/<date>-takeover-trials.md).

The logs are the daemons' own (``log_format = "json"``: one JSON object a line, from
llmd_supervisor/adapters/log.py: ``event``, ``level``, ``timestamp`` in ISO 8601 UTC,
and the bound ``cluster`` and ``holder`` of the lease keeper,
llmd_supervisor/supervision/ha/leadership.py). A daemon *acts* for a cluster from its
``lease.acquired`` to its next ``lease.lost``, ``lease.stepping_down`` or
``lease.released`` for that cluster, or to its process's death (which the trial knows:
it killed it), or to the end of the observation. Two leaders is the time during which
two or more daemons act for the same cluster at once.

Takeover (`takeover_s`): from the moment the fault was injected to the first
``lease.acquired`` for the cluster after it, by any daemon: the standby, or the old leader
again (after a PostgreSQL restart, say). None when no daemon acquired the lease after the
fault (the leader kept it, or nobody leads at the end: the report counts the trials with
a takeover, so read it with the fault: a standby's fault needs none).

No I/O but `write_report`; the table tests are tests/unit/test_ha_trials.py.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

__all__ = [
    "ACQUIRED",
    "ENDING",
    "Interval",
    "LeaseEvent",
    "Trial",
    "jobs_per_name",
    "leader_intervals",
    "parse_lease_events",
    "render_report",
    "sacct_argv",
    "takeover_s",
    "two_leaders_s",
    "write_report",
]

ACQUIRED = "lease.acquired"
ENDING = frozenset({"lease.lost", "lease.stepping_down", "lease.released"})
RESULTS = Path(__file__).resolve().parent.parent / "perf" / "results"


@dataclass(frozen=True)
class Trial:
    """One trial: a fault injected once, what followed."""

    fault: str  # e.g. "leader SIGKILL", "leader's database link cut 30 s", "PostgreSQL restarted"
    takeover_s: float | None  # `takeover_s`; None: no takeover happened (or was needed)
    two_leaders_s: float  # `two_leaders_s`
    jobs_per_name: dict[str, int] = field(default_factory=dict)  # `jobs_per_name`
    stale_writes_rejected: int = 0  # journal writes of a superseded epoch refused (fencing)
    stale_writes_committed: int = 0  # ... that got through: must stay 0
    runs_lost: int = 0  # runs submitted before the fault that no daemon finished
    # After a takeover, the trial writes once as the deposed leader's epoch: 1 if the
    # database refused it (the fence is in place after the fault), 0 if not tried.
    probes_refused: int = 0
    probes_committed: int = 0  # ... such writes that got through: must stay 0

    @property
    def duplicate_jobs(self) -> dict[str, int]:
        """The job names Slurm ran more than once (a run submitted twice)."""
        return {name: n for name, n in self.jobs_per_name.items() if n > 1}


@dataclass(frozen=True)
class LeaseEvent:
    daemon: str  # which daemon's log (the trial's label: "login1", ...)
    event: str  # lease.acquired, or one of ENDING
    cluster: str
    at: datetime  # aware, UTC
    epoch: int | None = None


@dataclass(frozen=True)
class Interval:
    """A stretch during which one daemon acted for a cluster."""

    daemon: str
    cluster: str
    start: datetime
    end: datetime
    ended_by: str  # an ENDING event, "acquired" (acquired again), "death" or "end"
    epoch: int | None = None

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def parse_timestamp(text: str) -> datetime:
    """structlog's ISO timestamp ("2026-12-06T07:13:05.123456Z") as an aware datetime."""
    at = datetime.fromisoformat(text)
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def parse_lease_events(daemon: str, lines: Iterable[str]) -> list[LeaseEvent]:
    """The lease events (acquired and ENDING) of one daemon's JSON log, in log order.
    Lines that are not JSON objects (a traceback, a partial last line) are skipped; a
    lease event without a cluster or a timestamp is an error (the log format changed)."""
    out: list[LeaseEvent] = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        event = record.get("event")
        if event != ACQUIRED and event not in ENDING:
            continue
        cluster, stamp = record.get("cluster"), record.get("timestamp")
        if not isinstance(cluster, str) or not isinstance(stamp, str):
            raise ValueError(f"{daemon}: {event} without cluster or timestamp: {line}")
        epoch = record.get("epoch")
        # A stop logged late (the process was stopped past its deadline) says how late:
        # the daemon acted until then (its writes and sbatch stop at the deadline).
        late = record.get("late_s")
        late_s = float(late) if isinstance(late, int | float) else 0.0
        out.append(
            LeaseEvent(
                daemon=daemon,
                event=str(event),
                cluster=cluster,
                at=parse_timestamp(stamp) - timedelta(seconds=late_s),
                epoch=epoch if isinstance(epoch, int) else None,
            )
        )
    return out


def leader_intervals(
    events: Iterable[LeaseEvent],
    *,
    until: datetime,
    died: Mapping[str, datetime] | None = None,
) -> list[Interval]:
    """The intervals during which each daemon acted, per cluster, sorted by start.

    An interval opens at lease.acquired and closes at that daemon's next ENDING event
    for the cluster; a second lease.acquired while open closes it there and opens a new
    one (a new epoch). Still open at the end of the events: closed at the daemon's death
    (`died[daemon]`) if it died, else at `until`. An ENDING event with nothing open is
    ignored (a release after a lost lease, say). Events are taken in time order per
    daemon (stable for equal timestamps)."""
    died = died or {}
    by_key: dict[tuple[str, str], list[LeaseEvent]] = {}
    for ev in events:
        by_key.setdefault((ev.daemon, ev.cluster), []).append(ev)
    out: list[Interval] = []
    for (daemon, cluster), evs in by_key.items():
        open_at: LeaseEvent | None = None
        for ev in sorted(evs, key=lambda e: e.at):
            if ev.event == ACQUIRED:
                if open_at is not None:
                    out.append(
                        Interval(daemon, cluster, open_at.at, ev.at, "acquired", open_at.epoch)
                    )
                open_at = ev
            elif open_at is not None:
                out.append(Interval(daemon, cluster, open_at.at, ev.at, ev.event, open_at.epoch))
                open_at = None
        if open_at is not None:
            death = died.get(daemon)
            if death is not None and death < until:
                end, how = max(death, open_at.at), "death"
            else:
                end, how = max(until, open_at.at), "end"
            out.append(Interval(daemon, cluster, open_at.at, end, how, open_at.epoch))
    return sorted(out, key=lambda i: (i.start, i.daemon))


def two_leaders_s(intervals: Iterable[Interval], cluster: str) -> float:
    """Seconds during which two or more different daemons acted for `cluster` at once."""
    points: list[tuple[datetime, int, str]] = []
    for iv in intervals:
        if iv.cluster == cluster and iv.end > iv.start:
            points.append((iv.start, 1, iv.daemon))
            points.append((iv.end, -1, iv.daemon))
    # Ends before starts at the same instant: touching intervals do not overlap.
    points.sort(key=lambda p: (p[0], p[1]))
    active: Counter[str] = Counter()
    total = 0.0
    last: datetime | None = None
    for at, delta, daemon in points:
        if last is not None and len(+active) >= 2:
            total += (at - last).total_seconds()
        active[daemon] += delta
        last = at
    return total


def takeover_s(intervals: Iterable[Interval], cluster: str, fault_at: datetime) -> float | None:
    """Seconds from the fault to the first lease acquisition of `cluster` after it (see
    the module); None when there was none."""
    later = [iv.start for iv in intervals if iv.cluster == cluster and iv.start > fault_at]
    return (min(later) - fault_at).total_seconds() if later else None


def sacct_argv(names: Iterable[str], *, since: str = "now-1day") -> list[str]:
    """The sacct command whose output `jobs_per_name` counts: every allocation (-X) of
    these job names, one ``JobName|JobID`` line each, requeued runs included (-D)."""
    return [
        "sacct",
        "-X",
        "-D",
        "-n",
        "--parsable2",
        f"--starttime={since}",
        f"--name={','.join(sorted(set(names)))}",
        "--format=JobName,JobID",
    ]


def jobs_per_name(sacct_out: str) -> dict[str, int]:
    """How many distinct Slurm jobs each name had, from `sacct_argv`'s output. A requeued
    job (same id, listed again with -D) counts once: it is one submission."""
    seen: dict[str, set[str]] = {}
    for line in sacct_out.splitlines():
        if not line.strip():
            continue
        name, _, job = line.partition("|")
        job = job.strip().split("|")[0]
        if not job:
            raise ValueError(f"not a JobName|JobID line: {line!r}")
        base = job.split("_")[0].split("+")[0].split(".")[0]
        seen.setdefault(name.strip(), set()).add(base)
    return {name: len(ids) for name, ids in sorted(seen.items())}


# ---------------------------------------------------------------- the report


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def render_report(trials: Sequence[Trial], *, title: str, notes: str = "") -> str:
    """The Markdown report: a row per fault (in first-seen order), then the totals."""
    faults = list(dict.fromkeys(t.fault for t in trials))
    lines = [f"# {title}", ""]
    if notes:
        lines += [notes.strip(), ""]
    lines += [
        "| fault | n | takeovers | worst takeover s | median takeover s | max two-leader s "
        "| duplicate jobs | stale writes rejected | stale writes committed "
        "| deposed-epoch probes refused / committed | runs lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def row(label: str, group: Sequence[Trial]) -> str:
        times = [t.takeover_s for t in group if t.takeover_s is not None]
        dups = sorted({name for t in group for name in t.duplicate_jobs})
        return (
            f"| {label} | {len(group)} | {len(times)} | {_fmt(max(times) if times else None)} "
            f"| {_fmt(statistics.median(times) if times else None)} "
            f"| {_fmt(max((t.two_leaders_s for t in group), default=None))} "
            f"| {', '.join(dups) if dups else 'none'} "
            f"| {sum(t.stale_writes_rejected for t in group)} "
            f"| {sum(t.stale_writes_committed for t in group)} "
            f"| {sum(t.probes_refused for t in group)} / {sum(t.probes_committed for t in group)} "
            f"| {sum(t.runs_lost for t in group)} |"
        )

    for fault in faults:
        lines.append(row(fault, [t for t in trials if t.fault == fault]))
    lines.append(row("**all**", trials))
    lines += [
        "",
        "takeovers: trials with a takeover (a new `lease.acquired` after the leadership "
        "held at the fault ended); two-leader time: total seconds with two daemons acting "
        "for the cluster at once (their `lease.acquired` to `lease.lost`/`stepping_down`/"
        "`released` or death); duplicate jobs: job names with more than one Slurm job "
        "(`sacct -X -D --name=...`).",
    ]
    bad = [
        t
        for t in trials
        if t.duplicate_jobs or t.stale_writes_committed or t.probes_committed or t.runs_lost
    ]
    if bad:
        lines += ["", "## Trials with a duplicate job, a stale write committed or a run lost", ""]
        for t in bad:
            lines.append(
                f"- {t.fault}: duplicates {t.duplicate_jobs or 'none'}, stale committed "
                f"{t.stale_writes_committed}, runs lost {t.runs_lost}"
            )
    return "\n".join(lines) + "\n"


def write_report(
    trials: Sequence[Trial],
    *,
    day: date | None = None,
    directory: Path = RESULTS,
    notes: str = "",
) -> Path:
    """Write <directory>/<day>-takeover-trials.md (and the trials as .json beside it)."""
    day = day or datetime.now(UTC).date()
    path = directory / f"{day.isoformat()}-takeover-trials.md"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(trials, title=f"Takeover trials, {day.isoformat()}", notes=notes))
    path.with_suffix(".json").write_text(
        json.dumps([asdict(t) for t in trials], indent=2, sort_keys=True) + "\n"
    )
    return path
