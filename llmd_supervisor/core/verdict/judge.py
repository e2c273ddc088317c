"""One judgement of an attempt from all of its evidence (pure; DESIGN.md section 5).

The caller gathers the :class:`Evidence` (I/O: Slurm's records, the marker, the
benchmark's gate, the ranks' status files, the nodes reported unreachable or named failed
by Slurm, the attempt's allocation and a hang the watchers journaled) and asks
:func:`judge` once. The judgement composes the pure decisions: the verdict
(`core.verdict.decide`: Slurm and the marker, then the benchmark's gate), a hang that
ended the attempt early, the cause (`core.verdict.cause`) and the retry policy's decision
(`core.run.retry_policy`; whether a retry can be placed is the caller's, it needs the
cluster's nodes). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Final

from llmd_supervisor.core.results.evidence import GateResult
from llmd_supervisor.core.run.retry_policy import Decision, RetryPolicy
from llmd_supervisor.core.run.retry_policy import decide as retry_decision
from llmd_supervisor.core.verdict.cause import Diagnosis, RankEnd, diagnose, hang
from llmd_supervisor.core.verdict.decide import (
    Outcome,
    Verdict,
    VerdictReceipt,
    VerdictState,
    build_receipt,
    decide,
    with_benchmark,
)
from llmd_supervisor.core.verdict.marker import MarkerReading
from llmd_supervisor.errors import RemoteError
from llmd_supervisor.node.common import RC_CONFIG

__all__ = [
    "Evidence",
    "Hang",
    "Judgement",
    "NodeReport",
    "Reach",
    "judge",
    "node_report",
]

CONNECTING: Final = "connecting"  # the action of a link's `RemoteError` when SSH failed
NO_RETRY: Final = RetryPolicy(infrastructure=0)


class Reach(StrEnum):
    """Why a node of the allocation is believed unreachable."""

    NO_SSH = "no_ssh"  # it did not take an SSH connection: the daemon's own evidence
    SLURM_FAILED = "slurm_failed"  # Slurm names it failed, down or not responding: likewise
    # A read of the job's files that failed or hung, or a status file gone stale: the
    # job can cause these, so they are inferred, never observed.
    SILENT = "silent"

    @property
    def observed(self) -> bool:
        """Whether the daemon saw the node fail itself (not inferred from the job's files)."""
        return self is not Reach.SILENT


@dataclass(frozen=True)
class NodeReport:
    """A node reported unreachable during the attempt, and why."""

    node: str
    reach: Reach
    error: str = ""


def node_report(node: object, error: object) -> NodeReport:
    """A `node.unreachable` report as journaled (node, error text) made typed.

    The journal stores only the error's words, so this is where they are classified, once:
    the link's `RemoteError` while connecting (worded by the daemon, for this node) is
    ``NO_SSH``; anything else (a read that failed or hung, a stale status file) is
    ``SILENT``."""
    name = str(node)
    prefix = str(RemoteError(name, CONNECTING, "")).removesuffix(": .")
    text = error if isinstance(error, str) else ""
    no_ssh = isinstance(error, str) and error.startswith(f"{prefix}: ")
    return NodeReport(name, Reach.NO_SSH if no_ssh else Reach.SILENT, text)


@dataclass(frozen=True)
class Hang:
    """A rank's agent still in a stage past its deadline (the `stage.overdue` event the
    attempt's watchers journaled); `journaled` is the event as stored, which the receipt
    holds as it is."""

    node: str | None
    rank: int | None
    stage: str | None
    deadline_s: float | None
    over_s: float | None
    journaled: Mapping[str, object] = field(default_factory=dict)

    def describe(self) -> str:
        """``rank 1 on node2 hung in stage 'engines-healthy', 75.0 s past its 600 s
        deadline``."""
        return (
            f"rank {self.rank} on {self.node} hung in stage {self.stage!r}, "
            f"{self.over_s} s past its {self.deadline_s} s deadline"
        )


@dataclass(frozen=True)
class Evidence:
    """Everything an attempt's judgement is made from.

    `state` and `marker` are what the verdict's last round saw, `deadline` when the
    evidence stopped being waited for; `gate` the benchmark's validity gate (None: no
    results were looked for). `cancel_reached`: the supervisor's cancel reached the job
    before it ended; `cancel_requested`: a cancel was asked for at all. `allocation` is the
    attempt's nodes by rank (from Slurm); `ranks` the ranks' last status files; `nodes`
    those reported unreachable or named failed by Slurm. `policy` and `retries_done` are
    the run's retry policy and how many retries it has had."""

    state: VerdictState
    marker: MarkerReading
    deadline: datetime
    gate: GateResult | None = None
    cancel_reached: bool = False
    cancel_requested: bool = False
    hang: Hang | None = None
    allocation: tuple[str, ...] = ()
    ranks: tuple[RankEnd, ...] = ()
    nodes: tuple[NodeReport, ...] = ()
    policy: RetryPolicy = NO_RETRY
    retries_done: int = 0


@dataclass(frozen=True)
class Judgement:
    """What an attempt's evidence proves.

    `verdict` is the job's (Slurm, the marker, the benchmark); `outcome` and `reason` the
    run's (a hang makes a non-success FAILED; the reason adds the hang, the cause and a
    cancel that did not reach the job); `diagnosis` why it did not succeed (None: it
    did); `receipt` the verdict's receipt; `retry` the policy's decision before
    placement; `hang` the hang that ended the attempt, when it counts."""

    verdict: Verdict
    outcome: Outcome
    reason: str
    diagnosis: Diagnosis | None
    receipt: VerdictReceipt
    retry: Decision
    hang: Hang | None


def judge(evidence: Evidence, now: datetime) -> Judgement:
    """Judge an attempt from its evidence, as of `now` (the verdict's decision time).

    The verdict is final once `now` is at the deadline or the evidence settles it; asked
    earlier with unsettled evidence it is PENDING_EVIDENCE (the caller's loop asks again).
    An agent's hang that ended the attempt early makes any outcome but a success or a
    cancel that reached the job FAILED, its cause the hang's (`core.verdict.cause.hang`).
    """
    e = evidence
    accounting_off = e.state.accounting_disabled_seen
    verdict = decide(
        e.state,
        e.marker,
        cancel_requested=e.cancel_reached,
        accounting_disabled=accounting_off,
        now=now,
        deadline=e.deadline,
    )
    if verdict.final:
        verdict = with_benchmark(verdict, e.gate)
    receipt = build_receipt(
        e.state,
        e.marker,
        verdict,
        decided_at=now,
        cancel_requested=e.cancel_reached,
        accounting_disabled=accounting_off,
        benchmark=e.gate,
    )
    outcome, reason = verdict.outcome, verdict.reason
    hung = e.hang
    diagnosis: Diagnosis | None
    if hung is not None and outcome is not Outcome.SUCCEEDED and not e.cancel_reached:
        # ended by the supervisor because an agent hung: a failure, not a cancel
        outcome = Outcome.FAILED
        reason = f"{hung.describe()}: the attempt was ended early; {reason}"
        rank = -1 if hung.rank is None else hung.rank
        diagnosis = hang(str(hung.stage), rank, e.allocation)
    else:
        hung = None
        diagnosis = _diagnosis(e, verdict)
    if diagnosis is not None:
        reason = f"{reason}; {diagnosis.text}"
    if e.cancel_requested and not e.cancel_reached:
        reason = f"{reason}; the cancel did not reach the job before it ended"
    retry = retry_decision(
        e.policy, diagnosis, retries_done=e.retries_done, cancel_requested=e.cancel_requested
    )
    return Judgement(verdict, outcome, reason, diagnosis, receipt, retry, hung)


def _diagnosis(e: Evidence, verdict: Verdict) -> Diagnosis | None:
    """Why the run did not succeed: the believed Slurm state, the ranks' ends, the nodes
    reported unreachable (those the daemon saw fail itself are observed), the gate and
    the marker's rc."""
    belief = verdict.belief
    marker = e.marker.marker
    return diagnose(
        verdict.outcome,
        slurm_state=None if belief is None else belief.record.state.state,
        cancel_requested=e.cancel_reached,
        allocation=e.allocation,
        ranks=e.ranks,
        unreachable=[r.node for r in e.nodes],
        observed=[r.node for r in e.nodes if r.reach.observed],
        benchmark_failed=(e.gate is not None and e.gate.ok is False)
        or (marker is not None and 0 < marker.rc < RC_CONFIG),
    )
