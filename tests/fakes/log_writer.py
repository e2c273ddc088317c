"""A job's log writer and file-size probe, shared by the SSH tests (fake and real sshd)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio


class Writer:
    """Appends numbered lines to a file at a steady rate (the job's log writer)."""

    def __init__(self, path: Path, *, lines: int, per_second: float) -> None:
        self.path = path
        self.lines = lines
        self.per_second = per_second
        self.written = 0

    async def run(self) -> None:
        start = time.monotonic()
        with self.path.open("ab", buffering=0) as f:
            for i in range(self.lines):
                f.write(f"{i:06d} {'payload ' * (i % 13)}\n".encode())
                self.written += 1
                await anyio.sleep(max(0.0, start + (i + 1) / self.per_second - time.monotonic()))


def size_of(path: Path) -> int:
    """The file's size, 0 while it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
