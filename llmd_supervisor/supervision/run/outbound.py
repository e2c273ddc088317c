"""The outbound events a change of a run makes (`core.events.outbox`), built from what the
run's phases left (the files its verdict was judged from, its ended attempts) and from
what the journal and the archive say of it when it is declared.

What must be read for them (the run's last receipt, its archived results table) is read
by `Outbound.prepare` before the driver takes the run's lock; under the lock the driver
only builds them (`Outbound.built`, pure but for the owner's user name) and journals them
with the run's change, in one transaction. Most changes report nothing: no destination
configured, or a transition no event is of.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog

from llmd_supervisor.adapters.journal.store import Journal, RunMeta
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.events.facts import RunDetails, finished_details, point_of_evidence
from llmd_supervisor.core.events.model import EventType, Links, PointFacts, RunRef
from llmd_supervisor.core.events.outbox import Outgoing, run_event_type, run_outgoing
from llmd_supervisor.core.run.kinds import RunKind
from llmd_supervisor.core.run.lifecycle import Run, RunState
from llmd_supervisor.errors import ControlError
from llmd_supervisor.supervision.control.access import host_name, user_name
from llmd_supervisor.supervision.control.views import results_table_of
from llmd_supervisor.supervision.run import bench_files
from llmd_supervisor.supervision.run.bench_files import JudgedFiles
from llmd_supervisor.supervision.run.records import AttemptEntry, last_receipt

log = structlog.get_logger("llmd_supervisor.runs")


@dataclass(frozen=True)
class Prepared:
    """What a change of a run reports beyond its two records: the points its verdict
    judged and (declared) its details. They depend only on the states the run leaves and
    enters (`before`, `after`), whose change they were read for."""

    before: RunState
    after: RunState
    judged: tuple[PointFacts, ...] = ()
    details: RunDetails | None = None

    def of(self, before: Run, after: Run) -> bool:
        """Whether these were read for a change between the states of `before`, `after`."""
        return (self.before, self.after) == (before.state, after.state)


class Outbound:
    """Builds a run's outbound events (the daemon's configured destinations)."""

    def __init__(self, config: Config, journal: Journal) -> None:
        self.config = config
        self._journal = journal

    def reports(self, before: Run | None, after: Run) -> bool:
        """Whether the change can report anything (else nothing is read or built)."""
        return bool(self.config.events.destinations) and (
            run_event_type(before, after) is not None
            or (before is not None and before.state is RunState.VERIFYING)
        )

    async def prepare(
        self,
        before: Run,
        after: Run,
        meta: RunMeta,
        kind: RunKind,
        files: JudgedFiles | None,
        history: Sequence[AttemptEntry],
    ) -> Prepared:
        """Read what the change's events say beyond the records: the points the verdict
        just judged when the run leaves verifying, and what the journal and the archive
        say of it (`core.events.facts`) when it is declared."""
        if not self.reports(before, after):
            return Prepared(before.state, after.state)
        judged: tuple[PointFacts, ...] = ()
        spec = kind.rendered
        if (
            before.state is RunState.VERIFYING
            and after.state is not RunState.VERIFYING
            and files is not None
            and files.bench is not None
            and spec is not None
        ):
            try:
                gate = bench_files.judge(spec, files.bench.results)
                judged = tuple(point_of_evidence(e) for e in gate.points if e.point is not None)
            except Exception:  # never hold up a verdict for its points' events
                log.exception("event.points_unjudged", run_id=after.run_id)
        details = None
        if run_event_type(before, after) is EventType.RUN_FINISHED:
            try:
                details = await self._finished_details(after.run_id, meta, history)
            except Exception:  # never hold up a verdict for its event's details
                log.exception("event.details_unread", run_id=after.run_id)
        return Prepared(before.state, after.state, judged, details)

    def built(
        self,
        before: Run,
        after: Run,
        prepared: Prepared,
        meta: RunMeta,
        kind: RunKind,
    ) -> tuple[Outgoing, ...]:
        """The outbound events of a change whose facts were `prepared` (`made`)."""
        judged, details = prepared.judged, prepared.details
        return self.made(before, after, meta, kind.name, kind.notify, details, judged)

    def made(
        self,
        before: Run | None,
        after: Run,
        meta: RunMeta,
        name: str,
        named: Sequence[str] = (),
        details: RunDetails | None = None,
        judged: Sequence[PointFacts] = (),
    ) -> tuple[Outgoing, ...]:
        """The outbound events to journal with this change of the run (`core.events.outbox`)."""
        destinations = self.config.events.destinations
        if not destinations or (run_event_type(before, after) is None and not judged):
            return ()  # most transitions report nothing: no user lookup, no spec hash
        ref = RunRef(
            id=after.run_id,
            name=name,
            owner=user_name(meta.owner_uid) or "",
            owner_uid=meta.owner_uid,
            cluster=meta.cluster,
            spec_name=name,
            spec_sha256=hashlib.sha256(meta.spec_toml.encode("utf-8")).hexdigest(),
        )
        links = Links(
            archive=meta.archive_dir or None,
            report=self.config.dashboard.page(f"/runs/{after.run_id}#results"),
            dashboard=self.config.dashboard.page(f"/runs/{after.run_id}"),
        )
        try:
            return run_outgoing(
                before,
                after,
                ref,
                links,
                destinations,
                host_name(),
                named=named,
                details=details,
                judged=judged,
            )
        except Exception:  # a bug in making an event must never hold up the run
            log.exception("event.not_made", run_id=after.run_id, state=after.state.value)
            return ()

    async def _finished_details(
        self, run_id: str, meta: RunMeta, history: Sequence[AttemptEntry]
    ) -> RunDetails:
        """What a declared run's run.finished says beyond its record: its last receipt,
        its attempts (journaled) and its archived results table."""
        receipt = last_receipt(await self._journal.events(run_id))
        attempts = [dict(e) for e in history]
        path = Path(meta.archive_dir) / "results.json"
        try:
            table = await anyio.to_thread.run_sync(results_table_of, path)
        except ControlError as exc:  # not a table this daemon wrote: no points
            log.warning("event.results_unread", path=str(path), error=str(exc))
            table = None
        return finished_details(receipt, attempts, None if table is None else dict(table))
