"""Retrying what the cluster caused, and keeping bad nodes out (pure).

A run's spec says how often an attempt that failed because of the cluster is tried again
(`RetryPolicy`, the ``[retry]`` table); `decide` says whether this attempt is, from its
`Diagnosis` (`core.verdict.cause`): only ``infrastructure`` is ever retried, never ``workload``,
``cancelled`` or ``unknown``, and never a run whose cancel was asked for. A retry that
could only be placed on the nodes it must keep out is not retried (`placed`): the run
ends with its attempt's outcome and says why.

Every node an infrastructure failure implicates is counted (`NodeFailure`, journaled:
node, owner, run, attempt, evidence); `quarantine` says, from the failures within the
TTL (``limits.quarantine_ttl_s``, the window), which nodes are kept out and for whom:

* **everyone**: ``limits.quarantine_after_failures`` (default 1) failures the daemon saw
  itself (`Evidence.OBSERVED`: Slurm's NODE_FAIL or BOOT_FAIL naming the node, or the
  node not taking an SSH connection); or failures of any kind from
  ``limits.quarantine_after_inferred`` (default 2) different runs of at least two
  different owners. One user's jobs alone never keep a node from anyone else, whatever
  their status files say: what a job writes is the job's word (`Evidence.INFERRED`).
* **one owner's runs**: that owner's failures from ``quarantine_after_inferred``
  different runs.
* **the run itself**: its retries keep out the nodes its earlier attempts implicated.

A node stays out while its failures within the last TTL still meet the rule (so until
the oldest failure the rule needs is a TTL old), or until it is released by hand.
`exclusion` says which nodes a submission excludes (plain node names only: see
`core.verdict.cause.valid_node_name`) and whether the job can still be placed; a job that cannot
is held back with a reason and a deadline (``retry.hold_timeout_s``, default
``limits.hold_timeout_s``), never submitted to wait forever: past the deadline the run
ends ``failed`` (`hold_expired_reason`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Final

from llmd_supervisor.core.spec.fields import int_field, num_field
from llmd_supervisor.core.verdict.cause import Cause, Diagnosis, valid_node_name
from llmd_supervisor.errors import SpecError

RETRY_KEYS: Final = ("infrastructure", "exclude_nodes", "backoff_s", "hold_timeout_s")
HOLD_TIMEOUT_MAX_S: Final = 7 * 86400.0


@dataclass(frozen=True)
class RetryPolicy:
    """The ``[retry]`` table of a run spec."""

    infrastructure: int = 1  # new attempts after infrastructure failures (0: none)
    exclude_nodes: bool = True  # a retry excludes the nodes the failure implicated
    backoff_s: float = 30.0  # wait before a retry's submission
    # How long a submission may be held for want of nodes that are not excluded before
    # the run fails (None: the daemon's `limits.hold_timeout_s`).
    hold_timeout_s: float | None = None


def parse_retry(t: Mapping[str, object]) -> RetryPolicy:
    exclude = t.get("exclude_nodes", True)
    if not isinstance(exclude, bool):
        raise SpecError("retry.exclude_nodes", exclude, "use true or false (default true)")
    hold = None
    if t.get("hold_timeout_s") is not None:
        hold = num_field(t, "retry.hold_timeout_s", default=0.0, lo=0.0, hi=HOLD_TIMEOUT_MAX_S)
    return RetryPolicy(
        infrastructure=int_field(t, "retry.infrastructure", default=1, lo=0, hi=10),
        exclude_nodes=exclude,
        backoff_s=num_field(t, "retry.backoff_s", default=30.0, lo=0.0, hi=86400.0),
        hold_timeout_s=hold,
    )


@dataclass(frozen=True)
class Decision:
    """Whether a failed attempt is tried again, and why (one phrase)."""

    retry: bool
    why: str
    exclude: tuple[str, ...] = ()  # the implicated nodes the next attempt keeps out
    # Not retried because the retry could not be placed: the run's reason says why.
    unplaced: bool = False


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


# --- node quarantine ---------------------------------------------------------------------


class Evidence(StrEnum):
    """Who says a node failed."""

    OBSERVED = "observed"  # the daemon itself: Slurm's NODE_FAIL/BOOT_FAIL, no SSH connection
    INFERRED = "inferred"  # the job's own files (status files: a failed component, a hang)


@dataclass(frozen=True)
class NodeFailure:
    """One node implicated in one attempt's infrastructure failure, as journaled."""

    cluster: str
    node: str
    owner_uid: int  # the owner of the run whose attempt failed
    run_id: str
    attempt: int
    evidence: Evidence
    reason: str
    at: datetime


def failures_of(diagnosis: Diagnosis) -> list[tuple[str, Evidence]]:
    """The nodes an infrastructure diagnosis counts a failure against, with its evidence."""
    if diagnosis.cause is not Cause.INFRASTRUCTURE:
        return []
    seen = set(diagnosis.observed)
    return [
        (n, Evidence.OBSERVED if n in seen else Evidence.INFERRED)
        for n in diagnosis.nodes
        if valid_node_name(n)
    ]


@dataclass(frozen=True)
class QuarantineRules:
    """When failures keep a node out (``[limits]`` keys; see the module's docstring)."""

    ttl: timedelta  # quarantine_ttl_s: the window, and how long the rule's failures count
    after_observed: int = 1  # quarantine_after_failures
    after_inferred: int = 2  # quarantine_after_inferred: different runs


