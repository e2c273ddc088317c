"""Campaigns in the daemon: one task per campaign that is not final (DESIGN.md section 12).

`Campaigns.create` expands a campaign file, journals the campaign and all its jobs at
once (a job whose points are all verified already is `reused` from the start) and starts
its task; `resume_all` starts the task of every campaign the journal holds as not final
after a restart. The task (`_drive`) loops: it brings each job's state up to date from its
run, asks the pure admission (`core.campaign.admission`) what to submit next, and
submits. It never decides anything itself that the core can decide.

Exactly once: before a job's run exists, the job is journaled with the run id it will get
(`core.campaign.lifecycle.campaign_run_id`); the run is then journaled by the supervisor under
that id before its sbatch (and reconciled by job name after a crash, as every run). On a
restart, a job whose run id has no run is submitted under that same id; one whose run
exists is followed. So a crash at any moment neither loses a point nor submits it twice.

QOS: an sbatch refused for a submit limit (`qos_refusal`) is back-pressure, not a failure:
the campaign backs off, lowers its cap to the jobs it has in the queue, and submits the
job again later as a new run.

A campaign over a batch script (`core.campaign.script`) keeps the script's text as its
base and submits each job's run as `submit --script` does (`Supervisor.submit_script`,
the same exactly-once run id), in the environment of the client that submitted the
campaign with ``--export-env`` (journaled with the campaign, owner-only), else in what a
job gets of the daemon's own (`adapters.slurm.runner.command_env`), with the job's variables over
it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import posixpath
import pwd
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import anyio
import anyio.abc
import anyio.to_thread
import structlog

from llmd_supervisor.adapters.control.protocol import Peer
from llmd_supervisor.adapters.control.requests import CancelRequest, WatchRequest
from llmd_supervisor.adapters.files.result_parser import ParseLimits, parse_many
from llmd_supervisor.adapters.journal.campaign_store import (
    CampaignStore,
    Proofs,
    StoredCampaign,
    StoredJob,
    VerifiedPoint,
)
from llmd_supervisor.adapters.journal.writer import writing_as
from llmd_supervisor.adapters.slurm.runner import command_env
from llmd_supervisor.core.campaign import expand as core
from llmd_supervisor.core.campaign.admission import (
    Admission,
    CampaignLimits,
    JobState,
    UserWork,
    admit,
    share_room,
)
from llmd_supervisor.core.campaign.lifecycle import (
    ACTIVE_JOB_STATES,
    CampaignState,
    campaign_run_id,
    job_state_of,
    qos_refusal,
)
from llmd_supervisor.core.campaign.reuse import (
    Candidate,
    PointGate,
    Reuse,
    gate_of_job,
    reuse_verdict,
)
from llmd_supervisor.core.campaign.script import ScriptJob, is_script_job
from llmd_supervisor.core.events.model import Owner
from llmd_supervisor.core.events.routing import check_named
from llmd_supervisor.core.run.lifecycle import RunState
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.core.spec.toml_read import decode_toml
from llmd_supervisor.core.spec.toml_write import dump_toml
from llmd_supervisor.errors import CampaignError, ControlError, SpecError, SupervisorError
from llmd_supervisor.supervision.campaign.events import CampaignEvents
from llmd_supervisor.supervision.campaign.expansion import Expander
from llmd_supervisor.supervision.campaign.points import archived_result, preferred, verified_of
from llmd_supervisor.supervision.control.access import user_name
from llmd_supervisor.supervision.control.service import SYSTEM_PEER, RunFacts, RunsService
from llmd_supervisor.supervision.run.supervisor import Supervisor

__all__ = ["Campaigns", "Plan"]

# A run whose job counts against a submit limit (pending or running in Slurm).
_QUEUED: Final = frozenset(
    {RunState.SUBMITTING, RunState.PENDING, RunState.RUNNING, RunState.FINISHING}
)

log = structlog.get_logger("llmd_supervisor.campaigns")

TICK_S: Final = 2.0  # a campaign looks at its runs at least this often
QOS_BACKOFF_S = 30.0  # after a submit-limit refusal, nothing is submitted for this long
QOS_REFRESH_S: Final = 300.0  # sacctmgr's submit limit is read again this often


@dataclass(frozen=True)
class Plan:
    """An expanded campaign before (or instead of, with --dry-run) it is journaled."""

    file: core.CampaignFile
    file_text: str
    base_text: str  # the base spec's text, or the batch script's
    expansion: core.Expansion
    reused: Mapping[tuple[str, int], VerifiedPoint]  # points verified before, still good
    rerun: bool
    export_env: Mapping[str, str] | None = None  # a script campaign's --export-env
    # Each point's reuse answer, reused or not and why (empty with --rerun).
    notes: Mapping[tuple[str, int], Reuse] = field(default_factory=dict)


@dataclass(frozen=True)
class _Share:
    """One campaign's hold on its cluster, for sharing the room among users."""

    cluster: str
    owner_uid: int
    runs: frozenset[str]  # the runs of its jobs submitted or running
    wanted: int  # those + the jobs it would submit now if it had all the room
    gpus: int  # counted GPUs of its jobs submitted or running


