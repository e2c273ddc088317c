"""SlurmClient against the replayed cluster, and the replay against the captures.

The first tests hold the replay to the captures: each captured case, replayed with its own
job id, name, nodes and times, must print exactly the captured text (so the replay cannot
drift from real Slurm output, nor the client's formats from the captures). The rest test
`SlurmClient.find_by_name` reconciliation and the scancel argv of the cancel sequence.
"""

from __future__ import annotations

import re
import shutil
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.slurm.runner import SlurmClient
from llmd_supervisor.core.slurm.parse import (
    JobState,
    parse_sacct,
    parse_scontrol_job,
    parse_squeue,
)
from llmd_supervisor.errors import SlurmCommandError
from llmd_supervisor.node.common import expand_hostlist
from tests.fakes.slurm_replay import (
    ACCOUNTING_DISABLED,
    DATA,
    SACCT_DBD_DOWN,
    SLURM_TIME,
    SLURMCTLD_DOWN,
    TIMEOUT,
    Captures,
    End,
    FakeClock,
    Purge,
    ReplayCluster,
    ReplayError,
    ReplayJob,
    Reply,
    Requeue,
    Start,
    hostlist,
)

CAPS = Captures.load()
STARTTIME = "2000-01-01T00:00:00"
SCRIPT = "#!/bin/bash\n#SBATCH --job-name={name}\n#SBATCH --nodes=2\nsrun true\n"


def state(job: ReplayJob) -> JobState:
    """The job's state, read afresh (a plain attribute read would be narrowed by mypy)."""
    return job.state


def local(text: str) -> datetime:
    """A time as Slurm printed it (local, no zone), as an aware UTC datetime."""
    return datetime.strptime(text, SLURM_TIME).astimezone(UTC)


def end_cases() -> list[str]:
    """Every captured job that ended (its scontrol record is in an end state)."""
    return sorted(
        p.name.removesuffix(".scontrol.txt")
        for p in DATA.glob("*.scontrol.txt")
        if parse_scontrol_job(p.read_text()).state.state.is_terminal
    )


async def replay_case(case: str) -> tuple[ReplayCluster, str]:
    """Replay a captured case with its own id, name, nodes and times."""
    rows = CAPS.sacct_rows(f"{case}.sacct.txt")
    alloc = rows[0]
    record = parse_scontrol_job(CAPS.text(f"{case}.scontrol.txt"))
    attempts = [alloc]
    if record.restarts:
        attempts = [
            r for r in CAPS.sacct_rows(f"{case}.sacct_duplicates.txt") if "." not in r["JobIDRaw"]
        ]
    clock = FakeClock(local(attempts[0]["Submit"]))
    cluster = ReplayCluster(clock=clock, first_job_id=int(alloc["JobIDRaw"]))
    client = SlurmClient(cluster)
    if (DATA / f"{case}.sbatch.txt").exists():
        job_id = await client.sbatch(SCRIPT.format(name=record.job_name))
        job = cluster.job(job_id)
    else:
        job = cluster.add_job(record.job_name, job_id=alloc["JobIDRaw"])
    for i, attempt in enumerate(attempts):
        clock.set(local(attempt["Start"]))
        job.start(expand_hostlist(attempt["NodeList"]))
        clock.set(local(attempt["End"]))
        if i < len(attempts) - 1:
            job.requeue(attempt["State"])
            clock.set(local(attempts[i + 1]["Submit"]))
    state = parse_sacct(CAPS.text(f"{case}.sacct.txt"))[0].state.state
    exit_code = alloc["ExitCode"] if state is JobState.FAILED else None
    job.end(state, exit_code=exit_code)
    return cluster, job.job_id


