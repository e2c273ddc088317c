"""The plan's steps whose phase ends in one event: each phase run, and what it found
returned as one `PhaseResult` for the driver to apply: the event, the events journaled
with it in the same transaction, and a frozen `Memo` of what the driver keeps in memory
on the run's handle (nothing of it journaled; a restart learns it again).

(The submission and the queue's follow-up apply more than one event, or wait between
them: the driver runs those itself.)
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd_supervisor.core.run.lifecycle import Event
from llmd_supervisor.supervision.run import archive as archiving
from llmd_supervisor.supervision.run import finish, retries, submit, verify
from llmd_supervisor.supervision.run.attempt import Attempt
from llmd_supervisor.supervision.run.bench_files import JudgedFiles
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import AttemptEntry, ToJournal


@dataclass(frozen=True)
class Memo:
    """What the driver keeps of a phase on the run's handle (`RunHandle.keep`): the
    attempt it stopped watching (finish, archive), the `scontrol show job` record finishing
    took, and the files a verdict was made from (`judged`; `consumed`: the archive wrote
    them, they are not kept). None: the handle's stays."""

    attempt: Attempt | None = None
    snapshot: str | None = None
    judged: JudgedFiles | None = None
    consumed: bool = False


@dataclass(frozen=True)
class PhaseResult:
    """A phase's one result: `event` to apply with `logged` journaled in its transaction,
    `memo` kept before, and `entry` (an attempt ended) added to the run's history after."""

    event: Event
    logged: tuple[ToJournal, ...] = ()
    memo: Memo = Memo()
    entry: AttemptEntry | None = None


async def reconciled(ctx: RunContext) -> PhaseResult:
    """A run found `submitting`: its job looked up by name, or submitted now (once) when
    squeue and sacct both say it never existed (`submit`)."""
    found = await submit.reconcile(ctx)
    if isinstance(found, submit.Resubmit):  # surely never submitted: now, once
        found = await submit.submit(ctx, await retries.excluded(ctx))
    return PhaseResult(found)


async def finished(ctx: RunContext) -> PhaseResult:
    """The attempt's watchers stopped and its log copies completed (`finish`)."""
    done = await finish.finish(ctx)
    done.attempt.copies = done.copies
    return PhaseResult(done.event, memo=Memo(attempt=done.attempt, snapshot=done.snapshot))


async def verified(ctx: RunContext) -> PhaseResult:
    """The verdict, its receipt and the attempt's history entry (`verify`)."""
    judged = await verify.verify(ctx)
    memo = Memo(judged=judged.files)
    return PhaseResult(judged.event, judged.logged, memo, judged.entry)


async def archived(ctx: RunContext) -> PhaseResult:
    """The evidence written to the archive before the outcome (`archive`)."""
    written = await archiving.write_archive(ctx)
    if written.attempt is not None:
        written.attempt.copies = written.copies
    return PhaseResult(written.event, memo=Memo(attempt=written.attempt, consumed=True))
