"""One takeover trial on the real dev cluster (issue 3.7): two daemons as two login nodes
(tests/faults/ha_daemons.py), one journal database, one run, one fault; what followed,
measured (tests/faults/ha_trials.py's `Trial`).

The first daemon (login1) is started alone and leads; the second (login2) is its standby.
A run is submitted to the leader and, once it runs, the fault is injected:

- ``sigkill``: the leader is SIGKILLed (the standby takes over when the lease expires);
- ``sigstop``: the leader is SIGSTOPped for 25 s, then SIGCONTinued (it wakes up believing
  it leads: its writes are fenced until its keeper sees the silence and stops acting);
- ``cut``: the leader's link to the database is cut for 30 s (it still reaches Slurm);
- ``pgrestart``: PostgreSQL is restarted with an immediate shutdown;
- ``graceful``: the leader is stopped with SIGTERM (it releases the lease).

Then the run must reach its verified outcome (``succeeded``), told by a ``wait`` on the
standby's socket (which serves it from the journal whoever finishes it), on one Slurm job.

After a takeover the trial writes once as the first leader's epoch (a probe: the
database must refuse it). Measured: takeover time (fault to the next
``lease.acquired``), time with two leaders (from both daemons' lease events), jobs per
job name (sacct), stale writes rejected (the ``journal.write_fenced`` warnings of both
daemons) and stale writes committed (the run transitions a daemon journaled outside its
own tenures: each ``run.transition`` is logged after its write committed), runs lost.

Used by tests/faults/test_takeover_cluster.py (one trial per fault) and by
tests/faults/takeover_trials.py (N per fault, the report).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import psycopg

from llmd_supervisor.core.ha.fencing import SET_WRITER_SQL, STALE_EPOCH_SQLSTATE
from tests.daemon_helpers import Daemon, demo_spec
from tests.faults.ha_daemons import HaRig, login_daemon
from tests.faults.ha_trials import (
    ACQUIRED,
    Interval,
    LeaseEvent,
    Trial,
    jobs_per_name,
    leader_intervals,
    parse_lease_events,
    parse_timestamp,
    sacct_argv,
    takeover_s,
    two_leaders_s,
)
from tests.ha_net import cut, restore
from tests.postgres import restart_immediate

__all__ = ["FAULTS", "run_trial"]

CLUSTER: Final = "dev"
FAULTS: Final = {
    "sigkill": "leader SIGKILLed",
    "sigstop": "leader SIGSTOPped 25 s",
    "cut": "leader's database link cut 30 s",
    "pgrestart": "PostgreSQL restarted (immediate)",
    "graceful": "leader stopped (SIGTERM)",
}
STOP_S: Final = 25.0
CUT_S: Final = 30.0
WAIT_S: Final = 300.0


def run_trial(rig: HaRig, fault: str, root: Path, *, port: int = 8600) -> Trial:
    """One trial of `fault` (a key of FAULTS) under `root`; AssertionError when the run
    does not reach a verified success (with both daemons' log tails)."""
    db = rig.pg.new_database()
    leader = login_daemon(rig, "login1", root / "login1", db)
    standby = login_daemon(rig, "login2", root / "login2", db)
    try:
        leader.start()
        _wait_for(leader.leads, 20, "login1 to lead", leader, standby)
        standby.start()
        submitted = leader.submit(demo_spec(root / "logs", port=port))
        assert submitted.returncode == 0, submitted.stderr
        run = str(json.loads(submitted.stdout)["run"])
        job_name = str(json.loads(submitted.stdout)["job_name"])
        leader.wait_state(run, {"running"}, timeout=180)
        standby.wait_state(run, {"running"}, timeout=10)  # its view, refreshed every 2 s
        waiter = standby.wait_in_background(run, WAIT_S)
        fault_at = datetime.now(UTC)
        died = _inject(rig, fault, leader)
        final = waiter.final(lambda: f": {_tails(leader, standby)}")
        end = datetime.now(UTC)
        assert final["outcome"] == "succeeded", (final.get("reason"), _tails(leader, standby))
    finally:
        for d in (leader, standby):
            if d.proc is not None and d.proc.poll() is None:
                d.stop()
    logs = {"login1": leader.log_text(), "login2": standby.log_text()}
    events = [  # what followed the fault until the outcome, not the trial's own teardown
        e
        for name, text in logs.items()
        for e in parse_lease_events(name, text.split("\n"))
        if e.at <= end
    ]
    intervals = leader_intervals(
        events, until=end, died={"login1": died} if died is not None else None
    )
    sacct = rig.cluster.slurm(sacct_argv([job_name]))
    refused, committed = _probe(rig, db, run, events)
    return Trial(
        fault=FAULTS[fault],
        takeover_s=takeover_s(intervals, CLUSTER, fault_at),
        two_leaders_s=two_leaders_s(intervals, CLUSTER),
        jobs_per_name=jobs_per_name(sacct.stdout),
        stale_writes_rejected=sum(_count(text, "journal.write_fenced") for text in logs.values()),
        stale_writes_committed=sum(_outside(name, text, intervals) for name, text in logs.items()),
        runs_lost=0,
        probes_refused=refused,
        probes_committed=committed,
    )


def _probe(rig: HaRig, db: str, run: str, events: list[LeaseEvent]) -> tuple[int, int]:
    """After a takeover, write once as the first leader's epoch (a no-op update of the
    run's row): (1, 0) when the database refused it, (0, 1) when it committed; (0, 0)
    without a takeover (that epoch may still be the current one)."""
    epochs = [e.epoch for e in events if e.event == ACQUIRED and e.epoch is not None]
    if len(set(epochs)) < 2:
        return 0, 0
    with psycopg.connect(rig.pg.url(db), password=rig.pg.password(), autocommit=True) as conn:
        try:
            with conn.transaction():
                conn.execute(SET_WRITER_SQL, {"cluster": CLUSTER, "epoch": str(min(epochs))})
                conn.execute("UPDATE runs SET reason = reason WHERE run_id = %s", (run,))
        except psycopg.Error as exc:
            assert exc.sqlstate == STALE_EPOCH_SQLSTATE, exc
            return 1, 0
    return 0, 1


def _inject(rig: HaRig, fault: str, leader: Daemon) -> datetime | None:
    """Inject `fault` on the leader; when the leader died, when."""
    assert leader.proc is not None
    if fault == "sigkill":
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait(30)
        return datetime.now(UTC)
    if fault == "sigstop":
        leader.proc.send_signal(signal.SIGSTOP)
        time.sleep(STOP_S)
        leader.proc.send_signal(signal.SIGCONT)
    elif fault == "cut":
        login = rig.net.login("login1")
        cut(login, net=rig.net)
        try:
            time.sleep(CUT_S)
        finally:
            restore(login)
    elif fault == "pgrestart":
        restart_immediate(rig.pg)
    elif fault == "graceful":
        leader.stop(signal.SIGTERM)
        return datetime.now(UTC)
    else:
        raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    return None


def _wait_for(predicate: object, timeout: float, what: str, *daemons: Daemon) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}: {_tails(*daemons)}")
        time.sleep(0.1)


def _tails(*daemons: Daemon) -> str:
    return "\n".join(f"--- {d.root.name}\n{d.log_text()[-3000:]}" for d in daemons)


def _records(text: str) -> Iterable[dict[str, object]]:
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def _count(text: str, event: str) -> int:
    return sum(1 for r in _records(text) if r.get("event") == event)


def _outside(daemon: str, text: str, intervals: list[Interval]) -> int:
    """The run transitions `daemon` journaled (logged after the commit) outside all of
    its tenures."""
    mine = [iv for iv in intervals if iv.daemon == daemon and iv.cluster == CLUSTER]
    count = 0
    for r in _records(text):
        if r.get("event") != "run.transition" or not isinstance(r.get("timestamp"), str):
            continue
        at = parse_timestamp(str(r["timestamp"]))
        if not any(iv.start <= at <= iv.end for iv in mine):
            count += 1
    return count
