"""Why a run that did not succeed failed: the cluster, the workload, a cancel, or unknown.

Pure: decided from evidence the verdict and the stages already have (Slurm's believed
state, the marker, each rank's last status file, the nodes reported unreachable, the
benchmark's validity gate). A retry policy may only act on ``infrastructure``.

* ``infrastructure`` — Slurm says NODE_FAIL, BOOT_FAIL or PREEMPTED; or some node was
  unreachable (or its status file silent) while others were not; or one node's engine or
  sidecar failed (to start, to get healthy, to answer the coordinator, by dying) while
  another rank of the same role had passed its own health check for it and did not fail:
  the implicated nodes are named. Each rank's status file says what failed
  (``failed_component``), on which rank (``failed_rank``: another one when this rank only
  saw it not answer), and what passed its own health check there (``healthy``). A rank
  stopped before its check (TERM after another's failure, an unchecked ``--headless``
  follower) is no evidence either way.
* ``workload`` — OUT_OF_MEMORY, TIMEOUT or DEADLINE; a benchmark point that failed or
  did not pass the validity gate; every rank of a role failing the same way (the model,
  the flags or the image, not a node).
* ``cancelled`` — the supervisor's cancel, or Slurm says CANCELLED.
* ``unknown`` — none of these is shown, or a router process failed (there is one per
  job: nothing to compare it with). Never retried.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from llmd_supervisor.core.slurm_parse import JobState
from llmd_supervisor.core.verdict import Outcome
from llmd_supervisor.node.common import (
    RC_ENGINE_DIED,
    RC_ENGINE_START,
    RC_ENGINE_UNHEALTHY,
    RC_REMOTE_UNHEALTHY,
    RC_SERVICE_DIED,
    RC_SERVICE_UNHEALTHY,
)

__all__ = ["Cause", "Diagnosis", "RankEnd", "diagnose", "hang", "rank_end"]


class Cause(StrEnum):
    INFRASTRUCTURE = "infrastructure"
    WORKLOAD = "workload"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"


# A rank's own exit status that blames its node's processes (not the benchmark).
NODE_RCS: Final = frozenset(
    {
        RC_ENGINE_START,
        RC_ENGINE_UNHEALTHY,
        RC_ENGINE_DIED,
        RC_REMOTE_UNHEALTHY,
        RC_SERVICE_UNHEALTHY,
        RC_SERVICE_DIED,
    }
)
# What failed, when it can be compared with the same role's other ranks.
COMPARABLE: Final = frozenset({"engine", "sidecar"})
_INFRA_STATES: Final = frozenset({JobState.NODE_FAIL, JobState.BOOT_FAIL, JobState.PREEMPTED})
_WORKLOAD_STATES: Final = frozenset({JobState.OUT_OF_MEMORY, JobState.TIMEOUT, JobState.DEADLINE})


@dataclass(frozen=True)
class RankEnd:
    """One rank as its last status file left it."""

    rank: int
    node: str
    role: str
    # The rank's own failure's rc: `failed_rc` (the coordinator's too), else `local_rc` (rc
    # is the marker's, the same on every rank).
    local_rc: int | None
    component: str | None = None  # what failed: engine, sidecar, a router process
    failed_rank: int | None = None  # where it failed (another rank: it did not answer)
    healthy: frozenset[str] = frozenset()  # what passed its own health check on the rank


@dataclass(frozen=True)
class Diagnosis:
    cause: Cause
    nodes: tuple[str, ...]  # the implicated nodes (infrastructure), sorted
    why: str  # one phrase naming the evidence

    @property
    def text(self) -> str:
        """The reason's suffix: ``cause=infrastructure node=node3``."""
        nodes = f" node={','.join(self.nodes)}" if self.nodes else ""
        return f"cause={self.cause.value}{nodes}"

    def as_json(self) -> dict[str, object]:
        return {"cause": self.cause.value, "nodes": list(self.nodes), "why": self.why}


def hang(stage: str, node: str, rank: int) -> Diagnosis:
    """The cause of an attempt ended early because a rank's agent was still in `stage`
    past its deadline: the benchmark's own stages are the workload's; a hang while
    starting or waiting for engines, sidecars or the router names the node."""
    why = f"rank {rank} on {node} hung in stage {stage!r} past its deadline"
    if stage.startswith("benchmark"):
        return Diagnosis(Cause.WORKLOAD, (), why)
    return Diagnosis(Cause.INFRASTRUCTURE, (node,), why)


