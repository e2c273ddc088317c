"""The poller against the replayed cluster (tests/fakes/slurm_replay.py): fast, no cluster.

Each test drives ticks one at a time (`tick`), so call counts are exact; the last one runs
the poller's own loop. DESIGN.md section 6: one squeue and one sacct per tick for all
tracked jobs, sacct chunked only for long id lists, failed or empty answers are not facts,
and "accounting storage is disabled" switches the poller to squeue and scontrol alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.slurm.runner import SlurmClient
from llmd_supervisor.core.config import PollConfig
from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.core.verdict.decide import QueryOutcome, SlurmQuery, Source
from llmd_supervisor.supervision.cluster.poller import Poller, QueueView
from tests.fakes.slurm_replay import (
    INVALID_JOB_ID,
    SACCT_DBD_DOWN,
    SLURMCTLD_DOWN,
    TIMEOUT,
    End,
    ReplayCluster,
    ReplayJob,
    Reply,
    Start,
)

FAST = PollConfig(min_interval_s=0.001, max_interval_s=0.01, command_timeout_s=5.0)
EVERY_TICK = 0.0  # squeue_interval_s: squeue in every tick
RARELY = 3600.0  # squeue_interval_s: squeue only when a job is new or sacct failed


def poller(cluster: ReplayCluster, *, squeue_interval_s: float, chunk: int = 200) -> Poller:
    poll = PollConfig(FAST.min_interval_s, FAST.max_interval_s, FAST.command_timeout_s, chunk)
    return Poller("dev", SlurmClient(cluster), poll, squeue_interval_s=squeue_interval_s)


async def tick(p: Poller) -> None:
    await p._tick()


def view(p: Poller, job: ReplayJob) -> QueueView:
    latest = p.latest(job.job_id)
    assert latest is not None, f"no view of job {job.job_id}"
    return latest


def seen(p: Poller, job: ReplayJob) -> tuple[JobState | None, tuple[str, ...], str]:
    v = view(p, job)
    return (v.state, v.nodes, v.source)


def ids_of(argv: tuple[str, ...]) -> list[str]:
    (jobs,) = [a for a in argv if a.startswith("--jobs=")]
    return jobs.removeprefix("--jobs=").split(",")


def jobs(cluster: ReplayCluster, n: int, *steps: Start | End) -> Iterator[ReplayJob]:
    for i in range(n):
        job = cluster.add_job(f"llmd-r{len(cluster.jobs)}-{i}", *steps)
        job.step(), job.step()
        yield job


async def sacct_evidence(p: Poller, jobs_: Iterable[ReplayJob]) -> dict[str, SlurmQuery]:
    """One sacct evidence request per job, all answered in one tick."""
    answers: dict[str, SlurmQuery] = {}

    async def ask(job: ReplayJob) -> None:
        answers[job.job_id] = await p.evidence(Source.SACCT, job.job_id, None)

    async with anyio.create_task_group() as tg:
        for job in jobs_:
            tg.start_soon(ask, job)
        await anyio.wait_all_tasks_blocked()
        await tick(p)
    return answers


# --- one query per tick, whatever the number of jobs --------------------------------------------


@pytest.mark.asyncio
async def test_one_squeue_and_one_sacct_per_tick_for_many_jobs() -> None:
    cluster = ReplayCluster()
    pending = list(jobs(cluster, 20))
    running = list(jobs(cluster, 20, Start(("node1", "node2"))))
    ended = list(jobs(cluster, 20, Start(("node3",)), End("COMPLETED")))
    p = poller(cluster, squeue_interval_s=EVERY_TICK)
    for job in cluster.jobs.values():
        p.track(job.job_id)
    await tick(p)
    assert cluster.counts() == {"squeue": 1, "sacct": 1}
    everyone = sorted(cluster.jobs, key=int)
    assert sorted(ids_of(cluster.argvs("squeue")[0]), key=int) == everyone
    assert sorted(ids_of(cluster.argvs("sacct")[0]), key=int) == everyone
    assert {seen(p, j) for j in pending} == {(JobState.PENDING, (), "squeue")}
    assert {seen(p, j) for j in running} == {(JobState.RUNNING, ("node1", "node2"), "squeue")}
    assert {seen(p, j) for j in ended} == {(JobState.COMPLETED, ("node3",), "squeue")}
    assert all(view(p, j).left_queue for j in ended)
    for _ in range(4):
        await tick(p)
    assert cluster.counts() == {"squeue": 5, "sacct": 5}


@pytest.mark.asyncio
async def test_sacct_is_chunked_for_long_id_lists_and_squeue_is_not() -> None:
    cluster = ReplayCluster()
    tracked = list(jobs(cluster, 45, Start(("node1",))))
    p = poller(cluster, squeue_interval_s=EVERY_TICK, chunk=20)
    for job in tracked:
        p.track(job.job_id, starttime="2026-01-01T00:00:00")
    p.track(tracked[0].job_id, starttime="2025-06-01T00:00:00")  # already tracked: ignored
    await tick(p)
    sacct = cluster.argvs("sacct")
    assert [len(ids_of(argv)) for argv in sacct] == [20, 20, 5]
    asked = [job_id for argv in sacct for job_id in ids_of(argv)]
    assert sorted(asked, key=int) == sorted(cluster.jobs, key=int)
    assert all("--starttime=2026-01-01T00:00:00" in argv for argv in sacct)
    assert [len(ids_of(argv)) for argv in cluster.argvs("squeue")] == [45]
    assert {seen(p, j)[0] for j in tracked} == {JobState.RUNNING}


@pytest.mark.asyncio
async def test_evidence_for_many_jobs_rides_on_the_same_sacct() -> None:
    cluster = ReplayCluster()
    done = list(jobs(cluster, 10, Start(("node1",)), End("COMPLETED")))
    p = poller(cluster, squeue_interval_s=RARELY)
    p.track(done[0].job_id)
    answers = await sacct_evidence(p, done)
    assert cluster.count("sacct") == 1
    assert {a.outcome for a in answers.values()} == {QueryOutcome.RECORD}
    assert {a.record.state.state for a in answers.values() if a.record} == {JobState.COMPLETED}


# --- sacct lags; squeue has the last word on going back -------------------------------------------


@pytest.mark.asyncio
async def test_a_lagging_sacct_never_moves_a_job_back() -> None:
    cluster = ReplayCluster()
    job = cluster.add_job("llmd-r1")
    p = poller(cluster, squeue_interval_s=RARELY)
    p.track(job.job_id)
    await tick(p)
    assert seen(p, job) == (JobState.PENDING, (), "squeue")

    job.lag_accounting()  # sacct goes on saying PENDING
    job.start(("node1", "node2"))
    p.squeue_interval_s = EVERY_TICK
    await tick(p)
    assert seen(p, job) == (JobState.RUNNING, ("node1", "node2"), "squeue")
    p.squeue_interval_s = RARELY
    cluster.reset_calls()
    await tick(p)
    assert cluster.counts() == {"sacct": 1}
    assert seen(p, job) == (JobState.RUNNING, ("node1", "node2"), "squeue")

    job.sync_accounting()  # sacct learns of the start ...
    job.lag_accounting()
    job.end("COMPLETED")  # ... and still says RUNNING after squeue saw the end
    p.squeue_interval_s = EVERY_TICK
    await tick(p)
    assert seen(p, job) == (JobState.COMPLETED, ("node1", "node2"), "squeue")
    p.squeue_interval_s = RARELY
    await tick(p)
    assert job.accounting_state is JobState.RUNNING
    assert seen(p, job) == (JobState.COMPLETED, ("node1", "node2"), "squeue")

    job.sync_accounting()  # sacct catches up: it may move the job forward, and does
    await tick(p)
    assert seen(p, job) == (JobState.COMPLETED, ("node1", "node2"), "sacct")


@pytest.mark.asyncio
async def test_sacct_alone_sees_a_start_and_asks_squeue_for_the_nodes() -> None:
    cluster = ReplayCluster()
    job = cluster.add_job("llmd-r1", Start(("node2", "node3")))
    p = poller(cluster, squeue_interval_s=RARELY)
    p.track(job.job_id)
    await tick(p)
    cluster.step()
    cluster.reset_calls()
    await tick(p)  # sacct says RUNNING (its node list is not trusted): squeue at once
    assert cluster.counts() == {"sacct": 1, "squeue": 1}
    assert seen(p, job) == (JobState.RUNNING, ("node2", "node3"), "squeue")
    await tick(p)  # nothing new: sacct only
    assert cluster.counts() == {"sacct": 2, "squeue": 1}


@pytest.mark.asyncio
async def test_a_requeue_is_seen_through_squeue() -> None:
    cluster = ReplayCluster()
    job = cluster.add_job("llmd-r1", Start(("node3",)))
    cluster.step()
    p = poller(cluster, squeue_interval_s=RARELY)
    p.track(job.job_id)
    await tick(p)
    assert seen(p, job) == (JobState.RUNNING, ("node3",), "squeue")

    job.requeue()
    await tick(p)  # sacct says PENDING: a step back, which only squeue may take
    assert seen(p, job) == (JobState.RUNNING, ("node3",), "squeue")
    p.squeue_interval_s = EVERY_TICK
    await tick(p)
    assert seen(p, job) == (JobState.PENDING, (), "squeue")
    assert job.restarts == 1

    job.start(("node2",))
    await tick(p)
    assert seen(p, job) == (JobState.RUNNING, ("node2",), "squeue")


# --- purged ids, failed and empty answers -------------------------------------------------------


@pytest.mark.asyncio
async def test_purged_jobs_have_left_the_queue() -> None:
    cluster = ReplayCluster()
    (running,) = jobs(cluster, 1, Start(("node1",)))
    (gone,) = jobs(cluster, 1, Start(("node2",)), End("COMPLETED"))
    gone.purge()
    p = poller(cluster, squeue_interval_s=EVERY_TICK)
    p.track(running.job_id)
    p.track(gone.job_id)
    await tick(p)  # squeue silently omits the purged id
    assert seen(p, running) == (JobState.RUNNING, ("node1",), "squeue")
    assert view(p, gone).state is None and view(p, gone).left_queue

    running.end("FAILED", exit_code="7:0")
    running.purge()
    answer = await SlurmClient(cluster).squeue([running.job_id, gone.job_id])
    assert (answer.returncode, answer.stderr) == (1, INVALID_JOB_ID.stderr)
    await tick(p)  # squeue knows none of the ids: "Invalid job id specified", rc 1
    assert view(p, running).state is None and view(p, running).left_queue


@pytest.mark.asyncio
async def test_failed_answers_are_not_facts() -> None:
    cluster = ReplayCluster()
    job = cluster.add_job("llmd-r1", Start(("node1",)))
    cluster.step()
    p = poller(cluster, squeue_interval_s=RARELY)
    p.track(job.job_id)
    await tick(p)
    before = seen(p, job)
    assert before == (JobState.RUNNING, ("node1",), "squeue")

    job.end("COMPLETED")
    cluster.reset_calls()
    cluster.fail("sacct", SACCT_DBD_DOWN)
    cluster.fail("squeue", SLURMCTLD_DOWN)
    await tick(p)  # a failed sacct brings a squeue into the same tick; it fails too
    assert cluster.counts() == {"sacct": 1, "squeue": 1}
    assert seen(p, job) == before

    cluster.fail("sacct", TIMEOUT)
    cluster.fail("squeue", TIMEOUT)
    await tick(p)
    assert seen(p, job) == before

    cluster.fail("sacct", Reply(0, "this is not sacct output\n", ""))
    cluster.fail("squeue", Reply(0, "neither|is this\n", ""))
    await tick(p)
    assert seen(p, job) == before

    await tick(p)  # Slurm answers again: the end is seen
    assert view(p, job).state is JobState.COMPLETED


@pytest.mark.asyncio
async def test_a_job_sacct_does_not_list_yet_is_not_gone() -> None:
    cluster = ReplayCluster()
    job = cluster.add_job("llmd-r1", lag_accounting=True)  # sacct lags sbatch by ~1 s
    p = poller(cluster, squeue_interval_s=RARELY)
    p.track(job.job_id)
    await tick(p)
    assert seen(p, job) == (JobState.PENDING, (), "squeue")
    for _ in range(3):
        await tick(p)  # sacct prints nothing for the job
        assert seen(p, job) == (JobState.PENDING, (), "squeue")
    assert cluster.counts() == {"squeue": 1, "sacct": 4}
    job.sync_accounting()
    job.start(("node4",))
    await tick(p)
    assert seen(p, job)[:1] == (JobState.RUNNING,)


# --- a job's name is its own text (issue 3.2, item 4) ----------------------------------------


def _hostile_jobs(cluster: ReplayCluster) -> dict[str, ReplayJob]:
    """Ordinary jobs batched with jobs whose names a user chose: a job renamed to hold a
    newline, one whose srun steps are named with a newline and a whole forged sacct row
    (claiming the ordinary job failed), and one with '|' in its name."""
    normal = cluster.add_job("llmd-r1", Start(("node2",)), End("COMPLETED"))
    newline = cluster.add_job("x\ny", Start(("node1",)), End("COMPLETED"))
    forged = f"{normal.job_id}|{normal.job_id}|FAILED|1:0|0:0|None|node2|a|b|c|00:00:01|x"
    stepper = cluster.add_job("llmd-r2", Start(("node3",)), End("FAILED", "7:0"))
    stepper.step_name = f"step\n{forged}\n{normal.job_id}|RUNNING|node9|None|x"
    pipe = cluster.add_job("a|b|COMPLETED|0:0", Start(("node4",)))
    cluster.step()
    cluster.step()
    return {"normal": normal, "newline": newline, "stepper": stepper, "pipe": pipe}


@pytest.mark.asyncio
async def test_a_job_name_cannot_break_or_forge_the_batch_of_everyone() -> None:
    cluster = ReplayCluster()
    hostile = _hostile_jobs(cluster)
    p = poller(cluster, squeue_interval_s=EVERY_TICK)
    for job in hostile.values():
        p.track(job.job_id)
    answers = await sacct_evidence(p, hostile.values())
    assert cluster.counts() == {"squeue": 1, "sacct": 1}  # still one batch each
    assert {k: (view(p, j).state, view(p, j).nodes) for k, j in hostile.items()} == {
        "normal": (JobState.COMPLETED, ("node2",)),
        "newline": (JobState.COMPLETED, ("node1",)),
        "stepper": (JobState.FAILED, ("node3",)),
        "pipe": (JobState.RUNNING, ("node4",)),
    }
    records = {k: answers[j.job_id].record for k, j in hostile.items()}
    got = {k: (r.state.state, str(r.exit_code)) for k, r in records.items() if r is not None}
    assert got == {
        "normal": (JobState.COMPLETED, "0:0"),
        "newline": (JobState.COMPLETED, "0:0"),
        "stepper": (JobState.FAILED, "7:0"),
        "pipe": (JobState.RUNNING, "0:0"),
    }
    # Each job's evidence holds its own rows only (never another user's job).
    for job in hostile.values():
        lines = answers[job.job_id].raw.splitlines()
        assert lines and all(line.split("|")[0].split(".")[0] == job.job_id for line in lines)


@pytest.mark.asyncio
async def test_a_malformed_record_is_its_own_jobs_error_only() -> None:
    """Whatever breaks one job's rows (here a line break and a bad ExitCode put into real
    rows) is an error for that job; the others' states and evidence come through."""
    cluster = ReplayCluster()
    good, broken, bad_exit = jobs(cluster, 3, Start(("node1",)), End("COMPLETED"))
    client = SlurmClient(cluster)
    ids = [good.job_id, broken.job_id, bad_exit.job_id]
    sacct_text = (await client.sacct(ids)).stdout.replace(
        f"\n{broken.job_id}.batch|", f"\n{broken.job_id}.batch|x\ny|"
    )
    row = f"{bad_exit.job_id}|{bad_exit.job_id}|COMPLETED|"
    sacct_text = sacct_text.replace(f"{row}0:0|", f"{row}0:zero|")
    squeue_text = "".join(
        line + ("\nbroken" if line.startswith(f"{broken.job_id}|") else "") + "\n"
        for line in (await client.squeue(ids)).stdout.splitlines()
    )
    p = poller(cluster, squeue_interval_s=EVERY_TICK)
    for job_id in ids:
        p.track(job_id)
    cluster.fail("sacct", Reply(0, sacct_text, ""))
    cluster.fail("squeue", Reply(0, squeue_text, ""))
    answers = await sacct_evidence(p, (good, broken, bad_exit))
    assert {j: a.outcome for j, a in answers.items()} == {
        good.job_id: QueryOutcome.RECORD,
        broken.job_id: QueryOutcome.ERROR,
        bad_exit.job_id: QueryOutcome.ERROR,
    }
    assert "line break" in answers[broken.job_id].error
    assert "ExitCode" in answers[bad_exit.job_id].error
    assert view(p, good).state is JobState.COMPLETED
    assert p.latest(broken.job_id) is None  # squeue's row for it was broken too: no view
    assert view(p, bad_exit).state is JobState.COMPLETED  # squeue's row was fine


