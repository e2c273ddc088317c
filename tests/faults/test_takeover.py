"""Two daemons on one PostgreSQL journal (issue 3.7), on a replayed Slurm cluster.

Two daemon processes, each with its own state directory, socket and archive, share one
journal database: the first to start leads the cluster, the other is its standby. The
standby answers list/status/wait from the database and refuses a submission naming the
leader. When the leader is SIGKILLed mid-run (or stopped gracefully), the standby takes
over and supervises the run to its verified outcome, on the same Slurm job.

The same faults on the real dev cluster, with the two daemons as two login nodes in
network namespaces, are in tests/faults/test_takeover_cluster.py; the repeated trials
and their report are tests/faults/ha_trials.py's.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.daemon_helpers import Daemon, demo_spec
from tests.fakes.replay_world import ReplayWorld
from tests.postgres import PgServer
from tests.waiting import wait_until

# The lease (core.ha.lease): a standby acquires once the killed leader's lease expired (15 s
# after its last renewal) at its next attempt (every 2 s); a released lease at once.
TAKEOVER_AFTER_KILL_S = 30.0
TAKEOVER_AFTER_STOP_S = 8.0


@dataclass
class Pair:
    """Two daemons on one journal database."""

    a: Daemon
    b: Daemon

    def leader(self, timeout: float = 20.0) -> tuple[Daemon, Daemon]:
        """(leader, standby) once exactly one of them acts for the cluster."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            acting = [d for d in (self.a, self.b) if _acting(d)]
            if len(acting) == 1:
                other = self.b if acting[0] is self.a else self.a
                return acting[0], other
            time.sleep(0.1)
        raise AssertionError(f"no single leader after {timeout:g} s: {_tails(self)}")


def _acting(d: Daemon) -> bool:
    """Whether `d` is alive and its log says it acts for the cluster now."""
    return d.proc is not None and d.proc.poll() is None and d.leads()


def _tails(pair: Pair) -> str:
    return "\n".join(f"--- {d.root.name}\n{d.log_text()[-1500:]}" for d in (pair.a, pair.b))


def _journal_config(postgres: PgServer) -> str:
    database = postgres.new_database()
    return f"""
[journal]
url = "{postgres.url(database)}"
password_file = "{postgres.password_file}"
"""


@pytest.fixture
def pair(world: ReplayWorld, tmp_path: Path, postgres: PgServer) -> Iterator[Pair]:
    journal = _journal_config(postgres)
    daemons = []
    for name in ("a", "b"):
        root = tmp_path / name
        root.mkdir()
        daemons.append(Daemon(world, root, replay_socket=world.socket, extra_config=journal))
    p = Pair(*daemons)
    p.a.start()
    p.b.start()
    try:
        yield p
    finally:
        for d in daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.stop()


@pytest.mark.parametrize("fault", ["sigkill", "graceful"])
def test_the_standby_finishes_the_run_of_a_leader_that_is_gone(
    pair: Pair, world: ReplayWorld, tmp_path: Path, fault: str
) -> None:
    leader, standby = pair.leader()
    refused = standby.submit(demo_spec(tmp_path / "logs-refused", port=8400))
    assert refused.returncode != 0
    assert "does not lead cluster 'dev'" in refused.stderr, refused.stderr
    assert leader.root.name not in refused.stderr or "its leader is" in refused.stderr

    submitted = leader.submit(demo_spec(tmp_path / "logs", port=8410))
    assert submitted.returncode == 0, submitted.stderr
    run = str(json.loads(submitted.stdout)["run"])
    leader.wait_state(run, {"running"})
    world.pause()  # the job keeps running while the daemons change
    waiter = standby.wait_in_background(run)  # a client of the standby
    standby.wait_state(run, {"running"}, timeout=10)  # its view, from the journal

    gone = time.monotonic()
    leader.stop(signal.SIGKILL if fault == "sigkill" else signal.SIGTERM)
    limit = TAKEOVER_AFTER_KILL_S if fault == "sigkill" else TAKEOVER_AFTER_STOP_S
    new_leader, _ = pair.leader(timeout=limit + 5)
    took = time.monotonic() - gone
    assert new_leader is standby
    assert took <= limit, f"takeover took {took:.1f} s"
    world.pause(False)

    final = waiter.final()
    assert final["outcome"] == "succeeded", final.get("reason")
    names = world.sbatch_names()
    assert len(names) == 1, f"jobs submitted: {names}"
    assert world.job_ids_named(str(final["job_name"])) == [str(final["slurm_job_id"])]
    receipt = json.loads((Path(str(final["archive"])) / "receipt.json").read_text())
    assert receipt["outcome"] == "succeeded"
    assert Path(str(final["archive"])).is_relative_to(standby.root)  # its own archive


