"""A campaign's outbound events: campaign.progress and campaign.finished (DESIGN.md §13).

`core.events.outbox` decides; this module gathers the campaign's facts and journals what it says.

- **campaign.finished** is journaled in the transaction that sets the campaign's final
  state (`CampaignStore.set_state`'s ``outgoing``): never lost, never made twice (its id
  is of the final state; a campaign ends once).
- **campaign.progress** reports the campaign's point counts when they differ from those
  its last campaign.progress reported, at most once a minute (`core.events.outbox.progress_step`,
  from the last journaled one's time and counts: read from the journal once per campaign
  task, so a restart keeps both the limit and the counter). Its seq is the counter, so a
  campaign task that journals it again after a restart (it reads the same last event)
  makes the same id, which the journal inserts once. What it reports (job states) is
  journaled before it, each change in its own transaction; one taken in a crash before
  its progress event is reported by the next one, which compares counts, not changes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Final

import anyio
import structlog

from llmd_supervisor.adapters.journal.campaign_store import CampaignStore, StoredCampaign, StoredJob
from llmd_supervisor.adapters.outbox.store import Outbox
from llmd_supervisor.core.campaign.admission import JobState
from llmd_supervisor.core.campaign.lifecycle import JobView, point_counts
from llmd_supervisor.core.events.facts import best_point, points_of_table
from llmd_supervisor.core.events.model import (
    BestOf,
    CampaignFacts,
    CampaignProblem,
    EventType,
    Links,
    Owner,
    PointCounts,
    PointFacts,
)
from llmd_supervisor.core.events.outbox import (
    LastProgress,
    Outgoing,
    campaign_counts,
    event_outgoing,
    last_progress,
    progress_step,
)
from llmd_supervisor.errors import ControlError, SupervisorError
from llmd_supervisor.supervision.campaign.points import proof_of
from llmd_supervisor.supervision.control.access import host_name, user_name
from llmd_supervisor.supervision.control.service import SYSTEM_PEER, RunsService
from llmd_supervisor.supervision.control.views import results_table_of
from llmd_supervisor.supervision.run.supervisor import Supervisor

__all__ = ["CampaignEvents", "named_of"]

log = structlog.get_logger("llmd_supervisor.campaigns")

PROBLEMS_MAX: Final = 200  # failed and blocked points an event lists (before trimming)
_FAILED: Final = frozenset(
    {JobState.FAILED_WORKLOAD, JobState.FAILED_INFRA, JobState.FAILED_OTHER, JobState.BLOCKED}
)


def named_of(c: StoredCampaign) -> tuple[str, ...]:
    """The destinations the campaign file's [notify] named (kept in its settings)."""
    value = c.settings.get("notify")
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


