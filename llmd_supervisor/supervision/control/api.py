"""The control API: what each op of the control protocol does, from the supervisor's state.

`ControlApi` is the `Handler` the daemon root serves on its control socket. Its ops are one
table (`HANDLERS`, keyed by op name) that is checked against the protocol's `OPS` when this
module is imported: an op without a handler, a handler without an op, or a streaming
mismatch raises there, not at the first request. Results and stream items are the typed
structures of `llmd_supervisor.core.protocol.runs` (the campaign ops': `core.campaign.views`).

Access: a peer sees and acts on its own runs; root and the admin group on every run
(`supervision.control.access`). A run the peer may not see is answered exactly like a run that does
not exist (``not_found``). A run ref is a run id, a job name, a Slurm job id or
``CLUSTER:JOBID``; a job id that several visible runs share is ``ambiguous`` (the error
names them). ``list`` returns bounded briefs a page at a time (a cursor in ``after``).
The streaming ops follow change signals: ``wait`` sends a summary
when the run changed (`changed` of its handle) and ``logs`` with ``follow`` reads when the
local log copies grew (inotify on their directories; without it, or as a safety net, it
also wakes when the run changed or after a short timeout). A ``logs`` request may carry
per-file byte offsets, so a client that reconnects resumes exactly where it stopped.
"""

from __future__ import annotations

import functools
import heapq
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel
import structlog

from llmd_supervisor.adapters.control.protocol import (
    DEFAULT_MAX_MESSAGE,
    LIST_MAX_LIMIT,
    OPS,
    OpSpec,
    Peer,
    Request,
    Send,
    show,
)
from llmd_supervisor.core.config import Config, SocketLimits
from llmd_supervisor.core.protocol.runs import (
    ArchiveInfo,
    DryRun,
    LogsDone,
    NodesView,
    Pong,
    QuarantineView,
    RunBrief,
    RunList,
    RunResults,
    RunSummary,
)
from llmd_supervisor.core.render.script import render_sbatch
from llmd_supervisor.core.run.retry_policy import Quarantined
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.errors import (
    AdoptRefused,
    ControlError,
    IllegalTransition,
    SpecError,
    SupervisorError,
)
from llmd_supervisor.supervision.campaign.api import CampaignOps
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
from llmd_supervisor.supervision.events.api import EventOps
from llmd_supervisor.supervision.run.verify_job import utcnow

__all__ = ["HANDLERS", "ControlApi", "Op", "check_handlers", "run_brief", "run_summary"]

log = structlog.get_logger("llmd_supervisor.supervision.api")

WAIT_REFRESH_S: Final = 5.0  # `wait` re-sends an unchanged summary this often (elapsed_s)
LIST_PAGE_BYTES: Final = DEFAULT_MAX_MESSAGE // 2  # a list page's briefs, encoded, at most
LIST_YIELD_EVERY: Final = 1000  # `list` lets others run after this many runs looked at
LIST_RECENT: Final = timedelta(hours=24)  # `list` without --all: runs ended within this
FOLLOW_SAFETY_S: Final = 2.0  # a follower with inotify looks again at least this often
FOLLOW_POLL_S: Final = 0.25  # ... and without inotify
FOLLOW_MIN_PASS_S: Final = 0.02  # coalesce a burst of small writes into one pass


H = TypeVar("H", bound=HandleView)


class SupervisorView(Protocol[H]):
    """The supervisor's entry points the API uses."""

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


# --------------------------------------------------------------------------- the API


