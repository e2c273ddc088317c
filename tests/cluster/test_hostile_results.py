"""Hostile benchmark result files through the daemon on the dev cluster (issue 3.2, item 2).

The finding, reproduced here: a `submit --script` job with `--results` over 8 files of
32 MiB of ``[[],[],...]`` kept the control socket from answering `list` for 30 s, past the
unit's WatchdogSec. Now, next to another user's normal demo run: `list` answers within a
second throughout, the daemon logs no loop lag and is never restarted, the normal run ends
verified, and each hostile file is refused by the result parser's memory limit, naming the
file and limits.result_parse_memory_bytes. The fast twin on the replayed site is
tests/faults/test_hostile_results.py."""

from __future__ import annotations

import json
from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import DevCluster
from tests.fakes.hostile_results import list_until_final, vm_hwm
from tests.foreign_helpers import WATCH, cli, final

PORT = 9800
FILES = 8
# One node, leaving three for the normal run (decode_nodes=1). The coordinator writes the
# result files by temporary names that `results/*.json` does not match, then the marker.
SCRIPT = f"""#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --output=slurm_job-%j.out
#SBATCH --error=slurm_job-%j.err
set -eu
mkdir -p results
echo "rank 0: benchmarked" >"slurm_job-${{SLURM_JOB_ID}}_rank_0.log"
python3 - <<'PY'
import os
size = 32 << 20
body = b"[" + b"[]," * ((size - 4) // 3) + b"[]]"
body += b" " * (size - len(body))
for i in range({FILES}):
    with open("results/ix_c%d.json.tmp" % 2**i, "wb") as f:
        f.write(body)
    os.rename("results/ix_c%d.json.tmp" % 2**i, "results/ix_c%d.json" % 2**i)
PY
printf '0\\n' >".bench_done.$SLURM_JOB_ID"
"""


def test_hostile_result_files_next_to_a_normal_run(
    cluster: DevCluster, daemon: Daemon, shared_tmp: Path
) -> None:
    normal = daemon.submit(demo_spec(shared_tmp / "normal", port=PORT, decode_nodes=1))
    assert normal.returncode == 0, normal.stderr
    script, run_dir = shared_tmp / "hostile.sbatch", shared_tmp / "ix"
    script.write_text(SCRIPT)
    run_dir.mkdir()
    hostile = cli(
        daemon, "submit", "--script", str(script), "--chdir", str(run_dir),
        "--socket", str(daemon.socket), "--job-name-prefix", "hostile", *WATCH, "--json",
        "--", "--time=00:05:00",
    )  # fmt: skip
    assert hostile.returncode == 0, hostile.stderr
    normal_run, hostile_run = json.loads(normal.stdout)["run"], json.loads(hostile.stdout)["run"]

    delays = list_until_final(daemon.socket, {normal_run, hostile_run}, within_s=900)
    assert daemon.proc is not None and daemon.proc.poll() is None
    peak = vm_hwm(daemon.proc.pid)
    assert max(delays) < 1.0, f"list took up to {max(delays):.2f} s"
    assert daemon.events("daemon.loop_lag") == [], daemon.events("daemon.loop_lag")
    assert daemon.starts == 1
    assert peak < 600 << 20, f"the daemon's peak RSS was {peak >> 20} MiB"

    got = final(daemon, normal_run)
    assert got["outcome"] == "succeeded", got["reason"]
    receipt = json.loads((Path(str(got["archive"])) / "receipt.json").read_text())
    assert receipt["benchmark"]["reason"] == "benchmark: 3 of 3 points valid", receipt
    got = final(daemon, hostile_run)
    assert got["outcome"] == "succeeded", got["reason"]  # its marker says 0; no gate
    rows = json.loads((Path(str(got["archive"])) / "results.json").read_text())["points"]
    assert len(rows) == FILES, rows
    for row in rows:
        path = run_dir / str(row["file"]).removeprefix("results/")
        assert row["valid"] is False
        assert f"parsing {path} needs more than 512 MiB of memory" in row["problem"], row
        assert "limits.result_parse_memory_bytes" in row["problem"]
