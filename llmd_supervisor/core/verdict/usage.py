"""What an attempt cost (pure): its allocation's elapsed time from the believed Slurm
record (sacct ``Elapsed``, scontrol ``RunTime``), times its nodes, times their GPUs.

A run's GPU-hours are split into useful (the attempt whose outcome is the run's) and lost
(every attempt before it: failed ones a retry replaced).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final, TypedDict

from llmd_supervisor.core.protocol.runs import UsageView
from llmd_supervisor.core.slurm.parse import parse_sacct, parse_scontrol_job
from llmd_supervisor.core.verdict.decide import JobRecord, Source
from llmd_supervisor.errors import SlurmParseError

# [D-]HH:MM:SS, MM:SS or MM:SS.mmm as Slurm prints durations
_DURATION: Final = re.compile(r"(?:(\d{1,5})-)?(?:(\d{1,2}):)?(\d{1,2}):(\d{1,2})(?:\.\d+)?")


def duration_s(text: str) -> float | None:
    """Seconds of a Slurm duration (None when it is not one: ``INVALID``, empty)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def elapsed_s(record: JobRecord | None) -> float | None:
    """The allocation's elapsed seconds from a believed record (None: not shown)."""
    if record is None:
        return None
    try:
        if record.source is Source.SACCT:
            rows = [r for r in parse_sacct(record.raw) if not r.is_step]
            return duration_s(rows[0].elapsed) if rows else None
        return duration_s(parse_scontrol_job(record.raw).run_time)
    except SlurmParseError:
        return None


class AttemptUsage(TypedDict):
    """An attempt's cost (None: its elapsed time is not known)."""

    elapsed_s: float | None
    node_hours: float | None
    gpu_hours: float | None


def usage(elapsed: float | None, nodes: int, gpus_per_node: int) -> AttemptUsage:
    """An attempt's node-hours and GPU-hours (None: the elapsed time is not known)."""
    if elapsed is None:
        return {"elapsed_s": None, "node_hours": None, "gpu_hours": None}
    hours = elapsed / 3600
    return {
        "elapsed_s": elapsed,
        "node_hours": round(hours * nodes, 6),
        "gpu_hours": round(hours * nodes * gpus_per_node, 6),
    }


def split(attempts: Iterable[Mapping[str, object]]) -> UsageView:
    """A run's GPU- and node-hours: the last attempt's are useful, the others' lost."""
    rows = list(attempts)
    out = {"gpu_hours_useful": 0.0, "gpu_hours_lost": 0.0, "node_hours_useful": 0.0,
           "node_hours_lost": 0.0}  # fmt: skip
    for i, row in enumerate(rows):
        kind = "useful" if i == len(rows) - 1 else "lost"
        for unit in ("gpu_hours", "node_hours"):
            value = row.get(unit)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{unit}_{kind}"] += float(value)
    return {
        "gpu_hours_useful": round(out["gpu_hours_useful"], 6),
        "gpu_hours_lost": round(out["gpu_hours_lost"], 6),
        "node_hours_useful": round(out["node_hours_useful"], 6),
        "node_hours_lost": round(out["node_hours_lost"], 6),
    }
