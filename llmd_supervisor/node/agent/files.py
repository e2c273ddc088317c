"""The agent's file writes and reads on the shared file system (atomic, bounded)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from typing import Any, Dict, List, Optional


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def write_atomic(path: str, data: bytes, *, durable: bool, slow_s: float = 0.0) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the whole new one.

    The temp file lives in the same directory (rename is atomic only within a file
    system). ``durable`` adds fsync of the file before the rename and of the directory
    after it, so the rename survives a node crash and is visible to other NFS clients.
    ``slow_s`` dribbles the temp file out over that many seconds (a fault hook's).
    """
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(
        directory, ".%s.tmp.%s.%d" % (os.path.basename(path), socket.gethostname(), os.getpid())
    )
    # 0600: the daemon reads these files as the same account (its SSH user, or shared fs).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if slow_s > 0:
            step = max(1, len(data) // 8)
            for i in range(0, len(data), step):
                os.write(fd, data[i : i + step])
                time.sleep(slow_s / 8)
        else:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_json(path: str) -> Optional[Dict[str, Any]]:
    """A JSON object from `path`, or None (missing, unreadable, not an object)."""
    try:
        with open(path, "rb") as fh:
            value = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def tail_lines(path: str, n: int = 30, max_bytes: int = 16384) -> List[str]:
    """The last `n` lines of `path` (from at most its last `max_bytes`)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError as exc:
        return ["<cannot read %s: %s>" % (path, exc)]
    return data.decode("utf-8", "replace").splitlines()[-n:]


# How "address already in use" reads in the logs of the components the agent starts:
# Python's OSError (vLLM, uvicorn, the stand-ins: "[Errno 98] Address already in use",
# uvicorn's "error while attempting to bind on address ...: address already in use"),
# Envoy ("cannot bind '0.0.0.0:8080': Address already in use"), Go (the EPP: "bind:
# address already in use").
PORT_IN_USE_WORDS = ("address already in use", "errno 98", "eaddrinuse")


def says_port_in_use(path: str) -> bool:
    """Whether the last lines of a component's log say its port was taken."""
    text = "\n".join(tail_lines(path, 40)).lower()
    return any(word in text for word in PORT_IN_USE_WORDS)
