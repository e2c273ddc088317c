"""llm-d allocations on the real dev cluster (issue 4): spec -> sbatch -> node agents.

Each run is ``deploy/llm-d/demo.toml`` (2 prefill + 2 decode nodes, stand-in engines and
benchmark) with its own shared log directory and fault knobs in ``[env.*]``, rendered by
``render_sbatch``, submitted with ``sbatch`` and checked with the real ``verify`` CLI.
A 2P+2D job needs all four nodes, so jobs run one after the other; the three runs that
need no interaction are submitted together up front.

Measured here (Slurm 22.05, KillWait=5): a task exiting nonzero makes ``srun
--kill-on-bad-exit=1`` TERM the other tasks at once ("_step_signal: Terminating"), SIGKILL
after KillWait, and srun's rc is the highest task rc -- or 137 when a task was killed by
SIGKILL. sacct shows a batch exit of 143 as ``FAILED|15:0`` and 137 as ``FAILED|9:0``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.llmd_helpers import (
    COORDINATOR,
    NRANKS,
    Run,
    make_log_dir,
    parse_time,
    sacct_times,
    spec_text,
    submit,
    verify,
    wait_for,
    wait_state,
)
from tests.devcluster import DevCluster

RANKS = range(NRANKS)
WORKERS = [r for r in RANKS if r != COORDINATOR]
GRACE_S = 10  # demo.toml run.sigterm_grace_s
# Nodes are shared between jobs (cons_tres, 1 CPU per task) and other engineers run llm-d
# jobs on port 8200 too: every run of ours gets its own engine port.
# Engine ports (each job also takes the next three) below Linux's ephemeral range
# (32768-60999): there, a node's outgoing connection once held a job's port (EADDRINUSE).
_PORTS = iter(range(20000 + 60 * (os.getpid() % 200), 32760, 10))
QUEUE_S = 300.0  # other engineers share the cluster: a job may wait for nodes


def _terminal(cluster: DevCluster, job: str) -> str:
    return cluster.wait_terminal(job, timeout=QUEUE_S)


def _exits(run: Run) -> dict[int, tuple[float, int | None]]:
    """(time, rc) of every rank's agent ``exit`` line (ranks without one are left out)."""
    out = {}
    for r in RANKS:
        log = run.agent_log(r)
        found = log.first("exit")
        if found is not None:
            out[r] = (found[0], log.exit_rc())
    return out


@dataclass
class Submitted:
    log_dir: Path
    job: str
    limit_s: int = 300

    @property
    def run(self) -> Run:
        return Run(self.log_dir, self.job)


@pytest.fixture(scope="module")
def batch(
    cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Submitted]]:
    """The runs that need no interaction, submitted together (Slurm runs them in turn)."""
    base = Path(tmp_path_factory.mktemp("llmd", numbered=True))
    base.chmod(0o755)
    cases: dict[str, dict[str, dict[str, str]]] = {
        "success": {},
        "bench_rc7": {"bench": {"LLMD_FAKE_BENCH_FAIL_CONCURRENCY": "2"}},
        # The sweep hangs, so only the crash of rank 1's prefill engine can end the run.
        "prefill_crash": {
            "bench": {"LLMD_FAKE_BENCH_HANG": "1"},
            "prefill": {"LLMD_FAKE_FAULT_RANKS": "1", "LLMD_FAKE_ENGINE_CRASH_AFTER_S": "3"},
        },
    }
    jobs = {}
    for name, env in cases.items():
        log_dir = make_log_dir(base, name)
        text = spec_text(log_dir, overrides={"port": next(_PORTS)}, env=env)
        jobs[name] = Submitted(log_dir, submit(cluster, log_dir, text, f"llmd-test-{name}"))
    yield jobs


def test_success_2p2d_completes_and_every_rank_exits_0_soon_after_marker(
    cluster: DevCluster, batch: dict[str, Submitted]
) -> None:
    s = batch["success"]
    run = s.run
    assert _terminal(cluster, s.job) == "COMPLETED|0:0", run.describe()

    marker = run.marker()
    assert marker is not None, run.describe()
    assert (marker["rc"], marker["rank"], marker["job_id"]) == (0, COORDINATOR, s.job)
    published = parse_time(marker["finished_at"])
    exits = _exits(run)
    assert {r: rc for r, (_, rc) in exits.items()} == dict.fromkeys(RANKS, 0), run.describe()
    lag = max(t for t, _ in exits.values()) - published
    assert lag < 3.0, f"last rank exited {lag:.2f} s after the marker"
    for r in RANKS:
        st = run.status(r)
        assert st is not None and (st["state"], st["rc"]) == ("exited", 0), st
        assert st["hostname"] == f"node{r + 1}"  # one task per node, in rank order
    for conc in (1, 2, 4):
        result = (run.job_dir / "bench" / f"c{conc}.json").read_text()
        assert '"failed": 0' in result and f'"concurrency": {conc}' in result

    status, receipt = verify(cluster, s.job, s.log_dir)
    assert (status, receipt["outcome"]) == (0, "succeeded"), receipt["reason"]
    assert "marker rc=0 from rank 2" in receipt["reason"]


