"""The per-run driver against a replayed Slurm cluster (tests/fakes/slurm_replay.py).

Fast, in addition to the real-cluster tests: submission exactly once, name reconciliation
after a crash, the cancel sequence, a cancel that arrives while the driver is backing off
after an error, and a requeue. Node links go to a closed loopback port (the nodes of a
replayed cluster do not exist here), so watchers see unreachable nodes and copy nothing.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import pytest

from llmd_supervisor.adapters.journal.store import Journal, RunMeta
from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
from llmd_supervisor.adapters.slurm.runner import SlurmClient
from llmd_supervisor.core.config import ClusterConfig, Config, Limits, PollConfig, SshConfig
from llmd_supervisor.core.run.lifecycle import RunState, Submit, new_run, step
from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.errors import SupervisorError
from llmd_supervisor.supervision.cluster.clusters import Cluster, SharedLogDir
from llmd_supervisor.supervision.cluster.poller import Poller, QueueView
from llmd_supervisor.supervision.run import follow, submit
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.driver import RunHandle
from llmd_supervisor.supervision.run.supervisor import Supervisor
from tests.devcluster import REPO
from tests.fakes.bench_results import finish_job
from tests.fakes.slurm_replay import End, ReplayCluster, Requeue, Start

NODES = ("127.0.0.1",)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec(log_dir: Path, grace_s: int = 2) -> str:
    lines = []
    for line in (REPO / "deploy" / "llm-d" / "demo.toml").read_text().splitlines():
        if line.startswith("log_dir ="):
            line = f'log_dir = "{log_dir}"'
        elif line.startswith("sigterm_grace_s ="):
            line = f"sigterm_grace_s = {grace_s}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def publish_marker(h: RunHandle, rc: int = 0) -> None:
    """What the coordinator writes at the end: results, then the marker."""
    assert isinstance(h.spec, RunSpec)
    finish_job(Path(h.layout.log_dir), h.job_id(), h.spec.benchmark, rc)


@dataclass
class Rig:
    sup: Supervisor
    replay: ReplayCluster
    journal: Journal
    tmp: Path

    async def until(
        self, h: RunHandle, done: Callable[[RunHandle], bool], limit: float = 20
    ) -> None:
        with anyio.fail_after(limit):
            while not done(h):
                await h.changed.wait()

    async def final(self, h: RunHandle) -> RunHandle:
        await self.until(h, lambda h: h.run.state.is_final)
        return h


@contextlib.asynccontextmanager
async def replayed(tmp_path: Path) -> AsyncIterator[Rig]:
    """A supervisor on a replayed cluster, inside the test's own task (anyio's task groups
    must be entered and left by one task, so this is not a fixture)."""
    (tmp_path / "known_hosts").write_text("")
    config = Config(
        state_dir=tmp_path / "state",
        log_roots=(str(tmp_path),),
        ssh=SshConfig(
            known_hosts=str(tmp_path / "known_hosts"), port=_closed_port(), connect_timeout_s=0.5
        ),
        poll=PollConfig(min_interval_s=0.05, max_interval_s=0.2),
        limits=Limits(verify_timeout_s=10, finish_drain_s=1, heartbeat_interval_s=0.2),
        clusters=(ClusterConfig("dev"),),
    )
    replay = ReplayCluster(touch_files=True)
    client = SlurmClient(replay, timeout=5)
    poller = Poller("dev", client, config.poll, squeue_interval_s=0.1)
    journal = await Journal.open(config.journal_path)
    files = SharedLogDir()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(poller.run)
            cluster = Cluster(ClusterConfig("dev"), client, poller, files, jobfiles.SharedFsNode)
            sup = Supervisor(config, journal, {"dev": cluster}, tg)
            yield Rig(sup, replay, journal, tmp_path)
            tg.cancel_scope.cancel()
    finally:
        await files.aclose()
        await journal.aclose()


async def run_job(
    rig: Rig, h: RunHandle, publish: Callable[[RunHandle], None] = publish_marker
) -> RunHandle:
    """Take a submitted run's job through its start, the coordinator's `publish` (results
    and marker) and its end, COMPLETED 0:0; return the run once final."""
    rig.replay.expect(h.run.job_name, Start(NODES), End(JobState.COMPLETED))
    # Without the marker, COMPLETED 0:0 is no success (test_verdict has that case).
    await rig.until(h, lambda h: h.run.state is RunState.PENDING)
    rig.replay.step()
    await rig.until(h, lambda h: h.attempt is not None and h.attempt.running)
    publish(h)
    rig.replay.step()
    return await rig.final(h)


@pytest.mark.asyncio
async def test_a_run_is_submitted_once_and_followed_to_its_verified_end(tmp_path: Path) -> None:
    async with replayed(tmp_path) as rig:
        h = await run_job(rig, await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0))
        assert h.run.state is RunState.SUCCEEDED, h.run.reason
        assert rig.replay.count("sbatch") == 1
        assert (Path(h.meta.archive_dir) / "receipt.json").exists()


@pytest.mark.asyncio
async def test_cancel_of_a_pending_job_runs_the_cancel_sequence(tmp_path: Path) -> None:
    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        job = rig.replay.job(h.run.job_name)
        job.on_term = (End(JobState.CANCELLED),)
        await rig.sup.cancel(h)
        await rig.final(h)
        assert h.run.state is RunState.CANCELLED, h.run.reason
        assert job.signals == ["TERM"]  # left the queue within the grace: no hard kill
        assert rig.replay.argvs("scancel") == [("scancel", "--signal=TERM", job.job_id)]


@pytest.mark.asyncio
async def test_cancel_sequence_kills_after_the_grace(tmp_path: Path) -> None:
    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs", grace_s=1), owner_uid=0)
        rig.replay.expect(h.run.job_name, Start(NODES))
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        rig.replay.step()
        await rig.until(h, lambda h: h.run.state is RunState.RUNNING)
        await rig.sup.cancel(h)  # TERM changes nothing here: the plain scancel ends it
        await rig.final(h)
        assert h.run.state is RunState.CANCELLED
        assert rig.replay.job(h.run.job_name).signals == ["TERM", "KILL"]


@pytest.mark.asyncio
async def test_a_cancel_during_a_supervision_retry_is_not_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with replayed(tmp_path) as rig:
        failures: list[str] = []
        follow_queue = follow.follow_queue
        cancelled_in_backoff = anyio.Event()

        async def flaky(ctx: RunContext, since: int, last: QueueView | None) -> follow.Followed:
            if not failures:
                failures.append("once")
                raise RuntimeError("a bug in one step")
            await cancelled_in_backoff.wait()
            return await follow_queue(ctx, since, last)

        monkeypatch.setattr(follow, "follow_queue", flaky)
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)
        await rig.until(h, lambda h: bool(failures))
        job = rig.replay.job(h.run.job_name)
        job.on_term = (End(JobState.CANCELLED),)
        await rig.sup.cancel(h)  # the driver is sleeping its backoff: nothing runs the cancel now
        assert job.signals == []
        cancelled_in_backoff.set()
        await rig.final(h)
        assert h.run.state is RunState.CANCELLED
        assert job.signals == ["TERM"]


async def _journal_submitting(rig: Rig) -> tuple[str, str]:
    """A run journaled as `submitting` by a daemon that then died (sbatch in flight)."""
    spec = _spec(rig.tmp / "logs")
    run = new_run("crashed1", "llmd-crashed1", rig.sup.clock())
    meta = RunMeta(
        0,
        "dev",
        spec,
        "#!/bin/bash\n",
        str(rig.tmp / "logs"),
        str(rig.tmp / "archive"),
        rig.sup.clock(),
    )
    await rig.journal.insert_run(run, meta)
    submitting, _ = step(run, Submit(), rig.sup.clock())
    await rig.journal.save(submitting, expected=run.state)
    return run.run_id, run.job_name


@pytest.mark.asyncio
async def test_after_a_crash_in_submitting_the_job_found_by_name_is_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with replayed(tmp_path) as rig:
        monkeypatch.setattr(submit, "SUBMIT_SETTLE_S", 0.0)
        run_id, job_name = await _journal_submitting(rig)
        job = rig.replay.add_job(job_name)  # the lost sbatch did submit it
        assert await rig.sup.resume_all() == 1
        h = rig.sup.handles[run_id]
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        assert h.run.slurm_job_id == job.job_id
        assert rig.replay.count("sbatch") == 0


@pytest.mark.asyncio
async def test_after_a_crash_in_submitting_a_job_that_surely_never_was_is_submitted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with replayed(tmp_path) as rig:
        monkeypatch.setattr(submit, "SUBMIT_SETTLE_S", 0.0)
        run_id, _ = await _journal_submitting(rig)
        await rig.sup.resume_all()
        h = rig.sup.handles[run_id]
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        assert rig.replay.count("sbatch") == 1


@pytest.mark.asyncio
async def test_a_requeued_job_stays_the_same_run_with_a_new_attempt(tmp_path: Path) -> None:
    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)
        rig.replay.expect(
            h.run.job_name, Start(NODES), Requeue(), Start(NODES), End(JobState.COMPLETED)
        )
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        rig.replay.step()
        await rig.until(h, lambda h: h.run.state is RunState.RUNNING)
        rig.replay.step()
        await rig.until(h, lambda h: h.run.attempt == 2)
        rig.replay.step()
        await rig.until(h, lambda h: h.run.state is RunState.RUNNING)
        assert h.attempt is not None and h.attempt.number == 2
        publish_marker(h)
        rig.replay.step()
        await rig.final(h)
        assert [t.event for t in h.run.transitions].count("Requeued") == 1
        assert rig.replay.count("sbatch") == 1


@pytest.mark.asyncio
async def test_a_lagging_sacct_saying_pending_after_a_restart_is_no_requeue(
    tmp_path: Path,
) -> None:
    """sacct can still say PENDING just after a job started (seen after a daemon restart,
    when the poller has no earlier view to keep it from going back): only squeue says
    that a job went back to the queue."""
    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)
        rig.replay.expect(h.run.job_name, Start(NODES))
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        job = rig.replay.job(h.run.job_name)
        job.lag_accounting()  # sacct keeps saying PENDING
        rig.replay.step()
        await rig.until(h, lambda h: h.run.state is RunState.RUNNING)
        poller = h.cluster.poller
        poller.untrack(h.job_id())  # what a restarted daemon's poller knows of the job
        with anyio.fail_after(10):  # several sacct answers of PENDING
            await rig.replay.wait_calls("sacct", rig.replay.count("sacct") + 5)
        assert h.run.state is RunState.RUNNING
        assert h.run.attempt == 1


@pytest.mark.asyncio
async def test_runs_of_a_cluster_no_longer_configured_stay_listed_and_are_not_driven(
    tmp_path: Path,
) -> None:
    async with replayed(tmp_path) as rig:
        spec = _spec(rig.tmp / "logs")
        for run_id in ("old1", "old2"):
            run = new_run(run_id, f"llmd-{run_id}", rig.sup.clock())
            meta = RunMeta(
                0, "gone", spec, "", str(rig.tmp / "logs"), str(rig.tmp / run_id), rig.sup.clock()
            )
            await rig.journal.insert_run(run, meta)
        assert await rig.sup.resume_all() == 0
        assert set(rig.sup.handles) == {"old1", "old2"}
        with pytest.raises(SupervisorError, match="'gone' is no longer configured"):
            _ = rig.sup.handles["old1"].cluster
        assert rig.replay.count("sbatch") == rig.replay.count("squeue") == 0