@pytest.mark.asyncio
@pytest.mark.parametrize("case", end_cases())
async def test_a_replayed_case_prints_exactly_what_was_captured(case: str) -> None:
    cluster, job_id = await replay_case(case)
    client = SlurmClient(cluster)
    # In the client's formats (the captures may hold more columns: the job name).
    assert (await client.sacct([job_id])).stdout == CAPS.sacct_text(f"{case}.sacct.txt")
    if (DATA / f"{case}.sacct_x.txt").exists():
        result = await client.sacct([job_id], allocations_only=True)
        assert result.stdout == CAPS.sacct_text(f"{case}.sacct_x.txt")
    if (DATA / f"{case}.squeue.txt").exists():
        assert (await client.squeue([job_id])).stdout == CAPS.squeue_text(f"{case}.squeue.txt")
    if (DATA / f"{case}.sbatch.txt").exists():
        assert cluster.argvs("sbatch") == [("sbatch", "--parsable")]
    scontrol = await client.scontrol_job(job_id)
    assert scontrol.stdout.strip() == CAPS.text(f"{case}.scontrol.txt").strip()
    if (DATA / f"{case}.sacct_duplicates.txt").exists():
        argv = ["sacct", "--parsable2", "--noheader", "--duplicates", f"--jobs={job_id}"]
        result = await cluster.run(argv, time_limit=5)
        assert result.stdout == CAPS.text(f"{case}.sacct_duplicates.txt")


@pytest.mark.asyncio
async def test_running_and_requeued_pending_replay_the_captured_lines() -> None:
    lines = [
        dict(zip(CAPS.squeue_tokens, cells, strict=True))
        for cells in CAPS.squeue_cells("running.squeue.txt")
    ]
    submit = local(CAPS.sacct_rows("running.sacct.txt")[0]["Submit"])
    cluster = ReplayCluster(clock=FakeClock(submit))
    # Their names are in their scontrol records (the client does not ask squeue for names).
    records = [parse_scontrol_job(p.read_text()) for p in DATA.glob("*.scontrol.txt")]
    names = {r.job_id: r.job_name for r in records}
    for line in lines:
        cluster.add_job(names.get(line["%i"], "capture"), job_id=line["%i"])
    cluster.clock.advance(1)
    for line in lines:
        cluster.job(line["%i"]).start(expand_hostlist(line["%N"]))
    client = SlurmClient(cluster)
    ids = [line["%i"] for line in lines]
    assert (await client.squeue(ids)).stdout == CAPS.squeue_text("running.squeue.txt")
    # The running scontrol record was taken 1 s into the `timeout` job (TimeLimit 1 min).
    cluster.clock.advance(1)
    running = parse_scontrol_job(CAPS.text("running.scontrol.txt"))
    record = (await client.scontrol_job(running.job_id)).stdout
    assert record.strip() == CAPS.text("running.scontrol.txt").strip()

    # Requeued: PENDING again without nodes; scontrol's StartTime of a pending job is
    # Slurm's estimate, which the replay does not make up.
    requeued = cluster.job(CAPS.squeue_cells("requeued_pending.squeue.txt")[0][0])
    requeued.requeue()
    got = (await client.squeue([requeued.job_id])).stdout
    assert got == CAPS.squeue_text("requeued_pending.squeue.txt")
    pending = parse_scontrol_job((await client.scontrol_job(requeued.job_id)).stdout)
    captured = parse_scontrol_job(CAPS.text("requeued_pending.scontrol.txt"))
    assert (pending.state.state, pending.restarts, pending.node_list) == (
        JobState.PENDING,
        1,
        "",
    )
    differing = {k for k, v in captured.fields.items() if pending.fields.get(k) != v}
    assert differing <= {"StartTime", "SubmitTime", "EligibleTime", "LastSchedEval"}


def test_hostlist_compresses_as_slurm_prints() -> None:
    assert hostlist(["node1", "node2"]) == "node[1-2]"
    assert hostlist(["node4"]) == "node4"
    assert hostlist(["node1", "node2", "node4", "gpu07", "gpu08", "login"]) == (
        "node[1-2,4],gpu[07-08],login"
    )
    for nodes in (["node1", "node2", "node4"], ["gpu07", "gpu08", "gpu10"]):
        assert expand_hostlist(hostlist(nodes)) == nodes


def test_captures_taken_with_other_formats_are_refused(tmp_path: Path) -> None:
    shutil.copytree(DATA, tmp_path / "slurm")
    index = tmp_path / "slurm" / "INDEX.md"
    # a squeue format without %N, which the client asks for
    index.write_text(
        re.sub(r"(squeue --noheader --format=)[^`]+", r"\1%i|%T|%r", index.read_text())
    )
    with pytest.raises(ReplayError, match="format drift"):
        Captures(tmp_path / "slurm")


