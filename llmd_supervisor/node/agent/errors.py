"""How a rank's way through the protocol ends early: a local failure, or a SIGTERM."""

from __future__ import annotations

from typing import Optional


class LocalFailure(Exception):
    """This rank failed with `rc`; `component` is what failed: "engine" (the default), or
    a service by its name ("sidecar", a router process), recorded in the status file."""

    def __init__(
        self, rc: int, reason: str, from_rank: Optional[int] = None, component: str = "engine"
    ) -> None:
        super().__init__(reason)
        self.rc = rc
        self.reason = reason
        self.from_rank = from_rank
        self.component = component


class Terminated(Exception):
    """SIGTERM arrived while the agent was waiting."""
