"""Faults on the real cluster while the daemon supervises a run (DESIGN.md sections 5-8)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, assert_copies_identical, demo_spec
from tests.devcluster import DevCluster, devcluster
from tests.fakes.replay_world import ReplayWorld
from tests.waiting import wait_until

PORT = 8500


@pytest.fixture
def daemon(cluster: DevCluster, tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(cluster, tmp_path, limits={"node_silent_s": 5.0})
    d.start()
    yield d
    d.stop()


def _run(daemon: Daemon, spec: str) -> str:
    proc = daemon.submit(spec)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["run"])


def _final(daemon: Daemon, run: str) -> dict[str, object]:
    result = json.loads(daemon.cli("wait", run, "--json", check=False, timeout=300).stdout)
    assert isinstance(result, dict)
    return result


@pytest.mark.slurm_contract
def test_slurmdbd_down_at_the_end_verifies_through_scontrol(
    daemon: Daemon, shared_tmp: Path
) -> None:
    run = _run(daemon, demo_spec(shared_tmp, port=PORT, common={"LLMD_FAKE_MARKER_DELAY_S": "4"}))
    daemon.wait_state(run, {"running"})
    devcluster("slurmdbd", "stop")
    try:
        final = _final(daemon, run)
    finally:
        devcluster("slurmdbd", "start")
    assert final["outcome"] == "succeeded", final["reason"]
    assert "scontrol, 2 agreeing reads" in str(final["reason"])
    receipt = json.loads((Path(str(final["archive"])) / "receipt.json").read_text())
    assert any(q["source"] == "sacct" and q["outcome"] == "error" for q in receipt["queries"])


@pytest.mark.slurm_contract
def test_slurmctld_restarted_mid_run(daemon: Daemon, shared_tmp: Path) -> None:
    run = _run(daemon, demo_spec(shared_tmp, port=PORT, common={"LLMD_FAKE_MARKER_DELAY_S": "8"}))
    daemon.wait_state(run, {"running"})
    devcluster("slurmctld", "restart")
    final = _final(daemon, run)
    assert final["outcome"] == "succeeded", final["reason"]
    assert_copies_identical(final)


@pytest.mark.slurm_contract
def test_cut_link_reports_unreachable_then_node_failed(
    daemon: Daemon, shared_tmp: Path, cluster: DevCluster
) -> None:
    spec = demo_spec(
        shared_tmp,
        port=PORT,
        common={"LLMD_FAKE_MARKER_DELAY_S": "120"},
        retry={"infrastructure": 0},  # this attempt's end is the point (retries: test_retries)
    )
    run = _run(daemon, spec)
    status = daemon.wait_state(run, {"running"})
    node = str(status["nodes"][-1])  # type: ignore[index]
    devcluster("node", node, "cut")
    try:
        deadline = time.monotonic() + 60
        while not daemon.events("run.node_unreachable") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert daemon.events("run.node_unreachable"), "no node.unreachable within 60 s"
        final = _final(daemon, run)
    finally:
        devcluster("node", node, "restore")
        time.sleep(1)
        devcluster("node", node, "resume")
    assert final["outcome"] == "node_failed", final["reason"]
    assert "State=NODE_FAIL" in str(final["reason"])
    assert str(final["reason"]).endswith(f"; cause=infrastructure node={node}"), final["reason"]
    events = (Path(str(final["archive"])) / "events.jsonl").read_text()
    assert '"kind": "node.unreachable"' in events


def test_full_archive_disk_delays_the_outcome_until_space_returns(
    world: ReplayWorld, tmp_path: Path
) -> None:
    """The disk is the daemon's, not the cluster's: a replayed cluster runs the job."""
    archive = tmp_path / "archive"
    archive.mkdir()
    root = tmp_path / "daemon"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(archive)], check=True)
    try:
        d = Daemon(world, root, archive_dir=archive, replay_socket=world.socket)
        d.start()
        # The job runs long enough that a loaded machine's `status` calls see it running.
        world.call(lambda: setattr(world, "running_s", 10.0))
        try:
            run = _run(d, demo_spec(tmp_path / "logs"))
            d.wait_state(run, {"running"})
            filler = archive / "filler"
            with contextlib.suppress(OSError):
                filler.write_bytes(b"\0" * (8 << 20))  # fills the 4 MiB tmpfs
            held = d.wait_state(run, {"archiving"}, timeout=120)
            # The first write and two retries fail on the full disk: still not declared.
            wait_until(
                lambda: len(d.events("run.archive_failed")) >= 3,
                120,
                "three failed archive writes",
            )
            assert d.status(run)["state"] == "archiving", "declared with a full disk"
            assert held["outcome"] == "succeeded"  # decided, but not declared
            assert any(
                "No space left" in str(e.get("error")) for e in d.events("run.archive_failed")
            )
            filler.unlink()
            final = _final(d, run)
        finally:
            d.stop()
        assert final["state"] == final["outcome"] == "succeeded"
        assert_copies_identical(final)
        events = (Path(str(final["archive"])) / "events.jsonl").read_text()
        assert '"kind": "archive.failed"' in events
    finally:
        subprocess.run(["umount", "-l", str(archive)], check=False)


MARKER_LATER = (
    'printf \'{{"rc": {rc}, "job_id": "%s", "rank": 2, "reason": "t", "finished_at": "%s"}}\' '
    '"$SLURM_JOB_ID" "$(date -Iseconds)" > "$LOGDIR/.later.$SLURM_JOB_ID"\n'
)


def test_marker_that_appears_late_is_waited_for(cluster: DevCluster, shared_tmp: Path) -> None:
    script = shared_tmp / "late.sh"
    script.write_text(f"#!/bin/bash\nLOGDIR={shared_tmp}\nsrun true\n" + MARKER_LATER.format(rc=0))
    job = cluster.sbatch(script, "-N", "2", f"--output={shared_tmp}/%j.out")
    assert cluster.wait_terminal(job) == "COMPLETED|0:0"
    verifier = subprocess.Popen(
        cluster.verify_argv(job, shared_tmp, "--timeout", "30"),
        stdout=subprocess.PIPE,
        text=True,
        env=cluster.slurm_env,
    )
    time.sleep(4)  # shared-filesystem lag, simulated: the marker becomes visible now
    (shared_tmp / f".later.{job}").rename(shared_tmp / f".bench_done.{job}")
    out, _ = verifier.communicate(timeout=60)
    receipt = json.loads(out)
    assert (verifier.returncode, receipt["outcome"]) == (0, "succeeded"), receipt["reason"]
    assert len(receipt["queries"]) > 4  # it kept asking while the marker was missing


def test_garbage_marker_fails_naming_it(cluster: DevCluster, shared_tmp: Path) -> None:
    script = shared_tmp / "garbage.sh"
    script.write_text(
        f"#!/bin/bash\nsrun true\nprintf 'rc=0 {{oops' > {shared_tmp}/.bench_done.$SLURM_JOB_ID\n"
    )
    job = cluster.sbatch(script, "-N", "1", f"--output={shared_tmp}/%j.out")
    assert cluster.wait_terminal(job) == "COMPLETED|0:0"
    status, receipt = cluster.verify(job, shared_tmp, "--timeout", "10")
    assert (status, receipt["outcome"]) == (10, "failed")
    assert "not json" in str(receipt["reason"])
    assert receipt["marker"]["status"] == "not_json"  # type: ignore[index]


@pytest.mark.faults_full
@pytest.mark.timeout(1800)
def test_two_hundred_concurrent_short_runs_are_all_verified(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """Load: 200 runs submitted at once over one control connection; every one ends
    succeeded, each through every state, none missed."""
    import anyio

    from llmd_supervisor.adapters.control.client import ControlClient

    d = Daemon(cluster, tmp_path)
    d.start()

    async def submit_all() -> list[str]:
        async with ControlClient(d.socket) as client:
            runs = []
            for i in range(200):
                spec = demo_spec(shared_tmp / f"r{i}", port=10000 + 10 * i)
                result = await client.call("submit", {"spec_toml": spec})
                runs.append(str(result["run"]))
            return runs

    try:
        runs = anyio.run(submit_all)
        deadline = time.monotonic() + 1500
        while time.monotonic() < deadline:
            listed = json.loads(d.cli("list", "--all", "--json").stdout)["runs"]
            if (
                sum(
                    1
                    for r in listed
                    if r["state"]
                    in (
                        "succeeded",
                        "failed",
                        "cancelled",
                        "timed_out",
                        "node_failed",
                        "out_of_memory",
                        "unverified",
                    )
                )
                >= 200
            ):
                break
            time.sleep(5)
        finals = [d.status(run) for run in runs]
    finally:
        d.stop()
    bad = {str(f["run"]): f["reason"] for f in finals if f["outcome"] != "succeeded"}
    assert not bad, bad
    assert len(d.events("run.finished")) == 200
    for f in finals:
        transitions = f["transitions"]
        assert isinstance(transitions, list)
        states = [t["state"] for t in transitions]
        assert states[-4:] == ["finishing", "verifying", "archiving", "succeeded"], states
