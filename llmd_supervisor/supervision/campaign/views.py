"""What `campaign status`, `list`, `results` and a dry run show (from the journal and the
runs' facts, `supervision.control.service.RunFacts`; no I/O but the runs' archived results
tables)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from statistics import median
from typing import Final

from llmd_supervisor.adapters.journal.campaign_store import StoredCampaign, StoredJob, VerifiedPoint
from llmd_supervisor.core.campaign.admission import JobState
from llmd_supervisor.core.campaign.expand import CampaignJob
from llmd_supervisor.core.campaign.lifecycle import (
    ACTIVE_JOB_STATES,
    CampaignState,
    JobView,
    exit_status,
    point_counts,
    point_state,
)
from llmd_supervisor.core.campaign.views import (
    CampaignBrief,
    CampaignDryRun,
    CampaignJobResults,
    CampaignPoint,
    CampaignProblem,
    CampaignStatus,
    MatrixValues,
)
from llmd_supervisor.core.protocol.runs import RunResults
from llmd_supervisor.supervision.campaign.points import proof_of
from llmd_supervisor.supervision.campaign.runner import Plan
from llmd_supervisor.supervision.control.service import RunFacts

__all__ = ["brief", "dry_run", "job_results", "status"]

PROBLEMS_SHOWN: Final = 50  # failed and blocked jobs `status` lists


def _job_view(j: StoredJob) -> JobView:
    return JobView(JobState(j.state), j.concurrencies, j.to_run)


def _values(j: StoredJob) -> MatrixValues:
    return dict(j.matrix_values)


def brief(c: StoredCampaign, jobs: Sequence[StoredJob]) -> CampaignBrief:
    """One line of `campaign list`."""
    counts = point_counts(_job_view(j) for j in jobs)
    return {
        "campaign": c.campaign_id,
        "name": c.name,
        "state": c.state,
        "cluster": c.cluster,
        "owner_uid": c.owner_uid,
        "created_at": c.created_at.isoformat(timespec="seconds"),
        "jobs": len(jobs),
        "points": sum(counts.values()),
        "settled": counts["verified"] + counts["reused"],
    }


def status(
    c: StoredCampaign,
    jobs: Sequence[StoredJob],
    runs: Mapping[str, RunFacts],
    *,
    max_jobs: int,
    qos: str,
    now: datetime,
) -> CampaignStatus:
    """`campaign status`: counts per state, GPU-hours useful and lost, an ETA."""
    counts = point_counts(_job_view(j) for j in jobs)
    job_counts = Counter(j.state for j in jobs)
    useful = lost = 0.0
    durations = []
    for j in jobs:
        f = runs.get(j.run_id or "")
        if f is None:
            continue
        usage = f.usage
        if JobState(j.state) is JobState.SUCCEEDED:
            useful += usage["gpu_hours_useful"]
            lost += usage["gpu_hours_lost"]
        else:
            lost += usage["gpu_hours_useful"] + usage["gpu_hours_lost"]
        took = f.ran_s
        if took is not None:
            durations.append(took)
    left = sum(1 for j in jobs if JobState(j.state) in (JobState.WAITING, *ACTIVE_JOB_STATES))
    state = CampaignState(c.state)
    eta = None
    if durations and left and not state.is_final:
        eta = round(median(durations) * -(-left // max(1, max_jobs)), 1)
    problems: list[CampaignProblem] = [
        {
            "job": j.job_key,
            "topology": j.topology,
            "values": _values(j),
            "state": j.state,
            "reason": j.reason,
            "run": j.run_id,
        }
        for j in jobs
        if JobState(j.state)
        in (
            JobState.BLOCKED,
            JobState.FAILED_WORKLOAD,
            JobState.FAILED_INFRA,
            JobState.FAILED_OTHER,
        )
    ]
    return {
        "campaign": c.campaign_id,
        "name": c.name,
        "state": c.state,
        "reason": c.reason,
        "cluster": c.cluster,
        "owner_uid": c.owner_uid,
        "created_at": c.created_at.isoformat(timespec="seconds"),
        "updated_at": c.updated_at.isoformat(timespec="seconds"),
        "points": counts,
        "points_total": sum(counts.values()),
        "jobs": dict(sorted(job_counts.items())),
        "jobs_total": len(jobs),
        "gpu_hours_useful": round(useful, 6),
        "gpu_hours_lost": round(lost, 6),
        "eta_s": eta,
        "qos": qos or None,
        "problems": problems[:PROBLEMS_SHOWN],
        "problems_total": len(problems),
        "exit_status": exit_status(state, counts) if state.is_final else None,
    }


def _job_env(job: CampaignJob, to_run: Sequence[int]) -> dict[str, str] | None:
    """The variables a script campaign's job gets from the campaign (None: a spec's)."""
    if job.script_job is None:
        return None
    return job.script_job.env_of(to_run or job.concurrencies)


def dry_run(plan: Plan) -> CampaignDryRun:
    """What `campaign submit --dry-run` prints: the expansion before anything is submitted
    (a script campaign's jobs with the variables each gets: `env`)."""
    e = plan.expansion
    points = sum(len(j.concurrencies) for j in e.jobs)
    reused = sum(1 for j in e.jobs for c in j.concurrencies if (j.recipe_id, c) in plan.reused)
    launcher = plan.file.launcher
    return {
        "dry_run": True,
        "name": plan.file.name,
        "script": plan.file.script,
        "concurrency_env": launcher.concurrency_env if launcher else None,
        "export_env": plan.export_env is not None,
        "jobs_without_time_limit": sum(1 for j in e.jobs if j.time_limit_s <= 0),
        "points": points,
        "jobs": len(e.jobs),
        "jobs_to_run": sum(
            1 for j in e.jobs if any((j.recipe_id, c) not in plan.reused for c in j.concurrencies)
        ),
        "reused_points": reused,
        "duplicates_merged": e.merged_points,
        "topologies": len({j.topology for j in e.jobs}),
        "gpu_hours_upper_bound": round(e.gpu_hours_upper_bound, 3),
        "node_hours_upper_bound": round(e.node_hours_upper_bound, 3),
        "job_list": [
            {
                "job": j.key,
                "recipe_id": j.recipe_id,
                "topology": j.topology,
                "values": dict(j.values),
                "concurrencies": list(j.concurrencies),
                "reused": [c for c in j.concurrencies if (j.recipe_id, c) in plan.reused],
                "reuse": [
                    {
                        "concurrency": c,
                        "run": note.run_id if (note := plan.notes.get((j.recipe_id, c))) else None,
                        "why": note.why if note else "run again (--rerun)",
                    }
                    for c in j.concurrencies
                ],
                "env": _job_env(
                    j, [c for c in j.concurrencies if (j.recipe_id, c) not in plan.reused]
                ),
            }
            for j in e.jobs[:200]
        ],
    }


def job_results(
    c: StoredCampaign,
    j: StoredJob,
    proofs: Mapping[tuple[str, int], Sequence[VerifiedPoint]],
    results_of: Mapping[str, RunResults],
    owners: Mapping[str, int],
) -> CampaignJobResults:
    """One job's points with provenance, and the results of the runs that proved them
    (`results_of`: run id to that run's `results` reply; `owners`: run id to its owner,
    for `proof_of`)."""
    rows: list[CampaignPoint] = []
    runs: dict[str, RunResults] = {}
    for conc in j.concurrencies:
        state = point_state(JobState(j.state), conc, j.to_run)
        ran = conc in j.to_run
        proof = proof_of(
            proofs,
            j.recipe_id,
            conc,
            ran=ran,
            run_id=j.run_id,
            owner_uid=c.owner_uid,
            owners=owners,
        )
        run_id = proof.run_id if proof is not None else j.run_id
        rows.append(
            {
                "concurrency": conc,
                "state": state,
                "run": run_id,
                "reused_from": proof.campaign_id if state == "reused" and proof else None,
                "reason": "" if state in ("verified", "reused") else j.reason,
            }
        )
        shown = proof.run_id if proof is not None else (j.run_id if state == "verified" else None)
        if shown is not None and shown in results_of:
            runs[shown] = results_of[shown]
    return {
        "campaign": c.campaign_id,
        "job": j.job_key,
        "recipe_id": j.recipe_id,
        "topology": j.topology,
        "values": _values(j),
        "state": j.state,
        "points": rows,
        "runs": list(runs.values()),
    }