@pytest.mark.asyncio
async def test_a_client_format_outside_the_captures_is_refused() -> None:
    cluster = ReplayCluster()
    with pytest.raises(ReplayError, match="format drift"):
        await cluster.run(["squeue", "--noheader", "--format=%i|%M", "--jobs=1"], time_limit=5)
    with pytest.raises(ReplayError, match="format drift"):
        argv = ["sacct", "--parsable2", "--noheader", "--format=JobIDRaw,MaxRSS"]
        await cluster.run(argv, time_limit=5)
    with pytest.raises(ReplayError, match="not modelled"):
        await cluster.run(["squeue", "--noheader", "--partition=gpu"], time_limit=5)


# --- submit ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_sbatch_submits_on_stdin_and_hands_out_ids() -> None:
    cluster = ReplayCluster(first_job_id=500)
    client = SlurmClient(cluster)
    cluster.expect("llmd-a", Start(("node1", "node2")), End("COMPLETED", after=30))
    script_a = SCRIPT.format(name="llmd-a")
    assert await client.sbatch(script_a) == "500"
    assert await client.sbatch(SCRIPT.format(name="llmd-b")) == "501"
    assert cluster.argvs("sbatch") == [("sbatch", "--parsable")] * 2
    assert cluster.stdin[0] == script_a.encode()
    a, b = cluster.job("llmd-a"), cluster.job("llmd-b")
    assert (a.job_id, a.state, b.state) == ("500", JobState.PENDING, JobState.PENDING)
    cluster.advance()
    assert (a.state, a.nodes, b.state) == (JobState.RUNNING, ("node1", "node2"), JobState.PENDING)
    cluster.advance(29)
    assert state(a) is JobState.RUNNING
    cluster.advance(1)
    assert state(a) is JobState.COMPLETED
    rows = parse_squeue((await client.squeue(["500", "501"])).stdout)
    assert [(r.job_id, r.state.state, r.node_list) for r in rows] == [
        ("500", JobState.COMPLETED, "node[1-2]"),
        ("501", JobState.PENDING, ""),
    ]


@pytest.mark.asyncio
async def test_a_failed_sbatch_is_an_error_and_submits_nothing() -> None:
    cluster = ReplayCluster()
    refused = Reply(1, "", "sbatch: error: Batch job submission failed: Invalid account\n")
    cluster.fail("sbatch", refused)
    with pytest.raises(SlurmCommandError, match="Invalid account"):
        await SlurmClient(cluster).sbatch(SCRIPT.format(name="llmd-x"))
    assert cluster.jobs == {}


# --- name reconciliation ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_find_by_name_in_squeue_needs_no_sacct() -> None:
    cluster = ReplayCluster()
    job = cluster.add_job("llmd-r1", Start(("node1",)))
    cluster.add_job("llmd-other")
    lookup = await SlurmClient(cluster).find_by_name("llmd-r1", starttime=STARTTIME)
    assert (lookup.job_id, lookup.certain) == (job.job_id, True)
    assert cluster.argvs("squeue") == [
        ("squeue", "--noheader", "--states=all", "--user=root", "--name=llmd-r1", "--format=%i")
    ]
    assert cluster.count("sacct") == 0


@pytest.mark.asyncio
async def test_find_by_name_of_a_purged_job_comes_from_sacct() -> None:
    cluster = ReplayCluster()
    job = cluster.add_job("llmd-r1", Start(("node1",)), End("COMPLETED"), Purge(after=30))
    cluster.advance(30)
    assert job.purged and job.state is JobState.COMPLETED
    lookup = await SlurmClient(cluster).find_by_name("llmd-r1", starttime=STARTTIME)
    assert (lookup.job_id, lookup.certain) == (job.job_id, True)
    (argv,) = cluster.argvs("sacct")
    assert "--name=llmd-r1" in argv and f"--starttime={STARTTIME}" in argv
    assert "--allocations" in argv


