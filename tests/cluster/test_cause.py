"""The cause of a failed run on the real cluster (core.verdict.cause): one node's engine never
healthy while its peer is healthy is the cluster's fault and names that node; every
prefill engine never healthy is the workload's."""

from __future__ import annotations

from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec, run_to_end

PORT = 9400


def _never_healthy(log_dir: Path, port: int, ranks: str) -> str:
    spec = demo_spec(
        log_dir,
        port=port,
        common={"LLMD_FAKE_ENGINE_NEVER_HEALTHY": "1", "LLMD_FAKE_FAULT_RANKS": ranks},
        retry={"infrastructure": 0},  # the cause of one attempt (retries: tests/faults)
    )
    return spec.replace("health_timeout_s = 60", "health_timeout_s = 12")


def test_one_engine_never_healthy_is_the_nodes_fault(daemon: Daemon, shared_tmp: Path) -> None:
    final = run_to_end(daemon, _never_healthy(shared_tmp, PORT, "1"))
    assert final["outcome"] == "failed", final
    node = str(final["nodes"][1])  # type: ignore[index]
    assert str(final["reason"]).endswith(f"; cause=infrastructure node={node}"), final["reason"]


def test_every_prefill_engine_never_healthy_is_the_workloads_fault(
    daemon: Daemon, shared_tmp: Path
) -> None:
    final = run_to_end(daemon, _never_healthy(shared_tmp, PORT + 10, "0,1"))
    assert final["outcome"] == "failed", final
    assert str(final["reason"]).endswith("; cause=workload"), final["reason"]
    attempts = final["attempts"]
    assert isinstance(attempts, list) and len(attempts) == 1, attempts
    assert attempts[0]["retry"] == "no retry: cause workload", attempts