@pytest.mark.slurm_contract
def test_failing_bench_point_ends_failed_7_and_verify_names_the_rank(
    cluster: DevCluster, batch: dict[str, Submitted]
) -> None:
    s = batch["bench_rc7"]
    run = s.run
    # Every rank must exit 7: srun's rc is the highest task rc, and a worker that the
    # kill-on-bad-exit TERM reaches before it has read the marker must not exit 143.
    assert _terminal(cluster, s.job) == "FAILED|7:0", run.describe()

    marker = run.marker()
    assert marker is not None and (marker["rc"], marker["rank"]) == (7, COORDINATOR)
    assert "concurrency 2 exited rc 7" in marker["reason"]
    exits = _exits(run)
    assert {r: rc for r, (_, rc) in exits.items()} == dict.fromkeys(RANKS, 7), run.describe()
    # The sweep went on after the failed point.
    assert '"failed": 0' in (run.job_dir / "bench" / "c4.json").read_text()

    status, receipt = verify(cluster, s.job, s.log_dir)
    assert (status, receipt["outcome"]) == (10, "failed"), receipt["reason"]
    assert "State=FAILED ExitCode=7:0" in receipt["reason"]
    assert "marker rc=7 from rank 2" in receipt["reason"]


@pytest.mark.slurm_contract
def test_prefill_worker_crash_ends_the_job_promptly_naming_the_rank(
    cluster: DevCluster, batch: dict[str, Submitted]
) -> None:
    s = batch["prefill_crash"]
    run = s.run
    assert _terminal(cluster, s.job) == "FAILED|73:0", run.describe()

    failure = run.agent_log(1).first("local.failure")
    assert failure is not None and "engine exited with rc 3" in failure[1], run.describe()
    start, end = sacct_times(cluster, s.job)
    # sacct's End has 1 s resolution (truncated): allow one more second.
    to_end = end + 1.0 - failure[0]
    assert to_end < 8.0, f"job ended {to_end:.1f} s after the crash"
    assert end - start < s.limit_s / 5, "the job ran towards its time limit"

    marker = run.marker()
    assert marker is not None and marker["rc"] == 73, run.describe()
    assert "rank 1 (prefill, node2:" in marker["reason"]
    exits = _exits(run)
    assert {r: rc for r, (_, rc) in exits.items()} == dict.fromkeys(RANKS, 73), run.describe()
    assert (run.status(1) or {}).get("engine_rc") == 3

    status, receipt = verify(cluster, s.job, s.log_dir)
    assert (status, receipt["outcome"]) == (10, "failed"), receipt["reason"]
    assert "State=FAILED ExitCode=73:0" in receipt["reason"]
    assert "rank 1 (prefill" in receipt["marker"]["parsed"]["reason"]


def _submit_hanging(
    cluster: DevCluster, shared_tmp: Path, name: str, env: dict[str, dict[str, str]], **ov: object
) -> Run:
    """Submit a run whose sweep hangs; return once it is benchmarking, workers ready."""
    # (it may first queue behind the previous test's job, still completing on its nodes)
    log_dir = make_log_dir(shared_tmp, name)
    env = {**env, "bench": {"LLMD_FAKE_BENCH_HANG": "1"}}
    text = spec_text(log_dir, overrides={"port": next(_PORTS), **ov}, env=env)
    job = submit(cluster, log_dir, text, f"llmd-test-{name}")
    run = Run(log_dir, job)
    wait_state(cluster, job, "RUNNING", timeout=QUEUE_S)

    def ready() -> bool:
        states = [(run.status(r) or {}).get("state") for r in RANKS]
        return states[COORDINATOR] == "benchmarking" and all(states[r] == "ready" for r in WORKERS)

    wait_for(ready, 150, f"job {job} benchmarking with every worker ready")
    return run


