"""Read a job's files without trusting them (stdlib only, Python 3.9+, one file).

Everything a job writes is hostile input: a log may be replaced by a symbolic link to
another user's secrets, a FIFO that never answers, a device that never ends or a
directory. This script is the only way the daemon opens a job's files. It runs on the
nodes and login hosts over SSH (``python3 -I -S -c <this file> MODE ...``) and on the
daemon's own machine as a child process, so a file that hangs a read holds a process the
daemon can kill, never one of its threads.

Paths are given as ROOT and REL: ROOT (the directory holding the run's log directory) is
opened as it is; every component of REL below it is opened with ``O_NOFOLLOW`` relative
to its parent's descriptor, so no symbolic link is followed inside the log directory, and
the file must then be (``fstat``) a regular file with one link, owned by this account.
``O_NONBLOCK`` keeps a FIFO from blocking the open. Anything else is refused with a
reason and never read.

Modes:
  read ROOT REL MAX            the file's bytes on stdout; exit 0, or MISSING, REFUSED,
                               TOO_LARGE (more than MAX bytes; nothing printed)
  follow ROOT REL OFFSET POLL  the file's bytes from OFFSET on, following it by name like
                               ``tail -F`` (a replaced or truncated file is read from its
                               start, and said on stderr: ``replaced: REL at byte N`` or
                               ``truncated: REL from byte N to M``) until stdin reaches EOF;
                               then what is left up to the current end, and exit 0. A
                               missing file is waited for. A file is taken as truncated
                               only when a fresh open by name shows it shorter on two polls
                               in a row (a shared file system's attribute cache may show a
                               stale size on the open descriptor).
  serve ROOT                   one request per stdin line, a JSON list: ["read", REL, MAX],
                               ["list", REL, MAX] (at most MAX entry names) or ["from", REL,
                               MAX, OFFSET] (at most MAX bytes from OFFSET on); each answer
                               is a line ``<status> <length>`` and then <length> bytes
                               (the file, the names one per line, or the reason). Ends at
                               stdin EOF.
"""

import errno
import json
import os
import select
import stat
import sys
from typing import List, Optional, Tuple

OK = 0
MISSING = 1
REFUSED = 3
TOO_LARGE = 4
STATUS = {OK: "ok", MISSING: "missing", REFUSED: "refused", TOO_LARGE: "too_large"}

_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Refused(Exception):
    """The file is not one this script reads; the message says why."""


def _parts(rel: str) -> List[str]:
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise Refused("the path %r below the log directory's parent is not plain" % rel)
    return parts


def open_file(root: str, rel: str) -> Optional[Tuple[int, os.stat_result]]:
    """A read descriptor of ROOT/REL and its stat, or None if it does not exist."""
    parts = _parts(rel)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    return None
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(_on_the_way(parts, i, exc.errno)) from None
                raise
            os.close(fd)
            fd = nfd
        st = os.fstat(fd)
        why = _not_plain(st)
        if why:
            raise Refused("it is " + why)
        found, fd = fd, -1
        return found, st
    finally:
        if fd >= 0:
            os.close(fd)


def _on_the_way(parts: List[str], i: int, err: int) -> str:
    """Why component `i` of `parts` could not be opened (ELOOP or ENOTDIR)."""
    if i == len(parts) - 1:
        return "it is a symbolic link"
    what = "a symbolic link" if err == errno.ELOOP else "a symbolic link or not a directory"
    return "%s on its way is %s" % ("/".join(parts[: i + 1]), what)


def _not_plain(st: os.stat_result) -> str:
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return "a device"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return "owned by uid %d, not by this account (uid %d)" % (st.st_uid, os.geteuid())
    if st.st_nlink != 1:
        return "a file with %d hard links" % st.st_nlink
    return ""


def read(root: str, rel: str, limit: int) -> Tuple[int, bytes]:
    """(status, bytes): the whole file if it has at most `limit` bytes."""
    opened = open_file(root, rel)
    if opened is None:
        return MISSING, b""
    fd, _st = opened
    try:
        data = bytearray()
        while len(data) <= limit:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - len(data)))
            if not chunk:
                return OK, bytes(data)
            data += chunk
        return TOO_LARGE, b""
    finally:
        os.close(fd)


def read_from(root: str, rel: str, offset: int, limit: int) -> Tuple[int, bytes]:
    """(status, bytes): at most `limit` bytes of the file from `offset` on."""
    opened = open_file(root, rel)
    if opened is None:
        return MISSING, b""
    fd, _st = opened
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        data = bytearray()
        while len(data) < limit:
            chunk = os.read(fd, min(_CHUNK, limit - len(data)))
            if not chunk:
                break
            data += chunk
        return OK, bytes(data)
    finally:
        os.close(fd)


