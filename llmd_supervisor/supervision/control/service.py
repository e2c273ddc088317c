"""`RunsService`: what may be done with runs, and by whom, typed.

Every caller asks it as a `Peer` with a typed request (`adapters.control.requests`) and
gets a typed answer (`core.protocol.runs`): the control socket (`ControlApi`, which only
decodes and encodes), the dashboard (as its viewer) and campaigns (as the daemon,
`SYSTEM_PEER`). The access rule lives here and nowhere else: a peer sees and acts on its
own runs; root and the admin group on every run (`supervision.control.access`). A run the
peer may not see is answered exactly like a run that does not exist (``not_found``), and
does not make a ref ambiguous either.

A run ref is a run id, a job name, a Slurm job id or ``CLUSTER:JOBID``; a job id that
several visible runs share is ``ambiguous`` (the error names them). ``list`` returns
bounded briefs a page at a time (a cursor in ``after``). The streaming calls follow
change signals: ``wait`` sends a summary when the run changed (`changed` of its handle),
``watch`` yields a run's `RunFacts` on every change until it is final, and ``logs`` with
``follow`` reads when the local log copies grew (inotify on their directories; without
it, or as a safety net, it also wakes when the run changed or after a short timeout).
"""

from __future__ import annotations

import builtins
import functools
import heapq
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Final, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel
import structlog

from llmd_supervisor.adapters.control.protocol import (
    DEFAULT_MAX_MESSAGE,
    LIST_MAX_LIMIT,
    Peer,
    show,
)
from llmd_supervisor.adapters.control.requests import (
    AdoptRequest,
    ArchiveRequest,
    CancelRequest,
    ListRequest,
    LogsRequest,
    NodesRequest,
    ResultsRequest,
    StatusRequest,
    SubmitRequest,
    SubmitScriptRequest,
    WaitRequest,
    WatchRequest,
)
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.protocol.runs import (
    ArchiveInfo,
    DryRun,
    LogChunk,
    LogsDone,
    NodesView,
    QuarantineView,
    RunBrief,
    RunList,
    RunResults,
    RunSummary,
    UsageView,
)
from llmd_supervisor.core.render.script import render_sbatch
from llmd_supervisor.core.run.lifecycle import RunState
from llmd_supervisor.core.run.retry_policy import Quarantined
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.core.verdict.usage import split as split_usage
from llmd_supervisor.errors import AdoptRefused, ControlError, IllegalTransition, SpecError
from llmd_supervisor.supervision.control.access import sees_all
from llmd_supervisor.supervision.control.log_follow import READ_CHUNK, Growth, first_of, read_new
from llmd_supervisor.supervision.control.views import (
    HandleView,
    cut,
    run_brief,
    run_end,
    run_results,
    run_summary,
)
from llmd_supervisor.supervision.run.verify_job import utcnow

__all__ = ["SYSTEM_PEER", "RunFacts", "RunsService", "SupervisorView"]

log = structlog.get_logger("llmd_supervisor.supervision.api")

# The daemon itself, asking for its own work (campaigns): sees every run, as root does.
SYSTEM_PEER: Final = Peer(uid=0, gid=0, pid=0)

WAIT_REFRESH_S: Final = 5.0  # `wait` re-sends an unchanged summary this often (elapsed_s)
LIST_PAGE_BYTES: Final = DEFAULT_MAX_MESSAGE // 2  # a list page's briefs, encoded, at most
LIST_YIELD_EVERY: Final = 1000  # `list` lets others run after this many runs looked at
LIST_RECENT: Final = timedelta(hours=24)  # `list` without --all: runs ended within this
FOLLOW_SAFETY_S: Final = 2.0  # a follower with inotify looks again at least this often
FOLLOW_POLL_S: Final = 0.25  # ... and without inotify
FOLLOW_MIN_PASS_S: Final = 0.02  # coalesce a burst of small writes into one pass


H = TypeVar("H", bound=HandleView)


