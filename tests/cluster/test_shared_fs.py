"""`access = "shared-fs"` on the real cluster: no SSH at all, every node's sshd stopped.

The daemon reads the batch logs, the ranks' logs, their status files and the marker on
this machine (the dev cluster's nodes share its file system, as a site's Lustre or NFS
would); liveness comes from the status files. Every sshd is started again afterwards.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from llmd_supervisor.node.common import status_name
from tests.daemon_helpers import Daemon, assert_copies_identical, demo_spec
from tests.devcluster import DevCluster, devcluster
from tests.waiting import wait_until

PORT = 9200
SHARED_FS = 'access = "shared-fs"'


@contextlib.contextmanager
def no_sshd(cluster: DevCluster) -> Iterator[None]:
    nodes = cluster.nodes
    try:
        for node in nodes:
            devcluster("sshd", node, "stop")
        yield
    finally:
        for node in nodes:
            devcluster("sshd", node, "start")


def _final(daemon: Daemon, run: str) -> dict[str, object]:
    result = json.loads(daemon.cli("wait", run, "--json", check=False, timeout=300).stdout)
    assert isinstance(result, dict)
    return result


def test_the_demo_succeeds_without_ssh_and_survives_a_daemon_sigkill(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    daemon = Daemon(cluster, tmp_path, extra_config=SHARED_FS)
    spec = demo_spec(shared_tmp, port=PORT, common={"LLMD_FAKE_MARKER_DELAY_S": "6"})
    with no_sshd(cluster):
        daemon.start()
        try:
            proc = daemon.submit(spec)
            assert proc.returncode == 0, proc.stderr
            run = str(json.loads(proc.stdout)["run"])
            status = daemon.wait_state(run, {"running"})
            copies = Path(str(status["archive"])) / "logs" / "attempt1"
            wait_until(  # some bytes copied before the crash
                lambda: any(f.is_file() and f.stat().st_size > 0 for f in copies.rglob("*")),
                60,
                f"log bytes copied into {copies}",
            )
            assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
            daemon.start()  # resumes the run from its journal and its copies' sizes
            final = _final(daemon, run)
            results = json.loads(daemon.cli("results", run, "--json").stdout)
        finally:
            daemon.stop()
    assert final["outcome"] == "succeeded", final["reason"]
    names = assert_copies_identical(final)  # nothing lost, nothing doubled
    assert any(n.endswith(".out") for n in names) and any("engine" in n for n in names), names
    assert not daemon.events("tail.interrupted"), "a follower failed on the shared file system"
    assert not daemon.events("ssh.connect") and not daemon.events("ssh.error")
    assert results["runs"][0]["results"]["points"], results


def test_a_killed_node_is_reported_by_its_silent_status_file(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    daemon = Daemon(cluster, tmp_path, extra_config=SHARED_FS, limits={"node_silent_s": 5.0})
    spec = demo_spec(shared_tmp, port=PORT + 10, common={"LLMD_FAKE_MARKER_DELAY_S": "120"})
    with no_sshd(cluster):
        daemon.start()
        node = ""
        try:
            proc = daemon.submit(spec)
            assert proc.returncode == 0, proc.stderr
            run = str(json.loads(proc.stdout)["run"])
            status = daemon.wait_state(run, {"running"})
            job_dir = shared_tmp / str(status["slurm_job_id"])
            ranks = range(len(status["nodes"]))  # type: ignore[arg-type]
            wait_until(  # every rank has written its status file
                lambda: all((job_dir / status_name(r)).is_file() for r in ranks),
                60,
                f"every rank's status file in {job_dir}",
            )
            node = str(status["nodes"][-1])  # type: ignore[index]
            devcluster("node", node, "kill")  # slurmd, the agent and its engine: gone
            deadline = time.monotonic() + 60
            while not daemon.events("run.node_unreachable") and time.monotonic() < deadline:
                time.sleep(0.5)
            (event,) = daemon.events("run.node_unreachable")
            assert event["node"] == node, event
            daemon.cli("cancel", run)
            devcluster("node", node, "start")
            final = _final(daemon, run)
        finally:
            if node:
                devcluster("node", node, "start")
                devcluster("node", node, "resume")
            daemon.stop()
    assert final["outcome"] != "succeeded", final
    events = (Path(str(final["archive"])) / "events.jsonl").read_text()
    assert "status file was last updated" in events, events[-2000:]
