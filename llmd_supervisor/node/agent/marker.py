"""The completion marker on the node: publishing it (coordinator) and waiting for it
(workers), read through the project's one reader (``marker_format``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional, Tuple

from .. import common as shared
from .. import marker_format
from .files import now_iso, write_atomic


def marker_path(log_dir: str, job_id: str) -> str:
    return os.path.join(log_dir, shared.marker_name(job_id))


def publish_marker(
    log_dir: str, job_id: str, rank: int, rc: int, reason: str, slow_s: float = 0.0
) -> Dict[str, Any]:
    """Publish the completion marker atomically and durably; return what was written."""
    marker = {
        "rc": int(rc),
        "job_id": str(job_id),
        "rank": int(rank),
        "reason": reason,
        "finished_at": now_iso(),
    }
    data = (json.dumps(marker, sort_keys=True) + "\n").encode("utf-8")
    write_atomic(marker_path(log_dir, job_id), data, durable=True, slow_s=slow_s)
    return marker


def read_marker(
    log_dir: str, job_id: str, min_age_s: float = 0.0
) -> Optional[marker_format.Parsed]:
    """The marker of ``job_id`` once there is one to act on, else None.

    None while none is visible, while it may still be being written (empty, torn) and for
    another job's marker; otherwise the reading, valid or not (`marker_exit` turns an
    invalid one into RC_BAD_MARKER). The directory is listed first: on NFS that refreshes
    the cached directory entries, so a marker renamed into place on another node is found
    without waiting for the attribute cache to expire. A marker younger than `min_age_s`
    is not seen yet (a fault hook's simulated lag).
    """
    name = shared.marker_name(job_id)
    try:
        if name not in os.listdir(log_dir):
            return None
        path = os.path.join(log_dir, name)
        if min_age_s > 0 and time.time() - os.stat(path).st_mtime < min_age_s:
            return None
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    reading = marker_format.parse(raw, job_id)
    if reading.may_still_arrive or reading.status == marker_format.WRONG_JOB_ID:
        return None
    return reading


def marker_exit(reading: marker_format.Parsed) -> Tuple[int, str]:
    """The exit status a marker stands for, and a phrase saying so: its rc, or
    RC_BAD_MARKER when the marker is invalid (an rc that is no exit status -- ``false``,
    256, -1: what ``int`` and ``exit`` would turn into 0 -- or any other defect)."""
    rank = "?" if reading.rank is None else str(reading.rank)
    if reading.ok and reading.rc is not None:
        if reading.format == "int":
            return reading.rc, "marker rc=%d (plain integer)" % reading.rc
        return reading.rc, "marker rc=%d from rank %s" % (reading.rc, rank)
    return shared.RC_BAD_MARKER, "marker %s: %s" % (
        reading.status.replace("_", " "),
        reading.detail,
    )