class ControlApi(Generic[H]):
    """Answers control-socket requests from the supervisor's state (a `Handler`)."""

    def __init__(
        self,
        supervisor: SupervisorView[H],
        *,
        clock: Callable[[], datetime] = utcnow,
        campaigns: CampaignOps | None = None,
        events: EventOps | None = None,
    ) -> None:
        self.sup = supervisor
        self.clock = clock
        self._campaigns = campaigns
        self._events = events

    @property
    def campaigns(self) -> CampaignOps:
        if self._campaigns is None:
            raise ControlError("internal", "This daemon serves no campaigns.")
        return self._campaigns

    @property
    def events(self) -> EventOps:
        if self._events is None:
            raise ControlError("internal", "This daemon serves no outbound events.")
        return self._events

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        return await HANDLERS[request.op].handler(self, request.args, peer, send)

    @property
    def socket_limits(self) -> SocketLimits:
        """The daemon's control-socket limits (the server takes them from its handler)."""
        return self.sup.config.socket_limits

    def _sees(self, peer: Peer) -> Callable[[H], bool]:
        """Which runs `peer` may see (the admin lookup done once, not per run)."""
        everyone = sees_all(peer, self.sup.config.admin_group)
        return lambda h: everyone or h.meta.owner_uid == peer.uid

    async def _visible(self, args: Mapping[str, object], peer: Peer) -> H:
        """`_find`, again after the journal was read once more if it found nothing (a
        standby: another daemon may have accepted the run since its last refresh)."""
        try:
            return self._find(args, peer)
        except ControlError as exc:
            if exc.code != "not_found" or not await self.sup.look_again():
                raise
        return self._find(args, peer)

    def _find(self, args: Mapping[str, object], peer: Peer) -> H:
        """The run `args["run"]` names among those the peer may see; ControlError otherwise.

        A run the peer may not see is not found, as if it did not exist, and neither does
        it make a job id ambiguous.
        """
        ref = str(args["run"])
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

    async def _ping(self, args: Mapping[str, object], peer: Peer, send: Send) -> Pong:
        return {"pong": True}

    async def _submit(
        self, args: Mapping[str, object], peer: Peer, send: Send
    ) -> RunSummary | DryRun:
        spec_toml = str(args["spec_toml"])
        where = str(args["spec_path"] or "the spec")
        cluster = self._cluster(args)
        try:
            if args["dry_run"]:
                spec = await self.sup.admit(spec_toml, cluster)
                script = await anyio.to_thread.run_sync(
                    functools.partial(render_sbatch, spec, job_name="llmd-dry-run")
                )
                return {"dry_run": True, "script": script}
            handle = await self.sup.submit(spec_toml, owner_uid=peer.uid, cluster=cluster)
        except SpecError as exc:
            raise ControlError("bad_request", f"{where}: {exc}") from exc
        return run_summary(handle, self.clock())

    async def _submit_script(
        self, args: Mapping[str, object], peer: Peer, send: Send
    ) -> RunSummary:
        cluster = self._cluster(args)
        try:
            handle = await self.sup.submit_script(
                str(args["spec_json"]), owner_uid=peer.uid, cluster=cluster
            )
        except SpecError as exc:
            raise ControlError("bad_request", str(exc)) from exc
        return run_summary(handle, self.clock())

    async def _adopt(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunSummary:
        cluster = self._cluster(args)
        privileged = sees_all(peer, self.sup.config.admin_group)
        try:
            handle = await self.sup.adopt(
                str(args["spec_json"]), owner_uid=peer.uid, privileged=privileged, cluster=cluster
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

    def _cluster(self, args: Mapping[str, object]) -> str | None:
        """The request's configured cluster (None: the first); bad_request if unknown."""
        cluster = args["cluster"]
        names = [c.name for c in self.sup.config.clusters]
        if cluster is not None and cluster not in names:
            raise ControlError(
                "bad_request",
                f"Cluster {cluster!r} is not configured in this daemon; "
                f"use one of: {', '.join(names)}.",
            )
        return None if cluster is None else str(cluster)

    async def _list(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunList:
        """One page of briefs, oldest first, from after the cursor; `next` when more remain.
        Without `all`: the runs in flight and those that ended within LIST_RECENT."""
        limit, after = args["limit"], args["after"]
        if limit is not None and not (isinstance(limit, int) and 1 <= limit <= LIST_MAX_LIMIT):
            raise ControlError(
                "bad_request",
                f"Request field 'args.limit' of op 'list' must be from 1 to {LIST_MAX_LIMIT}, "
                f"got {show(limit)}.",
            )
        start: tuple[datetime, str] | None = None
        if after is not None:
            created, bar, run_id = str(after).partition("|")
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
        sees, now, cluster = self._sees(peer), self.clock(), args["cluster"]
        keyed: list[tuple[tuple[datetime, str], H]] = []
        for n, h in enumerate(list(self.sup.handles.values())):
            if n % LIST_YIELD_EVERY == LIST_YIELD_EVERY - 1:
                await anyio.lowlevel.checkpoint()  # thousands of runs: let others go too
            if cluster is not None and h.meta.cluster != cluster:
                continue
            key = (h.meta.created_at, h.run.run_id)
            if start is not None and key <= start:
                continue
            if sees(h) and (args["all"] or now - run_end(h.run, now) <= LIST_RECENT):
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

    async def _nodes(self, args: Mapping[str, object], peer: Peer, send: Send) -> NodesView:
        """The nodes with infrastructure failures counted, kept out of everyone's runs or
        of one owner's; `release` one (admins only). A peer that is not an admin sees the
        entries for everyone and its own, and the run and reason of a failure only when
        the run is its own."""
        node = args["release"]
        admin = sees_all(peer, self.sup.config.admin_group)
        release = None
        if node is not None:
            if not admin:
                raise ControlError(
                    "forbidden",
                    "Only root or a member of the daemon's admin group may release a node.",
                )
            release = (self.sup.config.cluster(self._cluster(args)).name, str(node))
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

    async def _status(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunSummary:
        return run_summary(await self._visible(args, peer), self.clock())

    async def _cancel(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunSummary:
        handle = await self._visible(args, peer)
        try:
            await self.sup.cancel(handle)
        except IllegalTransition as exc:
            raise ControlError(
                "conflict", f"Run {handle.run.run_id} is already {handle.run.state.value}."
            ) from exc
        return run_summary(handle, self.clock())

    async def _archive(self, args: Mapping[str, object], peer: Peer, send: Send) -> ArchiveInfo:
        handle = await self._visible(args, peer)
        return {"archive": handle.meta.archive_dir, "state": handle.run.state.value}

    async def _results(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunResults:
        return await run_results(await self._visible(args, peer), self.clock())

    async def _wait(self, args: Mapping[str, object], peer: Peer, send: Send) -> RunSummary:
        """Stream a summary whenever the run changed visibly (and every WAIT_REFRESH_S)
        until it is final; the final summary is the result."""
        handle = await self._visible(args, peer)
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

    async def _logs(self, args: Mapping[str, object], peer: Peer, send: Send) -> LogsDone:
        """Stream the local log copies (batch .out/.err, or one rank's logs) from the
        requested offsets; with follow, until the run is final and the copies are read."""
        handle = await self._visible(args, peer)
        rank, follow = args["rank"], bool(args["follow"])
        nodes = handle.run.nodes
        if isinstance(rank, int) and handle.layout.watch is None and nodes and rank >= len(nodes):
            raise ControlError(
                "bad_request",
                f"Run {handle.run.run_id} has ranks 0 to {len(nodes) - 1} (one per node of"
                f" {','.join(nodes[:8])}{',...' if len(nodes) > 8 else ''}); rank {rank} is"
                " not one of them.",
            )
        given = args["offsets"]  # validated: str -> non-negative int, or None
        offsets: dict[str, int] = {}
        if isinstance(given, Mapping):
            offsets = {str(k): v for k, v in given.items() if isinstance(v, int)}
        root = handle.layout.logs_root

        def wanted(path: Path) -> bool:  # path: <root>/attempt<N>/<copy name>
            copy_name = path.relative_to(root).as_posix().partition("/")[2]
            return handle.layout.streamed(copy_name, rank if isinstance(rank, int) else None)

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


OpHandler = Callable[
    [ControlApi[Any], Mapping[str, object], Peer, Send], Awaitable[Mapping[str, object]]
]


@dataclass(frozen=True)
class Op:
    """One row of the API table: the op's handler and whether it streams."""

    handler: OpHandler
    streaming: bool = False


# The one table of what each op does; it must match the protocol's OPS exactly.
HANDLERS: Final[Mapping[str, Op]] = MappingProxyType(
    {
        "ping": Op(ControlApi._ping),
        "submit": Op(ControlApi._submit),
        "submit_script": Op(ControlApi._submit_script),
        "adopt": Op(ControlApi._adopt),
        "list": Op(ControlApi._list),
        "status": Op(ControlApi._status),
        "nodes": Op(ControlApi._nodes),
        "logs": Op(ControlApi._logs, streaming=True),
        "cancel": Op(ControlApi._cancel),
        "wait": Op(ControlApi._wait, streaming=True),
        "archive": Op(ControlApi._archive),
        "results": Op(ControlApi._results),
        "campaign_submit": Op(lambda api, a, p, s: api.campaigns.submit(a, p, s), streaming=True),
        "campaign_list": Op(lambda api, a, p, s: api.campaigns.list(a, p, s)),
        "campaign_status": Op(lambda api, a, p, s: api.campaigns.status(a, p, s)),
        "campaign_cancel": Op(lambda api, a, p, s: api.campaigns.cancel(a, p, s)),
        "campaign_wait": Op(lambda api, a, p, s: api.campaigns.wait(a, p, s), streaming=True),
        "campaign_results": Op(lambda api, a, p, s: api.campaigns.results(a, p, s), streaming=True),
        "events_list": Op(lambda api, a, p, s: api.events.list(a, p, s)),
        "events_show": Op(lambda api, a, p, s: api.events.show(a, p, s)),
        "events_replay": Op(lambda api, a, p, s: api.events.replay(a, p, s)),
        "events_test": Op(lambda api, a, p, s: api.events.test(a, p, s)),
    }
)


def check_handlers(handlers: Mapping[str, Op], ops: Mapping[str, OpSpec]) -> None:
    """Raise `SupervisorError` unless `handlers` has exactly the ops of `ops`, streaming alike."""
    problems = [f"op {op!r} has no handler" for op in sorted(set(ops) - set(handlers))]
    problems += [f"handler {op!r} is not an op" for op in sorted(set(handlers) - set(ops))]
    problems += [
        f"op {op!r} {'streams' if ops[op].streaming else 'does not stream'} but its handler "
        f"{'does not' if ops[op].streaming else 'does'}"
        for op in sorted(set(ops) & set(handlers))
        if ops[op].streaming != handlers[op].streaming
    ]
    if problems:
        raise SupervisorError(
            f"The control API does not match the protocol's table of ops: {'; '.join(problems)}."
        )


check_handlers(HANDLERS, OPS)