# --- no accounting -------------------------------------------------------------------------------


async def _both_evidence(p: Poller, job_id: str) -> dict[Source, SlurmQuery]:
    answers: dict[Source, SlurmQuery] = {}

    async def ask(source: Source) -> None:
        answers[source] = await p.evidence(source, job_id, None)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, Source.SACCT)
        tg.start_soon(ask, Source.SCONTROL)
        await anyio.wait_all_tasks_blocked()
        await tick(p)
    return answers


@pytest.mark.asyncio
async def test_without_accounting_the_poller_uses_squeue_and_scontrol_only() -> None:
    cluster = ReplayCluster(accounting="disabled", min_job_age_s=120)
    (job,) = jobs(cluster, 1, Start(("node1", "node2")), End("COMPLETED"))
    p = poller(cluster, squeue_interval_s=RARELY)
    await p._read_config()
    assert (p.accounting_enabled, p.min_job_age_s) == (False, 120)
    p.track(job.job_id)
    for _ in range(3):
        await tick(p)
    assert cluster.counts() == {"scontrol": 1, "squeue": 3}  # config, then squeue each tick
    answers = await _both_evidence(p, job.job_id)
    assert answers[Source.SACCT].outcome is QueryOutcome.ACCOUNTING_DISABLED
    record = answers[Source.SCONTROL].record
    assert record is not None
    assert (record.state.state, str(record.exit_code)) == (JobState.COMPLETED, "0:0")
    assert cluster.count("sacct") == 0
    assert cluster.argvs("scontrol")[-1] == ("scontrol", "show", "job", "--oneliner", job.job_id)