def list_dir(root: str, rel: str, limit: int) -> Tuple[int, List[str]]:
    """(status, names): at most `limit` entry names of the directory ROOT/REL."""
    parts = _parts(rel)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    return MISSING, []
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused("it is a symbolic link or not a directory") from None
                raise
            os.close(fd)
            fd = nfd
        names: List[str] = []
        for name in os.listdir(fd):
            if "\n" not in name:
                names.append(name)
                if len(names) >= limit:
                    break
        return OK, sorted(names)
    finally:
        os.close(fd)


def _write(data: bytes) -> None:
    out = sys.stdout.buffer
    out.write(data)
    out.flush()


def _stdin_closed(timeout: float) -> bool:
    """True once stdin reached EOF (waiting up to `timeout` for it)."""
    ready, _, _ = select.select([0], [], [], timeout)
    if ready:
        return not os.read(0, 4096)
    return False


def follow(root: str, rel: str, offset: int, poll: float) -> int:
    fd = -1
    ino: Optional[int] = None
    pos = offset
    stopping = False
    waiting = False
    shrunk = 0  # polls in a row that saw the file shorter than what was read
    try:
        while True:
            if fd < 0:
                opened = open_file(root, rel)
                if opened is None and not waiting:
                    waiting = True
                    _say("waiting for %s to appear (at byte %d)" % (rel, pos))
                if opened is not None:
                    fd, st = opened
                    if ino is not None and st.st_ino != ino:
                        _say("replaced: %s at byte %d" % (rel, pos))
                        pos = 0  # replaced while followed: the new file from its start
                    ino = st.st_ino
                    os.lseek(fd, pos, os.SEEK_SET)
            while fd >= 0:
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    break
                pos += len(chunk)
                _write(chunk)
            if stopping:
                return OK
            stopping = _stdin_closed(poll)
            if fd >= 0 and not stopping:
                fd = _recheck(root, rel, fd, ino)
                size = _size_by_name(root, rel, ino) if fd >= 0 else None
                shrunk = shrunk + 1 if size is not None and size < pos else 0
                if size is not None and shrunk >= 2:
                    _say("truncated: %s from byte %d to %d" % (rel, pos, size))
                    shrunk = 0
                    pos = 0  # truncated: like tail -F, from the start again
                    os.lseek(fd, 0, os.SEEK_SET)
    finally:
        if fd >= 0:
            os.close(fd)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _size_by_name(root: str, rel: str, ino: Optional[int]) -> Optional[int]:
    """The size of the file the name leads to now, if it is still the followed one (a
    fresh open revalidates a network file system's cached attributes)."""
    try:
        opened = open_file(root, rel)
    except Refused:
        return None
    if opened is None:
        return None
    nfd, st = opened
    os.close(nfd)
    return st.st_size if st.st_ino == ino else None


def _recheck(root: str, rel: str, fd: int, ino: Optional[int]) -> int:
    """Keep `fd` while the name still leads to it; -1 to reopen by name."""
    opened = open_file(root, rel)  # a link or a FIFO there now: Refused ends the follow
    if opened is None:
        return fd  # deleted for now: keep reading what we have
    nfd, st = opened
    os.close(nfd)
    if st.st_ino == ino:
        return fd
    # Replaced: finish the old file, then the new one from its start.
    while True:
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            break
        _write(chunk)
    os.close(fd)
    return -1


def serve(root: str) -> None:
    for line in sys.stdin.buffer:
        try:
            op, rel, limit, *rest = json.loads(line.decode("utf-8"))
            limit = int(limit)
            if op == "read":
                code, data = read(root, str(rel), limit)
            elif op == "from" and len(rest) == 1 and int(rest[0]) >= 0:
                code, data = read_from(root, str(rel), int(rest[0]), limit)
            elif op == "list":
                code, names = list_dir(root, str(rel), limit)
                data = "".join(n + "\n" for n in names).encode("utf-8", "surrogateescape")
            else:
                raise ValueError("unknown request %r" % op)
        except Refused as exc:
            code, data = REFUSED, str(exc).encode("utf-8", "backslashreplace")
        except (OSError, ValueError, TypeError) as exc:
            code, data = 2, str(exc).encode("utf-8", "backslashreplace")
        _write(("%s %d\n" % (STATUS.get(code, "error"), len(data))).encode() + data)


def main(argv: List[str]) -> int:
    mode = argv[1] if len(argv) > 1 else ""
    try:
        if mode == "read" and len(argv) == 5:
            code, data = read(argv[2], argv[3], int(argv[4]))
            _write(data)
            return code
        if mode == "follow" and len(argv) == 6:
            return follow(argv[2], argv[3], int(argv[4]), float(argv[5]))
        if mode == "serve" and len(argv) == 3:
            serve(argv[2])
            return OK
    except Refused as exc:
        sys.stderr.write("refused: %s\n" % exc)
        return REFUSED
    except BrokenPipeError:
        return OK
    sys.stderr.write("usage: safe_read.py read|follow|serve ... (see its docstring)\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
