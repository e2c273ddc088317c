"""Retries and node quarantine around a run's submissions (`core.run.retry_policy` decides).

* Before each submission: the nodes it excludes (those every earlier attempt of the run
  implicated, and those quarantined for everyone or for the run's owner) and whether the
  job can still be placed; a retry also waits out its backoff. A run that cannot be
  placed is held in `accepted` with the reason and its deadline (`Hold`, which the
  driver applies; the first `run.held` event of the submission is when the hold began,
  so a restart keeps the deadline), and looks again when something changes
  (`nodes release`), after HOLD_RECHECK_S, or at the deadline, when it ends `failed`
  (`HoldExpired`, with its last attempt's evidence: `expire_hold`).
* After each verdict: a failure counted for every implicated node (its owner, its
  evidence: `core.run.retry_policy`; once per attempt), the retry decision (a retry that could not
  be placed is none, and the run's reason says why), the attempt's history entry
  (`attempt.ended`: outcome, cause, implicated nodes, the decision, node- and
  GPU-hours), its own receipt in the archive (``attempt<N>/receipt.json``), and, when
  the decision says so, `Retry` (`retried`).

Idempotent after a crash: the history entry is the mark that the attempt's end was
handled (a re-run verification finds it, and its decision, and neither counts nor
archives twice; a failure counted again is the same row). The driver keeps the entries
(the run's `history`, read from the journal at start-up) and appends each new one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

import anyio
import structlog

from llmd_supervisor.adapters.files import archive as archive
from llmd_supervisor.core.config import Limits
from llmd_supervisor.core.events.outbox import quarantine_outgoing
from llmd_supervisor.core.run.lifecycle import Held, HoldExpired, Retry
from llmd_supervisor.core.run.retry_policy import (
    Decision,
    Exclusion,
    NodeFailure,
    QuarantineRules,
    RetryPolicy,
    exclusion,
    failures_of,
    held_reason,
    hold_expired_reason,
    placed,
    quarantine,
)
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.core.verdict.cause import Diagnosis
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.core.verdict.judge import Judgement
from llmd_supervisor.core.verdict.usage import AttemptUsage, elapsed_s, split, usage
from llmd_supervisor.errors import SlurmCommandError
from llmd_supervisor.supervision.control.access import host_name, user_name
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import (
    HELD_EVENT,
    RECEIPT_EVENT,
    AttemptEntry,
    AttemptReceipt,
    HeldEvent,
    HeldReceipt,
    ReceiptEvent,
    RunHeld,
    of_type,
    parsed,
)

log = structlog.get_logger("llmd_supervisor.runs")

HOLD_RECHECK_S = 30.0
NO_RETRY: Final = RetryPolicy(infrastructure=0)


@dataclass(frozen=True)
class Hold:
    """The submission cannot be placed: apply `event` (the reason), keep the deadline
    `until`, and look again after `recheck_s` or when the run changes."""

    event: Held
    until: datetime
    recheck_s: float


@dataclass(frozen=True)
class AttemptEnd:
    """An attempt's end: the retry decision, the history entry when it is new (for the
    driver to journal with the verdict; None: journaled before a restart), and the
    attempt's cost (None: likewise)."""

    decision: Decision
    entry: AttemptEntry | None
    usage: AttemptUsage | None


def policy(ctx: RunContext) -> RetryPolicy:
    """The run's retry policy (a foreign job is never resubmitted)."""
    return ctx.spec.retry if isinstance(ctx.spec, RunSpec) else NO_RETRY


def rules(limits: Limits) -> QuarantineRules:
    """The daemon's quarantine rules (``[limits]``)."""
    return QuarantineRules(
        ttl=timedelta(seconds=limits.quarantine_ttl_s),
        after_observed=int(limits.quarantine_after_failures),
        after_inferred=int(limits.quarantine_after_inferred),
    )


def hold_timeout_s(ctx: RunContext) -> float:
    """How long the run may be held for want of nodes (its spec's, else the daemon's)."""
    own = policy(ctx).hold_timeout_s
    return ctx.config.limits.hold_timeout_s if own is None else own


