"""Smoke tests on the real dev cluster: Slurm, accounting and SSH all answer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import asyncssh
import pytest

from tests.devcluster import DevCluster, devcluster


@pytest.mark.slurm_contract
def test_four_node_job_runs_on_every_node_and_sacct_says_completed(
    cluster: DevCluster, shared_tmp: Path
) -> None:
    script = shared_tmp / "smoke.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"srun bash -c 'echo \"$SLURM_PROCID $(hostname)\" > {shared_tmp}/rank-$SLURM_PROCID'\n"
    )
    job = cluster.sbatch(script, "-N", str(len(cluster.nodes)), f"--output={shared_tmp}/%j.out")
    assert cluster.wait_terminal(job) == "COMPLETED|0:0"

    seen = {}
    for rank in range(len(cluster.nodes)):
        procid, host = (shared_tmp / f"rank-{rank}").read_text().split()
        seen[int(procid)] = host
    assert seen == dict(enumerate(cluster.nodes))

    row = cluster.slurm(
        ["sacct", "-X", "--parsable2", "--noheader", "-j", job, "--format=JobIDRaw,State,ExitCode"]
    ).stdout.strip()
    assert row == f"{job}|COMPLETED|0:0"


@pytest.mark.asyncio
async def test_asyncssh_reaches_every_node_and_reads_a_file_a_job_wrote(
    cluster: DevCluster, shared_tmp: Path
) -> None:
    script = shared_tmp / "write.sh"
    script.write_text(f"#!/bin/bash\nsrun bash -c 'hostname > {shared_tmp}/from-$(hostname)'\n")
    job = await anyio.to_thread.run_sync(
        lambda: cluster.sbatch(
            script, "-N", str(len(cluster.nodes)), f"--output={shared_tmp}/%j.out"
        )
    )
    assert await anyio.to_thread.run_sync(cluster.wait_terminal, job) == "COMPLETED|0:0"

    for node in cluster.nodes:
        async with asyncssh.connect(
            node,
            username="root",
            client_keys=[cluster.ssh_key],
            known_hosts=cluster.known_hosts,
            connect_timeout=5,
        ) as conn:
            result = await conn.run(f"cat {shared_tmp}/from-{node}; hostname", check=True)
        assert result.stdout == f"{node}\n{node}\n"


# Not slurm_contract: the dev cluster script's own behaviour (each pass of tests/run.sh
# brings its version's cluster up and down, 22.05's included).
def test_down_leaves_nothing_behind_and_up_is_idempotent(cluster: DevCluster) -> None:
    """Bring the shared cluster down and up again; nothing may be left in between."""
    rig = Path(cluster.env["DEVCLUSTER_RIG"])
    pids = [int(p.read_text().split()[0]) for p in (rig / "pids").glob("*.pid")]
    assert len(pids) >= 3 + 2 * len(cluster.nodes)

    devcluster("down")
    try:
        assert devcluster("status", check=False).returncode == 3
        alive = [pid for pid in pids if _running(pid)]
        assert alive == [], f"processes still running after down: {alive}"
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
        assert "llmd-" not in netns.stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
        assert "llmd" not in links.stdout
        assert "llmd-devcluster" not in Path("/etc/hosts").read_text()
        assert not Path("/run/llmd-devcluster").exists()
    finally:
        devcluster("up")
    second = devcluster("up")
    assert "already up" in second.stderr
    assert devcluster("status", check=False).returncode == 0


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