def test_a_slow_sbatch_that_straddles_the_takeover_makes_one_job(
    pair: Pair, world: ReplayWorld, tmp_path: Path
) -> None:
    """The leader dies while its sbatch is in flight; the job appears afterwards. The new
    leader waits out the in-flight window, then finds the job by its name and adopts it:
    one job, never a second submission."""
    leader, standby = pair.leader()
    world.slow["sbatch"] = 6.0  # the job exists 6 s after the call, whoever waits for it
    submitted = leader.submit(demo_spec(tmp_path / "logs", port=8420))
    assert submitted.returncode == 0, submitted.stderr
    run = str(json.loads(submitted.stdout)["run"])
    assert standby.status(run)["run"] == run  # known at once: it reads the journal again
    leader.wait_state(run, {"submitting"}, timeout=10)
    wait_until(lambda: world.calls_received("sbatch") == 1, 30, "the leader's sbatch in flight")
    leader.stop(signal.SIGKILL)
    waiter = standby.wait_in_background(run)
    final = waiter.final()
    assert final["outcome"] == "succeeded", final.get("reason")
    assert world.sbatch_names() == [final["job_name"]]  # one sbatch, the dead leader's
    assert standby.events("run.reconciled"), standby.log_text()[-2000:]


def test_a_daemon_that_leads_two_clusters_writes_each_run_as_its_own_cluster(
    world: ReplayWorld, tmp_path: Path, postgres: PgServer
) -> None:
    """A submission is a write outside any tenure: it states the run's cluster, never
    the first cluster the daemon leads. The fence refuses a row of one cluster written as
    another (core.ha.fencing, schema version 8), so a submission to the daemon's second
    cluster written as its first would be refused; here it is accepted and runs, and the
    journal holds its rows under its own cluster."""
    database = postgres.new_database()
    config = f"""
[journal]
url = "{postgres.url(database)}"
password_file = "{postgres.password_file}"

[[clusters]]
name = "dev2"
"""
    root = tmp_path / "a"
    root.mkdir()
    d = Daemon(world, root, replay_socket=world.socket, extra_config=config)
    d.start()
    try:
        deadline = time.monotonic() + 20
        while {e.get("cluster") for e in d.events("leading.acting")} != {"dev", "dev2"}:
            assert time.monotonic() < deadline, d.log_text()[-2000:]
            time.sleep(0.1)
        submitted = d.submit(demo_spec(tmp_path / "logs", port=8430), "--cluster", "dev2")
        assert submitted.returncode == 0, submitted.stderr
        run = str(json.loads(submitted.stdout)["run"])
        final = d.wait_state(run, {"succeeded", "failed", "unverified"}, timeout=120)
        assert final["state"] == "succeeded", final.get("reason")
        assert d.events("journal.write_fenced") == []
    finally:
        d.stop()
    with psycopg.connect(
        host=str(postgres.base), port=postgres.port, user="postgres", dbname=database
    ) as conn:
        runs = conn.execute("SELECT run_id, cluster FROM runs").fetchall()
        children = conn.execute(
            "SELECT DISTINCT cluster FROM transitions UNION SELECT DISTINCT cluster FROM events"
        ).fetchall()
    assert runs == [(run, "dev2")]
    assert children == [("dev2",)]
