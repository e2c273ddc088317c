"""The real node agent, stand-in engine and bench, as 2P+2D ranks on 127.0.0.1.

Config in these runs: grace 5 s (engine stop timeout 3 s), marker grace 2 s, coordinator
silence 3 s, heartbeat 0.3 s.
"""

from __future__ import annotations

import datetime
import json
import signal
import socket
import threading
import time
from collections.abc import Callable

import pytest

from llmd_supervisor.node import common
from tests.node.conftest import LocalRun

pytestmark = [pytest.mark.timeout(60)]

MakeRun = Callable[..., LocalRun]
ALL = [0, 1, 2, 3]


def _finished_at(marker: dict[str, object]) -> float:
    value = marker["finished_at"]
    assert isinstance(value, str)
    return datetime.datetime.fromisoformat(value).timestamp()


class MarkerWatcher:
    """Polls the marker path as fast as it can; records anything that is not whole."""

    def __init__(self, run: LocalRun) -> None:
        self.path = run.marker_path
        self.reads = 0
        self.bad: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                continue
            self.reads += 1
            try:
                value = json.loads(raw)
                assert set(value) == {"rc", "job_id", "rank", "reason", "finished_at"}
            except (ValueError, AssertionError):
                self.bad.append(raw)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def test_success_all_ranks_exit_zero_soon_after_marker(local_run: MakeRun) -> None:
    # The coordinator writes the temp file slowly (knob from the spec's env.common): a
    # reader polling the marker path must still never see a part of it.
    run = local_run(env={"common": {"LLMD_FAKE_MARKER_SLOW_WRITE_S": "0.8"}})
    watcher = MarkerWatcher(run)
    run.start()
    rcs = run.wait(30)
    watcher.close()

    assert rcs == dict.fromkeys(ALL, 0), run.describe()
    marker = run.marker()
    assert marker is not None
    assert marker["rc"] == 0
    assert marker["job_id"] == "4242"
    assert marker["rank"] == 2
    assert str(marker["reason"]).startswith("ok")
    assert watcher.reads > 0 and watcher.bad == []
    done = _finished_at(marker)
    for rank in ALL:
        assert run.exit_times[rank] - done < 5.0, f"rank {rank} exited late"
        st = run.status(rank)
        assert st["state"] == "exited" and st["rc"] == 0
        assert st["role"] == ("prefill" if rank < 2 else "coordinator" if rank == 2 else "decode")
        assert st["hostname"] and st["host"] == "127.0.0.1"
        assert (run.job_dir / f"rank{rank}.agent.log").stat().st_size > 0
    for conc in (1, 2):
        result = json.loads((run.job_dir / "bench" / f"c{conc}.json").read_text())
        assert result["completed"] == conc * 2 and result["failed"] == 0
        # Requests went to both prefill leaders and to the single decode leader.
        assert len(result["prefill_urls"]) == 2 and len(result["decode_urls"]) == 1
    assert run.live_children() == []
    assert not list(run.log_dir.glob(".*.tmp.*")), "temp files left behind"


def test_failing_bench_point_gives_rc_7_and_sweep_continues(local_run: MakeRun) -> None:
    run = local_run(
        concurrencies=(1, 2, 3), env={"bench": {"LLMD_FAKE_BENCH_FAIL_CONCURRENCY": "2"}}
    )
    run.start()
    rcs = run.wait(30)

    assert rcs == dict.fromkeys(ALL, 7), run.describe()
    marker = run.marker()
    assert marker is not None and marker["rc"] == 7 and marker["rank"] == 2
    assert "concurrency 2 exited rc 7" in str(marker["reason"])
    ok3 = json.loads((run.job_dir / "bench" / "c3.json").read_text())
    assert ok3["completed"] == 6, "the sweep must continue after a failed point"
    assert run.live_children() == []


