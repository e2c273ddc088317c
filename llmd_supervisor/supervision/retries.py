"""Retries and node quarantine around a run's submissions (`core.retry` decides).

* Before each submission: the nodes it excludes (those every earlier attempt of the run
  implicated, and those quarantined for everyone or for the run's owner) and whether the
  job can still be placed; a retry also waits out its backoff. A run that cannot be
  placed is held in `accepted` with the reason and its deadline (`held_until` of its
  handle; the first `run.held` event of the submission is when the hold began, so a
  restart keeps the deadline), and looks again when something changes
  (`nodes release`), after HOLD_RECHECK_S, or at the deadline, when it ends `failed`
  (`HoldExpired`, with its last attempt's evidence).
* After each verdict: a failure counted for every implicated node (its owner, its
  evidence: `core.retry`; once per attempt), the retry decision (a retry that could not
  be placed is none, and the run's reason says why), the attempt's history entry
  (`attempt.ended`: outcome, cause, implicated nodes, the decision, node- and
  GPU-hours), its own receipt in the archive (``attempt<N>/receipt.json``), and, when
  the decision says so, `Retry`.

Idempotent after a crash: the history entry is the mark that the attempt's end was
handled (a re-run verification finds it, and its decision, and neither counts nor
archives twice; a failure counted again is the same row). The run handle keeps the
entries (`RunHandle.history`, read from the journal at start-up).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import anyio
import structlog

from llmd_supervisor.adapters import archive
from llmd_supervisor.core.cause import Diagnosis
from llmd_supervisor.core.config import Limits
from llmd_supervisor.core.lifecycle import Held, HoldExpired, Retry
from llmd_supervisor.core.retry import (
    Decision,
    Exclusion,
    NodeFailure,
    QuarantineRules,
    RetryPolicy,
    decide,
    exclusion,
    failures_of,
    held_reason,
    hold_expired_reason,
    placed,
    quarantine,
)
from llmd_supervisor.core.spec import RunSpec
from llmd_supervisor.core.usage import elapsed_s, usage
from llmd_supervisor.core.verdict import Outcome
from llmd_supervisor.errors import SlurmCommandError
from llmd_supervisor.supervision.verify import VerifyResult

if TYPE_CHECKING:
    from llmd_supervisor.supervision.driver import RunHandle, Supervisor

log = structlog.get_logger("llmd_supervisor.runs")

ATTEMPT_EVENT = "attempt.ended"
HELD_EVENT = "run.held"
HOLD_RECHECK_S = 30.0
NO_RETRY = RetryPolicy(infrastructure=0)


def policy(h: RunHandle) -> RetryPolicy:
    """The run's retry policy (a foreign job is never resubmitted)."""
    return h.spec.retry if isinstance(h.spec, RunSpec) else NO_RETRY


def rules(limits: Limits) -> QuarantineRules:
    """The daemon's quarantine rules (``[limits]``)."""
    return QuarantineRules(
        ttl=timedelta(seconds=limits.quarantine_ttl_s),
        after_observed=int(limits.quarantine_after_failures),
        after_inferred=int(limits.quarantine_after_inferred),
    )


def hold_timeout_s(sup: Supervisor, h: RunHandle) -> float:
    """How long the run may be held for want of nodes (its spec's, else the daemon's)."""
    own = policy(h).hold_timeout_s
    return sup.config.limits.hold_timeout_s if own is None else own


async def excluded(sup: Supervisor, h: RunHandle) -> tuple[str, ...]:
    """The nodes a resubmission after a restart keeps out (never held: the run was already
    submitting)."""
    kept = await _exclusion(sup, h, with_capacity=False)
    return kept.nodes


async def before_submit(sup: Supervisor, h: RunHandle) -> tuple[str, ...] | HoldExpired | None:
    """The nodes this submission excludes, once its backoff has passed; None when it must
    wait (backoff, or too many nodes excluded: the run is held with the reason and its
    deadline); `HoldExpired` for the driver to apply once the hold is past its deadline."""
    run = h.run
    if run.submission > 1:
        since = (sup.clock() - run.transitions[-1].at).total_seconds()
        left = policy(h).backoff_s - since
        if left > 0:
            await _wait_change(h, left)
            return None
    kept = await _exclusion(sup, h, with_capacity=True)
    if kept.placeable:
        h.held_until = None
        return kept.nodes
    now = sup.clock()
    timeout = hold_timeout_s(sup, h)
    held = await _held_since(sup, h) or now
    until = held + timedelta(seconds=timeout)
    if now >= until:
        last = h.history[-1] if h.history else None
        reason = hold_expired_reason(kept.shortage, held, timeout, last)
        log.warning("run.hold_expired", reason=reason)
        return HoldExpired(reason)
    why = held_reason(kept.shortage, until)
    if why != run.reason:
        log.warning("run.held", reason=why, until=until.isoformat())
        fields = {"reason": why, "submission": run.submission, "until": until.isoformat()}
        await sup.journal.add_event(run.run_id, HELD_EVENT, fields, now)
    h.held_until = until
    await sup.apply(h, Held(why))
    await _wait_change(h, min(HOLD_RECHECK_S, (until - now).total_seconds()))
    return None


async def _held_since(sup: Supervisor, h: RunHandle) -> datetime | None:
    """When this submission was first held (its first `run.held` event), if it was."""
    for e in await sup.journal.events(h.run.run_id):
        if e.get("kind") == HELD_EVENT and e.get("submission", 1) == h.run.submission:
            try:
                return datetime.fromisoformat(str(e.get("at")))
            except ValueError:
                return None
    return None


