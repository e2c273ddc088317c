"""The agent's fault hooks: nothing at all in production.

Tests and the dev cluster inject faults into the agent itself (a late marker, a marker
seen late, a slow marker write, a forced node address, a status file that lies, a hung
stage). The knobs that do so are the stand-ins' (``standins/faults.py``); the agent only
knows this interface, whose production implementation, `NoFaults`, changes nothing. The
stand-ins' hooks are loaded only when the agent's config says ``"standins": true`` (the
spec's ``[standins] enabled = true``), from ``faults.py`` in the node directory, where the
batch script writes it beside the stand-ins.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, Protocol

from .config import ConfigError

FAULTS_FILE = "faults.py"


class Faults(Protocol):
    """What the agent asks its fault hooks (`NoFaults` documents each)."""

    def marker_delay_s(self) -> float: ...
    def marker_lag_s(self) -> float: ...
    def marker_slow_write_s(self) -> float: ...
    def node_ip(self) -> str: ...
    def status_host(self) -> str: ...
    def hangs_in(self, stage: str) -> bool: ...


class NoFaults(object):
    """The hooks of a production run: no delay, no lag, the node's own address and host."""

    def marker_delay_s(self) -> float:
        """Seconds the coordinator waits before publishing the marker."""
        return 0.0

    def marker_lag_s(self) -> float:
        """A worker ignores a marker younger than this (shared-filesystem lag)."""
        return 0.0

    def marker_slow_write_s(self) -> float:
        """Seconds over which the marker's temp file is written."""
        return 0.0

    def node_ip(self) -> str:
        """This node's address for ``{host_ip}`` instead of the one found ("": found)."""
        return ""

    def status_host(self) -> str:
        """The host this rank's status file claims instead of its own ("": its own)."""
        return ""

    def hangs_in(self, stage: str) -> bool:
        """Whether the agent hangs in `stage` (until a TERM)."""
        return False


def load_faults(cfg: Dict[str, Any], node_dir: str, rank: int) -> Faults:
    """`NoFaults`, or with ``"standins": true`` the stand-ins' hooks from
    ``<node_dir>/faults.py``; ConfigError when that file is missing."""
    if not cfg.get("standins"):
        return NoFaults()
    path = os.path.join(node_dir, FAULTS_FILE)
    spec = importlib.util.spec_from_file_location("llmd_standin_faults", path)
    if spec is None or spec.loader is None or not os.path.isfile(path):
        raise ConfigError(
            "the config asks for the stand-ins, but %s does not exist (the batch script "
            "writes it when the spec says [standins] enabled = true)" % path
        )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hooks: Faults = module.agent_faults(dict(cfg["env"]["common"]), rank)
    return hooks
