"""The node agent's ``config.json``, as the renderer writes it (pure).

`agent_config` turns a run spec into the config the agent reads (``--config``;
``node/agent/config.py`` is the reading side, stdlib only, and ``node.common`` holds the
defaults both sides use). Its shape is the TypedDict `AgentConfig`, versioned by
``node.common.CONFIG_VERSION``.
"""

from __future__ import annotations

import math
from typing import Literal, TypedDict

from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.core.spec.services import HealthScope, Service
from llmd_supervisor.node import common as shared

__all__ = ["HEARTBEAT_S", "AgentConfig", "agent_config", "stop_timeout_s"]

HEARTBEAT_S = shared.HEARTBEAT_S


class RoleConfig(TypedDict):
    command: list[str]
    health: HealthScope


class EngineConfig(TypedDict):
    port: int
    port_stride: int
    health_path: str
    health_timeout_s: float
    connect_timeout_s: float
    read_timeout_s: float
    prefill: RoleConfig
    decode: RoleConfig


class ServiceConfig(TypedDict):
    name: str
    command: list[str]
    port: int
    health_path: str | None
    startup_timeout_s: float


class SidecarConfig(ServiceConfig):
    on: Literal["leaders", "all"]


class RouterConfig(TypedDict):
    port: int
    processes: list[ServiceConfig]


class BenchConfig(TypedDict):
    command: list[str]
    concurrencies: list[int]
    input_len: int
    output_len: int
    prompts_multiplier: int
    request_rate: float | Literal["inf"]
    point_timeout_s: float


class EnvConfig(TypedDict):
    common: dict[str, str]
    prefill: dict[str, str]
    decode: dict[str, str]
    bench: dict[str, str]


class AgentConfig(TypedDict):
    version: int
    log_dir: str
    prefill_nodes: int
    decode_nodes: int
    prefill_workers: int
    decode_workers: int
    gpus_per_node: int
    model_path: str
    served_name: str
    engine: EngineConfig
    router: RouterConfig | None
    sidecar: SidecarConfig | None
    bench: BenchConfig
    env: EnvConfig
    grace_s: int
    stop_timeout_s: float
    marker_grace_s: float
    coordinator_silence_s: float
    heartbeat_s: float
    exit_linger_s: float
    standins: bool


def stop_timeout_s(grace_s: int) -> float:
    """How long the agent waits for its engine after TERM before SIGKILL
    (`node.common.stop_timeout_s`, the agent's own default)."""
    return shared.stop_timeout_s(grace_s)


def agent_config(spec: RunSpec) -> AgentConfig:
    """The JSON config the node agent reads (``--config``)."""
    stop = stop_timeout_s(spec.sigterm_grace_s)
    b = spec.benchmark
    return {
        "version": shared.CONFIG_VERSION,
        "log_dir": spec.log_dir,
        "prefill_nodes": spec.topology.prefill_nodes,
        "decode_nodes": spec.topology.decode_nodes,
        "prefill_workers": spec.topology.prefill_workers,
        "decode_workers": spec.topology.decode_workers,
        "gpus_per_node": spec.topology.gpus_per_node,
        "model_path": spec.model.path,
        "served_name": spec.model.served_name,
        "engine": {
            "port": spec.engine.port,
            "port_stride": spec.engine.port_stride,
            "health_path": spec.engine.health_path,
            "health_timeout_s": spec.engine.health_timeout_s,
            "connect_timeout_s": shared.CONNECT_TIMEOUT_S,
            "read_timeout_s": shared.READ_TIMEOUT_S,
            "prefill": {
                "command": list(spec.engine.prefill_command),
                "health": spec.engine.prefill_health,
            },
            "decode": {
                "command": list(spec.engine.decode_command),
                "health": spec.engine.decode_health,
            },
        },
        "router": None
        if spec.router is None
        else {
            "port": spec.router.port,
            "processes": [_service(p) for p in spec.router.processes],
        },
        "sidecar": None
        if spec.sidecar is None
        else SidecarConfig(**_service(spec.sidecar.service), on=spec.sidecar.on),
        "bench": {
            "command": list(b.command),
            "concurrencies": list(b.concurrencies),
            "input_len": b.input_len,
            "output_len": b.output_len,
            "prompts_multiplier": b.prompts_multiplier,
            "request_rate": "inf" if math.isinf(b.request_rate) else b.request_rate,
            "point_timeout_s": b.point_timeout_s,
        },
        "env": {
            "common": dict(spec.env.common),
            "prefill": dict(spec.env.prefill),
            "decode": dict(spec.env.decode),
            "bench": dict(spec.env.bench),
        },
        "grace_s": spec.sigterm_grace_s,
        "stop_timeout_s": stop,
        "marker_grace_s": spec.marker_grace_s,
        "coordinator_silence_s": spec.coordinator_silence_s,
        "heartbeat_s": HEARTBEAT_S,
        "exit_linger_s": shared.exit_linger_s(stop),
        "standins": spec.standins,
    }


def _service(service: Service) -> ServiceConfig:
    return {
        "name": service.name,
        "command": list(service.command),
        "port": service.port,
        "health_path": service.health_path,
        "startup_timeout_s": service.startup_timeout_s,
    }