class CampaignEvents:
    """Makes and journals a daemon's campaigns' events."""

    def __init__(self, sup: Supervisor, store: CampaignStore, runs: RunsService[Any]) -> None:
        self._sup = sup
        self._runs = runs  # read as the daemon (SYSTEM_PEER): every campaign's runs
        self._store = store
        self._outbox = Outbox(sup.journal)
        # Each campaign's last journaled campaign.progress (None: none), once read.
        self._last: dict[str, LastProgress | None] = {}
        self._names: dict[int, str] = {}  # owners' user names by uid

    def _wanted(self, etype: EventType, c: StoredCampaign, named: Collection[str]) -> bool:
        """Whether any destination takes `etype` of this campaign (cheap: no facts)."""
        owner = Owner(c.owner_uid, "")
        for d in self._sup.config.events.destinations:
            if d.opt_in and d.name not in named:
                continue
            if d.owners and not owner.name:  # a user name is looked up only when needed
                owner = Owner(c.owner_uid, self._name(c.owner_uid))
            if d.takes(etype, owner):
                return True
        return False

    def _name(self, uid: int) -> str:
        """`uid`'s user name ("" when none), looked up once per daemon (NSS may be slow)."""
        if uid not in self._names:
            self._names[uid] = user_name(uid) or ""
        return self._names[uid]

    def facts(
        self,
        c: StoredCampaign,
        jobs: Sequence[StoredJob],
        *,
        outcome: str | None = None,
        reason: str = "",
        best: tuple[PointFacts, BestOf] | None = None,
    ) -> CampaignFacts:
        """The campaign as its events tell it: point counts, GPU-hours of its runs, its
        failed and blocked points with their reasons."""
        counts = _counts(jobs)
        useful = lost = 0.0
        problems: list[CampaignProblem] = []
        for j in jobs:
            state = JobState(j.state)
            f = self._runs.facts(SYSTEM_PEER, j.run_id or "")
            if f is not None:
                usage = f.usage
                if state is JobState.SUCCEEDED:
                    useful += usage["gpu_hours_useful"]
                    lost += usage["gpu_hours_lost"]
                else:
                    lost += usage["gpu_hours_useful"] + usage["gpu_hours_lost"]
            if state in _FAILED:
                shown = "blocked" if state is JobState.BLOCKED else "failed"
                problems += [
                    CampaignProblem(j.recipe_id, conc, shown, j.reason) for conc in j.to_run
                ]
        return CampaignFacts(
            id=c.campaign_id,
            name=c.name,
            owner=self._name(c.owner_uid),
            owner_uid=c.owner_uid,
            cluster=c.cluster,
            points=counts,
            outcome=outcome,
            reason=reason,
            gpu_hours_useful=round(useful, 6),
            gpu_hours_lost=round(lost, 6),
            problems=tuple(problems[:PROBLEMS_MAX]),
            best=None if best is None else best[0],
            best_of=None if best is None else best[1],
            links=Links(
                report=self._sup.config.dashboard.page(f"/campaigns/{c.campaign_id}#charts"),
                dashboard=self._sup.config.dashboard.page(f"/campaigns/{c.campaign_id}"),
            ),
        )

    async def best(
        self, c: StoredCampaign, jobs: Sequence[StoredJob]
    ) -> tuple[PointFacts, BestOf] | None:
        """The campaign's best verified point (`core.events.facts.best_point`'s rule: the
        highest total token throughput) among its points' archived results, read from the
        runs that verified them (reused points too), and where it comes from."""
        proofs = await self._store.verified(j.recipe_id for j in jobs)
        owners = {
            p.run_id: f.owner_uid
            for found in proofs.values()
            for p in found
            if (f := self._runs.facts(SYSTEM_PEER, p.run_id)) is not None
        }
        wanted: dict[str, dict[int, StoredJob]] = {}  # run -> concurrency -> its job
        for j in jobs:
            for conc in j.concurrencies:
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
                own = j.run_id if ran and j.state == "succeeded" else None
                run_id = proof.run_id if proof is not None else own
                if run_id is not None:
                    wanted.setdefault(run_id, {})[conc] = j
        found: list[tuple[PointFacts, BestOf]] = []
        for run_id, concs in wanted.items():
            f = self._runs.facts(SYSTEM_PEER, run_id)
            if f is None:
                continue
            try:
                table = await anyio.to_thread.run_sync(results_table_of, f.results_table)
            except ControlError as exc:  # not a table this daemon wrote: none of its points
                log.warning("event.results_unread", run_id=run_id, error=str(exc))
                continue
            for p in points_of_table(None if table is None else dict(table)):
                job = concs.get(p.concurrency)
                if job is not None:
                    found.append((p, BestOf(run_id, job.recipe_id, job.topology)))
        best = best_point([p for p, _ in found])
        return next(((p, of) for p, of in found if p is best), None)

    async def progress(self, c: StoredCampaign, jobs: Sequence[StoredJob]) -> None:
        """Journal a campaign.progress if its counts changed and the minute allows. A
        failure is logged, never raised: an event never holds up its campaign (the next
        step tries again, from the journal)."""
        try:
            await self._progress(c, jobs)
        except Exception as exc:  # the journal, or a bug in making the event
            log.warning(
                "event.progress_failed",
                campaign_id=c.campaign_id,
                error=str(exc),
                exc_info=not isinstance(exc, SupervisorError),
            )

    async def _progress(self, c: StoredCampaign, jobs: Sequence[StoredJob]) -> None:
        named = named_of(c)
        if not self._wanted(EventType.CAMPAIGN_PROGRESS, c, named):
            return
        cid = c.campaign_id
        if cid not in self._last:
            found = await self._outbox.last_event(
                f"campaign/{cid}", EventType.CAMPAIGN_PROGRESS.value
            )
            self._last[cid] = None if found is None else last_progress(*found)
        now = self._sup.clock()
        step = progress_step(self._last[cid], _counts(jobs), now)
        if step.seq is None:  # most looks: nothing changed, or not yet (no facts made)
            return
        facts = self.facts(c, jobs)
        outgoing = event_outgoing(
            EventType.CAMPAIGN_PROGRESS,
            facts,
            now,
            step.seq,
            self._sup.config.events.destinations,
            host_name(),
            named=named,
        )
        for o in outgoing:
            await self._outbox.add(o)
        self._last[cid] = LastProgress(at=now, seq=step.seq, points=facts.points)

    async def finished(
        self, c: StoredCampaign, jobs: Sequence[StoredJob], state: str, reason: str
    ) -> tuple[Outgoing, ...]:
        """The campaign.finished to journal with the campaign's final `state`."""
        named = named_of(c)
        if not self._wanted(EventType.CAMPAIGN_FINISHED, c, named):
            return ()
        try:
            best = await self.best(c, jobs)
            facts = self.facts(c, jobs, outcome=state, reason=reason, best=best)
            return event_outgoing(
                EventType.CAMPAIGN_FINISHED,
                facts,
                self._sup.clock(),
                state,  # a campaign ends once
                self._sup.config.events.destinations,
                host_name(),
                named=named,
            )
        except Exception:  # a bug in making an event must never hold up the campaign
            log.exception("event.not_made", campaign_id=c.campaign_id, type="campaign.finished")
            return ()

    def forget(self, campaign_id: str) -> None:
        """The campaign ended: its last progress is no longer needed in memory."""
        self._last.pop(campaign_id, None)


def _counts(jobs: Sequence[StoredJob]) -> PointCounts:
    """The campaign's point counts as its events give them."""
    return campaign_counts(
        point_counts(JobView(JobState(j.state), j.concurrencies, j.to_run) for j in jobs)
    )
