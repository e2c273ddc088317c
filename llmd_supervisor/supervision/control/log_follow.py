"""Reading a run's local log copies for the ``logs`` op: new bytes past per-file offsets
as bounded, binary-safe stream items, and an inotify wake-up for followers.

A chunk is at most `READ_CHUNK` bytes of one file. It goes as text (``encoding``
"utf-8") when its bytes are valid UTF-8 and their JSON-escaped text is at most `TEXT_MAX`
bytes, else as base64 (at most 4/3 of `READ_CHUNK`): either way its protocol line stays
well within the 1 MiB message bound, and the client gets the exact bytes back.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import ctypes.util
import json
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import structlog

from llmd_supervisor.core.protocol.runs import LogChunk

__all__ = ["READ_CHUNK", "TEXT_MAX", "Growth", "first_of", "read_new", "whole_utf8"]

log = structlog.get_logger("llmd_supervisor.supervision.api")

READ_CHUNK: Final = 256 << 10  # per file and item; base64 of it is 342 KiB
TEXT_MAX: Final = 512 << 10  # a chunk whose escaped text is longer goes as base64


def read_new(
    root: Path, wanted: Callable[[Path], bool], offsets: Mapping[str, int], final: bool
) -> tuple[list[LogChunk], list[Path]]:
    """New bytes of the wanted files under `root` past `offsets` (one chunk per file), and
    the directories to watch. Blocking: run in a thread.

    A chunk never ends inside a UTF-8 character unless the run is `final` (nothing more
    will come): the rest of the character goes with the next chunk. Bytes that are not
    UTF-8 go as base64 (`_chunk`), so every chunk round-trips byte for byte.
    """
    chunks: list[LogChunk] = []
    dirs = [root.parent]
    try:
        entries = sorted(root.rglob("*"))
    except OSError:
        entries = []
    for path in entries:
        if path.is_dir():
            dirs.append(path)
            continue
        if not wanted(path):
            continue
        name = str(path.relative_to(root))
        start = offsets.get(name, 0)
        try:
            with path.open("rb") as f:
                f.seek(start)
                data = f.read(READ_CHUNK)
        except OSError:
            continue
        if not final:
            data = data[: whole_utf8(data)]
        if data:
            chunks.append(_chunk(name, start, data))
    if root.is_dir():
        dirs.insert(1, root)
    return chunks, dirs


def _chunk(name: str, start: int, data: bytes) -> LogChunk:
    """`data` as a stream item: text when it is UTF-8 and fits escaped, else base64."""
    end = start + len(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and len(json.dumps(text)) <= TEXT_MAX:
        return {"file": name, "offset": start, "end": end, "data": text, "encoding": "utf-8"}
    packed = base64.b64encode(data).decode("ascii")
    return {"file": name, "offset": start, "end": end, "data": packed, "encoding": "base64"}


def whole_utf8(data: bytes) -> int:
    """The length of `data` without a UTF-8 character cut off at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        if byte >> 5 == 0b110:
            need = 2
        elif byte >> 4 == 0b1110:
            need = 3
        elif byte >> 3 == 0b11110:
            need = 4
        else:  # ASCII, or not a lead byte at all: nothing to hold back
            return len(data)
        return len(data) - back if need > back else len(data)
    return len(data)


async def first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as any of `waits` returns (the others are cancelled)."""
    async with anyio.create_task_group() as tg:

        async def one(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(one, wait)


# inotify(7): the local log copies are written by this process's tailers.
_IN_MODIFY: Final = 0x002
_IN_CLOSE_WRITE: Final = 0x008
_IN_MOVED_TO: Final = 0x080
_IN_CREATE: Final = 0x100
_IN_NONBLOCK: Final = os.O_NONBLOCK
_IN_CLOEXEC: Final = os.O_CLOEXEC
_MASK: Final = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE


def _load_libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC: Final = _load_libc()


class Growth:
    """Wakes a log follower when anything in its watched directories is written or created.

    One inotify instance per follower (closed with it); `open` returns None where inotify
    is not available (or the per-user instance limit is reached), and the follower falls
    back to short timeouts.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._watched: set[Path] = set()

    @classmethod
    def open(cls) -> Growth | None:
        if _LIBC is None:
            return None
        fd = int(_LIBC.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        if fd < 0:
            log.info("api.inotify_unavailable", errno=ctypes.get_errno())
            return None
        return cls(fd)

    def watch(self, dirs: Iterable[Path]) -> bool:
        """Watch the directories not watched yet; whether any was added (one that cannot
        be watched, e.g. gone again, is skipped)."""
        added = False
        for d in dirs:
            if d in self._watched:
                continue
            if _LIBC.inotify_add_watch(self._fd, os.fsencode(d), _MASK) >= 0:
                self._watched.add(d)
                added = True
        return added

    async def wait(self) -> None:
        """Until at least one event arrived since the last wait; drains them."""
        await anyio.wait_readable(self._fd)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._fd, 1 << 16):
                pass

    def close(self) -> None:
        os.close(self._fd)
