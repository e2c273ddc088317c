"""Each phase of a run on its own, against a `RunContext` fake (tests/fakes/run_context.py)
and a replayed Slurm: what it returns for the driver to apply, and what it journals. The
driver's own tests (test_driver_*.py) take whole runs through the same phases."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.core.run.lifecycle import (
    Archived,
    Held,
    HoldExpired,
    LeftQueue,
    RunState,
    Started,
    SubmitFailed,
    Submitted,
    SupervisionFailed,
    Verified,
    WatchersStopped,
)
from llmd_supervisor.core.run.retry_policy import Evidence, NodeFailure
from llmd_supervisor.core.slurm.parse import JobState, parse_scontrol_job
from llmd_supervisor.core.spec.foreign import load as load_foreign
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.supervision.run import (
    archive,
    cancel,
    failures,
    finish,
    follow,
    foreign,
    retries,
    submit,
    verify,
)
from llmd_supervisor.supervision.run.attempt import CopyState
from llmd_supervisor.supervision.run.records import (
    ATTEMPT_EVENT,
    HELD_EVENT,
    JOB_FILES_EVENT,
    RECEIPT_EVENT,
    TERM_EVENT,
    AttemptEntry,
    attempt_entry_of,
    job_files_of,
)
from tests.fakes.bench_results import finish_job
from tests.fakes.run_context import FakeRun, demo_spec, fake_run
from tests.fakes.slurm_replay import End, Reply, Start

NODES = ("node1", "node2", "node3", "node4")


# --- submit ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_submit_calls_sbatch_once_with_the_exclusions_and_returns_the_job(
    tmp_path: Path,
) -> None:
    async with fake_run(tmp_path) as ctx:
        got = await submit.submit(ctx, ("node3",))
        (argv,) = ctx.replay.argvs("sbatch")
        assert got == Submitted(ctx.replay.job("llmd-r1").job_id)
        assert "--exclude=node3" in argv
        assert ctx.emitted == []  # the driver journals the transition


@pytest.mark.asyncio
async def test_a_failed_sbatch_whose_job_exists_all_the_same_is_that_job(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        ctx.replay.fail("sbatch", Reply(1, "", "sbatch: error: Socket timed out", applied=True))
        got = await submit.submit(ctx, ())
        assert got == Submitted(ctx.replay.job("llmd-r1").job_id)


@pytest.mark.asyncio
async def test_a_failed_sbatch_without_a_job_fails_the_submission(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        ctx.replay.fail("sbatch", Reply(1, "", "sbatch: error: invalid partition"))
        got = await submit.submit(ctx, ())
        assert isinstance(got, SubmitFailed)
        assert got.reason.startswith("sbatch failed: ") and "invalid partition" in got.reason
        assert ctx.replay.jobs == {}


@pytest.mark.asyncio
async def test_reconcile_finds_the_job_by_name_or_says_to_submit_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(submit, "SUBMIT_SETTLE_S", 0.0)
    async with fake_run(tmp_path) as ctx:
        assert await submit.reconcile(ctx) is submit.RESUBMIT
        job = ctx.replay.add_job("llmd-r1")
        assert await submit.reconcile(ctx) == Submitted(job.job_id)
        assert ctx.replay.count("sbatch") == 0


@pytest.mark.asyncio
async def test_reconcile_keeps_the_first_job_of_the_name_and_cancels_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two daemons both submitted (the fence and the in-flight window make it impossible;
    this is the alarm if it happens all the same)."""
    monkeypatch.setattr(submit, "SUBMIT_SETTLE_S", 0.0)
    async with fake_run(tmp_path) as ctx:
        first = ctx.replay.add_job("llmd-r1")
        second = ctx.replay.add_job("llmd-r1")
        assert await submit.reconcile(ctx) == Submitted(first.job_id)
        cancelled = [a[-1] for a in ctx.replay.argvs("scancel")]
        assert cancelled == [second.job_id]


