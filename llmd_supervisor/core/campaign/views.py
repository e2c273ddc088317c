"""What the campaign ops answer on the control socket: their typed results and stream items.

The daemon's `supervision.campaign` builds these and the CLI reads them, both with these
types, as the run ops' answers are `core.protocol.runs`'s (and read with its `read`, which
checks a decoded value against one of them and drops the keys it does not know). They are
plain JSON objects on the wire, in control protocol version 1: a change here is a
protocol change (adding an optional field is not).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypedDict

from llmd_supervisor.core.protocol.runs import RunResults

__all__ = [
    "CampaignBrief",
    "CampaignDryRun",
    "CampaignJobResults",
    "CampaignList",
    "CampaignPoint",
    "CampaignProblem",
    "CampaignResultsDone",
    "CampaignStatus",
    "DryRunJob",
    "MatrixValues",
    "ReuseNote",
]

# A job's matrix values: each key of the campaign's [matrix] (a spec field such as
# "topology.prefill_nodes", or "env.NAME" of a script campaign) to the TOML value the file
# gave it (a string, number, boolean, array or table: any of them, as the spec field takes).
MatrixValues = Mapping[str, object]


class CampaignBrief(TypedDict):
    """One campaign as ``campaign_list`` shows it."""

    campaign: str  # the campaign id
    name: str
    state: str  # a CampaignState value
    cluster: str
    owner_uid: int
    created_at: str  # ISO 8601, UTC, to the second
    jobs: int
    points: int
    settled: int  # points verified or reused


class CampaignList(TypedDict):
    """``campaign_list``: the campaigns the peer may see, oldest first (the last 500)."""

    campaigns: list[CampaignBrief]


class CampaignProblem(TypedDict):
    """A failed or blocked job of a campaign."""

    job: str  # the job key (the first 12 hex digits of its recipe id)
    topology: str
    values: MatrixValues
    state: str  # a JobState value
    reason: str
    run: str | None  # its current run (null: it never had one)


class CampaignStatus(TypedDict):
    """``campaign_status`` and ``campaign_cancel``, ``campaign_submit`` (not a dry run),
    and each stream item and the final result of ``campaign_wait``."""

    campaign: str
    name: str
    state: str  # a CampaignState value
    reason: str
    cluster: str
    owner_uid: int
    created_at: str  # ISO 8601, UTC, to the second
    updated_at: str
    points: dict[str, int]  # point state -> how many (every state, zeros included)
    points_total: int
    jobs: dict[str, int]  # job state -> how many (the states some job is in)
    jobs_total: int
    gpu_hours_useful: float  # of the succeeded jobs' last attempts
    gpu_hours_lost: float  # everything else the campaign's runs held
    eta_s: float | None  # median run time x rounds of jobs left (null: unknown or final)
    qos: str | None  # the QOS refusal the campaign is backing off from
    problems: list[CampaignProblem]  # the first 50
    problems_total: int
    exit_status: int | None  # `campaign wait`'s exit status once final (null before)


class ReuseNote(TypedDict):
    """Whether one point of a dry run's job is reused, and why (`core.campaign.reuse`)."""

    concurrency: int
    run: str | None  # the run whose proof is reused (null: the point runs)
    why: str


class DryRunJob(TypedDict):
    """One job of a dry run's expansion."""

    job: str
    recipe_id: str
    topology: str
    values: MatrixValues
    concurrencies: list[int]  # every point of the job
    reused: list[int]  # its points verified before (not run again)
    reuse: list[ReuseNote]  # each point: reused or not, and why
    env: dict[str, str] | None  # a script campaign's variables for it (null: a spec's)


class CampaignDryRun(TypedDict):
    """``campaign_submit`` with ``dry_run``: the expansion; nothing was submitted."""

    dry_run: Literal[True]
    name: str
    script: str | None  # a script campaign's batch script (null: over a base spec)
    concurrency_env: str | None  # the variable a script's job gets its concurrencies in
    export_env: bool  # the runs get the client's environment (--export-env)
    jobs_without_time_limit: int  # counted as 0 hours in the upper bounds
    points: int
    jobs: int
    jobs_to_run: int  # jobs with a point not verified before
    reused_points: int
    duplicates_merged: int
    topologies: int
    gpu_hours_upper_bound: float  # every job holding its GPUs for its whole time limit
    node_hours_upper_bound: float
    job_list: list[DryRunJob]  # the first 200 jobs


class CampaignPoint(TypedDict):
    """One point of a job, with its provenance."""

    concurrency: int
    state: str  # a point state: verified, reused, running, queued, blocked, failed: ...
    run: str | None  # the run that proved it, else the job's current run
    reused_from: str | None  # a reused point: the campaign whose run proved it
    reason: str  # why it is not verified ("" when it is)


class CampaignJobResults(TypedDict):
    """A ``campaign_results`` stream item: one job's points, and the ``results`` of the
    runs that proved them (so that no reply holds a whole campaign)."""

    campaign: str
    job: str
    recipe_id: str
    topology: str
    values: MatrixValues
    state: str  # a JobState value
    points: list[CampaignPoint]
    runs: list[RunResults]


class CampaignResultsDone(TypedDict):
    """The final result of ``campaign_results``: how many points were streamed."""

    campaign: str
    name: str
    state: str
    points: int