class SupervisorView(Protocol[H]):
    """The supervisor's entry points the service uses."""

    @property
    def config(self) -> Config: ...
    @property
    def handles(self) -> Mapping[str, H]: ...
    def get(self, ref: str) -> H | None: ...
    async def look_again(self) -> bool: ...
    async def admit(self, spec_toml: str, cluster: str | None = None) -> RunSpec: ...
    async def submit(self, spec_toml: str, *, owner_uid: int, cluster: str | None = None) -> H: ...
    async def submit_script(
        self, spec_json: str, *, owner_uid: int, cluster: str | None = None
    ) -> H: ...
    async def adopt(
        self, spec_json: str, *, owner_uid: int, privileged: bool, cluster: str | None = None
    ) -> H: ...
    async def cancel(self, handle: H) -> None: ...
    async def nodes(
        self, release: tuple[str, str] | None = None
    ) -> tuple[list[Quarantined], bool]: ...


@dataclass(frozen=True)
class RunFacts:
    """What the daemon's own consumers (campaigns) act on of a run, as of one moment."""

    run_id: str
    state: RunState
    outcome: Outcome | None
    reason: str  # whole, as the verdict wrote it
    cause: str | None  # the last ended attempt's cause (None: no attempt ended yet)
    cancel_requested: bool
    owner_uid: int
    cluster: str
    archive_dir: Path
    results_table: Path  # the archived ``results.json`` (once the run is archived)
    usage: UsageView  # what its ended attempts cost
    ran_s: float | None  # from its first `running` to its end (None: never ran, or not ended)


def facts_of(h: HandleView) -> RunFacts:
    """A handle's `RunFacts` now."""
    run = h.run
    last = h.history[-1] if h.history else None
    cause = last.get("cause") if last is not None else None
    ts = run.transitions
    start = next((t.at for t in ts if t.state is RunState.RUNNING), None)
    ran_s = (ts[-1].at - start).total_seconds() if start and run.state.is_final else None
    return RunFacts(
        run_id=run.run_id,
        state=run.state,
        outcome=run.outcome,
        reason=run.reason,
        cause=None if cause is None else str(cause),
        cancel_requested=run.cancel_requested,
        owner_uid=h.meta.owner_uid,
        cluster=h.meta.cluster,
        archive_dir=h.layout.archive_dir,
        results_table=h.layout.results_table,
        usage=split_usage(h.history),
        ran_s=ran_s,
    )


