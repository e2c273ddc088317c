"""Where each rank sits in the P/D topology, and the router's endpoints file (pure)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .config import ConfigError


class Role(object):
    """Where a rank sits in the P/D topology."""

    def __init__(self, rank: int, cfg: Dict[str, Any]) -> None:
        p = int(cfg["prefill_nodes"])
        d = int(cfg["decode_nodes"])
        if not 0 <= rank < p + d:
            raise ConfigError("SLURM_PROCID %d is outside 0..%d" % (rank, p + d - 1))
        self.rank = rank
        self.prefill_nodes = p
        self.decode_nodes = d
        if rank < p:
            self.role = "prefill"
            size = p // int(cfg["prefill_workers"])
            local = rank
            base = 0
        else:
            self.role = "decode"
            size = d // int(cfg["decode_workers"])
            local = rank - p
            base = p
        self.group = local // size
        self.group_rank = local % size
        self.group_size = size
        self.leader_rank = base + self.group * size
        self.is_leader = self.group_rank == 0
        self.is_coordinator = rank == p

    @property
    def name(self) -> str:
        return "coordinator" if self.is_coordinator else self.role


def leader_ranks(cfg: Dict[str, Any], role: str) -> List[int]:
    """The first rank of each engine group of `role`."""
    p = int(cfg["prefill_nodes"])
    d = int(cfg["decode_nodes"])
    if role == "prefill":
        size = p // int(cfg["prefill_workers"])
        return list(range(0, p, size))
    size = d // int(cfg["decode_workers"])
    return list(range(p, p + d, size))


def sidecar_ranks(cfg: Dict[str, Any]) -> List[int]:
    """The decode ranks that run the P/D sidecar (none without a [sidecar])."""
    sidecar = cfg.get("sidecar")
    if not sidecar:
        return []
    p, d = int(cfg["prefill_nodes"]), int(cfg["decode_nodes"])
    return list(range(p, p + d)) if sidecar.get("on") == "all" else leader_ranks(cfg, "decode")


def endpoints_yaml(endpoints: List[Tuple[str, str, int, str]]) -> str:
    """The EPP's file-discovery endpoints file: (name, IPv4, port, role) each, the port
    as a string (upstream unmarshals it into one)."""
    lines = ["# written by the llmd agent from the allocation's node addresses", "endpoints:"]
    for name, ip, port, role in endpoints:
        lines += [
            "- name: %s" % name,
            "  address: %s" % ip,
            "  port: '%d'" % port,
            "  labels:",
            "    llm-d.ai/role: %s" % role,
        ]
    return "\n".join(lines) + "\n"
