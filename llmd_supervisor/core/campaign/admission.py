"""Which jobs of a campaign to submit next (pure: data in, a decision out; DESIGN.md §12).

The daemon calls :func:`admit` whenever something changed (a job was submitted, started,
finished, a QOS refusal came back) with every job's current :class:`JobState`, and
submits the jobs :attr:`Admission.submit` names, in that order. Nothing here remembers
anything between calls: the answer follows from the states alone, so a restarted daemon
that reloads the states from its journal decides the same.

The rules, in the order they apply:

* **Canary first.** Jobs are grouped by topology (:func:`topology_key`). Each topology's
  canary is its cheapest job: the smallest workload (input + output length), then the
  smallest largest concurrency, then the key. Until the canary SUCCEEDED (or was REUSED:
  its points were verified before) only the canary of that topology may be submitted.
  A canary that FAILED_WORKLOAD blocks every other WAITING job of its topology, naming
  the canary and its reason. A canary that FAILED_INFRA, FAILED_OTHER (its retries were
  spent inside the run) or was CANCELLED hands the part to the topology's next job.
* **Stop.** When more than ``canary_stop_fraction`` of the topologies whose canary
  finished (succeeded or failed with cause workload) failed with cause workload, and at
  least 2 canaries finished (or all of them did), the campaign submits nothing more.
* **Caps.** SUBMITTED + RUNNING jobs count against ``max_jobs`` and the live QOS cap
  (the lower of the two), SUBMITTED ones against ``max_pending``, and the nodes and
  counted GPUs of SUBMITTED + RUNNING jobs against ``max_nodes`` and ``max_gpus``. A
  job that alone needs more nodes or GPUs than the cap is blocked (it could never run).
  Before ``backoff_until`` (a QOS refusal of a submit) nothing is submitted.
* **Fair order.** Topologies take turns, one job per turn: the next turn goes to the
  topology with the fewest jobs started so far (submitted, running or finished), ties
  to the topology whose first job comes first. With equal histories that is plain
  round-robin in the order of each topology's first job; it also stays fair across
  calls, which a round-robin restarting at the first topology every call would not.
  Within a topology the order is strict (the canary order above): when its next job
  does not fit the node or GPU cap, that topology waits and the turn passes on; smaller
  jobs of the same topology do not overtake it.

A cancelled campaign is the caller's business: it stops calling :func:`admit`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from llmd_supervisor.core.spec.recipe_table import RoleParallelism
from llmd_supervisor.core.spec.runspec import RunSpec

__all__ = [
    "Admission",
    "AdmissionJob",
    "CampaignLimits",
    "JobState",
    "UserWork",
    "admit",
    "canary_order",
    "share_room",
    "topology_key",
]


class JobState(enum.StrEnum):
    """Where one campaign job stands, as the daemon last saw it."""

    WAITING = "waiting"  # not submitted yet
    SUBMITTED = "submitted"  # submitted, pending in Slurm
    RUNNING = "running"  # Slurm runs it
    SUCCEEDED = "succeeded"  # its run succeeded
    FAILED_WORKLOAD = "failed_workload"  # its run failed with cause workload
    FAILED_INFRA = "failed_infra"  # infrastructure failure, retries spent inside the run
    FAILED_OTHER = "failed_other"  # any other failure (unknown cause, lost job)
    BLOCKED = "blocked"  # never to be submitted (its topology's canary failed, too big)
    CANCELLED = "cancelled"  # cancelled by the user
    REUSED = "reused"  # every point was verified before: nothing to run


ACTIVE: Final = frozenset({JobState.SUBMITTED, JobState.RUNNING})
_PASSED: Final = frozenset({JobState.SUCCEEDED, JobState.REUSED})
# A canary in one of these says nothing about the workload: the next job takes its part.
# (A BLOCKED job never ran: blocked as too big, or after a failed canary it follows.)
_NOT_A_VERDICT: Final = frozenset(
    {JobState.FAILED_INFRA, JobState.FAILED_OTHER, JobState.CANCELLED, JobState.BLOCKED}
)
_STARTED: Final = frozenset(JobState) - {JobState.WAITING, JobState.BLOCKED, JobState.REUSED}

MAX_JOBS: Final = 1000


@dataclass(frozen=True)
class CampaignLimits:
    """A campaign's ``[limits]``: how much of the cluster it may hold at once.

    `max_pending` None means `max_jobs`; `max_nodes` and `max_gpus` None mean no cap.
    """

    max_jobs: int = 4
    max_pending: int | None = None
    max_nodes: int | None = None
    max_gpus: int | None = None
    canary_stop_fraction: float = 0.5

    @property
    def pending_cap(self) -> int:
        return self.max_jobs if self.max_pending is None else self.max_pending


class AdmissionJob(Protocol):
    """What admission needs of a job (``core.campaign.expand.CampaignJob`` has it)."""

    @property
    def key(self) -> str: ...
    @property
    def topology(self) -> str: ...
    @property
    def nodes(self) -> int: ...
    @property
    def gpus(self) -> int: ...
    @property
    def workload(self) -> int: ...
    @property
    def concurrencies(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Admission:
    """One decision: submit these jobs now, in this order; block those for good.

    `block` maps the key of a WAITING job that will never be submitted to why (the
    caller records it as BLOCKED). `stop` says why the campaign submits nothing more
    (None: it goes on). `done`: no job is waiting to be submitted, pending or running,
    so the campaign is finished (blocked and stopped jobs are final).
    """

    submit: tuple[str, ...]
    block: Mapping[str, str]
    stop: str | None
    done: bool


def _role(name: str, role: RoleParallelism) -> str:
    parts = [f"tp{role.tp}"] if role.tp is not None else []
    if role.pp != 1:
        parts.append(f"pp{role.pp}")
    if role.ep != 1:
        parts.append(f"ep{role.ep}")
    if role.dp_attention:
        parts.append("dpa")
    return f"{name}:{''.join(parts)}" if parts else ""


def topology_key(spec: RunSpec) -> str:
    """A short readable name of what a spec's run occupies and how it splits the work.

    ``"2P+2D/2x1w/8gpn"``: prefill + decode nodes, prefill x decode workers, counted GPUs
    per node; then the declared parallelism of ``[recipe]`` when there is any, e.g.
    ``"1P+2D/1x1w/4gpn/P:tp4,D:tp8ep8dpa"``. Runs of one topology share a canary.
    """
    t = spec.topology
    key = (
        f"{t.prefill_nodes}P+{t.decode_nodes}D/{t.prefill_workers}x{t.decode_workers}w"
        f"/{t.counted_gpus_per_node}gpn"
    )
    roles = [r for r in (_role("P", spec.recipe.prefill), _role("D", spec.recipe.decode)) if r]
    return key + ("/" + ",".join(roles) if roles else "")


def canary_order(job: AdmissionJob) -> tuple[int, int, str]:
    """A topology's jobs in this order: the first one that can still say something about
    the workload is its canary."""
    return (job.workload, max(job.concurrencies, default=0), job.key)


def _by_topology(jobs: Sequence[AdmissionJob]) -> dict[str, list[AdmissionJob]]:
    """Jobs per topology, topologies in the order of their first job, jobs in canary order."""
    groups: dict[str, list[AdmissionJob]] = {}
    for job in jobs:
        groups.setdefault(job.topology, []).append(job)
    return {topo: sorted(group, key=canary_order) for topo, group in groups.items()}


def _canary(group: Sequence[AdmissionJob], states: Mapping[str, JobState]) -> AdmissionJob | None:
    for job in group:
        if states[job.key] not in _NOT_A_VERDICT:
            return job
    return None


def admit(
    jobs: Sequence[AdmissionJob],
    states: Mapping[str, JobState],
    limits: CampaignLimits,
    *,
    qos_cap: int | None = None,
    backoff_until: float | None = None,
    now: float = 0.0,
    failures: Mapping[str, str] | None = None,
    gpu_cap: int | None = None,
    per_user_max_gpus: int | None = None,
) -> Admission:
    """What to submit next; see the module docstring for the rules.

    `gpu_cap` is the GPUs this campaign may hold now beside its owner's other campaigns
    (the daemon's ``[limits] per_user_max_gpus`` less theirs; None: no cap); a job that
    alone needs more than `per_user_max_gpus` is blocked.

    `states` has every job's state (a job missing from it is WAITING). `qos_cap` is the
    number of jobs the cluster lets this campaign have submitted now (None: unknown; the
    caller subtracts the user's other jobs if the QOS counts them). `failures` maps a
    failed job's key to its reason, quoted when its failure blocks other jobs.
    """
    failures = failures or {}
    state = {job.key: states.get(job.key, JobState.WAITING) for job in jobs}
    groups = _by_topology(jobs)
    block: dict[str, str] = {}
    eligible: dict[str, list[AdmissionJob]] = {}
    finished: list[str] = []
    failed: list[str] = []
    for job in jobs:  # jobs no cap could ever hold
        too_big = _too_big(job, limits)
        if too_big is None and per_user_max_gpus is not None and job.gpus > per_user_max_gpus:
            too_big = (
                f"it needs {job.gpus} GPUs, more than the daemon's"
                f" limits.per_user_max_gpus = {per_user_max_gpus}"
            )
        if state[job.key] is JobState.WAITING and too_big is not None:
            block[job.key] = too_big
    for topo, group in groups.items():
        waiting = [j for j in group if state[j.key] is JobState.WAITING and j.key not in block]
        canary = _canary([j for j in group if j.key not in block], state)
        if canary is None:
            continue
        verdict = state[canary.key]
        if verdict in _PASSED:
            finished.append(topo)
            eligible[topo] = waiting
        elif verdict is JobState.FAILED_WORKLOAD:
            finished.append(topo)
            failed.append(topo)
            why = failures.get(canary.key, "cause workload")
            for job in waiting:
                block[job.key] = f"canary {canary.key} of topology {topo} failed: {why}"
        elif verdict is JobState.WAITING:
            eligible[topo] = [canary]

    stop = _stop(finished, failed, len(groups), limits.canary_stop_fraction)
    still_waiting = any(s is JobState.WAITING and k not in block for k, s in state.items())
    done = not any(s in ACTIVE for s in state.values()) and (stop is not None or not still_waiting)
    if stop is not None or (backoff_until is not None and now < backoff_until):
        return Admission((), block, stop, done)
    chosen = _fill(jobs, state, groups, eligible, limits, qos_cap, gpu_cap)
    return Admission(chosen, block, None, done)


def _too_big(job: AdmissionJob, limits: CampaignLimits) -> str | None:
    if limits.max_nodes is not None and job.nodes > limits.max_nodes:
        return f"it needs {job.nodes} nodes, more than limits.max_nodes = {limits.max_nodes}"
    if limits.max_gpus is not None and job.gpus > limits.max_gpus:
        return f"it needs {job.gpus} GPUs, more than limits.max_gpus = {limits.max_gpus}"
    return None


def _stop(
    finished: Sequence[str], failed: Sequence[str], topologies: int, fraction: float
) -> str | None:
    if not failed or (len(finished) < 2 and len(finished) < topologies):
        return None
    if len(failed) / len(finished) <= fraction:
        return None
    return (
        f"the canaries of {len(failed)} of the {len(finished)} topologies whose canary finished"
        f" failed with cause workload ({', '.join(failed)}), more than"
        f" limits.canary_stop_fraction = {fraction:g} of them"
    )


def _fill(
    jobs: Sequence[AdmissionJob],
    state: Mapping[str, JobState],
    groups: Mapping[str, Sequence[AdmissionJob]],
    eligible: Mapping[str, Sequence[AdmissionJob]],
    limits: CampaignLimits,
    qos_cap: int | None,
    gpu_cap: int | None = None,
) -> tuple[str, ...]:
    """The eligible jobs to submit, in turn order, as far as the caps allow."""
    active = [j for j in jobs if state[j.key] in ACTIVE]
    pending = sum(1 for j in jobs if state[j.key] is JobState.SUBMITTED)
    job_cap = limits.max_jobs if qos_cap is None else min(limits.max_jobs, qos_cap)
    slots = min(job_cap - len(active), limits.pending_cap - pending)
    nodes = sum(j.nodes for j in active)
    gpus = sum(max(j.gpus, 0) for j in active)
    started = {
        topo: sum(1 for j in group if state[j.key] in _STARTED) for topo, group in groups.items()
    }
    order = {topo: i for i, topo in enumerate(groups)}
    queues = {topo: list(q) for topo, q in eligible.items() if q}
    submit: list[str] = []
    while slots > 0 and queues:
        topo = min(queues, key=lambda t: (started[t], order[t]))
        job = queues[topo][0]
        if (
            (limits.max_nodes is not None and nodes + job.nodes > limits.max_nodes)
            or (limits.max_gpus is not None and gpus + max(job.gpus, 0) > limits.max_gpus)
            or (gpu_cap is not None and gpus + max(job.gpus, 0) > gpu_cap)
        ):
            del queues[topo]  # strict order within a topology: it waits for room
            continue
        submit.append(job.key)
        slots -= 1
        nodes += job.nodes
        gpus += max(job.gpus, 0)
        started[topo] += 1
        queues[topo].pop(0)
        if not queues[topo]:
            del queues[topo]
    return tuple(submit)


@dataclass(frozen=True)
class UserWork:
    """One user's campaigns on a cluster, as fair sharing sees them."""

    uid: int
    wanted: int  # jobs submitted or running + jobs waiting (not blocked): the most it uses


def share_room(
    users: Sequence[UserWork], room: int | None, per_user_max_jobs: int | None
) -> dict[int, int | None]:
    """How many campaign jobs each user may hold (None: no cap), sharing `room` (the jobs
    the account's submit limit leaves beside runs that are no campaign's; None: unknown)
    among the users with work, in turns.

    Each turn gives one job to the user holding the fewest so far (ties: the lower uid)
    among those that want more and are under `per_user_max_jobs`. Nothing is taken back:
    a user who holds more than its share keeps its jobs and gets no new one until the
    others caught up, so the first campaign to tick no longer keeps the whole room.
    """
    if room is None:
        return {u.uid: per_user_max_jobs for u in users}
    cap = {u.uid: min(u.wanted, per_user_max_jobs or u.wanted) for u in users}
    given = {u.uid: 0 for u in users}
    left = max(0, room)
    while left > 0:
        open_ = [uid for uid in given if given[uid] < cap[uid]]
        if not open_:
            break
        uid = min(open_, key=lambda x: (given[x], x))
        given[uid] += 1
        left -= 1
    return {u.uid: given[u.uid] for u in users}
