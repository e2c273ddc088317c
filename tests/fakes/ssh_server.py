"""An in-process SSH server on 127.0.0.1 for fast `NodeLink` and tailing tests.

Built the way asyncssh's own tests build theirs (tests/server.py there): `asyncssh.listen`
on port 0 of the loopback address in the test's event loop, with a generated host key, a
generated client key that the server authorizes, and a known_hosts file naming the host
key, so `NodeLink` verifies the host key exactly as in production. Exec requests run as
real local processes (``<login shell> -c <command>`` as sshd runs them, /bin/sh if the
user has no shell; stdin, stdout and stderr wired to the channel), so GNU ``timeout`` and
``tail`` and the adapters' remote shell scripts really run; the SFTP subsystem serves the
local file system (`asyncssh.SFTPServer`).

Faults for reconnect tests: `drop_connections` resets every connection without an SSH
disconnect message, `stop` also stops listening (connects are refused), and `start`
listens again on the same port. Like sshd, the server never kills a process whose channel
closed: it closes the process's stdin and discards its further output. `aclose` (the
fixture's teardown) stops the server and kills what still runs in the processes' sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import pwd
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import asyncssh
import pytest_asyncio

from llmd_supervisor.adapters.nodes.remote import SshSettings

HOST = "127.0.0.1"
_CHUNK = 1 << 16
# How long `aclose` lets SIGTERMed processes exit before it SIGKILLs their groups.
_KILL_GRACE_S = 2.0


class _Connections(asyncssh.SSHServer):
    """Tells the `FakeSshServer` when a connection comes and goes."""

    def __init__(self, owner: FakeSshServer) -> None:
        self._owner = owner
        self._conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn
        self._owner._connections.add(conn)
        self._owner.accepted += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._owner._connections.discard(self._conn)


class FakeSshServer:
    """An SSH server in this process on 127.0.0.1, running exec requests as local processes."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.username = getpass.getuser()
        # Like sshd, run commands with the user's login shell.
        self.shell = pwd.getpwnam(self.username).pw_shell or "/bin/sh"
        self.port = 0  # chosen by the first `start`, then kept
        self.accepted = 0  # connections accepted so far
        self.commands: list[str] = []  # every exec request's command, in order
        self.client_key = directory / "client_key"
        self.known_hosts = directory / "known_hosts"
        self._authorized_keys = directory / "authorized_keys"
        self._host_key = asyncssh.generate_private_key("ssh-ed25519")
        key = asyncssh.generate_private_key("ssh-ed25519")
        key.write_private_key(str(self.client_key))
        self.client_key.chmod(0o600)
        key.write_public_key(str(self._authorized_keys))
        self._listener: asyncssh.SSHAcceptor | None = None
        self._connections: set[asyncssh.SSHServerConnection] = set()
        # Local processes of exec requests, until they exit.
        self._children: dict[asyncio.subprocess.Process, str] = {}
        # Exec handlers still running (asyncssh starts them as tasks of their connection).
        self._handlers: set[asyncio.Task[Any]] = set()

    # ---- what tests look at

    def settings(self, **overrides: Any) -> SshSettings:
        """`SshSettings` for this server: host key checked; short timeouts and keepalives."""
        values: dict[str, Any] = {
            "username": self.username,
            "client_keys": (str(self.client_key),),
            "known_hosts": str(self.known_hosts),
            "port": self.port,
            "connect_timeout": 2.0,
            "keepalive_interval": 0.5,
        }
        values.update(overrides)
        return SshSettings(**values)

    @property
    def listening(self) -> bool:
        """Whether connects are accepted right now (between `start` and `stop`)."""
        return self._listener is not None

    @property
    def connections(self) -> int:
        """Connections open right now."""
        return len(self._connections)

    def running(self, contains: str = "") -> list[str]:
        """Commands of the exec requests whose process is still running (filtered)."""
        return [c for c in self._children.values() if contains in c]

    # ---- control

    async def start(self) -> None:
        """Listen (on port 0 the first time, on the same port afterwards)."""
        assert self._listener is None, "already listening"
        self._listener = await asyncssh.listen(
            HOST,
            self.port,
            server_host_keys=[self._host_key],
            authorized_client_keys=str(self._authorized_keys),
            server_factory=lambda: _Connections(self),
            process_factory=self._exec,
            sftp_factory=asyncssh.SFTPServer,
            allow_scp=False,
            encoding=None,
            gss_host=None,
            reuse_address=True,
        )
        if self.port == 0:
            self.port = self._listener.get_port()
            public = self._host_key.export_public_key().decode().split()
            self.known_hosts.write_text(f"[{HOST}]:{self.port} {public[0]} {public[1]}\n")

    def drop_connections(self) -> int:
        """Reset every connection at once (no SSH disconnect); returns how many there were."""
        conns = list(self._connections)
        for conn in conns:
            conn.abort()
        return len(conns)

    async def stop(self) -> None:
        """Stop listening and drop every connection: connects are refused until `start`."""
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
            await listener.wait_closed()
        self.drop_connections()

    async def aclose(self) -> None:
        """Stop, then end the processes still running (TERM, KILL after a grace period)."""
        await self.stop()
        self._signal_children(signal.SIGTERM)
        with anyio.move_on_after(_KILL_GRACE_S):
            await self._children_gone()
        self._signal_children(signal.SIGKILL)
        with anyio.fail_after(_KILL_GRACE_S):
            await self._children_gone()
            handlers = [t for t in self._handlers if not t.done()]
            if handlers:
                await asyncio.wait(handlers)

    def _signal_children(self, sig: signal.Signals) -> None:
        for child in self._children:
            # Each child leads its own session (start_new_session); GNU `timeout` moves itself
            # to a process group of its own, but never out of the session.
            for pid in _session(child.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    async def _children_gone(self) -> None:
        for child in list(self._children):
            await child.wait()

    # ---- exec requests

    async def _exec(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        """Run one exec request; never raise (asyncssh would close the whole connection)."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(process)
        except Exception as exc:  # report it on the channel and keep the connection
            with contextlib.suppress(Exception):
                process.stderr.write(f"fake sshd: {exc!r}\n".encode())
                process.exit(255)
        finally:
            self._handlers.discard(task)

    async def _serve(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        command = process.command
        if command is None:
            process.stderr.write(b"fake sshd: only exec requests are served\n")
            process.exit(1)
            return
        self.commands.append(command)
        child = await asyncio.create_subprocess_exec(
            self.shell,
            "-c",
            command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._children[child] = command
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_feed_stdin, process, child)
                async with anyio.create_task_group() as outputs:
                    assert child.stdout is not None and child.stderr is not None
                    outputs.start_soon(_pump, child.stdout, process.stdout)
                    outputs.start_soon(_pump, child.stderr, process.stderr)
                status = await child.wait()
                tg.cancel_scope.cancel()  # sshd ends the session when the command exits
        finally:
            del self._children[child]
        # Both outputs are at EOF; on a channel already closed these do nothing or raise.
        with contextlib.suppress(OSError):
            process.stdout.write_eof()
            if status >= 0:
                process.exit(status)
            else:
                process.exit_with_signal(signal.Signals(-status).name.removeprefix("SIG"))


def _session(sid: int) -> list[int]:
    """The processes of session `sid` (from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == sid:  # state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


async def _feed_stdin(
    process: asyncssh.SSHServerProcess[bytes], child: asyncio.subprocess.Process
) -> None:
    """Copy the channel's input to the process; EOF (or a lost channel) closes its stdin."""
    assert child.stdin is not None
    try:
        while data := await process.stdin.read(_CHUNK):
            child.stdin.write(data)
            await child.stdin.drain()
    except (asyncssh.Error, OSError):
        pass  # the channel or the process is gone: like sshd, close the process's stdin
    finally:
        child.stdin.close()


async def _pump(source: asyncio.StreamReader, sink: asyncssh.SSHWriter[bytes]) -> None:
    """Copy one output of the process to the channel; discard the rest once the channel is gone."""
    open_ = True
    while data := await source.read(_CHUNK):
        if open_:
            try:
                sink.write(data)
                await sink.drain()
            except (asyncssh.Error, OSError):
                open_ = False


@pytest_asyncio.fixture
async def ssh_server(tmp_path: Path) -> AsyncIterator[FakeSshServer]:
    """A running `FakeSshServer` with its keys in `tmp_path`; stopped (processes too) after."""
    server = FakeSshServer(tmp_path / "sshd")
    await server.start()
    try:
        yield server
    finally:
        await server.aclose()


async def wait_until(what: str, cond: Callable[[], bool], limit: float = 10) -> None:
    """Await a condition by polling it every 10 ms; fail after `limit` seconds naming `what`."""
    with anyio.move_on_after(limit):
        # Polling: the conditions are file sizes and link state, which signal no event.
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"timed out after {limit:g} s waiting for {what}")


__all__ = ["HOST", "FakeSshServer", "ssh_server", "wait_until"]