@pytest.mark.asyncio
async def test_find_by_name_found_nowhere_is_certain() -> None:
    cluster = ReplayCluster()
    cluster.add_job("llmd-other")
    lookup = await SlurmClient(cluster).find_by_name("llmd-r1", starttime=STARTTIME)
    assert (lookup.job_id, lookup.certain) == (None, True)
    assert cluster.counts() == {"id": 1, "squeue": 1, "sacct": 1}


@pytest.mark.asyncio
async def test_find_by_name_ignores_jobs_that_ended_before_starttime() -> None:
    cluster = ReplayCluster(clock=FakeClock(datetime(2026, 1, 1, tzinfo=UTC)))
    old = cluster.add_job("llmd-r1")
    old.start(("node1",))
    old.end("COMPLETED")
    old.purge()
    cluster.advance(3600)
    since = cluster.clock.now().astimezone().strftime(SLURM_TIME)
    lookup = await SlurmClient(cluster).find_by_name("llmd-r1", starttime=since)
    assert (lookup.job_id, lookup.certain) == (None, True)


@pytest.mark.asyncio
@pytest.mark.parametrize("account", ["llmd", "root"])
async def test_find_by_name_never_takes_another_users_job(account: str) -> None:
    """Issue 3.2 item 11: after a crash, a job another user named like the run's retry is
    not the run's job, whether slurmctld still holds it or only accounting does; the
    lookup is for the account the commands (and so sbatch) run as."""
    cluster = ReplayCluster(user=account)
    cluster.add_job("llmd-r1.2", Start(("node1",)), user="mallory")
    cluster.add_job("llmd-r1.3", Start(("node1",)), End("COMPLETED"), Purge(), user="mallory")
    for _ in range(3):
        cluster.step()
    client = SlurmClient(cluster)
    for name in ("llmd-r1.2", "llmd-r1.3"):
        lookup = await client.find_by_name(name, starttime=STARTTIME)
        assert (lookup.job_id, lookup.certain) == (None, True), name
    mine = cluster.add_job("llmd-r1.2", Start(("node2",)), End("COMPLETED"), Purge())
    for _ in range(3):
        cluster.step()
    lookup = await client.find_by_name("llmd-r1.2", starttime=STARTTIME)
    assert (lookup.job_id, lookup.certain) == (mine.job_id, True)
    lookups = [a for a in cluster.calls if a[0] in ("squeue", "sacct")]
    assert len(lookups) == 6 and all(f"--user={account}" in argv for argv in lookups)
    assert cluster.count("id") == 1  # the account is asked once


@pytest.mark.asyncio
async def test_an_account_that_is_no_user_name_is_an_error() -> None:
    cluster = ReplayCluster(user="a,b")
    with pytest.raises(SlurmCommandError, match="not one user name"):
        await SlurmClient(cluster).find_by_name("llmd-r1", starttime=STARTTIME)
    assert cluster.count("squeue") == cluster.count("sacct") == 0


@pytest.mark.asyncio
async def test_find_by_name_with_sacct_failing_is_an_error() -> None:
    cluster = ReplayCluster(accounting="down")
    with pytest.raises(SlurmCommandError, match="Problem talking to the database"):
        await SlurmClient(cluster).find_by_name("llmd-r1", starttime=STARTTIME)
    assert cluster.argvs("sacct")[0][0] == "sacct"


@pytest.mark.asyncio
async def test_find_by_name_without_accounting_is_uncertain() -> None:
    cluster = ReplayCluster(accounting="disabled")
    lookup = await SlurmClient(cluster).find_by_name("llmd-r1", starttime=STARTTIME)
    assert (lookup.job_id, lookup.certain) == (None, False)
    # ... but a job slurmctld still holds is found, certainly.
    job = cluster.add_job("llmd-r1")
    lookup = await SlurmClient(cluster).find_by_name("llmd-r1", starttime=STARTTIME)
    assert (lookup.job_id, lookup.certain) == (job.job_id, True)


@pytest.mark.asyncio
async def test_find_by_name_with_squeue_failing_is_an_error() -> None:
    cluster = ReplayCluster()
    cluster.fail("squeue", SLURMCTLD_DOWN)
    with pytest.raises(SlurmCommandError, match="Unable to contact slurm controller"):
        await SlurmClient(cluster).find_by_name("llmd-r1", starttime=STARTTIME)
    assert cluster.count("sacct") == 0


