"""Retrying what the cluster caused, and keeping bad nodes out (pure).

A run's spec says how often an attempt that failed because of the cluster is tried again
(`RetryPolicy`, the ``[retry]`` table); `decide` says whether this attempt is, from its
`Diagnosis` (`core.cause`): only ``infrastructure`` is ever retried, never ``workload``,
``cancelled`` or ``unknown``, and never a run whose cancel was asked for.

A node implicated in an infrastructure failure is counted per cluster (`Quarantine`,
journaled); after ``after_failures`` such failures within the TTL it is kept out of every
run's submissions (`--exclude=`) until the TTL ends or it is released by hand.
`exclusion` says which nodes a submission excludes and whether the job can still be
placed; a job that could not is held back with a reason, never submitted to wait forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from llmd_supervisor.core.cause import Cause, Diagnosis
from llmd_supervisor.core.spec_fields import int_field, num_field
from llmd_supervisor.errors import SpecError

RETRY_KEYS: Final = ("infrastructure", "exclude_nodes", "backoff_s")


@dataclass(frozen=True)
class RetryPolicy:
    """The ``[retry]`` table of a run spec."""

    infrastructure: int = 1  # new attempts after infrastructure failures (0: none)
    exclude_nodes: bool = True  # a retry excludes the nodes the failure implicated
    backoff_s: float = 30.0  # wait before a retry's submission


def parse_retry(t: Mapping[str, object]) -> RetryPolicy:
    exclude = t.get("exclude_nodes", True)
    if not isinstance(exclude, bool):
        raise SpecError("retry.exclude_nodes", exclude, "use true or false (default true)")
    return RetryPolicy(
        infrastructure=int_field(t, "retry.infrastructure", default=1, lo=0, hi=10),
        exclude_nodes=exclude,
        backoff_s=num_field(t, "retry.backoff_s", default=30.0, lo=0.0, hi=86400.0),
    )


@dataclass(frozen=True)
class Decision:
    """Whether a failed attempt is tried again, and why (one phrase)."""

    retry: bool
    why: str
    exclude: tuple[str, ...] = ()  # the implicated nodes the next attempt keeps out


def decide(
    policy: RetryPolicy,
    diagnosis: Diagnosis | None,
    *,
    retries_done: int,
    cancel_requested: bool,
) -> Decision:
    """The retry decision for an attempt that ended as `diagnosis` says (None: it
    succeeded)."""
    if diagnosis is None:
        return Decision(False, "the attempt succeeded")
    if cancel_requested:
        return Decision(False, "no retry: a cancel was requested")
    if diagnosis.cause is not Cause.INFRASTRUCTURE:
        return Decision(False, f"no retry: cause {diagnosis.cause.value}")
    if retries_done >= policy.infrastructure:
        return Decision(False, f"no retry: retry.infrastructure = {policy.infrastructure} used up")
    nodes = diagnosis.nodes if policy.exclude_nodes else ()
    shown = f" without {','.join(nodes)}" if nodes else ""
    return Decision(
        True,
        f"retry {retries_done + 1} of {policy.infrastructure}{shown} after an "
        "infrastructure failure",
        nodes,
    )


@dataclass(frozen=True)
class Quarantined:
    """A node's infrastructure failures on one cluster, as journaled."""

    cluster: str
    node: str
    failures: int
    reason: str
    run_id: str
    since: datetime  # the first failure counted
    until: datetime  # the last failure + TTL

    def active(self, now: datetime, after_failures: int) -> bool:
        """Kept out of submissions now."""
        return self.failures >= after_failures and now < self.until


def count_failure(
    entry: Quarantined | None,
    *,
    cluster: str,
    node: str,
    run_id: str,
    reason: str,
    now: datetime,
    ttl: timedelta,
) -> Quarantined:
    """The node's record after one more infrastructure failure at `now` (an expired
    record starts again from one)."""
    if entry is None or now >= entry.until:
        return Quarantined(cluster, node, 1, reason, run_id, now, now + ttl)
    return Quarantined(cluster, node, entry.failures + 1, reason, run_id, entry.since, now + ttl)


@dataclass(frozen=True)
class Exclusion:
    """What a submission keeps out, and whether the job can still be placed."""

    nodes: tuple[str, ...]  # sorted, for `--exclude=`
    placeable: bool
    why: str  # why it cannot be placed ("" when it can)


def exclusion(
    implicated: Iterable[str],
    quarantined: Sequence[Quarantined],
    *,
    now: datetime,
    after_failures: int,
    cluster_nodes: Sequence[str] | None,
    needed: int | None,
) -> Exclusion:
    """The nodes a submission excludes: the run's own implicated ones and the cluster's
    quarantined ones. With the cluster's node list and the job's node count known, it is
    placeable only if enough nodes remain."""
    kept_out = set(implicated) | {q.node for q in quarantined if q.active(now, after_failures)}
    if cluster_nodes is not None:
        kept_out &= set(cluster_nodes)  # a node the cluster no longer has excludes nothing
    nodes = tuple(sorted(kept_out))
    if cluster_nodes is None or needed is None:
        return Exclusion(nodes, True, "")
    left = len(set(cluster_nodes) - kept_out)
    if left >= needed:
        return Exclusion(nodes, True, "")
    why = (
        f"waiting: the job needs {needed} nodes and only {left} of {len(set(cluster_nodes))} "
        f"are not excluded ({','.join(nodes)}); release one with `llmd-supervisor nodes "
        "release NODE` or wait for its quarantine to end"
    )
    return Exclusion(nodes, False, why)
