"""The fault knobs (``LLMD_FAKE_*``) of the stand-ins and of the node agent under test.

Stdlib only, Python 3.9+. The stand-ins import `fault` and `say` from here. The node agent
has fault hooks that do nothing in production (``agent.hooks.NoFaults``); when its config
says ``"standins": true`` it loads this file from its node directory and asks
`agent_faults` for hooks that read these knobs, from the agent's environment or from the
spec's ``env.common``:

  * ``LLMD_FAKE_MARKER_DELAY_S`` -- the coordinator waits this long before publishing;
  * ``LLMD_FAKE_MARKER_LAG_S`` -- a worker ignores a marker younger than this (simulated
    shared-filesystem lag);
  * ``LLMD_FAKE_MARKER_SLOW_WRITE_S`` -- the coordinator writes the temp file slowly;
  * ``LLMD_FAKE_NODE_IP`` -- this node's address for ``{host_ip}`` (tests that run every
    rank on one machine set 127.0.0.1; the agent's environment only);
  * ``LLMD_FAKE_STATUS_HOSTS`` -- a host name per rank (comma-separated) that the rank's
    status file claims instead of its own (a hostile job's words);
  * ``LLMD_FAKE_AGENT_HANG_STAGE`` -- the agent hangs in that stage until a TERM (only on
    the ranks and nodes `fault` selects).
"""

import os
import socket
import sys
import threading
from typing import Dict, Optional

_SAY = threading.Lock()


def say(line: str) -> None:
    """Write one whole line to stdout and flush it. ``print`` writes the text and its
    newline in two calls, so the request threads of a stand-in server could merge two
    access lines into one under load."""
    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def fault(name: str, extra: Optional[Dict[str, str]] = None) -> str:
    """A fault knob from the environment (over `extra`, e.g. the spec's ``env.common`` as
    the agent sees it): its value, or "" when unset, when ``LLMD_FAKE_FAULT_RANKS`` is set
    and does not list this rank (``LLMD_RANK``), or when ``LLMD_FAKE_FAULT_NODES`` is set
    and does not list this host (a node's fault follows the node into every job, as a bad
    node's would)."""
    env = dict(extra or {})
    env.update(os.environ)
    for knob, mine in (
        ("LLMD_FAKE_FAULT_RANKS", env.get("LLMD_RANK", "")),
        ("LLMD_FAKE_FAULT_NODES", socket.gethostname()),
    ):
        listed = env.get(knob, "").strip()
        if listed and mine not in [r.strip() for r in listed.split(",")]:
            return ""
    return str(env.get(name, ""))


def _float_or_zero(value: object) -> float:
    try:
        return float(value or 0)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


class AgentFaults(object):
    """The agent's fault hooks (the interface of ``agent.hooks.NoFaults``), from the
    knobs in the agent's environment or in the spec's ``env.common``."""

    def __init__(self, common: Dict[str, str], rank: int) -> None:
        self.common = dict(common)
        self.rank = rank

    def _knob(self, name: str) -> str:
        return str(os.environ.get(name) or self.common.get(name) or "")

    def marker_delay_s(self) -> float:
        return _float_or_zero(self._knob("LLMD_FAKE_MARKER_DELAY_S"))

    def marker_lag_s(self) -> float:
        return _float_or_zero(self._knob("LLMD_FAKE_MARKER_LAG_S"))

    def marker_slow_write_s(self) -> float:
        return _float_or_zero(self._knob("LLMD_FAKE_MARKER_SLOW_WRITE_S"))

    def node_ip(self) -> str:
        return os.environ.get("LLMD_FAKE_NODE_IP", "")

    def status_host(self) -> str:
        claims = self._knob("LLMD_FAKE_STATUS_HOSTS").split(",")
        return claims[self.rank].strip() if self.rank < len(claims) else ""

    def hangs_in(self, stage: str) -> bool:
        extra = dict(self.common, LLMD_RANK=str(self.rank))
        return fault("LLMD_FAKE_AGENT_HANG_STAGE", extra) == stage


def agent_faults(common: Dict[str, str], rank: int) -> AgentFaults:
    """The hooks the agent of `rank` uses (``common``: the spec's ``env.common``)."""
    return AgentFaults(common, rank)