@pytest.mark.asyncio
async def test_sbatch_waits_until_the_daemon_may_act_long_enough(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        ctx.lease_left = 1.0  # its lease was last renewed 9 s ago
        with anyio.move_on_after(0.6):
            await submit.submit(ctx, ())
        assert ctx.replay.count("sbatch") == 0
        ctx.lease_left = 9.5  # renewed
        with anyio.fail_after(5):
            got = await submit.submit(ctx, ())
        assert got == Submitted(ctx.replay.job("llmd-r1").job_id)


# --- follow ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_follow_says_started_then_left_queue(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        ctx.replay.expect("llmd-r1", Start(NODES), End(JobState.COMPLETED))
        got = await submit.submit(ctx, ())
        assert isinstance(got, Submitted)
        ctx.submitted(got.job_id)
        ctx.replay.step()
        followed = follow.Followed(None)
        with anyio.fail_after(10):  # as the driver does: each view in turn until one says
            while (followed := await follow.follow_queue(ctx, 0, followed.view)).event is None:
                pass
        assert followed.event == Started(NODES)
        ctx.run = dataclasses.replace(ctx.run, state=RunState.RUNNING, nodes=NODES)
        ctx.replay.step()
        with anyio.fail_after(10):
            while (followed := await follow.follow_queue(ctx, 0, followed.view)).event is None:
                pass
        assert followed.event == LeftQueue()


@pytest.mark.asyncio
async def test_follow_returns_nothing_when_the_run_changes_first(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        ctx.replay.add_job("llmd-r1", job_id="100")
        ctx.submitted("100")
        first = await follow.follow_queue(ctx, ctx.version, None)  # PENDING: nothing new
        assert first.view is not None and first.event is None
        latest = ctx.cluster.poller.latest("100")  # no newer view until the next change
        since = ctx.version
        ctx.change()  # a cancel, say, since the driver planned
        assert await follow.follow_queue(ctx, since, latest) == follow.Followed(None)


# --- finish, verify, archive: one job's end ---------------------------------------------------


async def ended_job(ctx: FakeRun, rc: int = 0) -> str:
    """A job that ran on NODES and ended COMPLETED 0:0 after its coordinator wrote its
    results and a marker of `rc`; the run as the driver leaves it in `finishing`."""
    job = ctx.replay.add_job("llmd-r1", Start(NODES), End(JobState.COMPLETED))
    ctx.submitted(job.job_id)
    ctx.replay.step()
    assert isinstance(ctx.spec, RunSpec)
    finish_job(Path(ctx.layout.log_dir), job.job_id, ctx.spec.benchmark, rc)
    ctx.replay.step()
    ctx.run = dataclasses.replace(ctx.run, state=RunState.FINISHING, nodes=NODES)
    return job.job_id


@pytest.mark.asyncio
async def test_finish_snapshots_the_job_and_completes_a_new_attempts_copies(
    tmp_path: Path,
) -> None:
    async with fake_run(tmp_path) as ctx:
        job_id = await ended_job(ctx)
        finished = await finish.finish(ctx)
        assert finished.event == WatchersStopped()
        assert finished.attempt.nodes == NODES and finished.attempt.job_id == job_id
        assert finished.copies is CopyState.COMPLETE
        assert finished.snapshot is not None and f"JobId={job_id}" in finished.snapshot
        saved = ctx.layout.archive_dir / "scontrol-show-job.txt"
        assert saved.read_text() == finished.snapshot


@pytest.mark.asyncio
async def test_verify_returns_the_verdict_with_a_receipt_complete_when_it_is_made(
    tmp_path: Path,
) -> None:
    async with fake_run(tmp_path) as ctx:
        await ended_job(ctx)
        ctx.run = dataclasses.replace(ctx.run, state=RunState.VERIFYING)
        with anyio.fail_after(15):
            judged = await verify.verify(ctx)
        assert judged.event == Verified(Outcome.SUCCEEDED, judged.event.reason)
        assert judged.entry is not None and judged.entry["outcome"] == "succeeded"
        # Nothing journaled by the phase: the driver writes these with the verdict.
        assert ctx.kinds() == []
        assert [kind for kind, _ in judged.logged] == [ATTEMPT_EVENT, RECEIPT_EVENT]
        assert judged.logged[0][1] == judged.entry
        receipt = judged.logged[-1][1]["receipt"]
        assert isinstance(receipt, dict)
        assert receipt["outcome"] == "succeeded" and receipt["cause"] is None
        assert receipt["attempts"] == [judged.entry]
        assert set(receipt["usage"]) == {"elapsed_s", "node_hours", "gpu_hours"}
        assert set(receipt["usage_total"]) == {
            "gpu_hours_useful",
            "gpu_hours_lost",
            "node_hours_useful",
            "node_hours_lost",
        }
        # Re-done after a crash (the entry journaled, the driver's history has it): the
        # attempt's end is not recorded twice, and the receipt says the same.
        ctx.history = (judged.entry,)
        with anyio.fail_after(15):
            again = await verify.verify(ctx)
        assert again.entry is None and again.event == judged.event
        assert [kind for kind, _ in again.logged] == [RECEIPT_EVENT]
        assert again.logged[0][1]["receipt"]["attempts"] == [judged.entry]  # type: ignore[index]


@pytest.mark.asyncio
async def test_archive_writes_the_last_receipt_and_the_results(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        await ended_job(ctx)
        ctx.run = dataclasses.replace(ctx.run, state=RunState.VERIFYING)
        with anyio.fail_after(15):
            judged = await verify.verify(ctx)
        assert isinstance(judged.event, Verified)
        for kind, fields in judged.logged:  # as the driver journals them
            await ctx.emit(kind, fields)
        ctx.run = dataclasses.replace(ctx.run, state=RunState.ARCHIVING, outcome=Outcome.SUCCEEDED)
        with anyio.fail_after(15):
            written = await archive.write_archive(ctx)
        assert written.event == Archived()
        assert written.attempt is not None and written.attempt.nodes == NODES  # a restart's
        receipt = json.loads((ctx.layout.archive_dir / "receipt.json").read_text())
        assert receipt == json.loads(json.dumps(ctx.emitted[-1]["receipt"]))
        table = json.loads((ctx.layout.archive_dir / "results.json").read_text())
        assert [p["valid"] for p in table["points"]] == [True] * len(table["points"])


# --- retries --------------------------------------------------------------------------------


def only_nodes(ctx: FakeRun, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster's nodes as sinfo lists them (the replayed cluster does not answer it)."""

    async def node_names(partition: str | None = None) -> list[str]:
        return list(NODES)

    monkeypatch.setattr(ctx.cluster.client, "node_names", node_names)


async def quarantine_node4(ctx: FakeRun) -> None:
    """node4 failed under another user's run: quarantined for everyone."""
    seen = NodeFailure("dev", "node4", 1001, "r0", 1, Evidence.OBSERVED, "NODE_FAIL", ctx.now())
    await ctx.journal.count_node_failure(seen, forget_before=ctx.now() - timedelta(hours=6))


@pytest.mark.asyncio
async def test_before_submit_excludes_nothing_on_a_healthy_cluster(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        assert await retries.before_submit(ctx) == ()


@pytest.mark.asyncio
async def test_before_submit_holds_a_run_too_many_nodes_are_kept_from_then_expires_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with fake_run(tmp_path) as ctx:
        only_nodes(ctx, monkeypatch)
        await quarantine_node4(ctx)
        hold = await retries.before_submit(ctx)
        assert isinstance(hold, retries.Hold) and isinstance(hold.event, Held)
        assert hold.until == ctx.now() + timedelta(seconds=retries.hold_timeout_s(ctx))
        assert hold.event.reason.startswith("waiting: the job needs 4 nodes and only 3 of 4")
        (held,) = ctx.emitted
        assert held["kind"] == HELD_EVENT and held["submission"] == 1
        assert held["until"] == hold.until.isoformat()
        # The driver applies the hold; past its deadline the run fails, its receipt first.
        ctx.run = dataclasses.replace(ctx.run, reason=hold.event.reason)
        ctx.clock = hold.until
        expired = await retries.before_submit(ctx)
        assert isinstance(expired, HoldExpired)
        assert expired.reason.startswith("held for want of nodes since ")
        assert await retries.expire_hold(ctx, expired) is expired
        receipt = ctx.emitted[-1]["receipt"]
        assert isinstance(receipt, dict)
        assert receipt["outcome"] == "failed" and receipt["held"]["submission"] == 1
        assert ctx.kinds() == [HELD_EVENT, RECEIPT_EVENT]


@pytest.mark.asyncio
async def test_a_retry_waits_its_backoff_before_anything_else(tmp_path: Path) -> None:
    spec = demo_spec(tmp_path / "logs", "\n[retry]\nbackoff_s = 30\n")
    async with fake_run(tmp_path, spec) as ctx:
        ctx.run = dataclasses.replace(ctx.run, submission=2)
        assert await retries.before_submit(ctx) is None
        assert ctx.waited == [30.0]
        assert ctx.replay.count("sinfo") == ctx.replay.count("sbatch") == 0


# --- the attempt's history entry ----------------------------------------------------------------


ENTRY: AttemptEntry = {
    "attempt": 1,
    "submission": 1,
    "slurm_job_id": "100",
    "job_name": "llmd-r1",
    "nodes": list(NODES),
    "outcome": "node_failed",
    "reason": "State=NODE_FAIL",
    "cause": "infrastructure",
    "implicated": ["node3"],
    "exclude": ["node3"],
    "retry": "retry 1 of 1",
    "retried": True,
    "unplaced": False,
    "elapsed_s": 60.0,
    "node_hours": 0.066667,
    "gpu_hours": 0.533333,
}


def test_an_attempt_entry_reads_back_as_it_was_journaled() -> None:
    stored = {"at": "2026-12-01T12:00:00+00:00", "kind": ATTEMPT_EVENT, **ENTRY}
    back = attempt_entry_of(json.loads(json.dumps(stored)))
    assert json.dumps(back, sort_keys=True) == json.dumps(stored, sort_keys=True)


def test_an_older_daemons_attempt_entry_reads_back_without_what_it_lacked() -> None:
    older = {k: v for k, v in ENTRY.items() if k not in ("retried", "unplaced", "gpu_hours")}
    back = attempt_entry_of(older)
    assert dict(back) == older
    assert "retried" not in back  # so the decision is made again (`retries`)


# --- foreign jobs -----------------------------------------------------------------------------


def adopt_spec(log_dir: Path) -> str:
    return json.dumps({"foreign": {"kind": "adopt", "job_id": "100", "log_dir": str(log_dir)}})


@pytest.mark.asyncio
async def test_a_foreign_jobs_files_are_journaled_and_read_back(tmp_path: Path) -> None:
    spec = load_foreign(adopt_spec(tmp_path / "logs"))
    async with fake_run(tmp_path, spec) as ctx:
        inside, outside = f"{tmp_path}/logs/job.out", "/etc/job.err"
        job = parse_scontrol_job(
            "JobId=100 JobName=theirs UserId=alice(1000) JobState=RUNNING ExitCode=0:0 "
            f"SubmitTime=2026-12-01T11:59:00 StdErr={outside} StdOut={inside}"
        )
        files = await foreign.note_job_files(ctx, job)
        assert files["batch_logs"] == [inside]
        assert files["submit_time"] == "2026-12-01T11:59:00"
        assert ctx.kinds() == [JOB_FILES_EVENT, "log.refused"]
        assert foreign.recalled(ctx.emitted[:1]) == job_files_of(ctx.emitted[0]) == files
        layout, submitted = foreign.used(ctx.layout, spec, files)
        assert layout.batch_paths == (inside,) and submitted == "2026-12-01T11:59:00"


# --- cancel -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_cancel_sequence_journals_the_term_it_sent(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        job = ctx.replay.add_job("llmd-r1", job_id="100")
        job.on_term = (End(JobState.CANCELLED),)
        ctx.submitted("100")
        ctx.run = dataclasses.replace(ctx.run, cancel_requested=True)
        ctx.cluster.poller.track("100", ctx.starttime())
        with anyio.fail_after(20):
            await cancel.cancel_sequence(ctx, "100")
        assert job.signals == ["TERM"]
        (term,) = ctx.emitted
        assert {k: term[k] for k in ("kind", "slurm_job_id", "delivered", "for")} == {
            "kind": TERM_EVENT,
            "slurm_job_id": "100",
            "delivered": True,
            "for": "cancel",
        }
        assert cancel.reached(ctx.run, ctx.emitted, "100")


# --- failures ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_giving_up_is_a_receipt_and_an_event_for_the_driver(tmp_path: Path) -> None:
    async with fake_run(tmp_path) as ctx:
        ctx.history = (ENTRY,)
        receipt, event = failures.given_up(ctx, ValueError("bad \x1b[2J value"), 8)
        assert isinstance(event, SupervisionFailed)
        assert event.reason == receipt["reason"]
        assert event.reason.startswith("supervision failed 8 times in a row in state accepted")
        assert "\x1b" not in event.reason
        assert receipt["attempts"] == [ENTRY]
        assert receipt["supervision_failed"]["failures"] == 8
        assert ctx.emitted == []  # the driver journals it and applies the event
