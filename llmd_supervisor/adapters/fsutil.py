"""Durable file writes (temp file, fsync, rename, fsync the directory); the umask."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def process_umask() -> int:
    """This process's umask (read from /proc, never by setting it: another thread could
    create a file in between); 0o077 where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o077


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace `path` with `data` so a reader sees the old file or the whole new one.
    Its mode is `mode`, by default 0o666 less the process's umask (as `open` would give).

    Raises OSError (disk full, permission) with the temp file removed; `path` is then
    unchanged.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~process_umask() if mode is None else mode)
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
