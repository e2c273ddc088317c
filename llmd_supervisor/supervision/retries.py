"""Retries and node quarantine around a run's submissions (`core.retry` decides).

* Before each submission: the nodes it excludes (those every earlier attempt of the run
  implicated, and the cluster's quarantined ones) and whether the job can still be placed;
  a retry also waits out its backoff. A run that cannot be placed is held in `accepted`
  with the reason, and looks again when something changes (`nodes release`) or after
  HOLD_RECHECK_S.
* After each verdict: the attempt's history entry (`attempt.ended`: outcome, cause,
  implicated nodes, node- and GPU-hours), its own receipt in the archive
  (``attempt<N>/receipt.json``), a failure counted for every implicated node, and, when
  the policy says so, `Retry`.

Idempotent after a crash: the history entry is the mark that the attempt's end was
handled (a re-run verification finds it and neither counts nor archives twice). The run
handle keeps the entries (`RunHandle.history`, read from the journal at start-up).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING

import anyio
import structlog

from llmd_supervisor.adapters import archive
from llmd_supervisor.core.cause import Cause, Diagnosis
from llmd_supervisor.core.lifecycle import Held, Retry
from llmd_supervisor.core.retry import Exclusion, RetryPolicy, decide, exclusion
from llmd_supervisor.core.spec import RunSpec
from llmd_supervisor.core.usage import elapsed_s, usage
from llmd_supervisor.core.verdict import Outcome
from llmd_supervisor.errors import SlurmCommandError
from llmd_supervisor.supervision.verify import VerifyResult

if TYPE_CHECKING:
    from llmd_supervisor.supervision.driver import RunHandle, Supervisor

log = structlog.get_logger("llmd_supervisor.runs")

ATTEMPT_EVENT = "attempt.ended"
HOLD_RECHECK_S = 30.0
NO_RETRY = RetryPolicy(infrastructure=0)


def policy(h: RunHandle) -> RetryPolicy:
    """The run's retry policy (a foreign job is never resubmitted)."""
    return h.spec.retry if isinstance(h.spec, RunSpec) else NO_RETRY


async def excluded(sup: Supervisor, h: RunHandle) -> tuple[str, ...]:
    """The nodes a resubmission after a restart keeps out (never held: the run was already
    submitting)."""
    kept = await _exclusion(sup, h, with_capacity=False)
    return kept.nodes


async def before_submit(sup: Supervisor, h: RunHandle) -> tuple[str, ...] | None:
    """The nodes this submission excludes, once its backoff has passed; None when it must
    wait (backoff, or too many nodes excluded: the run is held with the reason)."""
    run = h.run
    if run.submission > 1:
        since = (sup.clock() - run.transitions[-1].at).total_seconds()
        left = policy(h).backoff_s - since
        if left > 0:
            await _wait_change(h, left)
            return None
    kept = await _exclusion(sup, h, with_capacity=True)
    if not kept.placeable:
        if kept.why != run.reason:
            log.warning("run.held", reason=kept.why)
            await sup.journal.add_event(run.run_id, "run.held", {"reason": kept.why}, sup.clock())
        await sup.apply(h, Held(kept.why))
        await _wait_change(h, HOLD_RECHECK_S)
        return None
    return kept.nodes


async def _exclusion(sup: Supervisor, h: RunHandle, *, with_capacity: bool) -> Exclusion:
    implicated = [
        str(n) for e in h.history if isinstance(nodes := e.get("exclude"), list) for n in nodes
    ]
    limits = sup.config.limits
    quarantined = await sup.journal.quarantined(h.meta.cluster)
    # A node `nodes release` let in again (its failures forgotten) is not kept out by the
    # run's own earlier attempts either.
    counted = {q.node for q in quarantined}
    implicated = [n for n in implicated if n in counted]
    needed = h.spec.topology.nodes if isinstance(h.spec, RunSpec) else None
    cluster_nodes: list[str] | None = None
    if with_capacity and needed is not None and (implicated or quarantined):
        partition = h.spec.slurm.partition if isinstance(h.spec, RunSpec) else None
        try:
            cluster_nodes = await h.cluster.client.node_names(partition)
        except SlurmCommandError as exc:
            log.warning("run.nodes_unknown", error=str(exc))
    return exclusion(
        implicated,
        quarantined,
        now=sup.clock(),
        after_failures=int(limits.quarantine_after_failures),
        cluster_nodes=cluster_nodes,
        needed=needed,
    )


async def after_verdict(
    sup: Supervisor,
    h: RunHandle,
    result: VerifyResult,
    diagnosis: Diagnosis | None,
    outcome: Outcome,
    reason: str,
    receipt: dict[str, object],
) -> bool:
    """Record the attempt's end (once) and retry it when the policy says so; whether the
    run goes on with a new attempt (`Retry` applied)."""
    run = h.run
    ended = [e for e in h.history if e.get("submission") == run.submission]
    decision = decide(
        policy(h),
        diagnosis,
        retries_done=run.submission - 1,
        cancel_requested=run.cancel_requested,
    )
    if not ended:
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
            **cost,
        }
        await sup.journal.add_event(run.run_id, ATTEMPT_EVENT, entry, sup.clock())
        h.history.append(entry)
        if diagnosis is not None and diagnosis.cause is Cause.INFRASTRUCTURE:
            await _quarantine(sup, h, diagnosis)
    if not decision.retry:
        return False
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
    return True


async def _quarantine(sup: Supervisor, h: RunHandle, diagnosis: Diagnosis) -> None:
    limits = sup.config.limits
    for node in diagnosis.nodes:
        entry = await sup.journal.count_node_failure(
            h.meta.cluster,
            node,
            run_id=h.run.run_id,
            reason=diagnosis.why,
            at=sup.clock(),
            ttl=timedelta(seconds=limits.quarantine_ttl_s),
        )
        if entry.active(sup.clock(), int(limits.quarantine_after_failures)):
            log.warning(
                "node.quarantined", node=node, failures=entry.failures, until=str(entry.until)
            )


async def _wait_change(h: RunHandle, seconds: float) -> None:
    """Until the run changes (a cancel, a release) or `seconds` pass."""
    changed = h.changed
    with anyio.move_on_after(seconds):
        await changed.wait()
