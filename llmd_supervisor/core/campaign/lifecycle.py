"""A campaign's life and what its jobs' runs mean for it (pure).

The campaign's states, the job state a run's state and verdict give
(`job_state_of`), the run id a job's n-th run gets (`campaign_run_id`, chosen and
journaled before the run exists: exactly once per point after a crash), whether an sbatch
refusal is the QOS saying "not now" (`qos_refusal`: back-pressure, never a failure),
the points' states for `campaign status` (`point_counts`) and the exit status of
`campaign wait` (`exit_status`).
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from llmd_supervisor.core.campaign.admission import JobState
from llmd_supervisor.core.run.lifecycle import RunState
from llmd_supervisor.core.verdict.decide import Outcome

__all__ = [
    "ACTIVE_JOB_STATES",
    "CampaignState",
    "JobView",
    "campaign_run_id",
    "exit_status",
    "job_state_of",
    "point_counts",
    "qos_refusal",
]


class CampaignState(enum.Enum):
    RUNNING = "running"  # submitting and supervising its jobs
    STOPPING = "stopping"  # too many canaries failed: nothing more is submitted
    CANCELLING = "cancelling"  # its runs are being cancelled
    FINISHED = "finished"  # every job ended (verified, reused, failed or blocked)
    STOPPED = "stopped"  # ended by the canary stop
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (CampaignState.FINISHED, CampaignState.STOPPED, CampaignState.CANCELLED)


ACTIVE_JOB_STATES: Final = frozenset({JobState.SUBMITTED, JobState.RUNNING})

# sbatch's refusals that mean "over a submit limit now" (slurm_errno.h's texts):
# QOSMaxSubmitJobPerUserLimit, AssocMaxSubmitJobLimit, QOSMaxSubmitJob...; back off and
# submit again later, at a lower cap.
_QOS_REFUSAL = re.compile(
    r"QOSMaxSubmitJob\w*|AssocMaxSubmitJob\w*|QOSGrpSubmitJob\w*|AssocGrpSubmitJob\w*|"
    r"Job violates accounting/QOS policy \(job submit limit"
)


def qos_refusal(reason: str) -> str | None:
    """The submit limit an sbatch refusal names, or None when it is another failure."""
    m = _QOS_REFUSAL.search(reason)
    return m.group(0) if m else None


def campaign_run_id(campaign_id: str, job_key: str, submission: int) -> str:
    """The run id of a job's `submission`-th run (12 hex digits, like any run id)."""
    text = f"llmd-campaign/{campaign_id}/{job_key}/{submission}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def job_state_of(state: RunState, outcome: Outcome | None, cause: str | None) -> JobState:
    """The job state its current run's state and verdict give."""
    if state in (RunState.ACCEPTED, RunState.SUBMITTING, RunState.PENDING):
        return JobState.SUBMITTED
    if not state.is_final:
        return JobState.RUNNING
    if outcome is Outcome.SUCCEEDED:
        return JobState.SUCCEEDED
    if outcome is Outcome.CANCELLED:
        return JobState.CANCELLED
    if cause == "workload":
        return JobState.FAILED_WORKLOAD
    if cause == "infrastructure" or outcome is Outcome.NODE_FAILED:
        return JobState.FAILED_INFRA
    return JobState.FAILED_OTHER


@dataclass(frozen=True)
class JobView:
    """What `point_counts` needs of a job."""

    state: JobState
    concurrencies: tuple[int, ...]  # every point
    to_run: tuple[int, ...]  # the points its run runs; the others were verified before


# A point's state in `campaign status`, from its job's.
_POINT_STATE: Final[Mapping[JobState, str]] = {
    JobState.WAITING: "queued",
    JobState.SUBMITTED: "queued",
    JobState.RUNNING: "running",
    JobState.SUCCEEDED: "verified",
    JobState.REUSED: "reused",
    JobState.BLOCKED: "blocked",
    JobState.CANCELLED: "cancelled",
    JobState.FAILED_WORKLOAD: "failed: workload",
    JobState.FAILED_INFRA: "failed: infrastructure",
    JobState.FAILED_OTHER: "failed: other",
}
POINT_STATES: Final = tuple(dict.fromkeys(_POINT_STATE.values()))


def point_state(job: JobState, concurrency: int, to_run: Iterable[int]) -> str:
    """A point's state: `reused` when it was verified before its job ran."""
    return _POINT_STATE[job] if concurrency in to_run else "reused"


def point_counts(jobs: Iterable[JobView]) -> dict[str, int]:
    """How many points are in each state (every state listed, zeros included)."""
    counts: Counter[str] = Counter({s: 0 for s in POINT_STATES})
    for j in jobs:
        for c in j.concurrencies:
            counts[point_state(j.state, c, j.to_run)] += 1
    return dict(counts)


def exit_status(state: CampaignState, counts: Mapping[str, int]) -> int:
    """`campaign wait`'s exit status: 0 every point verified or reused, 11 cancelled, 10
    any point failed, blocked or never run (a stopped campaign too)."""
    if state is CampaignState.CANCELLED:
        return 11
    settled = counts.get("verified", 0) + counts.get("reused", 0)
    return 0 if settled == sum(counts.values()) else 10