@dataclass(frozen=True)
class Quarantined:
    """A node's failures within the TTL on one cluster, for everyone or for one owner."""

    cluster: str
    node: str
    owner_uid: int | None  # whose runs it is kept out of (None: everyone's)
    failures: int  # counted within the TTL (of that owner's runs, for an owner's entry)
    active: bool  # kept out of those runs' submissions now
    reason: str  # the last failure's
    run_id: str  # the run whose failure was counted last
    run_owner: int  # that run's owner
    since: datetime  # the first failure counted
    until: datetime  # active: when it ends; else when the last failure is forgotten

    def keeps_out(self, owner_uid: int) -> bool:
        """Kept out of this owner's submissions now."""
        return self.active and self.owner_uid in (None, owner_uid)


def quarantine(
    failures: Iterable[NodeFailure], *, now: datetime, rules: QuarantineRules
) -> list[Quarantined]:
    """Every node with failures within the TTL: its entry for everyone, and one for each
    owner whose own runs keep it out longer than everyone's do; by cluster and node."""
    live: dict[tuple[str, str], list[NodeFailure]] = {}
    for f in failures:
        if now - rules.ttl < f.at:
            live.setdefault((f.cluster, f.node), []).append(f)
    out: list[Quarantined] = []
    for key in sorted(live):
        newest = sorted(live[key], key=lambda f: f.at, reverse=True)
        observed = [f for f in newest if f.evidence is Evidence.OBSERVED]
        ends = [
            _until(observed, rules.ttl, lambda p: len(p) >= rules.after_observed),
            _until(
                newest,
                rules.ttl,
                lambda p: _runs(p) >= rules.after_inferred and len({f.owner_uid for f in p}) >= 2,
            ),
        ]
        everyone = max((e for e in ends if e), default=None)
        out.append(_entry(newest, None, everyone, rules.ttl))
        for owner in sorted({f.owner_uid for f in newest}):
            own = [f for f in newest if f.owner_uid == owner]
            until = _until(own, rules.ttl, lambda p: _runs(p) >= rules.after_inferred)
            if until is not None and (everyone is None or until > everyone):
                out.append(_entry(own, owner, until, rules.ttl))
    return out


def _runs(failures: Sequence[NodeFailure]) -> int:
    return len({f.run_id for f in failures})


def _until(
    newest_first: Sequence[NodeFailure],
    ttl: timedelta,
    enough: Callable[[Sequence[NodeFailure]], bool],
) -> datetime | None:
    """When the failures stop meeting the rule `enough` as they age out of the window
    (None: they do not meet it now). The rule only grows with more failures, so it holds
    until the oldest failure of the shortest newest-first run of them that meets it is a
    TTL old."""
    for i in range(1, len(newest_first) + 1):
        if enough(newest_first[:i]):
            return newest_first[i - 1].at + ttl
    return None


def _entry(
    newest_first: Sequence[NodeFailure], owner: int | None, until: datetime | None, ttl: timedelta
) -> Quarantined:
    last = newest_first[0]
    return Quarantined(
        last.cluster,
        last.node,
        owner,
        len(newest_first),
        until is not None,
        last.reason,
        last.run_id,
        last.owner_uid,
        newest_first[-1].at,
        until if until is not None else last.at + ttl,
    )


@dataclass(frozen=True)
class Exclusion:
    """What a submission keeps out, and whether the job can still be placed."""

    nodes: tuple[str, ...]  # sorted, for `--exclude=`
    placeable: bool
    shortage: str  # why it cannot be placed ("" when it can)


def exclusion(
    implicated: Iterable[str],
    quarantined: Sequence[Quarantined],
    *,
    owner_uid: int,
    cluster_nodes: Sequence[str] | None,
    needed: int | None,
) -> Exclusion:
    """The nodes a submission of `owner_uid`'s run excludes: the run's own implicated ones
    and those quarantined for everyone or for that owner, each a plain node name. With the
    cluster's node list and the job's node count known, it is placeable only if enough
    nodes remain."""
    kept_out = set(implicated) | {q.node for q in quarantined if q.keeps_out(owner_uid)}
    kept_out = {n for n in kept_out if valid_node_name(n)}
    if cluster_nodes is not None:
        kept_out &= set(cluster_nodes)  # a node the cluster no longer has excludes nothing
    nodes = tuple(sorted(kept_out))
    if cluster_nodes is None or needed is None:
        return Exclusion(nodes, True, "")
    left = len(set(cluster_nodes) - kept_out)
    if left >= needed:
        return Exclusion(nodes, True, "")
    shortage = (
        f"the job needs {needed} nodes and only {left} of {len(set(cluster_nodes))} "
        f"are not excluded ({','.join(nodes)})"
    )
    return Exclusion(nodes, False, shortage)


def placed(decision: Decision, where: Exclusion) -> Decision:
    """The decision once the retry's placement is known: a retry that could only be
    placed on nodes it must keep out is no retry (and says so), never a held run."""
    if not decision.retry or where.placeable:
        return decision
    return Decision(False, f"no retry: {where.shortage}", unplaced=True)


def held_reason(shortage: str, until: datetime) -> str:
    """A held run's reason: why, and until when it waits."""
    return (
        f"waiting: {shortage}; held until {until.isoformat(timespec='seconds')}, then it "
        "fails; release a node with `llmd-supervisor nodes release NODE` or wait for its "
        "quarantine to end"
    )


def hold_expired_reason(
    shortage: str, since: datetime, timeout_s: float, last_attempt: Mapping[str, object] | None
) -> str:
    """The reason of a run that was held past its deadline, with its last attempt's
    evidence (a held retry)."""
    reason = (
        f"held for want of nodes since {since.isoformat(timespec='seconds')}, past its "
        f"{timeout_s:g} s hold deadline: {shortage}"
    )
    if last_attempt is not None:
        reason += f"; attempt {last_attempt.get('attempt')}: {last_attempt.get('reason')}"
    return reason