@dataclass
class _Live:
    """A campaign's in-memory companion: its change signal and QOS back-off."""

    changed: anyio.Event = field(default_factory=anyio.Event)
    backoff_until: float = 0.0  # anyio.current_time() before which nothing is submitted
    qos_cap: int | None = None  # the submit cap a QOS refusal taught
    qos_reason: str = ""
    refused: str = ""  # a submit limit an sbatch named since the last step
    submit_limit: int | None = None  # sacctmgr's, for the daemon's account (None: none)
    limit_read_at: float | None = None  # anyio.current_time() of the last reading
    # What fair sharing sees of it, as of its last step (None: final, or not stepped yet).
    share: _Share | None = None
    # Its active jobs' runs as its last step saw them: a change of one wakes it (`_watch`).
    seen: dict[str, RunFacts] = field(default_factory=dict)

    def touch(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


class Campaigns:
    """Every campaign of this daemon; the control API's campaign ops talk to it.

    It reads and acts on runs only through `runs` (as the daemon, `SYSTEM_PEER`), and
    follows its active runs with `RunsService.watch`; its campaigns' tasks run in `tg`.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        store: CampaignStore,
        *,
        runs: RunsService[Any],
        tg: anyio.abc.TaskGroup,
    ) -> None:
        self.sup = supervisor
        self.runs = runs
        self.tg = tg
        self.store = store
        self.live: dict[str, _Live] = {}
        # One campaign of a cluster at a time decides and submits: each decides knowing
        # the jobs the others submitted (fair room, the account's submit limit).
        self.admitting: dict[str, anyio.Lock] = {}
        self.events = CampaignEvents(supervisor, self.store, runs)
        self.expander = Expander()  # expansions off the loop, stopped with their request

    # --- entry points --------------------------------------------------------------------

    async def plan(
        self,
        file_text: str,
        base_text: str,
        *,
        default_name: str,
        cluster: str | None,
        max_points: int | None,
        rerun: bool,
        file_dir: str | None = None,
        export_env: Mapping[str, str] | None = None,
        peer: Peer | None = None,
    ) -> Plan:
        """Parse, expand and validate a campaign (CampaignError / SpecError if bad) and find
        which of its points are verified already, for `peer` (the submitter: None, root).
        `max_points` is the client's bound (None: the daemon's), never more than the
        daemon's ``[limits] campaign_max_points``; the expansion stops if the calling
        task is cancelled (`Expander`).
        A script campaign's `base_text` is the script, `file_dir` the campaign file's
        directory, `export_env` the client's environment (``--export-env``, filtered as
        `submit --script` filters it)."""
        cf = core.parse_campaign(file_text, default_name=default_name)
        try:
            check_named(cf.notify, None, self.sup.config.events)
        except SpecError as exc:  # the campaign file's [notify], not a run spec's
            raise CampaignError(exc.field, exc.value, exc.hint) from None
        limit = core.PointLimit(max_points, self.sup.config.limits.campaign_max_points)
        if cf.launcher is None:
            if export_env is not None:
                raise CampaignError(
                    "--export-env",
                    "set",
                    "a campaign over a run spec sets its variables in the spec's [env];"
                    " --export-env is for a campaign over a batch script",
                )
            expansion = await self._expand_spec(cf, base_text, cluster, limit)
        else:
            expansion = await self._expand_script(
                cf, base_text, cluster, limit, file_dir, export_env
            )
        notes: dict[tuple[str, int], tuple[VerifiedPoint | None, Reuse]] = {}
        if not rerun:
            viewer = peer or Peer(0, 0, 0)
            everyone = await anyio.to_thread.run_sync(self.runs.sees_all, viewer)
            points = [
                (j.recipe_id, j.concurrencies, gate_of_job(core.job_text(j)))
                for j in expansion.jobs
            ]
            notes = await self._reusable(points, viewer_uid=viewer.uid, everyone=everyone)
        reused = {k: p for k, (p, _) in notes.items() if p is not None}
        why = {k: r for k, (_, r) in notes.items()}
        return Plan(cf, file_text, base_text, expansion, reused, rerun, export_env, why)

    async def _expand_spec(
        self, cf: core.CampaignFile, base_text: str, cluster: str | None, limit: core.PointLimit
    ) -> core.Expansion:
        base = decode_toml(base_text)
        expansion = await self.expander.run(
            cf, limit, lambda stop: core.expand(cf, base, max_points=limit, stop=stop)
        )
        # The cluster's own checks (log directory, nodes), once per distinct topology.
        seen: set[str] = set()
        for job in expansion.jobs:
            if job.topology not in seen:
                seen.add(job.topology)
                await self.sup.admit(dump_toml(job.spec_data), cluster or cf.cluster)
        return expansion

    async def _expand_script(
        self,
        cf: core.CampaignFile,
        script: str,
        cluster: str | None,
        limit: core.PointLimit,
        file_dir: str | None,
        export_env: Mapping[str, str] | None,
    ) -> core.Expansion:
        assert cf.script is not None
        cluster_cfg = self.sup.config.cluster(cluster or cf.cluster)
        if cluster_cfg.login_host is not None:
            raise CampaignError(
                "script",
                cf.script,
                f"cluster {cluster_cfg.name!r} runs sbatch on its login host over SSH, where"
                " a script campaign's variables would show in the command line; run the"
                " daemon (or the user service) on the login node",
            )
        expansion = await self.expander.run(
            cf,
            limit,
            lambda stop: core.expand_script(
                cf,
                script,
                script_name=posixpath.basename(cf.script or ""),
                campaign_dir=file_dir or "",
                max_points=limit,
                stop=stop,
            ),
        )
        base_env = _base_env(export_env)
        for job in expansion.jobs:
            assert job.script_job is not None
            size = foreign_spec.env_bytes({**base_env, **job.script_job.env_of(job.concurrencies)})
            if size > foreign_spec.ENV_MAX_BYTES:
                raise CampaignError(
                    "launcher.env",
                    f"{size} bytes",
                    f"job {job.key}'s environment (with the one exported) is more than"
                    f" {foreign_spec.ENV_MAX_BYTES} bytes; export less or set fewer variables",
                    point=job.values,
                    subject="Launcher",
                )
        if expansion.jobs:  # the cluster's own checks (the log directory) of the first job
            first = expansion.jobs[0]
            assert first.script_job is not None
            text = first.script_job.foreign_json(script, base_env, first.concurrencies)
            await self.sup.admit_foreign(text, cluster or cf.cluster, "script")
        return expansion

    async def create(self, plan: Plan, *, owner_uid: int, cluster: str | None) -> StoredCampaign:
        """Journal the planned campaign with all its jobs, then start its task."""
        campaign_id = uuid.uuid4().hex[:12]
        now = self.sup.clock()
        try:
            owner = Owner(owner_uid, user_name(owner_uid) or "")
            check_named(plan.file.notify, owner, self.sup.config.events)
        except SpecError as exc:
            raise CampaignError(exc.field, exc.value, exc.hint) from None
        cluster_name = self.sup.config.cluster(cluster or plan.file.cluster).name
        await self.sup.roles.require(cluster_name)
        limits = plan.file.limits
        stored = StoredCampaign(
            campaign_id=campaign_id,
            name=plan.file.name,
            owner_uid=owner_uid,
            cluster=cluster_name,
            state=CampaignState.RUNNING.value,
            reason="",
            file_text=plan.file_text,
            base_text=plan.base_text,
            settings={
                "limits": dataclasses.asdict(limits),
                "rerun": plan.rerun,
                # the client's environment of a script campaign's runs (None: the daemon's)
                "export_env": None if plan.export_env is None else dict(plan.export_env),
                # the destinations its [notify] names (its campaign.* events)
                "notify": list(plan.file.notify),
            },
            created_at=now,
            updated_at=now,
        )
        jobs = []
        for seq, job in enumerate(plan.expansion.jobs):
            to_run = tuple(c for c in job.concurrencies if (job.recipe_id, c) not in plan.reused)
            jobs.append(
                StoredJob(
                    campaign_id=campaign_id,
                    job_key=job.key,
                    seq=seq,
                    recipe_id=job.recipe_id,
                    topology=job.topology,
                    concurrencies=job.concurrencies,
                    to_run=to_run,
                    matrix_values=job.values,
                    nodes=job.nodes,
                    gpus=job.gpus,
                    workload=job.workload,
                    time_limit_s=job.time_limit_s,
                    spec_toml=core.job_text(job),
                    state=(JobState.WAITING if to_run else JobState.REUSED).value,
                    run_id=None,
                    submissions=0,
                    reason="" if to_run else "every point verified before",
                    updated_at=now,
                )
            )
        with writing_as(functools.partial(self.sup.roles.writer, cluster_name)):
            await self.store.insert(stored, jobs)
        log.info(
            "campaign.created",
            campaign_id=campaign_id,
            name=stored.name,
            jobs=len(jobs),
            reused_points=len(plan.reused),
        )
        self._start(campaign_id, cluster_name)
        return stored

    async def resume_all(self, cluster: str | None = None) -> int:
        """Start the task of every campaign not final (of `cluster`) that this daemon
        leads the cluster of; after `Supervisor.resume_all` (or its `take_over`)."""
        count = 0
        for c in await self.store.campaigns():
            if cluster is not None and c.cluster != cluster:
                continue
            if not CampaignState(c.state).is_final:
                count += self._start(c.campaign_id, c.cluster)
        return count

    async def cancel(self, campaign_id: str) -> None:
        """Stop submitting and cancel the campaign's runs (TERM, grace; as `cancel`)."""
        c = await self.store.get(campaign_id)
        if c is None or CampaignState(c.state).is_final:
            return
        await self.sup.roles.require(c.cluster)
        with writing_as(functools.partial(self.sup.roles.writer, c.cluster)):
            await self.store.set_state(
                campaign_id, CampaignState.CANCELLING.value, "cancel requested"
            )
        self._live(campaign_id).touch()

    def changed(self, campaign_id: str) -> anyio.Event:
        return self._live(campaign_id).changed

    def backoff(self, campaign_id: str) -> tuple[int | None, str]:
        live = self.live.get(campaign_id)
        return (live.qos_cap, live.qos_reason) if live else (None, "")

    # --- the task ------------------------------------------------------------------------

    def _live(self, campaign_id: str) -> _Live:
        return self.live.setdefault(campaign_id, _Live())

    def _start(self, campaign_id: str, cluster: str) -> bool:
        """Drive the campaign in its cluster's tenure (False: another daemon leads it)."""
        self._live(campaign_id)
        return self.sup.roles.start(self.tg, cluster, self._drive, campaign_id)

    async def _drive(self, campaign_id: str) -> None:
        with structlog.contextvars.bound_contextvars(campaign_id=campaign_id):
            while True:
                try:
                    if await self._step(campaign_id):
                        self._live(campaign_id).share = None
                        return
                except (OSError, SupervisorError) as exc:  # logged, tried again
                    log.error("campaign.step_failed", error=str(exc))
                live = self._live(campaign_id)
                with anyio.move_on_after(TICK_S):
                    await self._watch(live)

    async def _watch(self, live: _Live) -> None:
        """Until the campaign changed or one of its active runs did (`RunsService.watch`)."""
        seen = dict(live.seen)
        async with anyio.create_task_group() as tg:

            async def campaign() -> None:
                await live.changed.wait()
                tg.cancel_scope.cancel()

            async def run(run_id: str, before: RunFacts) -> None:
                try:
                    async with contextlib.aclosing(
                        self.runs.watch(SYSTEM_PEER, WatchRequest(run_id))
                    ) as changes:
                        async for now in changes:
                            if now != before:
                                tg.cancel_scope.cancel()
                                return
                except ControlError:  # gone from this daemon: the next step sees it
                    tg.cancel_scope.cancel()

            tg.start_soon(campaign)
            for run_id, before in seen.items():
                tg.start_soon(run, run_id, before)

    async def _step(self, campaign_id: str) -> bool:
        """One look at the campaign; True once it is final."""
        c = await self.store.get(campaign_id)
        if c is None:
            return True
        state = CampaignState(c.state)
        if state.is_final:
            return True
        live = self._live(campaign_id)
        jobs = await self.store.jobs(campaign_id)
        live.seen = {}
        jobs = [await self._refresh(c, j, live) for j in jobs]
        active = [j for j in jobs if JobState(j.state) in ACTIVE_JOB_STATES]
        if live.refused:  # keep to what the queue held when the QOS said no
            live.qos_cap = max(1, len(active))
            live.qos_reason = (
                f"sbatch refused a job ({live.refused}): at most {live.qos_cap} queued"
            )
            live.backoff_until = anyio.current_time() + QOS_BACKOFF_S
            live.refused = ""
            log.warning("campaign.qos_backoff", cap=live.qos_cap, backoff_s=QOS_BACKOFF_S)
        if state is CampaignState.CANCELLING:
            if live.share is not None:  # it submits nothing more: it wants what it holds
                live.share = replace(live.share, wanted=len(live.share.runs))
            return await self._cancelling(c, jobs, active)
        await self.events.progress(c, jobs)
        async with self.admitting.setdefault(c.cluster, anyio.Lock()):
            decision = await self._admit(c, live, jobs, active)
            await self._apply(c, jobs, decision, state)
        if decision.done:
            final = CampaignState.STOPPED if decision.stop else CampaignState.FINISHED
            reason = decision.stop or ""
            jobs = await self.store.jobs(campaign_id)
            outgoing = await self.events.finished(c, jobs, final.value, reason)
            await self.store.set_state(campaign_id, final.value, reason, outgoing)
            self.events.forget(campaign_id)
            log.info("campaign.finished", state=final.value, reason=decision.stop or "")
            live.touch()
            return True
        return False

    async def _admit(
        self,
        c: StoredCampaign,
        live: _Live,
        jobs: Sequence[StoredJob],
        active: Sequence[StoredJob],
    ) -> Admission:
        """What to submit now (`admit`), within the campaign's share of the room; notes
        its hold and its want in `live.share` for the other campaigns' decisions."""
        sys_limits = self.sup.config.limits
        gpu_cap = self._gpu_cap(c)
        states = {j.job_key: JobState(j.state) for j in jobs}
        failures = {j.job_key: j.reason for j in jobs if j.reason}

        def decide(qos_cap: int | None) -> Admission:
            return admit(
                [_Job(j) for j in jobs],
                states,
                limits_of(c),
                qos_cap=qos_cap,
                backoff_until=live.backoff_until,
                now=anyio.current_time(),
                failures=failures,
                gpu_cap=gpu_cap,
                per_user_max_gpus=sys_limits.per_user_max_gpus,
            )

        # What it wants of the room: what it holds and would submit if it had all of it
        # (its max_jobs, canary and back-off bound that; a waiting job behind a canary
        # wants no room yet), so no room is kept for work that could not use it.
        unshared = decide(live.qos_cap)
        live.share = _Share(
            c.cluster,
            c.owner_uid,
            frozenset(j.run_id for j in active if j.run_id is not None),
            wanted=len(active) + len(unshared.submit),
            gpus=sum(max(j.gpus, 0) for j in active),
        )
        return decide(await self._qos_cap(c, live))

    async def _qos_cap(self, c: StoredCampaign, live: _Live) -> int | None:
        """The jobs this campaign may hold now (None: no cap known): the lower of the cap a
        refusal taught, its owner's turn-based share (`share_room`) of what sacctmgr's
        submit limit leaves beside the daemon's runs that are no campaign's (and of
        ``[limits] per_user_max_jobs``) less the owner's jobs in its other campaigns, and
        its own jobs plus the room no campaign holds (a user over its share keeps its jobs:
        the others' share is what is free, until the jobs end)."""
        now = anyio.current_time()
        cluster = self.sup.clusters.get(c.cluster)
        if cluster is not None and (
            live.limit_read_at is None or now - live.limit_read_at >= QOS_REFRESH_S
        ):
            live.limit_read_at = now
            try:
                live.submit_limit = await cluster.client.submit_limit()
            except SupervisorError as exc:  # unknown: sbatch's refusal still teaches it
                log.warning("campaign.submit_limit_unknown", error=str(exc))
                live.submit_limit = None
            log.info("campaign.submit_limit", limit=live.submit_limit)
        caps = [live.qos_cap] if live.qos_cap is not None else []
        per_user = self.sup.config.limits.per_user_max_jobs
        if live.submit_limit is None and per_user is None:
            return min(caps) if caps else None
        shares = self._shares(c.cluster)
        campaign_runs = {r for s in shares.values() for r in s.runs}
        room = None
        if live.submit_limit is not None:
            others = sum(
                1
                for f in await self.runs.all_facts(SYSTEM_PEER, cluster=c.cluster)
                if f.run_id not in campaign_runs and f.state in _QUEUED
            )
            room = max(0, live.submit_limit - others)
        wanted: dict[int, int] = {}
        for s in shares.values():
            wanted[s.owner_uid] = wanted.get(s.owner_uid, 0) + s.wanted
        users = [UserWork(uid, n) for uid, n in sorted(wanted.items())]
        allowance = share_room(users, room, per_user).get(c.owner_uid)
        if allowance is not None:
            elsewhere = sum(
                len(s.runs)
                for cid, s in shares.items()
                if s.owner_uid == c.owner_uid and cid != c.campaign_id
            )
            caps.append(max(0, allowance - elsewhere))
        if room is not None:
            held = sum(len(s.runs) for s in shares.values())
            own = live.share.runs if live.share is not None else frozenset()
            caps.append(max(0, len(own) + room - held))
        return min(caps) if caps else None

    def facts(self, run_ids: Iterable[str | None]) -> dict[str, RunFacts]:
        """The runs of `run_ids` this daemon knows (as the daemon sees them), by run id."""
        return {
            run_id: f
            for run_id in run_ids
            if run_id is not None and (f := self.runs.facts(SYSTEM_PEER, run_id)) is not None
        }

    def owners(self, proofs: Mapping[tuple[str, int], Proofs]) -> dict[str, int]:
        """The owner of each proof's run that this daemon knows, by run id."""
        return {
            p.run_id: f.owner_uid
            for found in proofs.values()
            for p in found
            if (f := self.runs.facts(SYSTEM_PEER, p.run_id)) is not None
        }

    def _gpu_cap(self, c: StoredCampaign) -> int | None:
        """``[limits] per_user_max_gpus`` less the GPUs its owner's other campaigns hold."""
        cap = self.sup.config.limits.per_user_max_gpus
        if cap is None:
            return None
        held = sum(
            s.gpus
            for cid, s in self._shares(c.cluster).items()
            if s.owner_uid == c.owner_uid and cid != c.campaign_id
        )
        return max(0, cap - held)

    def _shares(self, cluster: str) -> dict[str, _Share]:
        """Every campaign's last hold on `cluster` (campaigns not final), by campaign id."""
        return {
            cid: live.share
            for cid, live in self.live.items()
            if live.share is not None and live.share.cluster == cluster
        }

    async def _apply(
        self,
        c: StoredCampaign,
        jobs: Sequence[StoredJob],
        decision: Admission,
        state: CampaignState,
    ) -> None:
        by_key = {j.job_key: j for j in jobs}
        for key, reason in decision.block.items():
            await self.store.set_job(
                c.campaign_id, key, state=JobState.BLOCKED.value, reason=reason
            )
            log.info("campaign.job_blocked", job_key=key, reason=reason)
        if decision.stop:
            if state is CampaignState.RUNNING:
                await self.store.set_state(
                    c.campaign_id, CampaignState.STOPPING.value, decision.stop
                )
                log.warning("campaign.stopping", reason=decision.stop)
            for job in jobs:  # never to be submitted now: said so, not left "queued"
                if JobState(job.state) is JobState.WAITING and job.job_key not in decision.block:
                    await self.store.set_job(
                        c.campaign_id,
                        job.job_key,
                        state=JobState.BLOCKED.value,
                        reason=f"not run: {decision.stop}",
                    )
            return
        for key in decision.submit:
            await self._submit(c, by_key[key])
        if decision.block or decision.submit:
            self._live(c.campaign_id).touch()

    async def _submit(self, c: StoredCampaign, job: StoredJob) -> None:
        """Submit the job's points not verified by now (none left: `reused`)."""
        verified: dict[tuple[str, int], VerifiedPoint] = {}
        if not c.settings.get("rerun"):
            viewer = await anyio.to_thread.run_sync(_peer_of, c.owner_uid)
            everyone = await anyio.to_thread.run_sync(self.runs.sees_all, viewer)
            got = await self._reusable(
                [(job.recipe_id, job.to_run, gate_of_job(job.spec_toml))],
                viewer_uid=c.owner_uid,
                everyone=everyone,
            )
            verified = {k: p for k, (p, _) in got.items() if p is not None}
        to_run = tuple(x for x in job.to_run if (job.recipe_id, x) not in verified)
        if not to_run:
            await self.store.set_job(
                c.campaign_id,
                job.job_key,
                state=JobState.REUSED.value,
                reason="every point verified meanwhile",
                to_run=(),
            )
            return
        run_id = campaign_run_id(c.campaign_id, job.job_key, job.submissions + 1)
        await self.store.set_job(
            c.campaign_id,
            job.job_key,
            state=JobState.SUBMITTED.value,
            reason="",
            run_id=run_id,
            to_run=to_run,
        )
        live = self._live(c.campaign_id)
        if live.share is not None:  # held from now on, for the next decision of any campaign
            share = live.share
            live.share = replace(
                share, runs=share.runs | {run_id}, gpus=share.gpus + max(job.gpus, 0)
            )
        log.info("campaign.job_submitting", job_key=job.job_key, run_id=run_id, points=to_run)
        await self._submit_run(c, replace(job, run_id=run_id, to_run=to_run))

    async def _submit_run(self, c: StoredCampaign, job: StoredJob) -> None:
        assert job.run_id is not None
        if is_script_job(job.spec_toml):
            exported = c.settings.get("export_env")
            text = ScriptJob.from_json(job.spec_toml).foreign_json(
                c.base_text,
                _base_env(exported if isinstance(exported, dict) else None),
                job.to_run,
            )
            await self.sup.submit_script(
                text, owner_uid=c.owner_uid, cluster=c.cluster, run_id=job.run_id
            )
            return
        data = decode_toml(job.spec_toml)
        bench = data["benchmark"]
        assert isinstance(bench, dict)
        bench["concurrencies"] = list(job.to_run)
        await self.sup.submit(
            dump_toml(data), owner_uid=c.owner_uid, cluster=c.cluster, run_id=job.run_id
        )

    async def _refresh(self, c: StoredCampaign, job: StoredJob, live: _Live) -> StoredJob:
        """The job's state from its run (and its points proven when the run succeeded)."""
        if job.run_id is None or JobState(job.state) not in ACTIVE_JOB_STATES:
            return job
        run = self.runs.facts(SYSTEM_PEER, job.run_id)
        if run is None:  # journaled as submitted, the run never was: submit it now
            log.info("campaign.job_resubmitted", job_key=job.job_key, run_id=job.run_id)
            await self._submit_run(c, job)
            run = self.runs.facts(SYSTEM_PEER, job.run_id)
            if run is None:  # not this daemon's to drive after all: the next step looks
                return job
        live.seen[run.run_id] = run
        new = job_state_of(run.state, run.outcome, run.cause)
        refusal = qos_refusal(run.reason) if run.state.is_final else None
        if refusal is not None and new is not JobState.SUCCEEDED:
            live.refused = refusal
            reason = f"sbatch refused it ({refusal}); submitted again after a back-off"
            log.warning("campaign.qos_refusal", job_key=job.job_key, limit=refusal)
            await self.store.set_job(
                c.campaign_id, job.job_key, state=JobState.WAITING.value, reason=reason
            )
            return replace(job, state=JobState.WAITING.value, reason=reason)
        if new.value == job.state:
            return job
        reason = run.reason if run.state.is_final else ""
        if new is JobState.SUCCEEDED:
            proofs = await anyio.to_thread.run_sync(
                lambda: verified_of(
                    run.archive_dir,
                    recipe_id=job.recipe_id,
                    concurrencies=job.to_run,
                    run_id=run.run_id,
                    campaign_id=c.campaign_id,
                    now=self.sup.clock(),
                )
            )
            await self.store.add_verified(proofs)
            missing = sorted(set(job.to_run) - {p.concurrency for p in proofs})
            if missing:  # a succeeded run's gate passed every point: only a damaged archive
                new = JobState.FAILED_OTHER
                reason = (
                    f"the archive of run {run.run_id} proves no result for c={missing} (no"
                    " valid result file for it, or more than one)"
                )
        await self.store.set_job(c.campaign_id, job.job_key, state=new.value, reason=reason)
        log.info("campaign.job_changed", job_key=job.job_key, state=new.value, reason=reason)
        return replace(job, state=new.value, reason=reason)

    async def _cancelling(
        self, c: StoredCampaign, jobs: Sequence[StoredJob], active: Sequence[StoredJob]
    ) -> bool:
        for job in jobs:
            if JobState(job.state) is JobState.WAITING:
                await self.store.set_job(
                    c.campaign_id,
                    job.job_key,
                    state=JobState.CANCELLED.value,
                    reason="campaign cancelled",
                )
        for job in active:
            run = self.runs.facts(SYSTEM_PEER, job.run_id or "")
            if run is not None and not run.cancel_requested:
                try:
                    await self.runs.cancel(SYSTEM_PEER, CancelRequest(run.run_id))
                except ControlError as exc:
                    if exc.code != "conflict":
                        raise
                    # it ended meanwhile
        if active:
            return False
        final = CampaignState.CANCELLED.value
        jobs = await self.store.jobs(c.campaign_id)
        outgoing = await self.events.finished(c, jobs, final, "cancelled")
        await self.store.set_state(c.campaign_id, final, "cancelled", outgoing)
        self.events.forget(c.campaign_id)
        log.info("campaign.cancelled")
        self._live(c.campaign_id).touch()
        return True

    async def _reusable(
        self,
        points: Sequence[tuple[str, Sequence[int], PointGate]],
        *,
        viewer_uid: int,
        everyone: bool,
    ) -> dict[tuple[str, int], tuple[VerifiedPoint | None, Reuse]]:
        """Each point (recipe id, its concurrencies, its job's gate) with the ledger's proof
        this campaign reuses (None: it runs again) and why (`core.campaign.reuse`). A proof
        whose run is gone or whose archived file no longer matches its sha256 is dropped
        from the ledger (its point runs again)."""
        proofs = await self.store.verified(r for r, _, _ in points)
        every = [p for found in proofs.values() for p in found]
        runs = {
            p.run_id: (f.owner_uid, f.archive_dir)
            for p in every
            if (f := self.runs.facts(SYSTEM_PEER, p.run_id)) is not None
        }
        owners = {run_id: owner for run_id, (owner, _) in runs.items()}
        # Only a proof the viewer may see is read and judged again.
        visible = [
            p for p in every if p.run_id in runs and (everyone or runs[p.run_id][0] == viewer_uid)
        ]
        data = await anyio.to_thread.run_sync(
            lambda: {_proof_key(p): archived_result(runs[p.run_id][1], p) for p in visible}
        )
        stale = [
            _proof_key(p)
            for p in every
            if p.run_id not in runs or data.get(_proof_key(p), b"") is None
        ]
        if stale:
            log.warning("campaign.proofs_dropped", points=len(stale))
            await self.store.forget_verified(stale)
        gates = {recipe: g for recipe, _, g in points}
        items = [
            ("/".join(map(str, key)), raw, gates[key[0]].formats)
            for key, raw in data.items()
            if raw is not None and key[0] in gates
        ]
        parsed = await parse_many(items, ParseLimits.of(self.sup.config.limits))
        out: dict[tuple[str, int], tuple[VerifiedPoint | None, Reuse]] = {}
        for recipe, concurrencies, point_gate in points:
            for conc in concurrencies:
                answers: list[tuple[bool, VerifiedPoint | None, Reuse]] = []  # visible?
                # Its owner's own proofs first, then the others' it may see, oldest first.
                for proof in preferred(proofs.get((recipe, conc), ()), viewer_uid, owners):
                    key = _proof_key(proof)
                    candidate = Candidate(
                        proof.run_id,
                        proof.campaign_id,
                        owners.get(proof.run_id),
                        intact=data.get(key) is not None,
                        parsed=parsed.get("/".join(map(str, key))),
                    )
                    answer = reuse_verdict(
                        conc,
                        candidate,
                        viewer_uid=viewer_uid,
                        sees_all=everyone,
                        point_gate=point_gate,
                    )
                    seen = everyone or candidate.run_owner == viewer_uid
                    if answer.run_id is not None:
                        answers.insert(0, (True, proof, answer))
                        break
                    answers.append((seen, None, answer))
                if not answers:
                    no_proof = reuse_verdict(
                        conc, None, viewer_uid=viewer_uid, sees_all=everyone, point_gate=point_gate
                    )
                    answers.append((False, None, no_proof))
                # Reused: that proof. Else why the first proof it may see failed (none
                # visible: why the first could not be used).
                _, chosen, why = next((a for a in answers if a[0]), answers[0])
                out[(recipe, conc)] = (chosen, why)
        return out


