"""The llm-d topology on loopback: prefill engines, decode engines each behind a P/D
sidecar, the router reading an endpoints file, and the benchmark client in single-URL
mode against the router. Every process is started here and killed by PID afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import llmd_supervisor.standins
from llmd_supervisor.standins import router as router_mod

NODE = Path(llmd_supervisor.standins.__file__).parent
PYTHON = os.environ.get("LLMD_NODE_PYTHON", sys.executable)
MODEL = "stand-in/test-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_config(role: str) -> str:
    return json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "fail"}
    )


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return -1


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


class Topology:
    """nP prefill engines, nD decode engines + sidecars, one router."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.prefill: list[int] = []  # engine ports
        self.decode: list[int] = []  # sidecar ports
        self.router_port = 0
        self.admin_port = 0
        self.endpoints = tmp / "endpoints.yaml"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMD_FAKE_")}
        out = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [PYTHON, *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**clean, **(env or {})},
            start_new_session=True,
        )
        out.close()
        self.procs.append((name, proc))

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def start_engines(self, n_prefill: int, n_decode: int, sidecar_env: dict[str, str]) -> None:
        for i in range(n_prefill):
            port = free_port()
            self.spawn(
                f"prefill{i}",
                [str(NODE / "engine.py"), "/models/x", "--host", "127.0.0.1", "--port",
                 str(port), "--served-model-name", MODEL, "--kv_transfer_config",
                 kv_config("kv_producer")],
            )  # fmt: skip
            self.prefill.append(port)
        for i in range(n_decode):
            vllm_port, car_port = free_port(), free_port()
            self.spawn(
                f"decode{i}",
                [str(NODE / "engine.py"), "--host", "127.0.0.1", "--port", str(vllm_port),
                 "--served-model-name", MODEL, "--kv-transfer-config", kv_config("kv_consumer")],
            )  # fmt: skip
            self.spawn(
                f"sidecar{i}",
                [str(NODE / "sidecar.py"), f"--port={car_port}", f"--vllm-port={vllm_port}",
                 "--kv-connector=nixlv2", "--secure-proxy=false", "--enable-prefiller-sampling"],
                sidecar_env,
            )  # fmt: skip
            self.decode.append(car_port)
        for port in self.prefill + self.decode:
            wait_until(
                lambda p=port: status_of(f"http://127.0.0.1:{p}/health") == 200, 20, f"port {port}"
            )

    def write_endpoints(self, prefill: list[int], decode: list[int]) -> None:
        lines = ["# written by the test, replaced by rename", "endpoints:"]
        for role, ports in (("prefill", prefill), ("decode", decode)):
            for port in ports:
                lines += [
                    f"- name: {role}-{port}",
                    "  namespace: inferencex",
                    "  address: 127.0.0.1",
                    f"  port: '{port}'",
                    "  labels:",
                    f"    llm-d.ai/role: {role}",
                ]
        tmp = self.endpoints.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.endpoints)

    def start_router(self, env: dict[str, str] | None = None) -> None:
        self.router_port, self.admin_port = free_port(), free_port()
        self.spawn(
            "router",
            [str(NODE / "router.py"), "--port", str(self.router_port), "--host", "127.0.0.1",
             "--admin-port", str(self.admin_port), "--endpoints", str(self.endpoints),
             "--pool-namespace", "inferencex"],
            env,
        )  # fmt: skip
        wait_until(
            lambda: status_of(f"http://127.0.0.1:{self.admin_port}/endpoints") == 200,
            20,
            "the router's admin port",
        )

    def admin(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=2) as r:
            return json.loads(r.read())

    def bench(self, name: str, prompts: int) -> tuple[int, dict[str, Any]]:
        result = self.tmp / f"{name}.json"
        argv = [
            PYTHON,
            str(NODE / "bench.py"),
            "--base-url",
            f"http://127.0.0.1:{self.router_port}",
        ]
        argv += ["--model", MODEL, "--max-concurrency", "4", "--num-prompts", str(prompts)]
        argv += ["--random-input-len", "40", "--random-output-len", "5", "--save-result"]
        argv += ["--result-dir", str(self.tmp), "--result-filename", result.name]
        done = subprocess.run(argv, capture_output=True, timeout=120)
        return done.returncode, json.loads(result.read_text())

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def topo(tmp_path: Path) -> Iterator[Topology]:
    t = Topology(tmp_path)
    try:
        yield t
    finally:
        t.stop()


