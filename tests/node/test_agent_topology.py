"""The agent with the full llm-d topology on one machine: engines (NIXL producer and
consumer), the P/D sidecar on the decode leader, the router on the coordinator fed the
endpoints file the agent writes, and the benchmark through the router's one URL; and a
router that never gets ready, a sidecar that crashes (issue 2.4)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.node.conftest import NODE_PYTHON, LocalRun, free_port_block

MakeRun = Callable[..., LocalRun]


def _kv(role: str) -> str:
    """vLLM's --kv-transfer-config as a command template writes it (braces doubled)."""
    config = f'"kv_connector":"NixlConnector","kv_role":"{role}","kv_load_failure_policy":"fail"'
    return "{{" + config + "}}"


def _topology() -> dict[str, Any]:
    """config_overrides for LocalRun: engines, sidecar, router and a single-URL bench."""
    base = free_port_block(3)
    car, router, admin = base, base + 1, base + 2
    py = NODE_PYTHON
    engine = [
        py,
        "{node_dir}/engine.py",
        "/m",
        "--host",
        "0.0.0.0",
        "--port",
        "{port}",
        "--served-model-name",
        "{served_name}",
        "--kv-transfer-config",
    ]
    return {
        "sidecar": {
            "name": "sidecar",
            "command": [
                py,
                "{node_dir}/sidecar.py",
                "--port={sidecar_port}",
                "--vllm-port={port}",
                "--kv-connector=nixlv2",
                "--secure-proxy=false",
            ],
            "port": car,
            "health_path": "/health",
            "startup_timeout_s": 10.0,
            "on": "leaders",
        },
        "router": {
            "port": router,
            "processes": [
                {
                    "name": "router",
                    "command": [
                        py,
                        "{node_dir}/router.py",
                        "--port",
                        "{router_port}",
                        "--endpoints",
                        "{endpoints_file}",
                        "--admin-port",
                        str(admin),
                    ],
                    "port": admin,
                    "health_path": "/ready",
                    "startup_timeout_s": 5.0,
                }
            ],
        },
        "engine_commands": {
            "prefill": [*engine, _kv("kv_producer")],
            "decode": [*engine, _kv("kv_consumer")],
        },
        "bench_command": [
            py,
            "{node_dir}/bench.py",
            "--base-url",
            "{router_url}",
            "--model",
            "{served_name}",
            "--max-concurrency",
            "{concurrency}",
            "--num-prompts",
            "{num_prompts}",
            "--random-input-len",
            "{input_len}",
            "--random-output-len",
            "{output_len}",
            "--save-result",
            "--result-filename",
            "{result_file}",
        ],
    }


def _run(local_run: MakeRun, env: dict[str, dict[str, str]] | None = None) -> LocalRun:
    t = _topology()
    run = local_run(
        env=env or {},
        config_overrides={"router": t["router"], "sidecar": t["sidecar"]},
    )
    cfg = run.config
    engine = cfg["engine"]
    assert isinstance(engine, dict)
    engine["prefill"]["command"] = t["engine_commands"]["prefill"]
    engine["decode"]["command"] = t["engine_commands"]["decode"]
    bench = cfg["bench"]
    assert isinstance(bench, dict)
    bench["command"] = t["bench_command"]
    run.write_config()
    run.start(agent_env={"LLMD_FAKE_NODE_IP": "127.0.0.1"})
    return run


def test_requests_take_the_router_sidecar_prefill_decode_path(local_run: MakeRun) -> None:
    run = _run(local_run)
    rcs = run.wait(90)
    assert rcs == dict.fromkeys(range(run.nranks), 0), run.describe()
    marker = run.marker()
    assert marker is not None and marker["rc"] == 0, marker
    endpoints = (run.job_dir / "endpoints.yaml").read_text()
    assert endpoints.count("address: 127.0.0.1") == 3, endpoints  # the nodes' own addresses
    assert endpoints.count("llm-d.ai/role: prefill") == 2
    assert endpoints.count("llm-d.ai/role: decode") == 1
    coordinator = run.coordinator
    router_log = (run.job_dir / f"rank{coordinator}.router.log").read_text()
    sidecar_log = (run.job_dir / f"rank{coordinator}.sidecar.log").read_text()
    routed = [line for line in router_log.splitlines() if line.startswith("router: request_id")]
    prompts = sum(c * run.multiplier for c in run.concurrencies)
    assert len(routed) == prompts, router_log[-2000:]
    assert all("prefill=127.0.0.1:" in line and "status=200" in line for line in routed)
    assert sidecar_log.count("prefill=") >= prompts, sidecar_log[-2000:]
    stages = [st["name"] for st in run.status(coordinator)["stages"]]
    assert stages[:4] == [
        "engines-healthy",
        "sidecar-healthy",
        "sidecars-healthy",
        "router-healthy",
    ]
    assert run.live_children() == []


def test_a_router_that_never_gets_ready_fails_the_run_within_its_deadline(
    local_run: MakeRun,
) -> None:
    run = _run(local_run, env={"common": {"LLMD_FAKE_ROUTER_NEVER_HEALTHY": "1"}})
    rcs = run.wait(60)
    marker = run.marker()
    assert marker is not None and marker["rc"] == 76, (rcs, run.describe())
    assert "stage router-healthy: router of rank 2" in str(marker["reason"])
    assert "after 5s" in str(marker["reason"])
    assert (run.job_dir / f"rank{run.coordinator}.net.txt").exists()


def test_a_sidecar_that_crashes_fails_the_run_naming_the_sidecar(local_run: MakeRun) -> None:
    run = _run(local_run, env={"common": {"LLMD_FAKE_SIDECAR_CRASH_AFTER_S": "0.5"}})
    rcs = run.wait(60)
    marker = run.marker()
    assert marker is not None and marker["rc"] == 77, (rcs, run.describe())
    assert "sidecar exited with" in str(marker["reason"])
