"""Result files a hostile job writes (issue 3.2, item 2): valid JSON of up to the reader's
32 MiB that takes some 25 times its size and seconds of CPU to parse (``[[],[],...]``);
and how a test watches a daemon through them (`list` answered promptly, its peak RSS)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import anyio

from llmd_supervisor.adapters.control.client import ControlClient
from llmd_supervisor.adapters.nodes.jobfiles import RESULT_FILE_MAX


def nested_lists(size: int = RESULT_FILE_MAX) -> bytes:
    """Exactly `size` bytes (at least 4): ``[[],[],...,[]]`` padded with spaces."""
    n = (size - 4) // 3
    body = b"[" + b"[]," * n + b"[]]"
    return body + b" " * (size - len(body))


def write_nested(directory: Path, names: Iterable[str], size: int = RESULT_FILE_MAX) -> bytes:
    """`nested_lists(size)` into each of `names` under `directory` (made); the bytes."""
    data = nested_lists(size)
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(data)
    return data


def list_until_final(socket: Path, runs: set[str], *, within_s: float) -> list[float]:
    """Ask the daemon at `socket` for `list` over and over until every run of `runs` is
    final (at most `within_s`); how long each answer took."""

    async def ask() -> list[float]:
        delays: list[float] = []
        async with ControlClient(socket) as client:
            while True:
                asked = time.monotonic()
                page = await client.call("list", {"all": True, "after": None})
                delays.append(time.monotonic() - asked)
                briefs = page["runs"]
                assert isinstance(briefs, list)
                done = {b["run"] for b in briefs if b["outcome"] and b["state"] == b["outcome"]}
                if runs <= done:
                    return delays
                await anyio.sleep(0.1)

    async def bounded() -> list[float]:
        with anyio.fail_after(within_s):
            return await ask()

    return anyio.run(bounded)


def vm_hwm(pid: int) -> int:
    """A process's peak resident set so far, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")
