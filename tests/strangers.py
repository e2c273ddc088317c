"""Another local user for the tests: a throwaway system user and group (created by the
fixture, removed after the module) that runs tests/faults/socket_peer.py under setpriv with
the system python3 (the checkout's virtualenv is not its to use)."""

from __future__ import annotations

import fcntl
import json
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.devcluster import REPO

PEER = REPO / "tests" / "faults" / "socket_peer.py"
USERS_LOCK = Path("/run/lock/llmd-tests-users.lock")
USERADD = ("useradd", "--system", "--user-group", "--no-create-home", "--shell", "/bin/false")

__all__ = ["PEER", "Stranger", "root_dir", "stranger"]


@dataclass(frozen=True)
class Stranger:
    name: str
    uid: int
    gid: int

    def argv(self, *args: str) -> list[str]:
        return [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "/usr/bin/python3",
            str(PEER),
            *args,
        ]

    @contextmanager
    def process(self, *args: str) -> Iterator[subprocess.Popen[str]]:
        """The peer running in the background (its stdout a pipe); killed if still there."""
        proc = subprocess.Popen(self.argv(*args), stdout=subprocess.PIPE, text=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args), capture_output=True, text=True, timeout=timeout, check=True
        )

    def ask(self, socket: Path, op: str, **args: object) -> dict[str, object]:
        """One request on the control socket as this user; its reply."""
        line = json.dumps({"v": 1, "id": 1, "op": op, "args": args})
        reply = json.loads(self.run("request", str(socket), line).stdout.splitlines()[0])
        assert isinstance(reply, dict)
        return reply


@contextmanager
def _users_locked() -> Iterator[None]:
    """One user change at a time on this machine: useradd and userdel of two test processes
    (pytest -n 2) at once fail on /etc/passwd's lock instead of waiting for it."""
    with open(USERS_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def stranger() -> Iterator[Stranger]:
    """A system user (and its group) that exists only for these tests."""
    name = f"llmdx{secrets.token_hex(4)}"
    with _users_locked():
        subprocess.run(
            [*USERADD, name],
            check=True,
        )
    try:
        entry = pwd.getpwnam(name)
        yield Stranger(name, entry.pw_uid, entry.pw_gid)
    finally:
        with _users_locked():
            subprocess.run(["userdel", name], check=False)
            subprocess.run(["groupdel", name], check=False, capture_output=True)


@pytest.fixture
def root_dir() -> Iterator[Path]:
    """A daemon root the stranger can reach the socket in (the socket itself is 0660)."""
    d = Path(tempfile.mkdtemp(prefix="llmd-sock-", dir="/var/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
