"""A hostile job against the per-run driver on a replayed cluster (issue 3.2 items 5, 6):
what its marker says cannot keep its run from ending or reach a terminal unescaped; a
supervision step that keeps failing the same way ends the run; a cancel that comes after
the job's end does not change its outcome."""

from __future__ import annotations

import functools
import json
import os
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.core.run.lifecycle import RunState, SubmitFailed, Submitted
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.errors import SlurmCommandError
from llmd_supervisor.supervision.run import driver, failures, submit, verify
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.driver import RunHandle
from tests.fakes.bench_results import finish_job
from tests.unit.test_driver_replay import (
    _journal_submitting,
    _spec,
    publish_marker,
    replayed,
    run_job,
)

HOSTILE_REASON = "boom \ud800 \x1b[2K\x1b[1Goutcome succeeded\x1b]52;c;aGk=\x07"


def publish_hostile_marker(h: RunHandle, rc: int = 1, reason: str = HOSTILE_REASON) -> None:
    """The coordinator's results, then a marker whose reason is valid JSON that holds a
    lone surrogate and terminal escapes."""
    assert isinstance(h.spec, RunSpec)
    log_dir, job_id = Path(h.layout.log_dir), h.job_id()
    finish_job(log_dir, job_id, h.spec.benchmark, rc)
    marker = {
        "rc": rc,
        "job_id": job_id,
        "rank": 2,
        "reason": reason,
        "finished_at": datetime.now(UTC).isoformat(),
    }
    (log_dir / f".bench_done.{job_id}").write_text(json.dumps(marker))


@pytest.mark.asyncio
async def test_a_marker_reason_with_a_lone_surrogate_and_escapes_still_ends_the_run(
    tmp_path: Path,
) -> None:
    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)
        await run_job(rig, h, publish_hostile_marker)
        assert h.run.state is RunState.FAILED, h.run.reason
        reason = h.run.reason
        assert "\x1b" not in reason and "\x07" not in reason
        assert "boom \\ud800 \\x1b[2K\\x1b[1Goutcome succeeded" in reason
        stored = {s.run.run_id: s.run for s in await rig.journal.list_runs()}[h.run.run_id]
        assert stored.reason == reason


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's backoff after a failed step in milliseconds, not 1 s doubling to 60 s."""
    monkeypatch.setattr(driver, "RETRY_FIRST_S", 0.001)
    monkeypatch.setattr(driver, "RETRY_CAP_S", 0.01)


@pytest.mark.asyncio
@pytest.mark.usefixtures("fast_retries")
async def test_a_step_that_keeps_failing_the_same_way_ends_the_run_unverified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    async def broken(ctx: RunContext) -> verify.Judged:
        calls.append(1)
        raise UnicodeEncodeError(
            "utf-8", "boom \ud800", 5, 6, f"surrogates not allowed ({len(calls)})"
        )

    monkeypatch.setattr(verify, "verify", broken)
    async with replayed(tmp_path) as rig:
        h = await run_job(rig, await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0))
        assert h.run.state is RunState.UNVERIFIED, h.run.reason
        assert len(calls) == failures.SAME_FAILURES_MAX
        assert h.run.reason.startswith(
            f"supervision failed {failures.SAME_FAILURES_MAX} times in a row in state verifying: "
            "UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800' in position 5"
        ), h.run.reason
        receipt = json.loads((Path(h.meta.archive_dir) / "receipt.json").read_text())
        assert receipt["outcome"] == "unverified"
        assert receipt["supervision_failed"]["failures"] == failures.SAME_FAILURES_MAX


@pytest.mark.asyncio
@pytest.mark.usefixtures("fast_retries")
async def test_failures_that_differ_or_say_slurm_is_away_are_retried_until_they_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    judge = verify.verify
    errors = [RuntimeError("a"), KeyError("b")] * failures.SAME_FAILURES_MAX
    away = SlurmCommandError(["sacct"], 1, "slurmdbd is down")
    errors += [away] * 3 * failures.SAME_FAILURES_MAX

    async def flaky(ctx: RunContext) -> verify.Judged:
        if errors:
            raise errors.pop(0)
        return await judge(ctx)

    monkeypatch.setattr(verify, "verify", flaky)
    async with replayed(tmp_path) as rig:
        h = await run_job(rig, await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0))
        assert h.run.state is RunState.SUCCEEDED, h.run.reason
        assert not errors


