"""Whether a campaign may reuse a verified point (pure; DESIGN.md section 12, issue 4.1).

A point proven by an earlier run is reused only when both hold:

* **visible**: the campaign's submitter may see the run that proved it (its own runs;
  root and the daemon's ``admin_group`` see every run), the control socket's rule. A
  point proven by a run the submitter may not see runs again: its results would show a
  run its `status` cannot;
* **passes this gate**: the archived result file, parsed again from its bytes (whose
  sha256 still matches the ledger), passes *this* campaign's validity gate for that
  point: a point verified under someone's ``min_completed_fraction = 0.01`` is not
  reused by a campaign that asks 0.95.

`reuse_verdict` answers with the reason, either way, for the dry run to show.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd_supervisor.core.campaign.script import is_script_job
from llmd_supervisor.core.results.evidence import (
    FORMATS,
    Point,
    ResultFormat,
    ResultProblem,
    Validity,
    gate,
    judge_alone,
)
from llmd_supervisor.core.spec.runspec import load_spec

__all__ = ["Candidate", "PointGate", "Reuse", "gate_of_job", "reuse_verdict"]


@dataclass(frozen=True)
class PointGate:
    """A campaign job's validity gate for its points: `requested` maps a concurrency to the
    prompts the job sends there (None: a script job's, whose files say it themselves)."""

    validity: Validity
    requested: dict[int, int] | None
    formats: tuple[ResultFormat, ...]


def gate_of_job(text: str) -> PointGate:
    """The gate of a campaign job from its journaled text (`core.campaign.expand.job_text`): a
    spec job's ``[benchmark]`` and ``[benchmark.validity]``; a script job's files are
    judged alone against the default gate, as its runs are (`judge_alone`)."""
    if is_script_job(text):
        return PointGate(Validity(), None, FORMATS)
    bench = load_spec(text).benchmark
    return PointGate(bench.validity, bench.expected_prompts(), (bench.result_format,))


@dataclass(frozen=True)
class Candidate:
    """The ledger's proof of a point, with what the daemon found out about it."""

    run_id: str
    campaign_id: str | None  # the campaign whose run proved it
    run_owner: int | None  # the proving run's owner (None: the daemon knows no such run)
    intact: bool  # its archived result file still has the ledger's sha256
    parsed: Point | ResultProblem | None  # that file, parsed again (None: not read)


@dataclass(frozen=True)
class Reuse:
    """One point's answer: reused (`run_id` set) or run again, and why."""

    run_id: str | None
    why: str


def reuse_verdict(
    concurrency: int,
    candidate: Candidate | None,
    *,
    viewer_uid: int,
    sees_all: bool,
    point_gate: PointGate,
) -> Reuse:
    """Whether the campaign of `viewer_uid` (`sees_all`: root or the admin group) reuses
    `candidate`'s proof of its point at `concurrency`; see the module docstring."""
    if candidate is None:
        return Reuse(None, "no run has verified it yet")
    run = candidate.run_id
    if candidate.run_owner is None:
        return Reuse(None, f"run {run} that verified it is no longer known to this daemon")
    if not sees_all and candidate.run_owner != viewer_uid:
        return Reuse(
            None,
            f"run {run} that verified it is not visible to you (another user's run; a"
            " team shares verified points through the daemon's admin_group)",
        )
    if not candidate.intact or candidate.parsed is None:
        return Reuse(None, f"run {run}'s archived result no longer matches its sha256")
    problem = _problem(concurrency, candidate.parsed, point_gate)
    if problem is not None:
        return Reuse(None, f"run {run}'s archived result fails this campaign's gate: {problem}")
    where = f" (campaign {candidate.campaign_id})" if candidate.campaign_id else ""
    return Reuse(run, f"verified by run {run}{where}; its result passes this campaign's gate")


def _problem(concurrency: int, parsed: Point | ResultProblem, point_gate: PointGate) -> str | None:
    """Why `parsed` is not a valid point at `concurrency` under `point_gate` (None: it is)."""
    if point_gate.requested is None:
        if isinstance(parsed, ResultProblem):
            return f"unparsable result ({parsed})"
        if parsed.concurrency != concurrency:
            return f"result for the wrong concurrency (max_concurrency {parsed.concurrency})"
        return judge_alone(parsed, point_gate.validity)
    requested = point_gate.requested.get(concurrency)
    if requested is None:
        return f"the job sends no requests at concurrency {concurrency}"
    judged = gate({concurrency: parsed}, {concurrency: requested}, point_gate.validity, {})
    return judged.points[0].problem if judged.points else judged.reason