def test_prefill_crash_ends_every_rank_promptly_naming_the_rank(local_run: MakeRun) -> None:
    run = local_run(
        concurrencies=(1,),
        multiplier=5000,  # a long point: the crash lands in the middle of the sweep
        env={
            "prefill": {
                "LLMD_FAKE_FAULT_RANKS": "1",
                "LLMD_FAKE_ENGINE_CRASH_AFTER_S": "2",
            }
        },
    )
    start = time.monotonic()
    run.start()
    rcs = run.wait(25)
    elapsed = time.monotonic() - start

    assert rcs == dict.fromkeys(ALL, 73), run.describe()
    marker = run.marker()
    assert marker is not None and marker["rc"] == 73
    assert "rank 1 (prefill" in str(marker["reason"])
    assert "engine exited with rc 3" in str(marker["reason"])
    assert elapsed < 15, f"took {elapsed:.1f} s"
    assert run.status(1)["engine_rc"] == 3
    assert run.live_children() == []


def test_sigterm_every_rank_exits_143_within_grace_with_diagnostic(local_run: MakeRun) -> None:
    run = local_run(
        env={
            "bench": {"LLMD_FAKE_BENCH_HANG": "1"},
            # Rank 3's engine ignores TERM: its agent must SIGKILL it within the grace.
            "decode": {"LLMD_FAKE_FAULT_RANKS": "3", "LLMD_FAKE_ENGINE_IGNORE_SIGTERM": "1"},
        }
    )
    run.start()
    run.wait_for(lambda: run.status(2).get("state") == "benchmarking", 20, "the sweep")
    run.wait_for(
        lambda: all(run.status(r).get("state") == "ready" for r in (0, 1, 3)), 10, "workers"
    )
    sent = time.time()
    for rank in ALL:  # what `scancel --signal=TERM` does: every task at once
        run.signal(rank, signal.SIGTERM)
    rcs = run.wait(15)

    assert rcs == dict.fromkeys(ALL, 143), run.describe()
    for rank in ALL:
        assert run.exit_times[rank] - sent < 5.0, f"rank {rank} exceeded the 5 s grace"
        diag = (run.job_dir / f"rank{rank}.diag.txt").read_text()
        assert "SIGTERM" in diag and "engine.py" in diag
        assert "last lines of" in diag and "stand-in" in diag
        assert run.status(rank)["state"] == "terminated"
    assert "needed SIGKILL" in (run.job_dir / "rank3.diag.txt").read_text()
    assert "(none)" not in (run.job_dir / "rank3.diag.txt").read_text().split("needed SIGKILL")[1]
    marker = run.marker()
    assert marker is not None and marker["rc"] == 143 and marker["reason"] == "sigterm"
    assert run.live_children() == []


def test_coordinator_dying_before_publishing_does_not_hang_workers(local_run: MakeRun) -> None:
    run = local_run(env={"bench": {"LLMD_FAKE_BENCH_HANG": "1"}})
    run.start()
    run.wait_for(lambda: run.status(2).get("bench_pid") is not None, 20, "the sweep")
    run.wait_for(
        lambda: all(run.status(r).get("state") == "ready" for r in (0, 1, 3)), 10, "workers"
    )
    killed = time.monotonic()
    run.signal(2, signal.SIGKILL)
    rcs = run.wait(20)
    elapsed = time.monotonic() - killed

    assert rcs == {0: 75, 1: 75, 2: -9, 3: 75}, run.describe()
    # Bound: coordinator silence (3 s) + marker grace (2 s) + engine stop + slack.
    assert elapsed < 10, f"workers took {elapsed:.1f} s"
    assert run.marker() is None, "a killed coordinator must not look finished"
    assert "coordinator" in str(run.status(0)["reason"])
    # The coordinator's engine and hung bench died with its agent (parent-death signal).
    run.wait_for(lambda: run.live_children() == [], 5, "engine and bench to be gone")


def test_engine_death_rereads_marker_that_appears_late(local_run: MakeRun) -> None:
    # Rank 3's engine dies after the sweep, while the coordinator delays publishing by
    # 4 s; rank 3 must wait for the marker (grace 6 s) and exit with its rc 0. Workers
    # also see the marker only once it is 1 s old (simulated file-system lag).
    run = local_run(
        concurrencies=(1,),
        config_overrides={"marker_grace_s": 6.0, "coordinator_silence_s": 10.0},
        env={"decode": {"LLMD_FAKE_FAULT_RANKS": "3", "LLMD_FAKE_ENGINE_CRASH_AFTER_S": "2.5"}},
    )
    run.start(agent_env={"LLMD_FAKE_MARKER_DELAY_S": "4", "LLMD_FAKE_MARKER_LAG_S": "1"})
    run.wait_for(lambda: run.status(3).get("state") == "engine_died", 15, "rank 3's crash")
    assert run.marker() is None
    rcs = run.wait(20)

    assert rcs == dict.fromkeys(ALL, 0), run.describe()
    assert run.status(3)["engine_rc"] == 3
    assert "marker rc=0" in str(run.status(3)["reason"])


