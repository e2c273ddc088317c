"""What the agent's phase modules (`bringup`, `sweep`, `stop`) see of the running agent.

They take the agent as an `AgentView` -- a Protocol that `run.Agent` satisfies -- so none of
them imports `run`, which calls them: no import cycle. The SIGTERM flag lives here too,
for the same reason (`stop` handles it, `run` owns one).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Tuple

if TYPE_CHECKING:
    import subprocess

    from .. import marker_format
    from .hooks import Faults
    from .templates import Values
    from .topology import Role


class TermFlag(object):
    """Whether (and when, on the monotonic clock) the first SIGTERM arrived."""

    def __init__(self) -> None:
        self.received = False
        self.at: Optional[float] = None

    def on_sigterm(self, signum: int, frame: Any) -> None:
        if self.at is None:
            self.at = time.monotonic()
        self.received = True


class AgentView(Protocol):
    """The agent's state and steps a phase module reads or calls."""

    cfg: Dict[str, Any]
    job_id: str
    rank: int
    role: "Role"
    faults: "Faults"
    log_dir: str
    job_dir: str
    grace_s: float
    stop_timeout_s: float
    heartbeat_s: float
    health_timeout_s: float
    health_path: str
    connect_s: float
    read_s: float
    engine: Optional["subprocess.Popen[bytes]"]
    engine_rc: Optional[int]
    engine_log: str
    bench: Optional["subprocess.Popen[bytes]"]
    services: Dict[str, "subprocess.Popen[bytes]"]
    state: str
    reason: str
    final_rc: Optional[int]
    marker_published: bool
    term: TermFlag
    term_handled: bool
    _lock: threading.Lock

    def host_of(self, rank: int) -> str: ...
    def ip_of(self, rank: int) -> str: ...
    def port_of(self, rank: int) -> int: ...
    def status_path(self, rank: int) -> str: ...
    def rank_label(self, rank: int) -> str: ...
    def other_ranks(self) -> List[int]: ...
    def log(self, event: str, **fields: Any) -> None: ...
    def set_state(self, state: str, reason: Optional[str] = None) -> None: ...
    def mark_healthy(self, component: str) -> None: ...
    def stage(self, name: str, deadline_s: float) -> None: ...
    def stage_end(self, failed: Optional[str] = None, diagnose: bool = True) -> None: ...
    def where(self, rank: int, port: int, path: str = "") -> str: ...
    def write_status(self) -> None: ...
    def check_term(self) -> None: ...
    def sleep(self, seconds: float) -> None: ...
    def template_values(self) -> "Values": ...
    def role_env(self, role: str) -> Dict[str, str]: ...
    def poll_engine(self) -> Optional[int]: ...
    def stop_group(self, proc: Optional["subprocess.Popen[bytes]"], what: str) -> List[str]: ...
    def failed_ranks(self) -> List[Tuple[int, int, str]]: ...
    def raise_if_others_failed(self) -> None: ...
    def publish(self, rc: int, reason: str) -> None: ...
    def marker_exit(self, marker: "marker_format.Parsed") -> Tuple[int, str]: ...