def rank_end(status: Mapping[str, object]) -> RankEnd | None:
    """A rank's end from its status file's JSON object (None when it is not one)."""
    rank, node, role, component = (
        status.get(k) for k in ("rank", "host", "role", "failed_component")
    )
    rank = _int(rank)
    if rank is None or not isinstance(node, str):
        return None
    healthy = status.get("healthy")
    return RankEnd(
        rank,
        node[:255],
        role[:40] if isinstance(role, str) else "",
        _int(status.get("failed_rc")) or _int(status.get("local_rc")),
        component[:64] if isinstance(component, str) else None,
        _int(status.get("failed_rank")),
        frozenset(h[:64] for h in healthy[:16] if isinstance(h, str))
        if isinstance(healthy, list)
        else frozenset(),
    )


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def diagnose(
    outcome: Outcome,
    *,
    slurm_state: JobState | None,
    cancel_requested: bool,
    ranks: Sequence[RankEnd],
    unreachable: Sequence[str],
    benchmark_failed: bool,
) -> Diagnosis | None:
    """The cause of an outcome other than success (None for a success)."""
    if outcome is Outcome.SUCCEEDED:
        return None
    if cancel_requested or outcome is Outcome.CANCELLED:
        return Diagnosis(Cause.CANCELLED, (), "the run was cancelled")
    if slurm_state in _INFRA_STATES:
        assert slurm_state is not None
        nodes = tuple(sorted(set(unreachable)))
        return Diagnosis(Cause.INFRASTRUCTURE, nodes, f"Slurm says {slurm_state.value}")
    if slurm_state in _WORKLOAD_STATES:
        assert slurm_state is not None
        return Diagnosis(Cause.WORKLOAD, (), f"Slurm says {slurm_state.value}")
    nodes_seen = {r.node for r in ranks}
    silent = set(unreachable)
    if silent and nodes_seen - silent:
        return Diagnosis(
            Cause.INFRASTRUCTURE,
            tuple(sorted(silent)),
            "unreachable or silent while the other nodes were not",
        )
    culprits = _culprits(ranks)
    if culprits:
        return _compare(culprits, ranks)
    if benchmark_failed:
        return Diagnosis(Cause.WORKLOAD, (), "the benchmark failed or was not valid")
    return Diagnosis(Cause.UNKNOWN, (), "no evidence names the cluster or the workload")


def _compare(culprits: Mapping[int, str], ranks: Sequence[RankEnd]) -> Diagnosis:
    """Infrastructure when a failed engine or sidecar has a peer (same role, runs the same
    component) that did not fail; workload when every one of them failed."""
    others = sorted(set(culprits.values()) - COMPARABLE)
    if others:
        return Diagnosis(Cause.UNKNOWN, (), f"{', '.join(others)} failed (one per job)")
    by_rank = {r.rank: r for r in ranks}
    if any(c not in by_rank for c in culprits):
        return Diagnosis(Cause.UNKNOWN, (), "a failing rank left no status file")
    healthy_peer = {
        c: any(
            r.rank not in culprits and r.role == by_rank[c].role and what in r.healthy
            for r in ranks
        )
        for c, what in culprits.items()
    }
    what = "/".join(sorted(set(culprits.values())))
    by_role: dict[str, list[int]] = {}
    for c in culprits:
        by_role.setdefault(by_rank[c].role, []).append(c)
    whole = sorted(
        role
        for role, failed in by_role.items()
        if len(failed) > 1 and not any(healthy_peer[c] for c in failed)
    )
    if whole:  # a role that failed everywhere: the model, flags or image, not a node
        return Diagnosis(Cause.WORKLOAD, (), f"every {' and every '.join(whole)} {what} failed")
    if all(healthy_peer.values()):
        return Diagnosis(
            Cause.INFRASTRUCTURE,
            tuple(sorted({by_rank[c].node for c in culprits})),
            f"its {what} failed while the same role's other ranks did not",
        )
    return Diagnosis(Cause.UNKNOWN, (), f"the {what} failed with no healthy peer to compare")


def _culprits(ranks: Sequence[RankEnd]) -> dict[int, str]:
    """Rank -> what failed there, for every rank some status file blames (a rank's own
    record of its failure wins over what another rank saw of it)."""
    out: dict[int, str] = {}
    for r in ranks:
        if r.local_rc not in NODE_RCS:
            continue
        where = r.rank if r.failed_rank is None else r.failed_rank
        if where == r.rank or where not in out:
            out[where] = r.component or "engine"
    return out