@pytest.mark.asyncio
async def test_an_sbatch_whose_answer_was_lost_is_found_by_name() -> None:
    """The crash window of DESIGN.md section 3: the job exists, its id was never seen."""
    cluster = ReplayCluster()
    client = SlurmClient(cluster)
    cluster.fail("sbatch", Reply(timeout=True, applied=True))
    with pytest.raises(SlurmCommandError, match="timed out"):
        await client.sbatch(SCRIPT.format(name="llmd-r1"))
    (job,) = cluster.jobs.values()
    lookup = await client.find_by_name("llmd-r1", starttime=STARTTIME)
    assert (lookup.job_id, lookup.certain) == (job.job_id, True)
    # A timeout with nothing applied leaves no job: certainly not submitted.
    cluster.fail("sbatch", TIMEOUT)
    with pytest.raises(SlurmCommandError):
        await client.sbatch(SCRIPT.format(name="llmd-r2"))
    lookup = await client.find_by_name("llmd-r2", starttime=STARTTIME)
    assert (lookup.job_id, lookup.certain) == (None, True)


@pytest.mark.asyncio
async def test_scripted_failures_apply_to_matching_calls_only() -> None:
    cluster = ReplayCluster()
    cluster.add_job("llmd-r1")
    cluster.fail("sacct", SACCT_DBD_DOWN, times=2, match=lambda argv: "--allocations" in argv)
    client = SlurmClient(cluster)
    assert (await client.sacct(["100"])).ok
    for _ in range(2):
        result = await client.sacct(["100"], allocations_only=True)
        assert (result.returncode, result.stderr) == (1, SACCT_DBD_DOWN.stderr)
    assert (await client.sacct(["100"], allocations_only=True)).ok
    cluster.fail("sacct", ACCOUNTING_DISABLED)
    result = await client.sacct(["100"])
    assert (result.returncode, result.stderr) == (1, ACCOUNTING_DISABLED.stderr)
    assert (await client.sacct(["100"])).ok


# --- cancel ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_cancel_sequence_is_term_then_plain_scancel() -> None:
    cluster = ReplayCluster()
    client = SlurmClient(cluster)
    job = cluster.add_job("llmd-r1", Start(("node1", "node2")))
    cluster.step()
    await client.scancel(job.job_id, signal="TERM")
    assert state(job) is JobState.RUNNING  # TERM reaches the tasks; the job goes on
    await client.scancel(job.job_id)
    assert cluster.argvs("scancel") == [
        ("scancel", "--signal=TERM", job.job_id),
        ("scancel", job.job_id),
    ]
    assert job.signals == ["TERM", "KILL"]
    assert state(job) is JobState.CANCELLED
    (row, *steps) = parse_sacct((await client.sacct([job.job_id])).stdout)
    assert (row.state.state, row.state.raw, str(row.exit_code)) == (
        JobState.CANCELLED,
        "CANCELLED by 0",
        "0:0",
    )
    assert [s.job_id_raw for s in steps] == [f"{job.job_id}.batch", f"{job.job_id}.0"]
    record = parse_scontrol_job((await client.scontrol_job(job.job_id)).stdout)
    assert (record.state.state, str(record.exit_code)) == (JobState.CANCELLED, "0:15")


@pytest.mark.asyncio
async def test_a_term_the_workload_obeys_ends_the_job_as_scripted() -> None:
    cluster = ReplayCluster()
    client = SlurmClient(cluster)
    job = cluster.add_job("llmd-r1", Start(("node1",)), End("COMPLETED", after=3600))
    cluster.step()
    job.on_term = (End("FAILED", "143:0", after=2),)
    await client.scancel(job.job_id, signal="TERM")
    cluster.advance(1.9)
    assert state(job) is JobState.RUNNING
    cluster.advance(0.1)
    assert state(job) is JobState.FAILED
    rows = parse_sacct((await client.sacct([job.job_id], allocations_only=True)).stdout)
    assert [(r.state.state, str(r.exit_code)) for r in rows] == [(JobState.FAILED, "143:0")]
    cluster.advance(7200)  # the rest of the timeline was replaced by the reaction
    assert state(job) is JobState.FAILED