class RunsService(Generic[H]):
    """Runs as a peer may see and act on them; every answer typed."""

    def __init__(
        self, supervisor: SupervisorView[H], *, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.sup = supervisor
        self.clock = clock

    @property
    def config(self) -> Config:
        return self.sup.config

    # ----------------------------------------------------------------------- access

    def sees_all(self, peer: Peer) -> bool:
        """Whether `peer` sees and acts on every run (root, the admin group)."""
        return sees_all(peer, self.sup.config.admin_group)

    def _sees(self, peer: Peer) -> Callable[[H], bool]:
        """Which runs `peer` may see (the admin lookup done once, not per run)."""
        everyone = self.sees_all(peer)
        return lambda h: everyone or h.meta.owner_uid == peer.uid

    async def _visible(self, peer: Peer, ref: str) -> H:
        """`_find`, again after the journal was read once more if it found nothing (a
        standby: another daemon may have accepted the run since its last refresh)."""
        try:
            return self._find(peer, ref)
        except ControlError as exc:
            if exc.code != "not_found" or not await self.sup.look_again():
                raise
        return self._find(peer, ref)

    def _find(self, peer: Peer, ref: str) -> H:
        """The run `ref` names among those the peer may see; ControlError otherwise.

        A run the peer may not see is not found, as if it did not exist, and neither does
        it make a job id ambiguous.
        """
        sees = self._sees(peer)
        handles = self.sup.handles
        exact = handles.get(ref)
        if exact is not None:
            found = [exact]
        else:
            found = [h for h in handles.values() if h.run.job_name == ref]
            if not found:
                cluster, colon, job = ref.rpartition(":")
                found = [
                    h
                    for h in handles.values()
                    if h.run.slurm_job_id == (job if colon else ref)
                    and (not colon or h.meta.cluster == cluster)
                ]
        found = [h for h in found if sees(h)]
        if not found:
            raise ControlError("not_found", f"No run {show(ref)} is known to this daemon.")
        if len(found) > 1:
            found.sort(key=lambda h: (h.meta.created_at, h.run.run_id))
            clusters = {h.meta.cluster for h in found}
            shown = "; ".join(
                f"{h.run.run_id} ({h.meta.cluster}:{h.run.slurm_job_id}, {h.run.state.value}, "
                f"created {h.meta.created_at.isoformat(timespec='seconds')})"
                for h in found[:10]
            ) + (f"; and {len(found) - 10} more" if len(found) > 10 else "")
            how = "its run id" if len(clusters) == 1 else "its run id or CLUSTER:JOBID"
            raise ControlError(
                "ambiguous",
                f"Run ref {show(ref)} names {len(found)} runs: {shown}. Name one by {how}.",
            )
        return found[0]

    def _cluster(self, cluster: str | None) -> str | None:
        """The request's configured cluster (None: the first); bad_request if unknown."""
        names = [c.name for c in self.sup.config.clusters]
        if cluster is not None and cluster not in names:
            raise ControlError(
                "bad_request",
                f"Cluster {cluster!r} is not configured in this daemon; "
                f"use one of: {', '.join(names)}.",
            )
        return cluster

    # ----------------------------------------------------------------------- submitting

    async def submit(self, peer: Peer, req: SubmitRequest) -> RunSummary | DryRun:
        """A run of `req.spec_toml` owned by the peer (or, dry, only its batch script)."""
        where = req.spec_path or "the spec"
        cluster = self._cluster(req.cluster)
        try:
            if req.dry_run:
                spec = await self.sup.admit(req.spec_toml, cluster)
                script = await anyio.to_thread.run_sync(
                    functools.partial(render_sbatch, spec, job_name="llmd-dry-run")
                )
                return {"dry_run": True, "script": script}
            handle = await self.sup.submit(req.spec_toml, owner_uid=peer.uid, cluster=cluster)
        except SpecError as exc:
            raise ControlError("bad_request", f"{where}: {exc}") from exc
        return run_summary(handle, self.clock())

    async def submit_script(self, peer: Peer, req: SubmitScriptRequest) -> RunSummary:
        """A run of the peer's own batch script (a foreign spec)."""
        cluster = self._cluster(req.cluster)
        try:
            handle = await self.sup.submit_script(
                req.spec_json, owner_uid=peer.uid, cluster=cluster
            )
        except SpecError as exc:
            raise ControlError("bad_request", str(exc)) from exc
        return run_summary(handle, self.clock())

    async def adopt(self, peer: Peer, req: AdoptRequest) -> RunSummary:
        """A job submitted without the daemon, followed from now on (its Slurm owner's or
        an admin's to adopt; any other job is not found)."""
        cluster = self._cluster(req.cluster)
        try:
            handle = await self.sup.adopt(
                req.spec_json,
                owner_uid=peer.uid,
                privileged=self.sees_all(peer),
                cluster=cluster,
            )
        except SpecError as exc:
            raise ControlError("bad_request", str(exc)) from exc
        except AdoptRefused as exc:
            # Whose job it is, and that another user's run may hold it, is not the peer's
            # to learn: one answer for every job it may not adopt, as for a run it may
            # not see.
            log.info("control.adopt_refused", job_id=exc.job_id, peer_uid=peer.uid, why=str(exc))
            raise ControlError(
                "not_found",
                f"No job {exc.job_id} that you may adopt is known to this daemon: a job is "
                "adopted by its Slurm owner or by the daemon's admin group.",
            ) from None
        return run_summary(handle, self.clock())

    # ----------------------------------------------------------------------- reading

    async def list(self, peer: Peer, req: ListRequest) -> RunList:
        """One page of briefs, oldest first, from after the cursor; `next` when more remain.
        Without `all`: the runs in flight and those that ended within LIST_RECENT."""
        limit, after = req.limit, req.after
        if limit is not None and not 1 <= limit <= LIST_MAX_LIMIT:
            raise ControlError(
                "bad_request",
                f"Request field 'args.limit' of op 'list' must be from 1 to {LIST_MAX_LIMIT}, "
                f"got {show(limit)}.",
            )
        start: tuple[datetime, str] | None = None
        if after is not None:
            created, bar, run_id = after.partition("|")
            try:
                at = datetime.fromisoformat(created) if bar else None
            except ValueError:
                at = None
            if at is None or at.tzinfo is None:
                raise ControlError(
                    "bad_request",
                    f"Request field 'args.after' of op 'list' must be the 'next' of a previous "
                    f"page, got {show(after)}.",
                )
            start = (at, run_id)
        sees, now, cluster = self._sees(peer), self.clock(), req.cluster
        keyed: list[tuple[tuple[datetime, str], H]] = []
        for n, h in enumerate(list(self.sup.handles.values())):
            if n % LIST_YIELD_EVERY == LIST_YIELD_EVERY - 1:
                await anyio.lowlevel.checkpoint()  # thousands of runs: let others go too
            if cluster is not None and h.meta.cluster != cluster:
                continue
            key = (h.meta.created_at, h.run.run_id)
            if start is not None and key <= start:
                continue
            if sees(h) and (req.all or now - run_end(h.run, now) <= LIST_RECENT):
                keyed.append((key, h))
        # One page and one more (is there a next?), not a sort of a team's 100,000 runs.
        todo = heapq.nsmallest((limit or LIST_MAX_LIMIT) + 1, keyed, key=lambda item: item[0])
        runs: list[RunBrief] = []
        size = 0
        for n, (key, one) in enumerate(todo):
            if n % (LIST_YIELD_EVERY // 10) == LIST_YIELD_EVERY // 10 - 1:
                await anyio.lowlevel.checkpoint()
            brief = run_brief(one, now)
            size += len(json.dumps(brief, separators=(",", ":"))) + 1
            if runs and (size > LIST_PAGE_BYTES or len(runs) == (limit or LIST_MAX_LIMIT)):
                break
            runs.append(brief)
            last = key
        more = len(runs) < len(todo)
        return {"runs": runs, "next": f"{last[0].isoformat()}|{last[1]}" if more else None}

    async def status(self, peer: Peer, req: StatusRequest) -> RunSummary:
        """The run's summary."""
        return run_summary(await self._visible(peer, req.run), self.clock())

    async def archive(self, peer: Peer, req: ArchiveRequest) -> ArchiveInfo:
        """Where the run's archive is."""
        handle = await self._visible(peer, req.run)
        return {"archive": handle.meta.archive_dir, "state": handle.run.state.value}

    async def results(self, peer: Peer, req: ResultsRequest) -> RunResults:
        """The run's verdict and results table."""
        return await run_results(await self._visible(peer, req.run), self.clock())

    def facts(self, peer: Peer, run_id: str) -> RunFacts | None:
        """The run `run_id` (exactly: no other kind of ref, no journal read again) as the
        daemon's consumers act on it; None when there is none the peer may see."""
        h = self.sup.handles.get(run_id)
        if h is None or not self._sees(peer)(h):
            return None
        return facts_of(h)

    async def all_facts(self, peer: Peer, *, cluster: str | None = None) -> builtins.list[RunFacts]:
        """Every run the peer may see (of `cluster`: None, every cluster's), as facts."""
        sees = self._sees(peer)
        out: list[RunFacts] = []
        for n, h in enumerate(list(self.sup.handles.values())):
            if n % LIST_YIELD_EVERY == LIST_YIELD_EVERY - 1:
                await anyio.lowlevel.checkpoint()
            if (cluster is None or h.meta.cluster == cluster) and sees(h):
                out.append(facts_of(h))
        return out

    async def nodes(self, peer: Peer, req: NodesRequest) -> NodesView:
        """The nodes with infrastructure failures counted, kept out of everyone's runs or
        of one owner's; `release` one (admins only). A peer that is not an admin sees the
        entries for everyone and its own, and the run and reason of a failure only when
        the run is its own."""
        admin = self.sees_all(peer)
        release = None
        if req.release is not None:
            if not admin:
                raise ControlError(
                    "forbidden",
                    "Only root or a member of the daemon's admin group may release a node.",
                )
            release = (self.sup.config.cluster(self._cluster(req.cluster)).name, req.release)
        found, released = await self.sup.nodes(release)
        shown: list[QuarantineView] = []
        for q in found:
            if not (admin or q.owner_uid is None or q.owner_uid == peer.uid):
                continue  # another owner's own quarantine
            own = admin or q.run_owner == peer.uid
            shown.append(
                {
                    "cluster": q.cluster,
                    "node": q.node,
                    "failures": q.failures,
                    "active": q.active,
                    "reason": cut(q.reason) if own else "(another user's run)",
                    "run": q.run_id if own else "",
                    "since": q.since.isoformat(),
                    "until": q.until.isoformat(),
                    "owner_uid": q.owner_uid,
                }
            )
        return {"nodes": shown, "released": released}

    # ----------------------------------------------------------------------- acting

    async def cancel(self, peer: Peer, req: CancelRequest) -> RunSummary:
        """Cancel the run (TERM, its grace, then KILL); ``conflict`` when it is final."""
        handle = await self._visible(peer, req.run)
        try:
            await self.sup.cancel(handle)
        except IllegalTransition as exc:
            raise ControlError(
                "conflict", f"Run {handle.run.run_id} is already {handle.run.state.value}."
            ) from exc
        return run_summary(handle, self.clock())

    # ----------------------------------------------------------------------- following

    async def wait(
        self,
        peer: Peer,
        req: WaitRequest,
        send: Callable[[RunSummary], Awaitable[None]],
    ) -> RunSummary:
        """Send a summary whenever the run changed visibly (and every WAIT_REFRESH_S)
        until it is final; the final summary is the result."""
        handle = await self._visible(peer, req.run)
        shown: RunSummary | None = None
        refresh_at = 0.0
        while not handle.run.state.is_final:
            changed = handle.changed  # taken before reading: a change after it sets it
            summary = run_summary(handle, self.clock())
            visible = summary.copy()  # what a client shows: the time alone is not a change
            visible["elapsed_s"] = 0.0
            now = anyio.current_time()
            if visible != shown or now >= refresh_at:
                await send(summary)
                shown, refresh_at = visible, now + WAIT_REFRESH_S
            with anyio.move_on_after(refresh_at - now):
                await changed.wait()
        return run_summary(handle, self.clock())

    async def watch(self, peer: Peer, req: WatchRequest) -> AsyncGenerator[RunFacts, None]:
        """The run's facts now, then again on every change of them, until (and with) the
        final ones. Raises ControlError (``not_found``, ``ambiguous``) before the first."""
        handle = await self._visible(peer, req.run)
        shown: RunFacts | None = None
        while True:
            changed = handle.changed  # taken before reading: a change after it sets it
            now = facts_of(handle)
            if now != shown:
                yield now
                shown = now
            if now.state.is_final:
                return
            await changed.wait()

    async def logs(
        self,
        peer: Peer,
        req: LogsRequest,
        send: Callable[[LogChunk], Awaitable[None]],
    ) -> LogsDone:
        """Send the local log copies (batch .out/.err, or one rank's logs) from the
        requested offsets; with follow, until the run is final and the copies are read."""
        handle = await self._visible(peer, req.run)
        rank, follow = req.rank, req.follow
        nodes = handle.run.nodes
        if rank is not None and handle.layout.watch is None and nodes and rank >= len(nodes):
            raise ControlError(
                "bad_request",
                f"Run {handle.run.run_id} has ranks 0 to {len(nodes) - 1} (one per node of"
                f" {','.join(nodes[:8])}{',...' if len(nodes) > 8 else ''}); rank {rank} is"
                " not one of them.",
            )
        offsets: dict[str, int] = dict(req.offsets)
        root = handle.layout.logs_root

        def wanted(path: Path) -> bool:  # path: <root>/attempt<N>/<copy name>
            copy_name = path.relative_to(root).as_posix().partition("/")[2]
            return handle.layout.streamed(copy_name, rank)

        sent = 0
        growth = Growth.open() if follow else None
        try:
            while True:
                final = handle.run.state.is_final  # read before the files: nothing after it
                changed = handle.changed
                chunks, dirs = await anyio.to_thread.run_sync(
                    read_new, root, wanted, dict(offsets), final
                )
                backlog = False
                for chunk in chunks:
                    await send(chunk)
                    offsets[chunk["file"]] = chunk["end"]
                    sent += chunk["end"] - chunk["offset"]
                    backlog = backlog or chunk["end"] - chunk["offset"] >= READ_CHUNK
                if backlog:
                    continue  # more is there already: read on at once
                if chunks:
                    if follow and not final:
                        await anyio.sleep(FOLLOW_MIN_PASS_S)  # let a burst of writes land
                    continue  # look once more: nothing new is the end of a pass
                if not follow or final:
                    return {"bytes": sent, "state": handle.run.state.value}
                if growth is not None:
                    if growth.watch(dirs):
                        continue  # a new directory: read again, now that it is watched
                    with anyio.move_on_after(FOLLOW_SAFETY_S):
                        await first_of(changed.wait, growth.wait)
                else:
                    with anyio.move_on_after(FOLLOW_POLL_S):
                        await changed.wait()
        finally:
            if growth is not None:
                growth.close()
