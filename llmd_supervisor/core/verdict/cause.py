"""Why a run that did not succeed failed: the cluster, the workload, a cancel, or unknown.

Pure: decided from evidence the verdict and the stages already have (Slurm's believed
state, the marker, each rank's last status file, the nodes reported unreachable, the
benchmark's validity gate). A retry policy may only act on ``infrastructure``.

A node is only ever named from the attempt's allocation (the run's node list from Slurm,
by rank): a status file's own words (its ``"host"``) are never a node name, and a rank
outside the allocation names nothing. The implicated nodes the daemon saw fail itself
(Slurm names them failed or down, or they did not take an SSH connection) are the
diagnosis's `observed` ones; the others are inferred from what the job wrote (its status
files: a failed component, a hang, a status file gone stale), which the quarantine counts
only against the job's owner (`core.run.retry_policy`).

* ``infrastructure`` — Slurm says NODE_FAIL, BOOT_FAIL or PREEMPTED; or some node was
  unreachable (or its status file silent) while others were not; or one node's engine or
  sidecar failed (to start, to get healthy, to answer the coordinator, by dying) while
  another rank of the same role had passed its own health check for it and did not fail:
  the implicated nodes are named. Each rank's status file says what failed
  (``failed_component``), on which rank (``failed_rank``: another one when this rank only
  saw it not answer), and what passed its own health check there (``healthy``). A rank
  stopped before its check (TERM after another's failure, an unchecked ``--headless``
  follower) is no evidence either way.
* ``workload`` — OUT_OF_MEMORY, TIMEOUT or DEADLINE; a component whose port was already
  in use (its log says so: the spec's ports, or another process on the node); a
  benchmark point that failed or
  did not pass the validity gate; every rank of a role failing the same way (the model,
  the flags or the image, not a node).
* ``cancelled`` — the supervisor's cancel, or Slurm says CANCELLED.
* ``unknown`` — none of these is shown, or a router process failed (there is one per
  job: nothing to compare it with). Never retried.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, TypedDict

from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.node.common import (
    RC_ENGINE_DIED,
    RC_ENGINE_START,
    RC_ENGINE_UNHEALTHY,
    RC_PORT_IN_USE,
    RC_REMOTE_UNHEALTHY,
    RC_SERVICE_DIED,
    RC_SERVICE_UNHEALTHY,
)

__all__ = [
    "Cause",
    "Diagnosis",
    "RankEnd",
    "diagnose",
    "hang",
    "rank_end",
    "valid_node_name",
]


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
# A Slurm node name as it may reach `sbatch --exclude=`: one name, no hostlist syntax
# (`[`, `,`), no path (`/`), no space or option.
_NODE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def valid_node_name(name: object) -> bool:
    """Whether `name` is one plain node name (letters, digits, ``.``, ``_``, ``-``)."""
    return isinstance(name, str) and _NODE_NAME.fullmatch(name) is not None


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
    # Those of `nodes` the daemon saw fail itself (Slurm, SSH), sorted; the others are
    # inferred from the job's own files.
    observed: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The reason's suffix: ``cause=infrastructure node=node3``."""
        nodes = f" node={','.join(self.nodes)}" if self.nodes else ""
        return f"cause={self.cause.value}{nodes}"

    def as_json(self) -> CauseJson:
        return {
            "cause": self.cause.value,
            "nodes": list(self.nodes),
            "observed": list(self.observed),
            "why": self.why,
        }


class CauseJson(TypedDict):
    """A diagnosis as receipts hold it."""

    cause: str
    nodes: list[str]
    observed: list[str]
    why: str


def hang(stage: str, rank: int, allocation: Sequence[str]) -> Diagnosis:
    """The cause of an attempt ended early because rank `rank`'s agent was still in
    `stage` past its deadline: the benchmark's own stages are the workload's; a hang while
    starting or waiting for engines, sidecars or the router names the rank's node in the
    attempt's `allocation` (inferred: the stages are the job's status file's)."""
    node = allocation[rank] if 0 <= rank < len(allocation) else ""
    why = f"rank {rank} on {node or '?'} hung in stage {stage!r} past its deadline"
    if stage.startswith("benchmark"):
        return Diagnosis(Cause.WORKLOAD, (), why)
    if not valid_node_name(node):
        return Diagnosis(Cause.UNKNOWN, (), why)
    return Diagnosis(Cause.INFRASTRUCTURE, (node,), why)


def rank_end(status: Mapping[str, object], allocation: Sequence[str]) -> RankEnd | None:
    """A rank's end from its status file's JSON object, on the rank's node in the
    attempt's `allocation` (by rank); None when it is not one, or its rank is not one of
    the allocation's. The status file's ``"host"`` is the job's word and is not read."""
    rank, role, component = (status.get(k) for k in ("rank", "role", "failed_component"))
    rank = _int(rank)
    if rank is None or not 0 <= rank < len(allocation):
        return None
    healthy = status.get("healthy")
    return RankEnd(
        rank,
        allocation[rank],
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
    allocation: Sequence[str],
    ranks: Sequence[RankEnd],
    unreachable: Sequence[str],
    observed: Collection[str] = (),
    benchmark_failed: bool,
) -> Diagnosis | None:
    """The cause of an outcome other than success (None for a success).

    `allocation` is the attempt's nodes by rank (from Slurm): no other node is ever
    named. `unreachable` are the nodes reported unreachable or silent; `observed` those
    the daemon saw fail itself (Slurm names them failed or down, or they did not take an
    SSH connection)."""
    if outcome is Outcome.SUCCEEDED:
        return None
    if cancel_requested or outcome is Outcome.CANCELLED:
        return Diagnosis(Cause.CANCELLED, (), "the run was cancelled")
    allocated = {n for n in allocation if valid_node_name(n)}
    ranks = [r for r in ranks if r.node in allocated]
    silent = set(unreachable) & allocated
    seen = set(observed) & allocated
    if slurm_state in _INFRA_STATES:
        assert slurm_state is not None
        nodes = tuple(sorted(silent))
        return Diagnosis(
            Cause.INFRASTRUCTURE,
            nodes,
            f"Slurm says {slurm_state.value}",
            tuple(sorted(silent & seen)),
        )
    if slurm_state in _WORKLOAD_STATES:
        assert slurm_state is not None
        return Diagnosis(Cause.WORKLOAD, (), f"Slurm says {slurm_state.value}")
    nodes_seen = {r.node for r in ranks}
    if silent and nodes_seen - silent:
        return Diagnosis(
            Cause.INFRASTRUCTURE,
            tuple(sorted(silent)),
            "unreachable or silent while the other nodes were not",
            tuple(sorted(silent & seen)),
        )
    taken = [r for r in ranks if r.local_rc == RC_PORT_IN_USE]
    if taken:  # the spec's ports, or another process on the node: not the node's fault
        r = taken[0]
        return Diagnosis(
            Cause.WORKLOAD,
            (),
            f"the {r.component or 'engine'} of rank {r.rank} on {r.node} found its port"
            " already in use",
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
