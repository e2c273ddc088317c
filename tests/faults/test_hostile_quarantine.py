"""A hostile job cannot quarantine nodes for another user (issue 3.2 items 1 and 3), on the
real cluster through the daemon.

A stranger's two 3-node runs crash rank 0's engine (rc 73 beside rank 1's healthy one:
cause infrastructure) while every rank's status file claims to be on node4 (the stand-in
agent's `LLMD_FAKE_STATUS_HOSTS`). Only the allocation names the failed node (rank 0's
real node); the stranger's two runs keep that node out of the stranger's own runs only;
node4 is never counted. The test user's 4-node run, submitted after them, is placed on
every node, with nothing excluded, and ends verified. Before the fix, one such run
quarantined node4 for everyone for 6 h and the 4-node run waited forever.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import DevCluster
from tests.faults.test_retries import sacct_submit_line
from tests.strangers import Stranger

PORT = 9700
LIE = "node4"  # what the hostile job's status files say every rank runs on


def hostile_spec(log_dir: Path, port: int) -> str:
    return demo_spec(
        log_dir,
        port=port,
        decode_nodes=1,  # 3 nodes: ranks 0-1 prefill, rank 2 the coordinator
        retry={"infrastructure": 0},
        common={"LLMD_FAKE_STATUS_HOSTS": ",".join([LIE] * 3)},
        tables={
            # rank 0's engine dies once rank 1's has passed its health check; the benchmark
            # hangs meanwhile, so the run cannot succeed first
            "prefill": {"LLMD_FAKE_FAULT_RANKS": "0", "LLMD_FAKE_ENGINE_CRASH_AFTER_S": "5"},
            "bench": {"LLMD_FAKE_BENCH_HANG": "1"},
        },
    )


def final(daemon: Daemon, run: str) -> dict[str, object]:
    got = json.loads(daemon.cli("wait", run, "--json", check=False, timeout=300).stdout)
    assert isinstance(got, dict)
    return got


def test_a_jobs_status_files_quarantine_no_node_for_another_user(
    cluster: DevCluster, root_dir: Path, shared_tmp: Path, stranger: Stranger
) -> None:
    daemon = Daemon(cluster, root_dir, daemon_keys=f'socket_group = "{stranger.name}"')
    daemon.start()
    try:
        hostile = []
        for i in range(2):
            spec = hostile_spec(shared_tmp / f"hostile{i}", PORT + 10 * i)
            (shared_tmp / f"hostile{i}").mkdir()
            reply = stranger.ask(daemon.socket, "submit", spec_toml=spec)
            result = reply.get("result")
            assert isinstance(result, dict), reply
            hostile.append(str(result["run"]))
        implicated = set()
        for run in hostile:
            got = final(daemon, run)
            assert got["outcome"] == "failed", got["reason"]
            assert got["owner_uid"] == stranger.uid
            attempts = got["attempts"]
            assert isinstance(attempts, list) and len(attempts) == 1, attempts
            attempt, nodes = attempts[0], attempts[0]["nodes"]
            assert attempt["cause"] == "infrastructure", attempt
            assert attempt["implicated"] == [nodes[0]], attempt  # rank 0's real node
            assert f"node={nodes[0]}" in str(got["reason"])
            implicated.add(nodes[0])
        assert LIE not in implicated

        # The other user's 4-node run, submitted now: nothing kept out of it.
        (shared_tmp / "normal").mkdir()
        proc = daemon.submit(demo_spec(shared_tmp / "normal", port=PORT + 30))
        assert proc.returncode == 0, proc.stderr
        run = str(json.loads(proc.stdout)["run"])
        deadline = time.monotonic() + 30
        while (status := daemon.status(run))["state"] == "accepted":
            assert "waiting" not in str(status["reason"]), status["reason"]  # never held
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        normal = final(daemon, run)
        assert normal["outcome"] == "succeeded", normal["reason"]
        assert normal["nodes"] == ["node1", "node2", "node3", "node4"], normal["nodes"]
        assert "--exclude" not in sacct_submit_line(cluster, str(normal["slurm_job_id"]))

        listed = json.loads(daemon.cli("nodes", "--json").stdout)["nodes"]
        assert LIE not in {q["node"] for q in listed}, listed  # the job's word counts nothing
        active = [q for q in listed if q["active"]]
        assert all(q["owner_uid"] == stranger.uid for q in active), listed
        assert not any(q["owner_uid"] is None and q["active"] for q in listed), listed
        if len(implicated) == 1:  # both runs on the same rank-0 node: the stranger's own
            assert [(q["node"], q["owner_uid"]) for q in active] == [
                (next(iter(implicated)), stranger.uid)
            ]
        # The stranger sees its own runs' failures; the test user (root) sees all.
        theirs = stranger.ask(daemon.socket, "nodes", release=None, cluster=None)
        shown = theirs.get("result")
        assert isinstance(shown, dict), theirs
        assert {q["run"] for q in shown["nodes"]} <= set(hostile)
    finally:
        daemon.stop()