async def excluded(ctx: RunContext) -> tuple[str, ...]:
    """The nodes a resubmission after a restart keeps out (never held: the run was already
    submitting)."""
    kept = await _exclusion(ctx, with_capacity=False)
    return kept.nodes


async def before_submit(ctx: RunContext) -> tuple[str, ...] | Hold | HoldExpired | None:
    """The nodes this submission excludes, once its backoff has passed; None when it must
    wait out its backoff (waited here: the driver plans again); `Hold` when too many nodes
    are excluded (the reason and its deadline); `HoldExpired` once the hold is past its
    deadline."""
    run = ctx.run
    if run.submission > 1:
        since = (ctx.now() - run.transitions[-1].at).total_seconds()
        left = policy(ctx).backoff_s - since
        if left > 0:
            await ctx.wait_change(left)
            return None
    kept = await _exclusion(ctx, with_capacity=True)
    if kept.placeable:
        return kept.nodes
    now = ctx.now()
    timeout = hold_timeout_s(ctx)
    held = await _held_since(ctx) or now
    until = held + timedelta(seconds=timeout)
    if now >= until:
        last = ctx.history[-1] if ctx.history else None
        reason = hold_expired_reason(kept.shortage, held, timeout, last)
        log.warning("run.hold_expired", reason=reason)
        return HoldExpired(reason)
    why = held_reason(kept.shortage, until)
    if why != run.reason:
        log.warning("run.held", reason=why, until=until.isoformat())
        fields: HeldEvent = {
            "reason": why,
            "submission": run.submission,
            "until": until.isoformat(),
        }
        await ctx.emit(HELD_EVENT, fields)
    return Hold(Held(why), until, min(HOLD_RECHECK_S, (until - now).total_seconds()))


async def expire_hold(ctx: RunContext, expired: HoldExpired) -> HoldExpired:
    """A run held past its deadline fails: its receipt (the hold, and every attempt it
    had) is journaled first; then the driver applies `expired`, and the archive is
    written as for any verdict."""
    run = ctx.run
    attempts = list(ctx.history)
    receipt: HeldReceipt = {
        "outcome": Outcome.FAILED.value,
        "reason": expired.reason,
        "attempt": run.attempt,
        "slurm_job_name": run.slurm_job_name,
        "held": {"submission": run.submission, "reason": run.reason},
        "attempts": attempts,
        "usage_total": split(attempts),
    }
    journaled: ReceiptEvent = {"receipt": receipt}
    await ctx.emit(RECEIPT_EVENT, journaled)
    return expired


async def _held_since(ctx: RunContext) -> datetime | None:
    """When this submission was first held (its first `run.held` event), if it was."""
    for held in of_type(parsed(await ctx.events()), RunHeld):
        if held.submission == ctx.run.submission:
            return held.at
    return None


async def _exclusion(
    ctx: RunContext, *, with_capacity: bool, extra: Sequence[str] = ()
) -> Exclusion:
    """What the run's next submission keeps out (`extra`: more of its own implicated
    nodes, a retry's not yet in its history), and, `with_capacity`, whether it fits."""
    failures = await ctx.journal.node_failures(ctx.meta.cluster)
    # A node `nodes release` let in again (its failures forgotten) is not kept out by the
    # run's own earlier attempts either.
    counted = {f.node for f in failures}
    implicated = [n for e in ctx.history for n in e["exclude"] if n in counted]
    implicated += extra
    quarantined = quarantine(failures, now=ctx.now(), rules=rules(ctx.config.limits))
    owner = ctx.meta.owner_uid
    spec = ctx.spec
    needed = spec.topology.nodes if isinstance(spec, RunSpec) else None
    cluster_nodes: list[str] | None = None
    kept = implicated or any(q.keeps_out(owner) for q in quarantined)
    if with_capacity and needed is not None and kept:
        partition = spec.slurm.partition if isinstance(spec, RunSpec) else None
        try:
            cluster_nodes = await ctx.cluster.client.node_names(partition)
        except SlurmCommandError as exc:
            log.warning("run.nodes_unknown", error=str(exc))
    return exclusion(
        implicated, quarantined, owner_uid=owner, cluster_nodes=cluster_nodes, needed=needed
    )


