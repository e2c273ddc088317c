"""What every client subcommand shares: how an expected failure ends the command (one
line on stderr and an exit status, never a traceback), and reading a reply's shape."""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, TypeVar

import anyio

from llmd_supervisor.core.protocol.runs import read
from llmd_supervisor.core.spec.log_dirs import DEFAULT_SOCKET
from llmd_supervisor.errors import ControlError, SupervisorError

EXIT_DAEMON_UNREACHABLE = 3
EXIT_INTERRUPTED = 130

T = TypeVar("T")


class _Exit(Exception):
    """End the command with this status (after its one line on stderr, if any)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _expected(exc: BaseException) -> BaseException | None:
    """The first of our own errors (or `_Exit`) in `exc`, unwrapping task-group
    ExceptionGroups, when every leaf of it is one; None when something else failed."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [_expected(e) for e in exc.exceptions]
        if not leaves or any(leaf is None for leaf in leaves):
            return None
        return next((e for e in leaves if isinstance(e, _Exit)), leaves[0])
    return exc if isinstance(exc, SupervisorError | _Exit | BrokenPipeError) else None


def _run(command: str, go: Callable[[], Awaitable[T]]) -> T:
    """`anyio.run(go)`; an expected failure becomes `_Exit` after one line on stderr.

    Our errors print their message (exit 2 for an error reply, 3 when the daemon cannot be
    reached or answers nonsense); Ctrl-C outside a wait exits 130; a closed stdout (a
    pager that quit) exits 0. Anything else is a bug and keeps its traceback.
    """
    try:
        return anyio.run(go)
    except KeyboardInterrupt:
        raise _Exit(EXIT_INTERRUPTED) from None
    except BaseException as exc:  # sorted below; re-raised when unexpected
        found = _expected(exc)
        if found is None:
            raise
        if isinstance(found, _Exit):
            raise found from None
        if isinstance(found, BrokenPipeError):
            _silence_stdout()
            raise _Exit(0) from None
        print(f"llmd-supervisor {command}: {found}", file=sys.stderr)
        status = 2 if isinstance(found, ControlError) else EXIT_DAEMON_UNREACHABLE
        raise _Exit(status) from None


def unreadable(what: str, path: Path, exc: OSError | UnicodeDecodeError) -> str:
    """The sentence for a file the user named that cannot be read (`what`: "run spec")."""
    if isinstance(exc, UnicodeDecodeError):
        why = "is not UTF-8 text; give the text file itself"
    elif isinstance(exc, FileNotFoundError):
        where = "" if path.is_absolute() else f" (looked for {os.path.abspath(path)})"
        why = f"does not exist{where}; check the path"
    elif isinstance(exc, IsADirectoryError):
        why = "is a directory; give the file in it"
    elif isinstance(exc, PermissionError):
        why = "cannot be read by you (permission denied); check its mode and directories"
    else:
        why = f"cannot be read ({exc.strerror or exc})"
    return f"The {what} {path} {why}."


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush finds no broken pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _exits(cmd: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(cmd)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return cmd(args)
        except _Exit as exc:
            return exc.status

    return wrapper


def _write(data: bytes, out: IO[str] | None = None) -> None:
    """Print log bytes exactly as they are, whatever the locale says."""
    out = out or sys.stdout
    out.flush()
    buffer = getattr(out, "buffer", None)
    if buffer is None:
        out.write(data.decode("utf-8", "replace"))
    else:
        buffer.write(data)
        buffer.flush()
    out.flush()


def _read(command: str, kind: type[T], value: object) -> T:
    """`value` as `kind`; a reply of the wrong shape ends the command with status 3."""
    try:
        return read(kind, value)
    except SupervisorError as exc:
        print(f"llmd-supervisor {command}: {exc}", file=sys.stderr)
        raise _Exit(EXIT_DAEMON_UNREACHABLE) from None


def fit_to_terminal(lines: list[str], out: IO[str] | None = None) -> list[str]:
    """Table lines cut to the terminal's width when the output is one (a cut line ends in
    '…'); whole lines otherwise, for pipes and files (scripts use --json)."""
    out = out or sys.stdout
    if not out.isatty():
        return lines
    width = shutil.get_terminal_size().columns
    return [line if len(line) <= width else line[: max(1, width - 1)] + "…" for line in lines]


def user_socket() -> Path | None:
    """Where the per-user service listens (systemd/user/llmd-supervisor.service)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "llmd-supervisor" / "control.sock" if runtime else None


def socket_default() -> Path:
    """`--socket`'s default: $LLMD_SUPERVISOR_SOCKET, else the user's own service when its
    socket exists, else the system service's."""
    chosen = os.environ.get("LLMD_SUPERVISOR_SOCKET")
    if chosen:
        return Path(chosen)
    user = user_socket()
    if user is not None and user.is_socket():
        return user
    return DEFAULT_SOCKET