def router_lines(t: Topology) -> list[dict[str, str]]:
    return [
        dict(re.findall(r"(\w+)=(\S+)", line))
        for line in t.log("router").splitlines()
        if line.startswith("router: request_id=")
    ]


def settle(t: Topology, requests: int) -> None:
    """Wait for the access lines of `requests` requests: the router, sidecar and engine
    stand-ins (like uvicorn's access log) write theirs after the response has gone, so a
    benchmark client can exit before the last lines are written."""
    wait_until(
        lambda: len(router_lines(t)) == requests and len(sidecar_lines(t)) == requests,
        10,
        f"the router's and the sidecars' lines of {requests} requests",
    )


def sidecar_lines(t: Topology) -> list[dict[str, str]]:
    found = []
    for i in range(len(t.decode)):
        for line in t.log(f"sidecar{i}").splitlines():
            if line.startswith("sidecar: request_id="):
                found.append(dict(re.findall(r"(\w+)=(\S+)", line)))
    return found


def test_every_request_takes_prefill_then_decode_and_the_file_is_followed(
    topo: Topology,
) -> None:
    topo.start_engines(2, 2, {})
    topo.write_endpoints(topo.prefill, topo.decode)
    topo.start_router()
    wait_until(lambda: status_of(f"http://127.0.0.1:{topo.admin_port}/ready") == 200, 10, "/ready")
    assert status_of(f"http://127.0.0.1:{topo.router_port}/health") == 200

    rc, result = topo.bench("c4", 12)
    assert rc == 0, result.get("errors")
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (12, 0, 60)
    assert result["base_url"] == f"http://127.0.0.1:{topo.router_port}"
    assert result["median_ttft_ms"] > 0 and result["median_tpot_ms"] > 0

    settle(topo, 12)
    routed = router_lines(topo)
    assert len(routed) == 12 and {r["status"] for r in routed} == {"200"}
    prefills = {f"127.0.0.1:{p}" for p in topo.prefill}
    decodes = {f"127.0.0.1:{p}" for p in topo.decode}
    assert {r["prefill"] for r in routed} == prefills  # round robin: both used
    assert {r["decode"] for r in routed} == decodes
    legs = sidecar_lines(topo)
    assert len(legs) == 12
    assert all(s["path"] == "prefill->decode" for s in legs)
    assert all(s["prefill_status"] == "200" and s["status"] == "200" for s in legs)
    # the sidecar that served a request is the one the router chose, with its prefill
    by_id = {r["request_id"]: r for r in routed}
    assert {s["client_request_id"] for s in legs} == set(by_id)
    for i, port in enumerate(topo.decode):
        for line in topo.log(f"sidecar{i}").splitlines():
            if line.startswith("sidecar: request_id="):
                fields = dict(re.findall(r"(\w+)=(\S+)", line))
                assert by_id[fields["client_request_id"]]["decode"] == f"127.0.0.1:{port}"
                assert by_id[fields["client_request_id"]]["prefill"] == fields["prefill"]

    def legs_logged() -> tuple[int, int]:
        logs = [(topo.log(f"prefill{i}"), topo.log(f"decode{i}")) for i in range(2)]
        return (
            sum(p.count("leg=prefill status=200") for p, _ in logs),
            sum(d.count("leg=decode status=200 from=") for _, d in logs),
        )

    wait_until(lambda: legs_logged() == (12, 12), 10, "the engines' lines of 12 requests")

    # one decode endpoint removed from the file (replaced by rename): followed
    topo.write_endpoints(topo.prefill, topo.decode[:1])
    wait_until(lambda: len(topo.admin("/endpoints")["decode"]) == 1, 10, "the reload")
    rc, result = topo.bench("c4-again", 6)
    assert rc == 0 and result["completed"] == 6
    settle(topo, 18)
    later = router_lines(topo)[12:]
    assert len(later) == 6 and {r["decode"] for r in later} == {f"127.0.0.1:{topo.decode[0]}"}