@pytest.mark.parametrize("rc", [False, 256], ids=["false", "256"])
def test_a_marker_rc_that_is_no_exit_status_ends_a_worker_with_its_own_status(
    local_run: MakeRun, rc: object
) -> None:
    # The job writes the marker itself, with an rc that int() and exit() would turn into
    # 0: the worker exits RC_BAD_MARKER instead and its log names the value.
    run = local_run(prefill=1, decode=1, config_overrides={"coordinator_silence_s": 30.0})
    run.start([0])  # the prefill worker; no coordinator
    run.wait_for(lambda: run.status(0).get("state") == "ready", 20, "rank 0 ready")
    marker = {"rc": rc, "job_id": "4242", "rank": 1, "reason": "x", "finished_at": "now"}
    run.marker_path.write_text(json.dumps(marker))
    rcs = run.wait(15)

    assert rcs == {0: common.RC_BAD_MARKER}, run.describe()
    log = (run.job_dir / "rank0.agent.log").read_text()
    assert f"marker.invalid rc={json.dumps(json.dumps(rc))}" in log, log[-2000:]
    assert "is not an exit status" in str(run.status(0)["reason"])
    assert run.live_children() == []


def test_blackholed_health_endpoint_hits_the_deadline(local_run: MakeRun) -> None:
    run = local_run(prefill=1, decode=1, health_timeout=3.0)
    # Rank 0's port: a listener that never accepts; connects succeed, reads never answer.
    hole = socket.socket()
    hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hole.bind(("127.0.0.1", run.port_of(0)))
    hole.listen(64)
    try:
        start = time.monotonic()
        run.start([1])
        rcs = run.wait(20)
        elapsed = time.monotonic() - start
    finally:
        hole.close()

    assert rcs == {1: 74}, run.describe()
    assert elapsed < 3.0 + 5.0, f"took {elapsed:.1f} s for a 3 s deadline"
    marker = run.marker()
    assert marker is not None and marker["rc"] == 74 and marker["rank"] == 1
    assert (
        "stage engines-healthy: no answer after 3s from rank 0 (prefill, 127.0.0.1) on 127.0.0.1:"
        in str(marker["reason"])
    )
    assert "timed out" in str(marker["reason"])
    stages = {st["name"]: st for st in run.status(1)["stages"]}
    assert stages["engines-healthy"]["state"] == "failed"
    assert stages["engines-healthy"]["deadline_s"] == 3.0
    assert stages["marker-published"]["state"] == "done"
    net = (run.job_dir / "rank1.net.txt").read_text()
    assert "stage engines-healthy failed" in net and "$ ip -4 addr" in net
    assert run.live_children() == []


def test_an_engine_whose_port_is_taken_says_so_and_exits_port_in_use(
    local_run: MakeRun,
) -> None:
    """Rank 1's engine port is held by another process: its engine cannot bind ("Address
    already in use" in its log). The failure names the port and the host, with the rc
    the daemon's cause reads as the workload's (a configuration's, not the node's)."""
    run = local_run(concurrencies=(1,))
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    taken.bind(("127.0.0.1", run.port + 1))
    taken.listen(1)
    try:
        run.start()
        rcs = run.wait(30)
    finally:
        taken.close()
    assert rcs[1] == common.RC_PORT_IN_USE, run.describe()
    marker = run.marker()
    assert marker is not None and marker["rc"] == common.RC_PORT_IN_USE, marker
    assert f"port {run.port + 1} on 127.0.0.1 already in use" in str(marker["reason"])
    status = run.status(1)
    assert status["local_rc"] == common.RC_PORT_IN_USE and status["failed_component"] == "engine"
