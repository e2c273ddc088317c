"""What a run's events say beyond its record: the verdict's receipt, the attempts' cost
and the benchmark's points, turned into event facts (pure; `core.events.model`).

The driver reads what the journal and the archive hold when a run's outcome is declared
(the last receipt, the attempts' history entries, the archive's ``results.json``) and
hands it here as decoded JSON; `finished_details` keeps only the headline of each (no
raw sacct rows, no marker text, no log line, no environment). Every value a job could
have written is read defensively: a field of the wrong type is treated as missing, never
an error (an event must never hold up a run).

A point's headline numbers come from the gate's own evidence when verification has just
judged the attempt (`point_of_evidence`, for run.point_finished), and from the archived
results table when the run is declared (`points_of_table`, for run.finished). The best
point is the valid point with the highest total token throughput (ties: the lower
concurrency).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from llmd_supervisor.core.events.model import PointFacts
from llmd_supervisor.core.results.evidence import PointEvidence
from llmd_supervisor.core.verdict.usage import split

__all__ = [
    "EVIDENCE_LINES_MAX",
    "RunDetails",
    "best_point",
    "finished_details",
    "point_of_evidence",
    "points_of_table",
]

EVIDENCE_LINES_MAX: Final = 8
_LINE_MAX: Final = 300  # characters of one evidence line before `core.events.model` caps it again


@dataclass(frozen=True)
class RunDetails:
    """What a declared run's event adds to its record (`core.events.outbox.run_facts`)."""

    slurm_state: str | None = None  # the believed record's State
    exit_code: str | None = None  # and its ExitCode
    cause: str | None = None  # core.verdict.cause.Cause value (None: succeeded, or not diagnosed)
    evidence: tuple[str, ...] = ()  # the evidence summary, one line each
    gpu_hours_useful: float | None = None
    gpu_hours_lost: float | None = None
    best: PointFacts | None = None
    points: tuple[PointFacts, ...] = ()  # sorted by concurrency


def finished_details(
    receipt: Mapping[str, object] | None,
    attempts: Sequence[Mapping[str, object]],
    table: Mapping[str, object] | None,
) -> RunDetails:
    """The details of a declared run from its last receipt (None: none was journaled),
    its attempts' history entries (oldest first) and its archived results table (None:
    no job ran, or no table)."""
    r = receipt or {}
    believed = _mapping(r.get("believed"))
    cause = _mapping(r.get("cause"))
    points = points_of_table(table)
    usage = split(attempts) if attempts else None
    return RunDetails(
        slurm_state=_str(believed.get("state")),
        exit_code=_str(believed.get("exit_code")),
        cause=_str(cause.get("cause")),
        evidence=_evidence(r, believed, cause),
        gpu_hours_useful=None if usage is None else usage["gpu_hours_useful"],
        gpu_hours_lost=None if usage is None else usage["gpu_hours_lost"],
        best=best_point(points),
        points=points,
    )


def _evidence(
    r: Mapping[str, object], believed: Mapping[str, object], cause: Mapping[str, object]
) -> tuple[str, ...]:
    """One line per piece of evidence the receipt names, in the verdict's order."""
    lines: list[str] = []
    if believed:
        lines.append(
            f"Slurm ({_str(believed.get('source')) or '?'}, {_str(believed.get('basis')) or '?'}):"
            f" State={_str(believed.get('state')) or '?'}"
            f" ExitCode={_str(believed.get('exit_code')) or '?'}"
        )
    elif "believed" in r:
        lines.append("Slurm: no terminal record was believed")
    marker = _mapping(r.get("marker"))
    if marker:
        parsed = _mapping(marker.get("parsed"))
        rc = parsed.get("rc")
        shown = f" rc={rc}" if isinstance(rc, int) and not isinstance(rc, bool) else ""
        detail = _str(marker.get("detail")) or ""
        status = _str(marker.get("status")) or "?"
        lines.append(f"marker: {status}{shown}" + (f": {detail}" if detail else ""))
    gate = _mapping(r.get("benchmark"))
    if gate:
        verdict = "passed" if gate.get("ok") is True else "failed"
        lines.append(f"benchmark gate {verdict}: {_str(gate.get('reason')) or ''}".rstrip(": "))
    why = _str(cause.get("why"))
    if why:
        nodes = [str(n) for n in _list(cause.get("nodes"))]
        on = f" (nodes: {', '.join(nodes)})" if nodes else ""
        lines.append(f"cause {_str(cause.get('cause')) or '?'}: {why}{on}")
    held = _mapping(r.get("held"))
    if held:
        lines.append(f"held: {_str(held.get('reason')) or ''}")
    failed = _mapping(r.get("supervision_failed"))
    if failed:
        lines.append(
            f"supervision failed {failed.get('failures')} times in state "
            f"{_str(failed.get('state')) or '?'}"
        )
    if r.get("cancel_reached") is True:
        lines.append("the cancel reached the job")
    return tuple(line[:_LINE_MAX] for line in lines[:EVIDENCE_LINES_MAX])


def point_of_evidence(e: PointEvidence) -> PointFacts:
    """A point's headline numbers as the validity gate saw them."""
    p = e.point
    if p is None:
        return PointFacts(concurrency=e.concurrency, valid=e.valid, problem=e.problem)
    return PointFacts(
        concurrency=e.concurrency,
        valid=e.valid,
        completed=p.completed,
        num_prompts=p.num_prompts,
        total_token_throughput=p.total_token_throughput,
        output_throughput=p.output_throughput,
        ttft_ms_median=p.ttft_ms.median,
        tpot_ms_median=p.tpot_ms.median,
        problem=e.problem,
    )


def points_of_table(table: Mapping[str, object] | None) -> tuple[PointFacts, ...]:
    """The points of an archived results table (``results.json``), by concurrency; a row
    without an integer concurrency is left out."""
    rows = _list((table or {}).get("points"))
    out: list[PointFacts] = []
    for raw in rows:
        row = _mapping(raw)
        conc = row.get("concurrency")
        if not isinstance(conc, int) or isinstance(conc, bool):
            continue
        out.append(
            PointFacts(
                concurrency=conc,
                valid=row.get("valid") is True,
                completed=_int(row.get("completed")),
                num_prompts=_int(row.get("num_prompts")),
                total_token_throughput=_num(row.get("total_token_throughput")),
                output_throughput=_num(row.get("output_throughput")),
                ttft_ms_median=_num(_mapping(row.get("ttft_ms")).get("median")),
                tpot_ms_median=_num(_mapping(row.get("tpot_ms")).get("median")),
                problem=_str(row.get("problem")),
            )
        )
    return tuple(sorted(out, key=lambda p: p.concurrency))


def best_point(points: Sequence[PointFacts]) -> PointFacts | None:
    """The valid point with the highest total token throughput (ties: lower concurrency)."""
    valid = [p for p in points if p.valid and p.total_token_throughput is not None]
    if not valid:
        return None
    return max(valid, key=lambda p: (p.total_token_throughput or 0.0, -p.concurrency))


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