async def after_verdict(ctx: RunContext, judgement: Judgement) -> AttemptEnd:
    """The attempt's end (once: its history entry, which the driver journals with the
    verdict, and the failures of the nodes it implicates, counted now) and the decision on
    a retry: the judgement's (`core.verdict.judge`), or the one journaled before a restart;
    a retry that could not be placed is none (`unplaced`)."""
    run = ctx.run
    diagnosis, outcome, reason = judgement.diagnosis, judgement.outcome, judgement.reason
    ended = [e for e in ctx.history if e["submission"] == run.submission]
    if ended:
        decision = _journaled(ended[-1]) or judgement.retry
        return AttemptEnd(decision, None, None)
    if diagnosis is not None:
        await _quarantine(ctx, diagnosis)
    decision = judgement.retry
    if decision.retry:
        where = await _exclusion(ctx, with_capacity=True, extra=decision.exclude)
        decision = placed(decision, where)
    belief = judgement.verdict.belief
    spec = ctx.spec
    gpus = spec.topology.gpus_per_node if isinstance(spec, RunSpec) else 0
    cost = usage(elapsed_s(belief.record if belief else None), len(run.nodes), gpus)
    entry: AttemptEntry = {
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
        "elapsed_s": cost["elapsed_s"],
        "node_hours": cost["node_hours"],
        "gpu_hours": cost["gpu_hours"],
    }
    return AttemptEnd(decision, entry, cost)


async def retried(ctx: RunContext, part: AttemptReceipt, decision: Decision, reason: str) -> Retry:
    """The attempt's own receipt (`part`) written into the archive; the `Retry` to apply."""
    run = ctx.run
    await anyio.to_thread.run_sync(
        lambda: archive.write_part(
            ctx.config.archive_root,
            run.run_id,
            f"attempt{run.attempt}/receipt.json",
            (json.dumps(part, indent=2, sort_keys=True, default=str) + "\n").encode(),
        )
    )
    log.warning("run.retrying", why=decision.why, reason=reason)
    return Retry(f"{decision.why}; attempt {run.attempt}: {reason}")


def _journaled(entry: AttemptEntry) -> Decision | None:
    """The decision an attempt's history entry recorded (None: an entry of an older
    daemon, which did not record it)."""
    if "retried" not in entry:
        return None
    return Decision(
        entry["retried"],
        entry["retry"],
        tuple(entry["exclude"]),
        unplaced="unplaced" in entry and entry["unplaced"] is True,
    )


async def _quarantine(ctx: RunContext, diagnosis: Diagnosis) -> None:
    """Count a failure for every node the diagnosis implicates, against the run's owner
    and with its evidence (`core.run.retry_policy` says for whom it keeps the node out)."""
    counted = failures_of(diagnosis)
    if not counted:
        return
    now, r, cluster = ctx.now(), rules(ctx.config.limits), ctx.meta.cluster
    journal = ctx.journal
    destinations = ctx.config.events.destinations
    known = await journal.node_failures(cluster) if destinations else []
    for node, evidence in counted:
        failure = NodeFailure(
            cluster,
            node,
            ctx.meta.owner_uid,
            ctx.run.run_id,
            ctx.run.attempt,
            evidence,
            diagnosis.why,
            now,
        )
        # The node.quarantined this count makes commits with it (`core.events.outbox`).
        try:
            outgoing = quarantine_outgoing(
                [f for f in known if f.at >= now - r.ttl],
                failure,
                rules=r,
                destinations=destinations,
                name_of=user_name,
                host=host_name(),
            )
        except Exception:  # a bug in making an event must never hold up the verdict
            log.exception("event.not_made", node=node, cluster=cluster)
            outgoing = ()
        await journal.count_node_failure(failure, forget_before=now - r.ttl, outgoing=outgoing)
        known.append(failure)
    nodes = {n for n, _ in counted}
    for q in quarantine(await journal.node_failures(cluster), now=now, rules=r):
        if q.active and q.node in nodes:
            log.warning(
                "node.quarantined",
                node=q.node,
                owner_uid=q.owner_uid,  # None: everyone's runs
                failures=q.failures,
                until=q.until.isoformat(),
            )
