"""The llm-d serving topology's extra processes: the router on the coordinator and the
P/D sidecar on decode nodes (pure; part of the run spec).

llm-d routes requests through Envoy with the EPP as its ext_proc, fed an endpoints file
of literal IPv4 endpoints labelled ``llm-d.ai/role: prefill|decode``; the EPP picks a
decode endpoint and a prefill endpoint and sets ``x-prefiller-host-port``; the P/D sidecar
in front of each decode vLLM sends the prefill leg, then hands the KV transfer parameters
to its local vLLM. In a spec::

    [router]                 # optional: processes started on the coordinator, in order
    port = 8080              # where {router_url} points (Envoy's listener)
    [[router.process]]
    name = "epp"
    command = ["epp", "--config-file", "...", "--grpc-port", "9002"]
    port = 9003              # health-checked here: GET health_path, or a TCP connect
    health_path = "/health"  # absent: TCP connect only
    startup_timeout_s = 60

    [sidecar]                # optional: on decode leaders (or every decode node)
    command = ["pd-sidecar", "--port={sidecar_port}", "--vllm-port={port}", ...]
    port = 8000
    health_path = "/health"
    startup_timeout_s = 120
    on = "leaders"           # or "all"

The agent writes the endpoints file (``{endpoints_file}``, by rename) from the
allocation's per-node IPv4 addresses before it starts the router: prefill leaders at the
engine port, decode leaders at the sidecar port (or the engine port without a sidecar).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from llmd_supervisor.core.spec.fields import (
    check_keys,
    command_field,
    int_field,
    num_field,
    pattern_field,
)
from llmd_supervisor.errors import SpecError

# What a router or sidecar command (and the benchmark, with a router) may name, beyond
# the engine's placeholders.
SERVICE_PLACEHOLDERS: Final = frozenset(
    {"router_port", "router_url", "sidecar_port", "endpoints_file"}
)
_NAME_RE: Final = re.compile(r"[a-z][a-z0-9-]{0,31}")
_HEALTH_RE: Final = re.compile(r"/[A-Za-z0-9._/-]{0,200}")
_MAX_PROCESSES: Final = 8
HealthScope = Literal["leaders", "all", "none"]


@dataclass(frozen=True)
class Service:
    """One process the agent starts and waits healthy within its deadline."""

    name: str
    command: tuple[str, ...]
    port: int
    health_path: str | None  # None: healthy once the port accepts a TCP connection
    startup_timeout_s: float


@dataclass(frozen=True)
class Router:
    port: int
    processes: tuple[Service, ...]


@dataclass(frozen=True)
class Sidecar:
    service: Service
    on: Literal["leaders", "all"] = "leaders"


def _service(
    t: Mapping[str, object], where: str, name: str, placeholders: frozenset[str]
) -> Service:
    health = t.get("health_path")
    if health is not None and (not isinstance(health, str) or not _HEALTH_RE.fullmatch(health)):
        raise SpecError(
            f"{where}.health_path",
            health,
            "use a URL path like '/health', or leave it out for a TCP check",
        )
    return Service(
        name=name,
        command=command_field(t, f"{where}.command", placeholders),
        port=int_field(t, f"{where}.port", lo=1024, hi=65535),
        health_path=health,
        startup_timeout_s=num_field(
            t, f"{where}.startup_timeout_s", default=120.0, lo=1.0, hi=86400.0
        ),
    )


def parse_router(t: Mapping[str, object], placeholders: frozenset[str]) -> Router | None:
    """The ``[router]`` table, or None when the spec has none."""
    if not t:
        return None
    check_keys("router", t, ("port", "process"))
    raw = t.get("process")
    if not isinstance(raw, list) or not raw or len(raw) > _MAX_PROCESSES:
        raise SpecError(
            "router.process",
            raw,
            f"give 1 to {_MAX_PROCESSES} [[router.process]] tables (name, command, port)",
        )
    processes = []
    for i, item in enumerate(raw):
        where = f"router.process[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(where, item, "each [[router.process]] entry is a table")
        check_keys(where, item, ("name", "command", "port", "health_path", "startup_timeout_s"))
        name = (
            pattern_field(
                item,
                f"{where}.name",
                _NAME_RE,
                "use lowercase letters, digits and -",
                required=True,
            )
            or ""
        )
        processes.append(_service(item, where, name, placeholders))
    names = [p.name for p in processes]
    if len(set(names)) != len(names):
        raise SpecError("router.process", names, "give each process its own name")
    return Router(port=int_field(t, "router.port", lo=1024, hi=65535), processes=tuple(processes))


def parse_sidecar(t: Mapping[str, object], placeholders: frozenset[str]) -> Sidecar | None:
    """The ``[sidecar]`` table, or None when the spec has none."""
    if not t:
        return None
    check_keys("sidecar", t, ("command", "port", "health_path", "startup_timeout_s", "on"))
    on = t.get("on", "leaders")
    if on not in ("leaders", "all"):
        raise SpecError("sidecar.on", on, "use 'leaders' (one per decode engine group) or 'all'")
    return Sidecar(
        _service(t, "sidecar", "sidecar", placeholders), "all" if on == "all" else "leaders"
    )


def health_scope(t: Mapping[str, object], fld: str) -> HealthScope:
    """A role's engine health scope: every node, its group leaders, or none (headless)."""
    value = t.get(fld.rsplit(".", 1)[1], "all")
    if value not in ("leaders", "all", "none"):
        raise SpecError(
            fld,
            value,
            "use 'all', 'leaders' (followers started --headless have no HTTP API) or 'none'",
        )
    return value
