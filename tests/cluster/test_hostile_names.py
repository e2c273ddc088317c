"""A job's name is its own text (issue 3.2, item 4), on the real cluster: a job that renames
itself and names its steps with a newline and a '|' is polled in the same squeue and sacct
batches as another run, and neither run's supervision is disturbed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, demo_spec, run_to_end
from tests.devcluster import DevCluster
from tests.foreign_helpers import cli

# Renames its own job and names its steps (a user may, for their own job); records what
# Slurm accepted; stays in the daemon's batches until the test releases it.
HOSTILE = """#!/bin/bash
#SBATCH --nodes=1
scontrol update JobId="$SLURM_JOB_ID" JobName=$'hostile\\nname|COMPLETED|0:0'
echo "rename=$?" >> names.txt
srun --job-name=$'step\\nname' true
echo "step_newline=$?" >> names.txt
srun --job-name='step|name' true
echo "step_pipe=$?" >> names.txt
touch named
for _ in $(seq 600); do [ -e release ] && exit 0; sleep 0.5; done
exit 9
"""

UNPARSABLE = (
    "slurm.squeue_unparsable",
    "slurm.sacct_unparsable",
    "slurm.squeue_record_unparsable",
    "slurm.sacct_record_unparsable",
)


@pytest.mark.slurm_contract
def test_a_job_named_with_a_newline_leaves_the_other_run_verified(
    cluster: DevCluster, daemon: Daemon, shared_tmp: Path
) -> None:
    run_dir = shared_tmp / "hostile"
    run_dir.mkdir()
    (run_dir / "job.sbatch").write_text(HOSTILE)
    argv = ["submit", "--script", str(run_dir / "job.sbatch"), "--chdir", str(run_dir),
            "--socket", str(daemon.socket), "--json", "--", "--time=00:06:00"]  # fmt: skip
    proc = cli(daemon, *argv)
    assert proc.returncode == 0, proc.stderr
    hostile = str(json.loads(proc.stdout)["run"])
    deadline = time.monotonic() + 120
    while not (run_dir / "named").exists():
        assert time.monotonic() < deadline, daemon.log_text()[-2000:]
        time.sleep(0.2)
    taken = dict(line.split("=") for line in (run_dir / "names.txt").read_text().split())
    assert "0" in taken.values(), f"Slurm took none of the names: {taken}"

    # The other run, polled in the same batches as the renamed job, ends verified.
    final = run_to_end(daemon, demo_spec(shared_tmp / "runs", decode_nodes=1))
    assert final["outcome"] == "succeeded", (final["reason"], daemon.log_text()[-3000:])
    assert "State=COMPLETED ExitCode=0:0" in str(final["reason"])
    receipt = json.loads((Path(str(final["archive"])) / "receipt.json").read_text())
    assert receipt["believed"]["source"] == "sacct", receipt["believed"]
    sacct = [q["raw"] for q in receipt["queries"] if q["source"] == "sacct"]
    owners = {line.split("|")[0].split(".")[0] for raw in sacct for line in raw.splitlines()}
    assert owners == {str(final["slurm_job_id"])}  # its own rows only, not the batch's

    # ... and so does the renamed job itself: its name is never asked for.
    (run_dir / "release").touch()
    got = json.loads(daemon.cli("wait", hostile, "--json", check=False).stdout)
    assert got["outcome"] == "succeeded", got["reason"]
    assert "State=COMPLETED ExitCode=0:0 (sacct" in str(got["reason"])
    assert not [e for name in UNPARSABLE for e in daemon.events(name)]
