"""Per-node network identity on the real cluster (issue 2.4): `{host_ip}`, `{iface}` and
`{leader_ip}` in a spec's environment values reach every engine as its own node's IPv4
address, the interface holding it, and its group leader's address (NIXL's
VLLM_NIXL_SIDE_CHANNEL_HOST must be the node's own address, never localhost)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec, node_addresses
from tests.devcluster import DevCluster

# The engines dump their environment before exec'ing the stand-in.
DUMP_ENV = """'env > "$LLMD_JOB_DIR/env.rank$LLMD_RANK"; exec "$0" "$@"'"""


def test_host_ip_iface_and_leader_ip_reach_each_engine_as_its_own_nodes(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    spec = demo_spec(
        shared_tmp,
        port=8950,
        common={  # (the demo sets VLLM_NIXL_SIDE_CHANNEL_HOST = "{host_ip}" itself)
            "NCCL_SOCKET_IFNAME": "{iface}",
            "LLMD_LEADER_IP": "{leader_ip}",
            "LLMD_JSON_STAYS": "{'kv_role': 'kv_consumer'}",
        },
    )
    for role in ("prefill", "decode"):
        spec = spec.replace(
            f'{role}_command = ["python3",', f'{role}_command = ["sh", "-c", {DUMP_ENV}, "python3",'
        )
    d = Daemon(cluster, tmp_path)
    d.start()
    try:
        proc = d.submit(spec)
        assert proc.returncode == 0, proc.stderr
        run = str(json.loads(proc.stdout)["run"])
        final = json.loads(d.cli("wait", run, "--json", check=False, timeout=300).stdout)
    finally:
        d.stop()
    assert final["outcome"] == "succeeded", final["reason"]
    hosts = node_addresses()
    job_dir = shared_tmp / str(final["slurm_job_id"])
    dumps = sorted(job_dir.glob("env.rank*"))
    assert len(dumps) == 4, dumps
    for dump in dumps:
        env = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
        node = env["SLURMD_NODENAME"]
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == hosts[node], (dump.name, node)
        assert env["NCCL_SOCKET_IFNAME"] == "eth0", dump.name
        assert env["LLMD_LEADER_IP"] in hosts.values(), dump.name
        assert env["LLMD_JSON_STAYS"] == "{'kv_role': 'kv_consumer'}"  # other braces stay