@pytest.mark.asyncio
async def test_accounting_found_disabled_at_run_time_switches_once() -> None:
    cluster = ReplayCluster()
    (job,) = jobs(cluster, 1, Start(("node1",)))
    p = poller(cluster, squeue_interval_s=RARELY)
    await p._read_config()
    assert p.accounting_enabled
    p.track(job.job_id)
    await tick(p)
    cluster.accounting = "disabled"
    cluster.reset_calls()
    await tick(p)  # sacct says so; the tick falls back to squeue at once
    assert not p.accounting_enabled
    assert cluster.counts() == {"sacct": 1, "squeue": 1}
    job.end("COMPLETED")
    for _ in range(3):
        await tick(p)
    assert cluster.counts() == {"sacct": 1, "squeue": 4}
    assert view(p, job).state is JobState.COMPLETED


# --- the loop itself ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_running_loop_follows_a_job_to_its_end() -> None:
    cluster = ReplayCluster()
    job = cluster.add_job("llmd-r1", Start(("node1", "node2")), End("TIMEOUT"))
    p = poller(cluster, squeue_interval_s=0.02)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(p.run)
            first = await p.next_view(job.job_id, None)
            assert first.state is JobState.PENDING
            cluster.step()
            p.poke()
            running = await p.next_view(job.job_id, first)
            while not running.nodes:
                running = await p.next_view(job.job_id, running)
            assert (running.state, running.nodes) == (JobState.RUNNING, ("node1", "node2"))
            cluster.step()
            p.poke()
            last = await p.next_view(job.job_id, running)
            assert last.left_queue and last.state is JobState.TIMEOUT
            tg.cancel_scope.cancel()
    per_tick = cluster.counts()
    assert per_tick["sacct"] <= p.ticks and per_tick["squeue"] <= p.ticks


# --- a job about to end ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_marker_appearing_makes_the_poller_look_for_the_end_often(tmp_path: Path) -> None:
    cluster = ReplayCluster()
    p = poller(cluster, squeue_interval_s=10.0)
    (job,) = jobs(cluster, 1, Start(("node1",)))
    p.track(job.job_id)
    marker = tmp_path / f".bench_done.{job.job_id}"
    p.watch_end(job.job_id, marker)
    await tick(p)
    assert not p._ending()  # no marker yet: the running job's usual cadence
    marker.write_text("0\n")
    await tick(p)
    assert p._ending()  # every ENDING_INTERVAL_S from now on, until it is untracked
    p.untrack(job.job_id)
    assert not p._ending()
