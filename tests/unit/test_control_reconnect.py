"""Waiting clients across daemon restarts: a real `ControlServer` on a temporary socket is
stopped and started again under the reconnecting client helpers and under the CLI itself
(run as a subprocess), with a fake run behind it whose log grows."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest

from llmd_supervisor.adapters.control.client import (
    ControlClient,
    Reconnect,
    call_retrying,
    connection_lost,
    resumable_stream,
)
from llmd_supervisor.adapters.control.protocol import Peer, Request, Send
from llmd_supervisor.adapters.control.server import ControlServer
from llmd_supervisor.core.protocol.runs import LogChunk, RunSummary, read
from llmd_supervisor.errors import ControlError, ControlProtocolError, DaemonUnreachable
from tests.daemon_helpers import demo_spec

pytestmark = pytest.mark.timeout(60)

FILE = "attempt1/llmd-r1-7.out"
QUICK = Reconnect(window_s=10.0, first_delay_s=0.02, max_delay_s=0.1)


def summary(state: str, outcome: str | None) -> RunSummary:
    return {
        "run": "r1",
        "job_name": "llmd-r1",
        "state": state,
        "outcome": outcome,
        "reason": "fake" if outcome else "",
        "slurm_job_id": "7",
        "attempt": 1,
        "nodes": ["n1"],
        "nodes_healthy": 1,
        "cancel_requested": False,
        "cluster": "dev",
        "owner_uid": os.getuid(),
        "created_at": "2026-01-01T00:00:00+00:00",
        "elapsed_s": 1.0,
        "archive": "/nowhere",
        "log_dir": "/nowhere",
        "health": {},
        "transitions": [],
        "last_log_line": "",
    }


class FakeRun:
    """One run as a daemon would serve it; its state outlives the fake daemon's restarts.

    ``logs`` honours the offsets argument and sends at most `piece` bytes per item.
    """

    def __init__(self, piece: int = 5) -> None:
        self.blob = bytearray()
        self.state = "running"
        self.outcome: str | None = None
        self.changed = anyio.Event()
        self.requests: list[Request] = []
        self.requested = anyio.Event()  # set by the first request
        self.piece = piece

    def _notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def grow(self, data: bytes) -> None:
        self.blob += data
        self._notify()

    def finish(self, outcome: str) -> None:
        self.state = self.outcome = outcome
        self._notify()

    @property
    def final(self) -> bool:
        return self.outcome is not None

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        self.requests.append(request)
        self.requested.set()
        if request.op == "submit":
            return summary(self.state, self.outcome)
        if request.op == "cancel":
            self.finish("cancelled")
            return summary(self.state, self.outcome)
        if request.op == "wait":
            while not self.final:
                changed = self.changed
                await send(summary(self.state, self.outcome))
                await changed.wait()
            return summary(self.state, self.outcome)
        assert request.op == "logs", request
        offsets = request.args["offsets"] or {}
        assert isinstance(offsets, dict)
        pos = int(offsets.get(FILE, 0))
        while True:
            changed, final = self.changed, self.final
            while pos < len(self.blob):
                data = bytes(self.blob[pos : pos + self.piece])
                chunk: LogChunk = {
                    "file": FILE,
                    "offset": pos,
                    "end": pos + len(data),
                    "data": data.decode(),
                }
                await send(chunk)
                pos += len(data)
            if final:
                return {"bytes": pos, "state": self.state}
            await changed.wait()


class FakeDaemon:
    """Serves a `FakeRun` on `path`; `stop` and `start` are a daemon restart."""

    def __init__(self, tg: anyio.abc.TaskGroup, path: Path, run: FakeRun) -> None:
        self.tg, self.path, self.run = tg, path, run
        self.scope: anyio.CancelScope | None = None
        self.stopped = anyio.Event()

    async def start(self) -> None:
        await self.tg.start(self._serve)

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self.stopped = anyio.Event()
        with anyio.CancelScope() as self.scope:
            await ControlServer(self.path, self.run).serve(task_status=task_status)
        self.stopped.set()

    async def stop(self) -> None:
        assert self.scope is not None
        self.scope.cancel()
        await self.stopped.wait()
        assert not self.path.exists()


@asynccontextmanager
async def daemon(path: Path, run: FakeRun) -> AsyncIterator[FakeDaemon]:
    async with anyio.create_task_group() as tg:
        d = FakeDaemon(tg, path, run)
        yield d
        tg.cancel_scope.cancel()


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "ctl.sock"


# ------------------------------------------------------------------- the helpers


@pytest.mark.asyncio
async def test_a_stream_resumes_at_its_offsets_across_two_restarts(sock: Path) -> None:
    run = FakeRun()
    printed = bytearray()
    offsets: dict[str, int] = {}
    losses: list[str] = []
    lines = [f"line {i}\n".encode() for i in range(30)]
    with anyio.fail_after(20):
        async with daemon(sock, run) as d, anyio.create_task_group() as tg:
            await d.start()

            async def client() -> None:
                stream = resumable_stream(
                    sock,
                    "logs",
                    lambda: {"run": "r1", "follow": True, "offsets": dict(offsets)},
                    reconnect=QUICK,
                    on_lost=losses.append,
                )
                async with aclosing(stream) as items:
                    async for item in items:
                        if "final" in item:
                            return
                        chunk = read(LogChunk, item)
                        printed.extend(chunk["data"].encode())
                        offsets[chunk["file"]] = chunk["end"]

            tg.start_soon(client)
            for i, line in enumerate(lines):
                run.grow(line)
                await anyio.sleep(0.005)
                if i in (10, 20):
                    await d.stop()
                    run.grow(b"written while the daemon was down\n")
                    gone = functools.partial(_has_length, losses, 1 if i == 10 else 2)
                    await until("the client sees the daemon gone", gone)
                    asked = len(run.requests)
                    await d.start()
                    await until("the client is back", functools.partial(_more, run, asked))
            run.finish("succeeded")
    assert bytes(printed) == bytes(run.blob)
    assert len(losses) == 2
    assert "closed the connection" in losses[0]
    resumed = [r.args["offsets"] for r in run.requests]
    assert resumed[0] == {} and len(resumed) == 3
    assert all(isinstance(o, dict) and o[FILE] > 0 for o in resumed[1:])


@pytest.mark.asyncio
async def test_nothing_listening_is_retried_until_the_window_passes(sock: Path) -> None:
    policy = Reconnect(window_s=0.4, first_delay_s=0.02, max_delay_s=0.1)
    t0 = anyio.current_time()
    with anyio.fail_after(5), pytest.raises(DaemonUnreachable) as info:
        async with aclosing(resumable_stream(sock, "wait", dict, reconnect=policy)) as items:
            async for _ in items:
                pass
    assert 0.4 <= anyio.current_time() - t0 < 2
    assert "no socket exists there" in str(info.value)
    assert "gave up after trying again for 0.4 s" in str(info.value)
    # A stale socket file is the same: nothing listens.
    import socket as socketlib

    with socketlib.socket(socketlib.AF_UNIX) as s:
        s.bind(str(sock))
    with anyio.fail_after(5), pytest.raises(DaemonUnreachable, match="nothing listens"):
        await call_retrying(sock, "ping", {}, reconnect=policy, resend=True)


@pytest.mark.asyncio
async def test_a_daemon_that_comes_up_late_is_waited_for(sock: Path) -> None:
    run = FakeRun()
    run.finish("succeeded")
    with anyio.fail_after(10):
        async with daemon(sock, run) as d, anyio.create_task_group() as tg:
            results: list[Mapping[str, object]] = []
            losses: list[str] = []

            async def submit() -> None:
                results.append(
                    await call_retrying(
                        sock,
                        "submit",
                        {"spec_toml": "x"},
                        reconnect=QUICK,
                        resend=False,
                        on_lost=losses.append,
                    )
                )

            tg.start_soon(submit)
            await until("the client found nothing listening", lambda: bool(losses))
            await d.start()
    assert read(RunSummary, results[0])["state"] == "succeeded"
    assert losses == [losses[0]] and "no socket exists there" in losses[0]


@pytest.mark.asyncio
async def test_a_request_that_may_have_been_sent_is_not_sent_again(sock: Path) -> None:
    run = FakeRun()  # its wait never ends until the daemon stops
    with anyio.fail_after(10):
        async with daemon(sock, run) as d, anyio.create_task_group() as tg:
            await d.start()
            failures: list[BaseException] = []

            async def once() -> None:
                try:
                    await call_retrying(sock, "wait", {"run": "r1"}, reconnect=QUICK, resend=False)
                except ControlProtocolError as exc:
                    failures.append(exc)

            tg.start_soon(once)
            await run.requested.wait()
            await d.stop()
    assert len(run.requests) == 1
    assert "closed the connection" in str(failures[0])


def test_which_failures_are_worth_a_reconnect(sock: Path) -> None:
    def unreachable(cause: BaseException) -> DaemonUnreachable:
        exc = DaemonUnreachable(sock, "x")
        exc.__cause__ = cause
        return exc

    def broke(cause: BaseException | None) -> ControlProtocolError:
        exc = ControlProtocolError(sock, "x")
        exc.__cause__ = cause
        return exc

    assert connection_lost(unreachable(FileNotFoundError()))
    assert connection_lost(unreachable(ConnectionRefusedError()))
    assert connection_lost(unreachable(BlockingIOError()))
    assert not connection_lost(unreachable(PermissionError()))
    assert connection_lost(broke(anyio.IncompleteRead()))
    assert connection_lost(broke(anyio.BrokenResourceError()))
    assert not connection_lost(broke(None))  # a reply that is not the protocol
    assert not connection_lost(ControlError("not_found", "No run."))


@pytest.mark.asyncio
async def test_error_replies_are_not_retried(sock: Path) -> None:
    class Refuses(FakeRun):
        async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
            self.requests.append(request)
            raise ControlError("not_found", "No run 'x' is known to this daemon.")

    run = Refuses()
    with anyio.fail_after(5):
        async with daemon(sock, run) as d:
            await d.start()
            with pytest.raises(ControlError, match="No run 'x'"):
                async with aclosing(
                    resumable_stream(sock, "wait", lambda: {"run": "x"}, reconnect=QUICK)
                ) as items:
                    async for _ in items:
                        pass
            async with ControlClient(sock) as c:
                with pytest.raises(ControlError):
                    await c.call("status", {"run": "x"})
    assert len(run.requests) == 2


# ------------------------------------------------------------------- the CLI


@asynccontextmanager
async def cli(*args: str, tmp_path: Path) -> AsyncIterator[tuple[anyio.abc.Process, Path, Path]]:
    """The CLI as a subprocess (stdout and stderr to files); killed if still running after."""
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = await anyio.open_process(
            [sys.executable, "-m", "llmd_supervisor", *args],
            stdin=subprocess.DEVNULL,
            stdout=o,
            stderr=e,
        )
    async with proc:
        try:
            yield proc, out, err
        finally:
            if proc.returncode is None:
                proc.kill()
                with anyio.CancelScope(shield=True):
                    await proc.wait()


async def until(what: str, check: Callable[[], bool], limit_s: float = 10) -> None:
    """Poll `check` (state in another process or a file) until true."""
    with anyio.fail_after(limit_s):
        while not check():  # noqa: ASYNC110  # a bounded poll of another process, test-only
            await anyio.sleep(0.02)


@pytest.mark.asyncio
async def test_cli_wait_with_nothing_listening_exits_3_with_one_line(
    sock: Path, tmp_path: Path
) -> None:
    with anyio.fail_after(20):
        t0 = anyio.current_time()
        async with cli(
            "wait", "r1", "--socket", str(sock), "--reconnect-s", "1", tmp_path=tmp_path
        ) as (proc, _, err):
            assert await proc.wait() == 3
    assert anyio.current_time() - t0 >= 1
    lines = err.read_text().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("llmd-supervisor wait: Cannot reach the llmd-supervisor daemon")
    assert "gave up after trying again for 1 s" in lines[0]
    assert "Traceback" not in err.read_text()


@pytest.mark.asyncio
async def test_cli_unknown_run_is_one_line_and_exit_2(sock: Path, tmp_path: Path) -> None:
    class Unknown(FakeRun):
        async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
            raise ControlError("not_found", "No run 'zz' is known to this daemon.")

    with anyio.fail_after(20):
        async with daemon(sock, Unknown()) as d:
            await d.start()
            async with cli("wait", "zz", "--socket", str(sock), tmp_path=tmp_path) as (
                proc,
                _,
                err,
            ):
                assert await proc.wait() == 2
    assert err.read_text() == "llmd-supervisor wait: No run 'zz' is known to this daemon.\n"


@pytest.mark.asyncio
async def test_cli_submit_follow_across_two_restarts_prints_every_byte_once(
    sock: Path, tmp_path: Path
) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(demo_spec(tmp_path / "logs"))  # the CLI checks it; the fake daemon not
    run = FakeRun(piece=7)
    with anyio.fail_after(40):
        async with daemon(sock, run) as d:
            await d.start()
            args = ("submit", str(spec), "--follow", "--socket", str(sock), "--reconnect-s", "20")
            async with cli(*args, tmp_path=tmp_path) as (proc, out, err):
                await until("the client waits", lambda: {"wait", "logs"} <= _ops(run))
                for i in range(60):
                    run.grow(f"{i:03d} {'x' * (i % 13)}\n".encode())
                    await anyio.sleep(0.01)
                    if i in (20, 40):
                        await d.stop()
                        run.grow(b"while the daemon was down\n")
                        await anyio.sleep(0.3)
                        await d.start()
                await until("the client caught up", lambda: out.stat().st_size == len(run.blob))
                run.finish("succeeded")
                assert await proc.wait() == 0, err.read_text()
    assert out.read_bytes() == bytes(run.blob)
    text = err.read_text()
    assert "submitted run r1" in text and "outcome succeeded: fake" in text
    assert "Traceback" not in text
    assert [r.op for r in run.requests].count("submit") == 1
    # One stream per restart it saw: a client still backing off from the first restart
    # when the second one comes (a loaded machine) reconnects once for both.
    assert 2 <= [r.op for r in run.requests].count("logs") <= 3
    assert 2 <= [r.op for r in run.requests].count("wait") <= 3


def _has_length(items: list[str], length: int) -> bool:
    return len(items) == length


def _more(run: FakeRun, than: int) -> bool:
    return len(run.requests) > than


def _ops(run: FakeRun) -> set[str]:
    return {r.op for r in run.requests}


@pytest.mark.asyncio
async def test_cli_ctrl_c_while_the_daemon_is_down_cancels_once_it_is_back(
    sock: Path, tmp_path: Path
) -> None:
    run = FakeRun()
    with anyio.fail_after(30):
        async with daemon(sock, run) as d:
            await d.start()
            args = ("wait", "r1", "--json", "--socket", str(sock), "--reconnect-s", "20")
            async with cli(*args, tmp_path=tmp_path) as (proc, out, err):
                await until("the client waits", lambda: "wait" in _ops(run))
                await d.stop()
                await anyio.sleep(0.2)
                proc.send_signal(signal.SIGINT)
                await until("the client says so", lambda: "cancelling run r1" in err.read_text())
                await d.start()
                assert await proc.wait() == 11, err.read_text()
    assert [r.op for r in run.requests].count("cancel") == 1
    assert read(RunSummary, json.loads(out.read_text()))["outcome"] == "cancelled"
