"""Status files: this rank's heartbeat, and what the other ranks' files say.

Each rank rewrites ``rank<r>.status.json`` in the job directory (atomically) at every
change and every ``heartbeat_s``; the daemon and the other ranks read it. Peers are judged
on this node's own clocks: a file's age by its mtime, a coordinator's silence on the
local monotonic clock (so clock skew between nodes does not matter).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import common as shared
from .files import read_json, write_atomic


def write_status_file(path: str, status: Dict[str, Any]) -> None:
    """Replace the status file at `path` (not fsynced: the next heartbeat rewrites it)."""
    data = (json.dumps(status, sort_keys=True) + "\n").encode("utf-8")
    write_atomic(path, data, durable=False)


def start_heartbeat(
    interval_s: float, beat: Callable[[], None]
) -> Tuple[threading.Thread, threading.Event]:
    """Call `beat` every `interval_s` in a daemon thread until the returned event is set."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            beat()

    thread = threading.Thread(target=loop, name="heartbeat", daemon=True)
    thread.start()
    return thread, stop


def peer_failures(job_dir: str, job_id: str, ranks: List[int]) -> List[Tuple[int, int, str]]:
    """(rank, rc, reason) of the `ranks` whose status file reports a local failure."""
    failures = []
    for r in ranks:
        st = read_json(os.path.join(job_dir, shared.status_name(r)))
        if st is None or str(st.get("job_id")) != job_id:
            continue
        # local_rc stays in the status after the state moves on (stopping, exited).
        rc = st.get("local_rc")
        if isinstance(rc, int) and rc > 0:
            failures.append((r, rc, str(st.get("reason", ""))))
    return failures


def _age_and_state(path: str) -> Tuple[Optional[float], Any]:
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return None, None
    return age, (read_json(path) or {}).get("state")


def peer_alive(path: str, stale_s: float) -> bool:
    """Whether the rank of status file `path` is still running (fresh and not gone)."""
    age, state = _age_and_state(path)
    return age is not None and age < stale_s and state not in shared.GONE_STATES


def peer_still_stopping(path: str, stale_s: float, noticing: bool) -> bool:
    """Whether to keep waiting for the rank of `path` after our own TERM handling: it is
    ``terminating``, or (while `noticing`) in any unfinished state with a fresh file."""
    age, state = _age_and_state(path)
    if age is None or age >= stale_s or state in shared.GONE_STATES:
        return False
    return state == shared.STATE_TERMINATING or noticing


class Silence(object):
    """Detects that a status file stopped changing, on the local monotonic clock."""

    def __init__(self, path: str, limit_s: float) -> None:
        self.path = path
        self.limit_s = limit_s
        self.last_seen: Optional[Tuple[float, int]] = None
        self.changed_at = time.monotonic()

    def expired(self) -> bool:
        try:
            st = os.stat(self.path)
            seen: Optional[Tuple[float, int]] = (st.st_mtime, st.st_ino)
        except OSError:
            seen = None
        if seen is not None and seen != self.last_seen:
            self.last_seen = seen
            self.changed_at = time.monotonic()
            state = (read_json(self.path) or {}).get("state")
            if state in shared.GONE_STATES:
                # The coordinator is gone for good; only the marker can still arrive.
                self.changed_at = -1e18
        return time.monotonic() - self.changed_at > self.limit_s
