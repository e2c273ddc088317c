"""The control ops of campaigns (`campaign_*` in the protocol's table; `supervision.control.api`
dispatches them here).

Access as for runs: a peer sees and acts on its own campaigns; root and the admin group
on every campaign. A campaign the peer may not see is answered like one that does not
exist. `campaign_wait` streams the status whenever the campaign changed (and every few
seconds); `campaign_results` streams one item per job (its points with provenance and the
results of the runs that proved them), so a 5,000-point campaign never makes one reply
larger than the message bound.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Final

import anyio

from llmd_supervisor.adapters.control.protocol import Peer, show
from llmd_supervisor.adapters.control.requests import CampaignRef, CampaignSubmitRequest
from llmd_supervisor.adapters.journal.campaign_store import StoredCampaign
from llmd_supervisor.core.campaign.lifecycle import CampaignState
from llmd_supervisor.core.campaign.views import (
    CampaignDryRun,
    CampaignJobResults,
    CampaignList,
    CampaignResultsDone,
    CampaignStatus,
)
from llmd_supervisor.core.protocol.runs import RunResults
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.errors import ControlError, SpecError
from llmd_supervisor.supervision.campaign import views
from llmd_supervisor.supervision.campaign.points import proof_of
from llmd_supervisor.supervision.campaign.runner import Campaigns, limits_of

__all__ = ["CampaignOps"]

WAIT_REFRESH_S: Final = 5.0

RunResultsOf = Callable[[str], Awaitable[RunResults | None]]  # a run's `results` answer


def _exported(text: object) -> dict[str, str] | None:
    """The client's environment of `--export-env` (a JSON object of strings), filtered as
    `submit --script --export-env` filters it; SpecError when it is not one."""
    if text is None:
        return None
    try:
        value = json.loads(str(text))
    except ValueError as exc:
        raise SpecError("--export-env", str(text)[:40], f"not a JSON object ({exc})") from None
    env, _ = foreign_spec.exported_env(value)
    return env


class CampaignOps:
    """The campaign ops' handlers, over the daemon's `Campaigns` (who sees all campaigns is
    who sees all runs: `RunsService.sees_all`)."""

    def __init__(
        self,
        campaigns: Campaigns,
        *,
        clock: Callable[[], datetime],
        run_results: RunResultsOf,
    ) -> None:
        self.campaigns = campaigns
        self.clock = clock
        self.run_results = run_results

    async def _visible(self, peer: Peer, req: CampaignRef) -> StoredCampaign:
        ref = req.campaign
        everyone = self.campaigns.runs.sees_all(peer)  # the runs' access rule
        found = [
            c
            for c in await self.campaigns.store.campaigns()
            if (c.campaign_id == ref or c.name == ref) and (everyone or c.owner_uid == peer.uid)
        ]
        if not found:
            raise ControlError("not_found", f"No campaign {show(ref)} is known to this daemon.")
        if len(found) > 1:
            ids = ", ".join(f"{c.campaign_id} ({c.state})" for c in found[:10])
            raise ControlError(
                "ambiguous",
                f"Campaign name {show(ref)} names {len(found)} campaigns: {ids}. "
                "Name one by its id.",
            )
        return found[0]

    async def submit(
        self, peer: Peer, req: CampaignSubmitRequest
    ) -> CampaignDryRun | CampaignStatus:
        """Expand and journal a campaign owned by the peer (with `dry_run`, only expand it);
        the expansion stops when the calling task is cancelled."""
        where = req.file_path or "the campaign file"
        cluster = req.cluster
        max_points = req.max_points  # None: the daemon's [limits] campaign_max_points
        if max_points is not None and max_points < 1:
            raise ControlError(
                "bad_request", f"max_points must be a positive integer, not {show(max_points)}."
            )
        try:
            plan = await self.campaigns.plan(
                req.file_text,
                req.base_text,
                default_name=req.name,
                cluster=cluster,
                max_points=max_points,
                rerun=req.rerun,
                file_dir=req.file_dir,
                export_env=_exported(req.export_env_json),
                peer=peer,
            )
        except SpecError as exc:
            raise ControlError("bad_request", f"{where}: {exc}") from exc
        if req.dry_run:
            return views.dry_run(plan)
        # Expanded: the campaign is journaled whole even if its client goes away now.
        with anyio.CancelScope(shield=True):
            c = await self.campaigns.create(plan, owner_uid=peer.uid, cluster=cluster)
        return await self._status(c)

    async def _status(self, c: StoredCampaign) -> CampaignStatus:
        jobs = await self.campaigns.store.jobs(c.campaign_id)
        limits = limits_of(c)
        _, qos = self.campaigns.backoff(c.campaign_id)
        return views.status(
            c,
            jobs,
            self.campaigns.facts(j.run_id for j in jobs),
            max_jobs=limits.max_jobs,
            qos=qos,
            now=self.clock(),
        )

    async def status(self, peer: Peer, req: CampaignRef) -> CampaignStatus:
        """The campaign's status."""
        return await self._status(await self._visible(peer, req))

    async def list(self, peer: Peer) -> CampaignList:
        """The campaigns the peer may see (the last 500)."""
        everyone = self.campaigns.runs.sees_all(peer)  # the runs' access rule
        store = self.campaigns.store
        out = []
        for c in await store.campaigns(owner_uid=None if everyone else peer.uid):
            out.append(views.brief(c, await store.jobs(c.campaign_id)))
        return {"campaigns": out[-500:]}

    async def cancel(self, peer: Peer, req: CampaignRef) -> CampaignStatus:
        """Stop submitting and cancel the campaign's runs."""
        c = await self._visible(peer, req)
        await self.campaigns.cancel(c.campaign_id)
        again = await self.campaigns.store.get(c.campaign_id)
        return await self._status(again or c)

    async def wait(
        self, peer: Peer, req: CampaignRef, send: Callable[[CampaignStatus], Awaitable[None]]
    ) -> CampaignStatus:
        """Send the status whenever the campaign changed visibly, until it is final; the
        final status is the result."""
        c = await self._visible(peer, req)
        shown: CampaignStatus | None = None
        while True:
            changed = self.campaigns.changed(c.campaign_id)
            now_c = await self.campaigns.store.get(c.campaign_id)
            assert now_c is not None
            summary = await self._status(now_c)
            if CampaignState(now_c.state).is_final:
                return summary
            # what a client shows: a new ETA or update time alone is not a change
            visible = summary.copy()
            visible["eta_s"], visible["updated_at"] = None, ""
            if visible != shown:
                await send(summary)
                shown = visible
            with anyio.move_on_after(WAIT_REFRESH_S):
                await changed.wait()

    async def results(
        self,
        peer: Peer,
        req: CampaignRef,
        send: Callable[[CampaignJobResults], Awaitable[None]],
    ) -> CampaignResultsDone:
        """Send one item per job (its points with provenance and the results of the runs
        that proved them); the result counts them."""
        c = await self._visible(peer, req)
        jobs = await self.campaigns.store.jobs(c.campaign_id)
        proofs = await self.campaigns.store.verified(j.recipe_id for j in jobs)
        owners = self.campaigns.owners(proofs)
        cache: dict[str, RunResults] = {}
        points = 0
        for j in jobs:
            shown = {
                p.run_id
                for conc in j.concurrencies
                if (
                    p := proof_of(
                        proofs,
                        j.recipe_id,
                        conc,
                        ran=conc in j.to_run,
                        run_id=j.run_id,
                        owner_uid=c.owner_uid,
                        owners=owners,
                    )
                )
            }
            if j.run_id is not None and j.state == "succeeded":
                shown.add(j.run_id)  # its own points' results (views.job_results picks)
            for run_id in sorted(shown - cache.keys()):
                got = await self.run_results(run_id)
                if got is not None:
                    cache[run_id] = got
            item = views.job_results(c, j, proofs, cache, owners)
            points += len(j.concurrencies)
            await send(item)
        return {"campaign": c.campaign_id, "name": c.name, "state": c.state, "points": points}
