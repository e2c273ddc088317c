"""The llm-d topology's router and sidecar tables, and the engine health scopes."""

from __future__ import annotations

from typing import Any

import pytest

from llmd_supervisor.core.render.agent_config import agent_config
from llmd_supervisor.core.spec.runspec import parse_spec
from tests.unit.test_spec import demo, spec_error

ROUTER: dict[str, Any] = {
    "port": 8080,
    "process": [
        {
            "name": "router",
            "command": ["router", "--port", "{router_port}", "--endpoints", "{endpoints_file}"],
            "port": 9901,
            "health_path": "/ready",
            "startup_timeout_s": 30,
        }
    ],
}
SIDECAR: dict[str, Any] = {
    "command": ["pd-sidecar", "--port={sidecar_port}", "--vllm-port={port}"],
    "port": 8000,
    "health_path": "/health",
    "startup_timeout_s": 120,
}
ROUTED_BENCH = ["vllm", "bench", "serve", "--base-url", "{router_url}"]


def test_router_and_sidecar_reach_the_agent_config() -> None:
    spec = parse_spec(demo(router=ROUTER, sidecar=SIDECAR, benchmark__command=ROUTED_BENCH))
    assert spec.router is not None and spec.sidecar is not None
    assert [p.name for p in spec.router.processes] == ["router"]
    assert spec.sidecar.on == "leaders" and spec.sidecar.service.port == 8000
    cfg = agent_config(spec)
    assert cfg["router"] == {
        "port": 8080,
        "processes": [
            {
                "name": "router",
                "command": ROUTER["process"][0]["command"],
                "port": 9901,
                "health_path": "/ready",
                "startup_timeout_s": 30.0,
            }
        ],
    }
    assert cfg["sidecar"]["on"] == "leaders"  # type: ignore[index]


def test_without_them_the_topology_is_as_before() -> None:
    spec = parse_spec(demo(router=None, sidecar=None, benchmark__command=["bench"]))
    assert spec.router is None and spec.sidecar is None
    cfg = agent_config(spec)
    assert cfg["router"] is None and cfg["sidecar"] is None


@pytest.mark.parametrize(
    ("changes", "field", "hint"),
    [
        (
            {"router": None, "benchmark__command": ROUTED_BENCH},
            "benchmark.command[4]",
            "unknown placeholder",
        ),
        ({"router": {"port": 8080}}, "router.process", "[[router.process]]"),
        ({"router": {**ROUTER, "port": 80}}, "router.port", ""),
        (
            {"router": {**ROUTER, "process": [{**ROUTER["process"][0], "name": "Bad Name"}]}},
            "router.process[0].name",
            "lowercase",
        ),
        (
            {"router": {**ROUTER, "process": [ROUTER["process"][0]] * 2}},
            "router.process",
            "its own name",
        ),
        (
            {"router": {**ROUTER, "process": [{**ROUTER["process"][0], "health_path": "ready"}]}},
            "router.process[0].health_path",
            "URL path",
        ),
        (
            {"router": {**ROUTER, "process": [{**ROUTER["process"][0], "extra": 1}]}},
            "router.process[0]",
            "",
        ),
        ({"sidecar": {**SIDECAR, "on": "some"}}, "sidecar.on", "'leaders'"),
        (
            {"sidecar": {**SIDECAR, "command": ["pd-sidecar", "{router_url}"]}},
            "sidecar.command[1]",
            "unknown placeholder",
        ),
        ({"engine__decode_health": "followers"}, "engine.decode_health", "--headless"),
    ],
)
def test_bad_topology_values_name_the_field_and_the_fix(
    changes: dict[str, Any], field: str, hint: str
) -> None:
    error = spec_error(demo(**changes))
    assert error.field.startswith(field), (error.field, str(error))
    assert hint in str(error)


@pytest.mark.parametrize("scope", ["all", "leaders", "none"])
def test_engine_health_scopes(scope: str) -> None:
    spec = parse_spec(demo(engine__decode_health=scope))
    assert spec.engine.decode_health == scope and spec.engine.prefill_health == "all"
    cfg = agent_config(spec)
    assert cfg["engine"]["decode"]["health"] == scope