def _proof_key(p: VerifiedPoint) -> tuple[str, int, str]:
    return (p.recipe_id, p.concurrency, p.run_id)


def _peer_of(uid: int) -> Peer:
    """A campaign's owner as the control socket's access rule sees a peer (its primary
    group; NSS, may block)."""
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except (KeyError, OverflowError):
        gid = -1
    return Peer(uid, gid, 0)


def _base_env(exported: Mapping[str, object] | None) -> dict[str, str]:
    """What a script campaign's runs are submitted from: the client's exported environment
    (filtered as `submit --script --export-env` filters it), else what a `submit --script`
    job gets of the daemon's own (the configured variables are added by the runner)."""
    if exported is None:
        exported = command_env(os.environ)
    env, _ = foreign_spec.exported_env(dict(exported))
    return env or {}


def limits_of(c: StoredCampaign) -> CampaignLimits:
    """The campaign's journaled [limits]."""
    raw = c.settings["limits"]
    assert isinstance(raw, dict)
    return CampaignLimits(**raw)


@dataclass(frozen=True)
class _Job:
    """A journaled job as admission sees it (`core.campaign.admission.AdmissionJob`)."""

    stored: StoredJob

    @property
    def key(self) -> str:
        return self.stored.job_key

    @property
    def topology(self) -> str:
        return self.stored.topology

    @property
    def nodes(self) -> int:
        return self.stored.nodes

    @property
    def gpus(self) -> int:
        return self.stored.gpus

    @property
    def workload(self) -> int:
        return self.stored.workload

    @property
    def concurrencies(self) -> tuple[int, ...]:
        return self.stored.concurrencies
