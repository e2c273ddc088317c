"""Children of the agent: one spawn helper, process groups and the stop sequence.

Every child (engine, router and sidecar processes, benchmark client) is started by `spawn`:
stdin from /dev/null, stdout and stderr appended to its log, its own session and process
group (or the engine's group, for a router or sidecar process, so that stopping the
engine stops them too) and SIGKILL when the agent dies. `stop_group` is the one stop
sequence: TERM to the group, wait, KILL what is left, and reap.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import common as shared


def spawn(
    argv: List[str], log_path: str, env: Dict[str, str], cwd: str, group: Optional[int] = None
) -> "subprocess.Popen[bytes]":
    """Start `argv` with its output appended to `log_path`, in its own process group (or
    in `group`); raises OSError when it cannot be started."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            preexec_fn=_child_preexec_for(os.getpid(), group),
            close_fds=True,
        )


def stop_group(
    proc: Optional["subprocess.Popen[bytes]"],
    what: str,
    timeout_s: float,
    log: Callable[..., None],
) -> List[str]:
    """TERM the process group of `proc`, wait up to `timeout_s`, KILL the rest, reap.

    Returns a description of what had to be SIGKILLed (empty if TERM was enough).
    """
    if proc is None:
        return []
    pgid = proc.pid  # the child called setsid(): its pid is its process group id
    killed: List[str] = []
    if not group_alive(pgid):
        # Already gone (e.g. Slurm signalled the whole step): still record its status.
        _reap(proc)
        return killed
    log("%s.stop" % what, pgid=pgid, signal="TERM", timeout_s=timeout_s)
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(proc)
        if not group_alive(pgid):
            break
        time.sleep(0.05)
    else:
        killed = ["%d %s" % (pid, cmd) for pid, _, cmd in list_processes(pgid)]
        log("%s.kill" % what, pgid=pgid, signal="KILL", remaining=len(killed))
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and group_alive(pgid):
            _reap(proc)
            time.sleep(0.05)
    _reap(proc)
    return killed


def _reap(proc: "subprocess.Popen[bytes]") -> None:
    with contextlib.suppress(OSError):
        proc.poll()


def list_processes(pgid: Optional[int] = None) -> List[Tuple[int, int, str]]:
    """(pid, pgid, cmdline) of processes, optionally only one process group (Linux /proc)."""
    result: List[Tuple[int, int, str]] = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return result
    for pid in sorted(pids):
        try:
            group = os.getpgid(pid)
        except OSError:
            continue
        if pgid is not None and group != pgid:
            continue
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            cmd = "?"
        if not cmd:  # a zombie (or kernel thread) has no command line: name it anyway
            try:
                with open("/proc/%d/comm" % pid, "rb") as fh:
                    comm = fh.read().decode("utf-8", "replace").strip()
            except OSError:
                comm = "?"
            cmd = "[%s] (exited)" % comm
        result.append((pid, group, cmd))
    return result


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group whose members are all zombies still "exists"; look closer.
    for pid, _, _ in list_processes(pgid):
        try:
            with open("/proc/%d/stat" % pid, "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z":
            return True
    return False


def rc_text(rc: Optional[int]) -> str:
    """A child's exit status in words: ``rc 3``, ``signal SIGKILL``."""
    if rc is None:
        return "unknown status"
    if rc < 0:
        try:
            return "signal %s" % signal.Signals(-rc).name
        except ValueError:
            return "signal %d" % -rc
    return "rc %d" % rc


def _load_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except Exception:  # not Linux/glibc: no parent-death signal, stop_group still reaps
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _child_preexec_for(parent: int, group: Optional[int] = None) -> Any:
    """A preexec_fn for children of ``parent`` (the agent's pid).

    The child gets its own session and process group (or joins `group`, the engine's), and
    is SIGKILLed if the agent dies (a SIGKILLed agent cannot stop it otherwise). If the
    agent died between fork and prctl the signal would never come, so the child checks
    its parent and exits.

    preexec_fn is documented as unsafe once threads exist (the bench is spawned while the
    heartbeat thread runs): this only makes system calls (setsid, prctl through a ctypes
    function resolved at import, getppid), and glibc keeps malloc usable in the child.
    """

    def preexec() -> None:
        try:
            if group is None:
                raise OSError
            os.setpgid(0, group)  # a router or sidecar: stopped with its engine's group
        except OSError:
            os.setsid()
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(shared.RC_INTERNAL)

    return preexec
