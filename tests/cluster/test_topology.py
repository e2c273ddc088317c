"""The demo's llm-d topology on the real cluster through the daemon (issue 2.4): every
request takes router -> sidecar -> prefill -> decode, the endpoints file lists the nodes'
own addresses; a router that never gets ready and a sidecar that crashes fail the run
within their deadlines, naming the stage and the rank."""

from __future__ import annotations

import re
from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec, node_addresses, run_to_end

PORT = 9100
PROMPTS = 4 + 8 + 16  # the demo's three points (concurrency x prompts_multiplier 4)


def test_every_request_takes_router_sidecar_prefill_decode(
    daemon: Daemon, shared_tmp: Path
) -> None:
    final = run_to_end(daemon, demo_spec(shared_tmp, port=PORT))
    assert final["outcome"] == "succeeded", final["reason"]
    job_dir = shared_tmp / str(final["slurm_job_id"])
    endpoints = (job_dir / "endpoints.yaml").read_text()
    addresses = set(re.findall(r"address: (\S+)", endpoints))
    listed = final["nodes"]
    assert isinstance(listed, list)
    nodes = [str(n) for n in listed]
    hosts = node_addresses()
    # prefill leaders (ranks 0, 1) and the decode leader (rank 2), by their own IPv4
    assert addresses == {hosts[n] for n in nodes[:3]}, endpoints
    router = (job_dir / "rank2.router.log").read_text()
    sidecar = (job_dir / "rank2.sidecar.log").read_text()
    routed = [ln for ln in router.splitlines() if ln.startswith("router: request_id")]
    assert len(routed) == PROMPTS, router[-2000:]
    prefills = {hosts[n] for n in nodes[:2]}
    for line in routed:
        picked = re.search(r"prefill=(\S+):\d+", line)
        assert picked is not None and picked.group(1) in prefills and "status=200" in line
    assert sidecar.count("path=prefill->decode") == PROMPTS, sidecar[-2000:]


def test_a_router_that_never_gets_ready_fails_within_its_deadline_naming_the_stage(
    daemon: Daemon, shared_tmp: Path
) -> None:
    spec = demo_spec(shared_tmp, port=PORT + 10, common={"LLMD_FAKE_ROUTER_NEVER_HEALTHY": "1"})
    router_timeout = 'health_path = "/ready"\nstartup_timeout_s = 30'
    assert spec.count(router_timeout) == 1
    spec = spec.replace(router_timeout, 'health_path = "/ready"\nstartup_timeout_s = 8')
    final = run_to_end(daemon, spec)
    assert final["outcome"] == "failed", final
    reason = str(final["reason"])
    assert "stage router-healthy: router of rank 2" in reason, reason
    assert "after 8s" in reason and "marker rc=76" in reason
    assert reason.endswith("; cause=unknown"), reason  # one router per job: nothing to compare
    archive = Path(str(final["archive"]))
    assert any(p.name == "rank2.net.txt" for p in archive.rglob("*")), "no network diagnostics"


def test_a_sidecar_that_crashes_fails_the_run_naming_the_sidecar(
    daemon: Daemon, shared_tmp: Path
) -> None:
    spec = demo_spec(shared_tmp, port=PORT + 20, common={"LLMD_FAKE_SIDECAR_CRASH_AFTER_S": "0.5"})
    final = run_to_end(daemon, spec)
    assert final["outcome"] == "failed", final
    reason = str(final["reason"])
    assert "sidecar exited with" in reason and "marker rc=77" in reason, reason