@pytest.mark.asyncio
async def test_scancel_of_a_pending_job_and_of_a_gone_one() -> None:
    cluster = ReplayCluster()
    client = SlurmClient(cluster)
    pending = cluster.add_job("llmd-r1")
    await client.scancel(pending.job_id)
    assert state(pending) is JobState.CANCELLED
    rows = parse_sacct((await client.sacct([pending.job_id])).stdout)
    assert [(r.job_id_raw, r.node_list) for r in rows] == [(pending.job_id, "None assigned")]
    pending.purge()
    await client.scancel(pending.job_id)  # plain scancel of a gone job is no error
    with pytest.raises(SlurmCommandError, match="Invalid job id"):
        await client.scancel(pending.job_id, signal="TERM")


@pytest.mark.asyncio
async def test_requeue_keeps_the_id_and_counts_restarts() -> None:
    cluster = ReplayCluster()
    client = SlurmClient(cluster)
    job = cluster.add_job(
        "llmd-r1", Start(("node3",)), Requeue(after=5), Start(("node2",), after=9), End()
    )
    cluster.advance(60)
    assert (job.state, job.restarts, job.nodes) == (JobState.COMPLETED, 1, ("node2",))
    record = parse_scontrol_job((await client.scontrol_job(job.job_id)).stdout)
    assert (record.restarts, record.node_list) == (1, "node2")
    argv = ["sacct", "--parsable2", "--noheader", "--allocations", "--duplicates"]
    rows = parse_sacct((await cluster.run([*argv, f"--jobs={job.job_id}"], time_limit=5)).stdout)
    assert [(r.state.state, r.node_list) for r in rows] == [
        (JobState.NODE_FAIL, "node3"),
        (JobState.COMPLETED, "node2"),
    ]


# --- the harness itself: files, gates, waiting for calls ----------------------------------------


@pytest.mark.asyncio
async def test_touch_files_makes_the_log_dir_and_the_batch_log_at_start(tmp_path: Path) -> None:
    cluster = ReplayCluster(touch_files=True, first_job_id=7)
    client = SlurmClient(cluster)
    log_dir = tmp_path / "logs"
    await client.mkdir(str(log_dir))
    assert log_dir.is_dir()
    script = SCRIPT.format(name="llmd-r1") + f"#SBATCH --output={log_dir}/%x-%j.out\n"
    cluster.expect("llmd-r1", Start(("node1",), after=2))
    job_id = await client.sbatch(script)
    assert not (log_dir / "llmd-r1-7.out").exists()
    cluster.advance(2)
    assert (log_dir / "llmd-r1-7.out").exists()
    record = parse_scontrol_job((await client.scontrol_job(job_id)).stdout)
    assert record.fields["StdOut"] == f"{log_dir}/llmd-r1-7.out"


@pytest.mark.asyncio
async def test_a_held_call_waits_for_release_and_can_be_cancelled() -> None:
    cluster = ReplayCluster()
    client = SlurmClient(cluster)
    gate = cluster.hold("sbatch")
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.sbatch, SCRIPT.format(name="llmd-r1"))
            await gate.entered.wait()
            assert (gate.waiting, cluster.count("sbatch")) == (1, 1)
            scope.cancel()  # the daemon stops while sbatch is in flight
    assert cluster.jobs == {}  # answered at release, which never came: nothing submitted
    ids: list[str] = []

    async def submit() -> None:
        ids.append(await client.sbatch(SCRIPT.format(name="llmd-r2")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(submit)
        await gate.entered.wait()
        gate.release()
    assert ids == [cluster.job("llmd-r2").job_id]


@pytest.mark.asyncio
async def test_wait_calls_returns_once_the_calls_were_made() -> None:
    cluster = ReplayCluster()
    client = SlurmClient(cluster)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(cluster.wait_calls, "squeue", 2)
            await client.squeue(["1"])
            await client.sacct(["1"])
            await client.squeue(["1"])
    await cluster.wait_calls(None, 3)  # already made: returns at once