@pytest.mark.asyncio
@pytest.mark.usefixtures("fast_retries")
async def test_a_run_whose_sbatch_may_be_in_flight_is_never_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    reconcile = submit.reconcile

    async def broken(ctx: RunContext) -> Submitted | SubmitFailed | submit.Resubmit:
        calls.append(1)
        if len(calls) <= 3 * failures.SAME_FAILURES_MAX:
            raise ValueError("the same bug every time")
        return await reconcile(ctx)

    monkeypatch.setattr(submit, "reconcile", broken)
    monkeypatch.setattr(submit, "SUBMIT_SETTLE_S", 0.0)
    async with replayed(tmp_path) as rig:
        run_id, _ = await _journal_submitting(rig)
        await rig.sup.resume_all()
        h = rig.sup.handles[run_id]
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        assert len(calls) == 3 * failures.SAME_FAILURES_MAX + 1


@pytest.mark.asyncio
async def test_a_cancel_that_comes_after_the_job_ended_does_not_change_its_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    judge = verify.verify
    cancelled = anyio.Event()

    async def after_the_cancel(ctx: RunContext) -> verify.Judged:
        await cancelled.wait()  # the job ended (COMPLETED, marker rc 1); then the cancel
        return await judge(ctx)

    monkeypatch.setattr(verify, "verify", after_the_cancel)
    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_job, rig, h, functools.partial(publish_hostile_marker, reason="x"))
            await rig.until(h, lambda h: h.run.state is RunState.VERIFYING)
            await rig.sup.cancel(h)
            cancelled.set()
        assert h.run.state is RunState.FAILED, h.run.reason
        assert h.run.reason.startswith("marker rc=1 from rank 2: x; "), h.run.reason
        assert "cancel requested by the supervisor" not in h.run.reason
        assert h.run.reason.endswith("; the cancel did not reach the job before it ended")
        assert rig.replay.argvs("scancel") == []
        receipt = json.loads((Path(h.meta.archive_dir) / "receipt.json").read_text())
        assert receipt["outcome"] == "failed"
        assert receipt["cause"]["cause"] != "cancelled"


@pytest.mark.asyncio
async def test_a_cancel_racing_the_jobs_end_does_not_change_its_outcome(tmp_path: Path) -> None:
    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)

        def end_then_cancel(h: RunHandle) -> None:
            publish_hostile_marker(h, reason="x")
            rig.replay.step()  # the job ends now, before the poller or the driver know it
            rig.replay.expect(h.run.job_name)  # run_job's own step finds nothing left to do
            rig.sup.tg.start_soon(rig.sup.cancel, h)

        await run_job(rig, h, end_then_cancel)
        assert h.run.state is RunState.FAILED, h.run.reason
        assert "cancel requested by the supervisor" not in h.run.reason
        assert rig.replay.job(h.run.job_name).signals in ([], ["TERM"])  # TERM: refused


@pytest.mark.asyncio
async def test_a_refused_file_named_with_escapes_and_undecodable_bytes_is_journaled_escaped(
    tmp_path: Path,
) -> None:
    def plant_then_publish(h: RunHandle) -> None:
        job_dir = Path(h.layout.log_dir) / h.job_id()
        job_dir.mkdir(parents=True, exist_ok=True)
        name = b"rank0.\xff\x1b]0;pwned\x07.log"  # not UTF-8, with an OSC sequence
        os.symlink(b"/etc/passwd", os.path.join(os.fsencode(job_dir), name))
        publish_marker(h)

    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)
        await run_job(rig, h, plant_then_publish)
        assert h.run.state is RunState.SUCCEEDED, h.run.reason
        refused = [e for e in await rig.journal.events(h.run.run_id) if e["kind"] == "log.refused"]
        assert len(refused) == 1, refused
        assert str(refused[0]["path"]).endswith("/rank0.\\udcff\\x1b]0;pwned\\x07.log")