@pytest.mark.slurm_contract
def test_scancel_term_every_rank_exits_143_within_grace_with_diagnostic(
    cluster: DevCluster, shared_tmp: Path
) -> None:
    # Rank 3's engine ignores TERM: its agent must SIGKILL it, and the other ranks must
    # not exit before it has (srun would SIGKILL it after KillWait, without diagnostic).
    run = _submit_hanging(
        cluster,
        shared_tmp,
        "term",
        {"decode": {"LLMD_FAKE_FAULT_RANKS": "3", "LLMD_FAKE_ENGINE_IGNORE_SIGTERM": "1"}},
    )
    sent = time.time()
    cluster.slurm(["scancel", "--signal=TERM", run.job_id])
    state, exit_code = _terminal(cluster, run.job_id).split("|")
    # srun exits 143, which sacct shows as 15:0 (scontrol: 143:0).
    assert (state, exit_code) == ("FAILED", "15:0"), run.describe()

    exits = _exits(run)
    assert {r: rc for r, (_, rc) in exits.items()} == dict.fromkeys(RANKS, 143), run.describe()
    worst = max(t for t, _ in exits.values()) - sent
    assert worst < GRACE_S, f"a rank exited {worst:.1f} s after TERM (grace {GRACE_S} s)"
    for r in RANKS:
        term = run.agent_log(r).first("sigterm")
        assert term is not None and term[0] - sent < 2.0, f"rank {r} did not log SIGTERM"
        diag = run.diag(r)
        assert diag is not None and "SIGTERM" in diag, f"rank {r} wrote no diagnostic"
        assert "engine pid" in diag and "last lines of" in diag and "stand-in" in diag
        assert (run.status(r) or {}).get("state") == "terminated"
    killed = (run.diag(3) or "").split("needed SIGKILL")[1]
    assert "engine.py" in killed, "rank 3's TERM-ignoring engine was not SIGKILLed"
    marker = run.marker()
    assert marker is not None and (marker["rc"], marker["reason"]) == (143, "sigterm")

    status, receipt = verify(cluster, run.job_id, run.log_dir, "--cancel-requested")
    assert (status, receipt["outcome"]) == (11, "cancelled"), receipt["reason"]


def _agent_pid(run: Run, rank: int) -> int:
    """The agent's PID from its status file, checked against /proc (nodes share PIDs)."""
    st = run.status(rank)
    assert st is not None
    pid = int(st["pid"])
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert f"{run.job_dir}/node/agent.py" in cmdline, cmdline
    return pid


def _gone(pid: int, job_dir: Path) -> bool:
    try:
        return str(job_dir) not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
            errors="replace"
        )
    except OSError:
        return True


@pytest.mark.slurm_contract
def test_coordinator_dying_before_publishing_does_not_hang_workers(
    cluster: DevCluster, shared_tmp: Path
) -> None:
    silence, grace = 6.0, 3.0
    run = _submit_hanging(
        cluster,
        shared_tmp,
        "coordinator_killed",
        {},
        coordinator_silence_s=silence,
        marker_grace_s=grace,
    )
    st = wait_for(
        lambda: (run.status(COORDINATOR) or {}).get("bench_pid") and run.status(COORDINATOR),
        10,
        "the coordinator's bench pid",
    )
    children = [int(st["engine_pid"]), int(st["bench_pid"])]
    killed = time.time()
    os.kill(_agent_pid(run, COORDINATOR), signal.SIGKILL)
    state, exit_code = _terminal(cluster, run.job_id).split("|")
    # srun reports the killed task: rc 137, shown by sacct as 9:0.
    assert (state, exit_code) == ("FAILED", "9:0"), run.describe()

    # The workers' own bound: coordinator silence + marker grace + engine stop + slack.
    # (srun --kill-on-bad-exit TERMs them at once here; either way they must be gone.)
    bound = silence + grace + 3.0
    exits = _exits(run)
    assert set(exits) == set(WORKERS), run.describe()
    assert all(rc in (75, 143) for _, rc in exits.values()), run.describe()
    worst = max(t for t, _ in exits.values()) - killed
    assert worst < bound, f"a worker exited {worst:.1f} s after the coordinator died"
    _, end = sacct_times(cluster, run.job_id)
    assert end - killed < bound + 1.0
    assert run.marker() is None, "a killed coordinator must not look finished"
    # Its engine and hung bench died with it (parent-death signal), not left running.
    wait_for(lambda: all(_gone(p, run.job_dir) for p in children), 5, "coordinator children")

    status, receipt = verify(cluster, run.job_id, run.log_dir)
    assert (status, receipt["outcome"]) == (10, "failed"), receipt["reason"]
    assert "missing" in receipt["reason"]