async def _exclusion(
    sup: Supervisor, h: RunHandle, *, with_capacity: bool, extra: Sequence[str] = ()
) -> Exclusion:
    """What the run's next submission keeps out (`extra`: more of its own implicated
    nodes, a retry's not yet in its history), and, `with_capacity`, whether it fits."""
    failures = await sup.journal.node_failures(h.meta.cluster)
    # A node `nodes release` let in again (its failures forgotten) is not kept out by the
    # run's own earlier attempts either.
    counted = {f.node for f in failures}
    implicated = [
        str(n)
        for e in h.history
        if isinstance(nodes := e.get("exclude"), list)
        for n in nodes
        if str(n) in counted
    ]
    implicated += extra
    quarantined = quarantine(failures, now=sup.clock(), rules=rules(sup.config.limits))
    owner = h.meta.owner_uid
    needed = h.spec.topology.nodes if isinstance(h.spec, RunSpec) else None
    cluster_nodes: list[str] | None = None
    kept = implicated or any(q.keeps_out(owner) for q in quarantined)
    if with_capacity and needed is not None and kept:
        partition = h.spec.slurm.partition if isinstance(h.spec, RunSpec) else None
        try:
            cluster_nodes = await h.cluster.client.node_names(partition)
        except SlurmCommandError as exc:
            log.warning("run.nodes_unknown", error=str(exc))
    return exclusion(
        implicated, quarantined, owner_uid=owner, cluster_nodes=cluster_nodes, needed=needed
    )


async def after_verdict(
    sup: Supervisor,
    h: RunHandle,
    result: VerifyResult,
    diagnosis: Diagnosis | None,
    outcome: Outcome,
    reason: str,
    receipt: dict[str, object],
) -> Decision:
    """Record the attempt's end (once) and retry it when the decision says so (`Retry`
    applied); the decision (a retry that could not be placed is none, `unplaced`)."""
    run = h.run
    ended = [e for e in h.history if e.get("submission") == run.submission]
    if ended:
        decision = _journaled(ended[-1]) or _decide(h, diagnosis)
    else:
        if diagnosis is not None:
            await _quarantine(sup, h, diagnosis)
        decision = _decide(h, diagnosis)
        if decision.retry:
            where = await _exclusion(sup, h, with_capacity=True, extra=decision.exclude)
            decision = placed(decision, where)
        belief = result.verdict.belief
        gpus = h.spec.topology.gpus_per_node if isinstance(h.spec, RunSpec) else 0
        cost = usage(elapsed_s(belief.record if belief else None), len(run.nodes), gpus)
        receipt["usage"] = cost
        entry: dict[str, object] = {
            "attempt": run.attempt,
            "submission": run.submission,
            "slurm_job_id": run.slurm_job_id,
            "job_name": run.slurm_job_name,
            "nodes": list(run.nodes),
            "outcome": outcome.value,
            "reason": reason,
            "cause": None if diagnosis is None else diagnosis.cause.value,
            "implicated": [] if diagnosis is None else list(diagnosis.nodes),
            "exclude": list(decision.exclude),
            "retry": decision.why,
            "retried": decision.retry,
            "unplaced": decision.unplaced,
            **cost,
        }
        await sup.journal.add_event(run.run_id, ATTEMPT_EVENT, entry, sup.clock())
        h.history.append(entry)
    if not decision.retry:
        return decision
    part = {**receipt, "retry": decision.why}
    await anyio.to_thread.run_sync(
        lambda: archive.write_part(
            sup.config.archive_root,
            run.run_id,
            f"attempt{run.attempt}/receipt.json",
            (json.dumps(part, indent=2, sort_keys=True, default=str) + "\n").encode(),
        )
    )
    log.warning("run.retrying", why=decision.why, reason=reason)
    await sup.apply(h, Retry(f"{decision.why}; attempt {run.attempt}: {reason}"))
    return decision


def _decide(h: RunHandle, diagnosis: Diagnosis | None) -> Decision:
    run = h.run
    return decide(
        policy(h),
        diagnosis,
        retries_done=run.submission - 1,
        cancel_requested=run.cancel_requested,
    )


def _journaled(entry: dict[str, object]) -> Decision | None:
    """The decision an attempt's history entry recorded (None: an entry of an older
    daemon, which did not record it)."""
    retried, exclude = entry.get("retried"), entry.get("exclude")
    if not isinstance(retried, bool):
        return None
    return Decision(
        retried,
        str(entry.get("retry", "")),
        tuple(str(n) for n in exclude) if isinstance(exclude, list) else (),
        unplaced=entry.get("unplaced") is True,
    )


async def _quarantine(sup: Supervisor, h: RunHandle, diagnosis: Diagnosis) -> None:
    """Count a failure for every node the diagnosis implicates, against the run's owner
    and with its evidence (`core.retry` says for whom it keeps the node out)."""
    counted = failures_of(diagnosis)
    if not counted:
        return
    now, r, cluster = sup.clock(), rules(sup.config.limits), h.meta.cluster
    for node, evidence in counted:
        failure = NodeFailure(
            cluster,
            node,
            h.meta.owner_uid,
            h.run.run_id,
            h.run.attempt,
            evidence,
            diagnosis.why,
            now,
        )
        await sup.journal.count_node_failure(failure, forget_before=now - r.ttl)
    nodes = {n for n, _ in counted}
    for q in quarantine(await sup.journal.node_failures(cluster), now=now, rules=r):
        if q.active and q.node in nodes:
            log.warning(
                "node.quarantined",
                node=q.node,
                owner_uid=q.owner_uid,  # None: everyone's runs
                failures=q.failures,
                until=q.until.isoformat(),
            )


async def _wait_change(h: RunHandle, seconds: float) -> None:
    """Until the run changes (a cancel, a release) or `seconds` pass."""
    changed = h.changed
    with anyio.move_on_after(seconds):
        await changed.wait()
