"""Bring-up: the stages before the benchmark, each with its own deadline.

Engines healthy (every health-checked rank, seen from the coordinator; a worker checks its
own), the P/D sidecars, the endpoints file and the router processes. Each stage polls its
health probes (`health`) until they all answer, a child it started exits, another rank
reports a failure, or its deadline passes; the two last raise `LocalFailure` naming the
stage, rank, host and address.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from .. import common as shared
from . import processes
from .config import ConfigError
from .errors import LocalFailure
from .files import says_port_in_use, write_atomic
from .health import check_health, check_tcp
from .processes import rc_text
from .templates import Values, expand_template
from .topology import Role, endpoints_yaml, leader_ranks, sidecar_ranks

if TYPE_CHECKING:
    from .view import AgentView


def service_values(agent: "AgentView") -> Values:
    """Placeholders of router and sidecar commands (and of the benchmark)."""
    values = agent.template_values()
    router, sidecar = agent.cfg.get("router"), agent.cfg.get("sidecar")
    coordinator = agent.role.prefill_nodes
    extra: Dict[str, Any] = {
        "endpoints_file": os.path.join(agent.job_dir, shared.ENDPOINTS_FILE),
        "router_port": str(router["port"]) if router else "",
        "sidecar_port": str(sidecar["port"]) if sidecar else "",
    }
    if router:
        extra["router_url"] = lambda: "http://%s:%d" % (agent.ip_of(coordinator), router["port"])
    values.update(extra)
    return values


def start_service(agent: "AgentView", svc: Dict[str, Any]) -> "subprocess.Popen[bytes]":
    """Start a router or sidecar process (log ``rank<r>.<name>.log``) in the engine's
    process group."""
    values = service_values(agent)
    argv = [expand_template(a, values) for a in svc["command"]]
    name = str(svc["name"])
    log_path = service_log(agent, name)
    agent.log("%s.start" % name, argv=" ".join(argv), log=log_path)
    group = agent.engine.pid if agent.engine is not None else None
    try:
        proc = processes.spawn(
            argv, log_path, agent.role_env(agent.role.role), agent.job_dir, group
        )
    except OSError as exc:
        raise LocalFailure(
            shared.RC_SERVICE_DIED,
            "%s could not be started: %s" % (name, exc),
            component=name,
        ) from exc
    agent.services[name] = proc
    agent.log("%s.started" % name, pid=proc.pid)
    return proc


def service_log(agent: "AgentView", name: str) -> str:
    return os.path.join(agent.job_dir, "rank%d.%s.log" % (agent.rank, name))


def died(
    agent: "AgentView", rc: int, reason: str, component: str, log_path: str, port: int
) -> LocalFailure:
    """The failure of a component that exited: `rc`, or RC_PORT_IN_USE naming the port
    and this node when its log says the port was taken (a configuration's or another
    process's doing, not the node's)."""
    if log_path and says_port_in_use(log_path):
        where = "port %d on %s already in use" % (port, agent.host_of(agent.rank))
        return LocalFailure(shared.RC_PORT_IN_USE, "%s (%s)" % (where, reason), None, component)
    return LocalFailure(rc, reason, component=component)


def check_services(agent: "AgentView") -> None:
    """LocalFailure if a router or sidecar process of this rank has exited."""
    for name, proc in agent.services.items():
        rc = proc.poll()
        if rc is not None:
            svc = _service_config(agent, name)
            raise died(
                agent,
                shared.RC_SERVICE_DIED,
                "%s exited with %s" % (name, rc_text(rc)),
                name,
                service_log(agent, name),
                int(svc["port"]) if svc else 0,
            )


def _service_config(agent: "AgentView", name: str) -> Optional[Dict[str, Any]]:
    router = agent.cfg.get("router") or {}
    for svc in [*router.get("processes", []), agent.cfg.get("sidecar") or {}]:
        if svc.get("name") == name:
            return dict(svc)
    return None


def wait_healthy(
    agent: "AgentView",
    stage: str,
    svc: Dict[str, Any],
    targets: List[Tuple[int, str]],
    proc: Optional["subprocess.Popen[bytes]"] = None,
) -> None:
    """Stage `stage`: every (rank, address) answers `svc`'s health check (GET its
    health_path, or a TCP connect) within its startup deadline."""
    timeout = float(svc["startup_timeout_s"])
    port, path = int(svc["port"]), svc.get("health_path")
    agent.stage(stage, timeout)
    deadline = time.monotonic() + timeout
    pending = {rank: "not checked yet" for rank, _ in targets}
    addresses = dict(targets)
    while pending:
        agent.check_term()
        if proc is not None and proc.poll() is not None:
            raise died(
                agent,
                shared.RC_SERVICE_DIED,
                "stage %s: %s exited with %s before it was healthy"
                % (stage, svc["name"], rc_text(proc.poll())),
                svc["name"],
                service_log(agent, svc["name"]),
                port,
            )
        agent.raise_if_others_failed()
        for rank in sorted(pending):
            host = addresses[rank]
            why = (
                check_health(host, port, path, agent.connect_s, agent.read_s)
                if path
                else check_tcp(host, port, agent.connect_s)
            )
            if why:
                pending[rank] = why
            else:
                del pending[rank]
        if not pending:
            agent.stage_end()
            return
        if time.monotonic() >= deadline:
            rank = min(pending)
            raise LocalFailure(
                shared.RC_SERVICE_UNHEALTHY,
                "stage %s: %s of rank %d (%s) no answer on %s:%d%s after %gs (last: %s)"
                % (
                    stage,
                    svc["name"],
                    rank,
                    agent.host_of(rank),
                    addresses[rank],
                    port,
                    path or "",
                    timeout,
                    pending[rank],
                ),
                from_rank=None if rank == agent.rank else rank,
                component=svc["name"],
            )
        agent.sleep(0.5)


def start_own_sidecar(agent: "AgentView") -> None:
    """On a sidecar rank: start the P/D sidecar and wait until it answers here."""
    sidecar = agent.cfg.get("sidecar")
    if sidecar and agent.rank in sidecar_ranks(agent.cfg):
        proc = start_service(agent, sidecar)
        try:
            here = agent.ip_of(agent.rank)  # where the other nodes reach it
        except ConfigError:
            here = "127.0.0.1"
        wait_healthy(agent, "sidecar-healthy", sidecar, [(agent.rank, here)], proc)
        agent.mark_healthy("sidecar")


def start_router(agent: "AgentView") -> str:
    """On the coordinator: every sidecar answers, the endpoints file is written (by
    rename), the router processes start in order and each answers; the router URL."""
    sidecar, router = agent.cfg.get("sidecar"), agent.cfg["router"]
    if sidecar:
        targets = [(r, agent.ip_of(r)) for r in sidecar_ranks(agent.cfg)]
        wait_healthy(agent, "sidecars-healthy", sidecar, targets)
    endpoints = [
        ("prefill-%d" % r, agent.ip_of(r), agent.port_of(r), "prefill")
        for r in leader_ranks(agent.cfg, "prefill")
    ]
    for r in leader_ranks(agent.cfg, "decode"):
        port = (
            int(sidecar["port"]) if sidecar and r in sidecar_ranks(agent.cfg) else agent.port_of(r)
        )
        endpoints.append(("decode-%d" % r, agent.ip_of(r), port, "decode"))
    path = os.path.join(agent.job_dir, shared.ENDPOINTS_FILE)
    write_atomic(path, endpoints_yaml(endpoints).encode("utf-8"), durable=False)
    agent.log("endpoints.written", path=path, endpoints=len(endpoints))
    for svc in router["processes"]:
        proc = start_service(agent, svc)
        wait_healthy(agent, "%s-healthy" % svc["name"], svc, [(agent.rank, "127.0.0.1")], proc)
    return service_values(agent)["router_url"]


def health_checked(agent: "AgentView", rank: int) -> bool:
    """Whether `rank`'s engine answers health checks ([engine] prefill_/decode_health:
    all, group leaders only -- followers run --headless -- or none)."""
    role = Role(rank, agent.cfg)
    scope = agent.cfg["engine"][role.role].get("health", shared.HEALTH_SCOPE_DEFAULT)
    return scope == "all" or (scope == "leaders" and role.is_leader)


def raise_if_engine_died(agent: "AgentView") -> None:
    """LocalFailure if this rank's engine exited before it was healthy (port in use or
    not: see `died`)."""
    rc = agent.poll_engine()
    if rc is not None:
        raise died(
            agent,
            shared.RC_ENGINE_DIED,
            "engine exited with %s before becoming healthy" % rc_text(rc),
            "engine",
            agent.engine_log,
            agent.port_of(agent.rank),
        )


def wait_own_health(agent: "AgentView", deadline: float) -> None:
    host, port = agent.host_of(agent.rank), agent.port_of(agent.rank)
    last = ""
    while True:
        agent.check_term()
        raise_if_engine_died(agent)
        last = check_health(host, port, agent.health_path, agent.connect_s, agent.read_s)
        if not last:
            agent.log("engine.healthy", host=host, port=port)
            agent.mark_healthy("engine")
            return
        if time.monotonic() >= deadline:
            raise LocalFailure(
                shared.RC_ENGINE_UNHEALTHY,
                "engine not healthy after %gs at %s:%d%s (last: %s)"
                % (agent.health_timeout_s, host, port, agent.health_path, last),
            )
        agent.sleep(0.5)


def wait_all_engines(agent: "AgentView", deadline: float) -> None:
    ranks = [
        r
        for r in range(agent.role.prefill_nodes + agent.role.decode_nodes)
        if health_checked(agent, r)
    ]
    pending = {r: "not checked yet" for r in ranks}
    while pending:
        agent.check_term()
        raise_if_engine_died(agent)
        agent.raise_if_others_failed()
        for r in sorted(pending):
            agent.check_term()
            left = max(0.2, deadline - time.monotonic())
            why = check_health(
                agent.host_of(r),
                agent.port_of(r),
                agent.health_path,
                min(agent.connect_s, left),
                min(agent.read_s, left),
            )
            if why:
                pending[r] = why
            else:
                del pending[r]
                agent.log("engine.ready", peer=r, host=agent.host_of(r), port=agent.port_of(r))
                if r == agent.rank:
                    agent.mark_healthy("engine")
        if not pending:
            return
        if time.monotonic() >= deadline:
            own = pending.pop(agent.rank, None)
            if own is not None:
                raise LocalFailure(
                    shared.RC_ENGINE_UNHEALTHY,
                    "engine not healthy after %gs (last: %s)" % (agent.health_timeout_s, own),
                )
            first = min(pending)
            detail = "; ".join(
                "%s: %s" % (agent.where(r, agent.port_of(r), agent.health_path), w)
                for r, w in sorted(pending.items())
            )
            raise LocalFailure(
                shared.RC_REMOTE_UNHEALTHY,
                "stage engines-healthy: no answer after %gs from %s"
                % (agent.health_timeout_s, detail),
                from_rank=first,
            )
        agent.sleep(0.5)