def test_a_dropped_prefill_leg_is_refused_by_the_decode_engine(topo: Topology) -> None:
    topo.start_engines(1, 1, {"LLMD_FAKE_SIDECAR_DROP_PREFILL": "1"})
    topo.write_endpoints(topo.prefill, topo.decode)
    topo.start_router()
    rc, result = topo.bench("c4", 4)
    assert rc == 1 and (result["completed"], result["failed"]) == (0, 4)
    assert all("400" in e for e in result["errors"]), result["errors"]
    settle(topo, 4)
    wait_until(lambda: topo.log("decode0").count("leg=decode status=400") == 4, 10, "4 lines")
    assert all(s["prefill_status"] == "dropped" for s in sidecar_lines(topo))
    assert "leg=prefill" not in topo.log("prefill0")
    assert {r["status"] for r in router_lines(topo)} == {"400"}


def test_never_healthy_router_keeps_failing_readiness(topo: Topology) -> None:
    topo.write_endpoints([free_port()], [free_port()])
    topo.start_router({"LLMD_FAKE_ROUTER_NEVER_HEALTHY": "1"})
    assert topo.admin("/endpoints")["loaded"] is True
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert status_of(f"http://127.0.0.1:{topo.admin_port}/ready") == 503
        assert status_of(f"http://127.0.0.1:{topo.router_port}/health") == 503
        time.sleep(0.2)


def test_router_is_not_ready_before_a_good_endpoints_file(topo: Topology) -> None:
    topo.endpoints.write_text("endpoints:\n- name: x\n  address: 127.0.0.1\n  port: 8000\n")
    topo.start_router()  # a bare number as port: the file does not unmarshal, as upstream
    assert status_of(f"http://127.0.0.1:{topo.admin_port}/ready") == 503
    topo.write_endpoints([], [free_port()])
    wait_until(lambda: status_of(f"http://127.0.0.1:{topo.admin_port}/ready") == 200, 10, "ready")


def test_sidecar_crash_knob_exits_nonzero(topo: Topology) -> None:
    port = free_port()
    topo.spawn(
        "sidecar0",
        [str(NODE / "sidecar.py"), f"--port={port}", f"--vllm-port={free_port()}",
         "--secure-proxy=false"],
        {"LLMD_FAKE_SIDECAR_CRASH_AFTER_S": "1"},
    )  # fmt: skip
    wait_until(lambda: status_of(f"http://127.0.0.1:{port}/health") == 200, 10, "the sidecar")
    proc = topo.procs[0][1]
    assert proc.wait(timeout=10) == 3
    assert "fault: sidecar crashing" in topo.log("sidecar0")


def test_sidecar_refuses_a_secure_proxy_without_certificate(tmp_path: Path) -> None:
    done = subprocess.run(
        [PYTHON, str(NODE / "sidecar.py"), "--port=1", "--vllm-port=2"],
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 2 and b"--secure-proxy=false" in done.stderr


def test_endpoints_file_as_inferencex_writes_it(tmp_path: Path) -> None:
    # yaml.safe_dump's layout: sorted keys, list items at the parent's indentation
    text = (
        "endpoints:\n- address: 10.0.0.1\n  labels:\n    llm-d.ai/role: prefill\n"
        "  name: prefill-0\n  namespace: inferencex\n  port: '8200'\n"
        "- address: 10.0.0.2\n  labels:\n    llm-d.ai/role: decode\n  name: decode-0\n"
        "  namespace: inferencex\n  port: '8000'\n- address: node3\n  name: bad\n  port: '1'\n"
    )
    path = tmp_path / "endpoints.yaml"
    path.write_text(text)
    endpoints, problems = router_mod.load_endpoints(str(path), "inferencex")
    assert [(e.hostport, e.role) for e in endpoints] == [
        ("10.0.0.1:8200", "prefill"),
        ("10.0.0.2:8000", "decode"),
    ]
    assert problems == ["endpoint 'bad': invalid IPv4 address 'node3'"]
    path.write_text(json.dumps({"endpoints": [{"name": "d", "address": "10.0.0.3", "port": "1"}]}))
    endpoints, _ = router_mod.load_endpoints(str(path), None)
    assert endpoints[0].role is None and endpoints[0].namespace == "default"
