"""A replayed Slurm cluster that outlives the daemon: `ReplayCluster` served on a Unix socket.

The crash-point tests SIGKILL a daemon process and start another on the same state
directory; the cluster it talks to must survive that, as a real slurmctld does. So the
`ReplayCluster` lives in the test process (`serve_replay`), and the daemon's Slurm commands
go to it through `ReplayRunner`, a `CommandRunner` that sends each command as one JSON line
over a fresh connection and reads one JSON line back. A daemon killed mid-call leaves the
command applied or not, exactly as a killed `sbatch` client would.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import anyio
import anyio.abc

from llmd_supervisor.adapters.slurm.runner import CommandResult
from llmd_supervisor.errors import SlurmCommandError
from tests.fakes.slurm_replay import ReplayCluster

_LINE_LIMIT = 16 << 20  # a batch script with the stand-ins embedded is ~170 KB


async def _read_line(stream: anyio.abc.ByteStream) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive()
        data += chunk
        if len(data) > _LINE_LIMIT:
            raise ValueError(f"a replay message longer than {_LINE_LIMIT} bytes")
    return data


async def serve_replay(
    cluster: ReplayCluster,
    path: Path,
    *,
    slow: Mapping[str, float] | None = None,
    received: list[str] | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Answer `ReplayRunner` calls from `cluster` on the Unix socket `path` until cancelled.
    `slow` (read at each call: a test may change it) delays a program's answer by that
    many seconds BEFORE it takes effect, as a slow sbatch does; the command takes effect
    even if the caller is gone meanwhile. `received` gets each call's program as the call
    arrives (before any delay): a call in flight is there."""

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                request = json.loads(await _read_line(stream))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return  # the daemon died before it sent the whole command: nothing ran
            stdin = request["stdin"]
            if received is not None:
                received.append(str(request["argv"][0]))
            delay = (slow or {}).get(str(request["argv"][0]), 0.0)
            if delay:
                await anyio.sleep(delay)
            try:
                result = await cluster.run(
                    request["argv"],
                    time_limit=float(request["time_limit"]),
                    stdin=None if stdin is None else base64.b64decode(stdin),
                    env=request["env"],
                )
            except SlurmCommandError:
                reply: dict[str, object] = {"timeout": True}
            else:
                reply = {
                    "returncode": result.returncode,
                    "stdout": result.stdout,
                    "stderr": result.stderr,
                    "started_at": result.started_at.isoformat(),
                }
            # The daemon may be gone by now (killed while it waited): the command stands.
            with anyio.move_on_after(5):
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await stream.send(json.dumps(reply).encode() + b"\n")

    listener = await anyio.create_unix_listener(path)
    async with listener:
        task_status.started()
        await listener.serve(handle)


class ReplayRunner:
    """Runs each Slurm command on the `ReplayCluster` that `serve_replay` serves at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def run(
        self,
        argv: Sequence[str],
        *,
        time_limit: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        request = {
            "argv": list(argv),
            "time_limit": time_limit,
            "stdin": None if stdin is None else base64.b64encode(stdin).decode(),
            "env": None if env is None else dict(env),
        }
        try:
            with anyio.fail_after(time_limit):
                async with await anyio.connect_unix(self.path) as stream:
                    await stream.send(json.dumps(request).encode() + b"\n")
                    reply = json.loads(await _read_line(stream))
        except (TimeoutError, OSError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            raise SlurmCommandError(
                tuple(argv), None, f"the replayed cluster did not answer: {exc!r}"
            ) from None
        if reply.get("timeout"):
            raise SlurmCommandError(tuple(argv), None, "", timed_out_after=time_limit)
        return CommandResult(
            tuple(argv),
            int(reply["returncode"]),
            str(reply["stdout"]),
            str(reply["stderr"]),
            datetime.fromisoformat(str(reply["started_at"])),
            0.0,
        )


__all__ = ["ReplayRunner", "serve_replay"]
