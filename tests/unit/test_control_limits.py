"""Control socket limits over real sockets: connection caps in all and per uid, the first
byte / request / idle / write timeouts, the stream cap, the partial-line budget, bounded
error replies, and one final reply even for ids a console log renderer cannot print."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import anyio
import anyio.abc
import pytest
import structlog
from anyio.abc import SocketAttribute

from llmd_supervisor.adapters.control.client import ControlClient
from llmd_supervisor.adapters.control.server import ControlServer
from llmd_supervisor.core.config import SocketLimits
from llmd_supervisor.errors import ControlError
from tests.unit.test_control import DummyHandler, Raw, error_of, raw
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10
BASE = SocketLimits()


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "ctl.sock"


@asynccontextmanager
async def serving(path: Path, **limits: object) -> AsyncIterator[ControlServer]:
    server = ControlServer(path, DummyHandler(), limits=replace(BASE, **limits))  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        yield server
        with anyio.move_on_after(2):
            while server.connections:  # noqa: ASYNC110  # a bounded poll of a counter, test-only
                await anyio.sleep(0.001)
        tg.cancel_scope.cancel()


async def closed(conn: Raw) -> bool:
    """Whether the server closed the connection (after any lines it sent)."""
    with anyio.fail_after(TIMEOUT):
        try:
            await conn.reader.receive(1)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return True
    return False


async def ping(conn: Raw) -> dict[str, object]:
    with anyio.fail_after(TIMEOUT):
        return await conn.request({"v": 1, "id": 1, "op": "ping"})


@pytest.mark.asyncio
async def test_the_per_uid_cap_refuses_with_one_busy_line_then_admits_again(sock: Path) -> None:
    async with serving(sock, max_connections_per_uid=3) as server:
        async with raw(sock) as a, raw(sock) as b, raw(sock) as c:
            for conn in (a, b, c):
                assert (await ping(conn))["ok"] is True
            async with raw(sock) as d:
                with anyio.fail_after(TIMEOUT):
                    reply = await d.reply()
                code, message = error_of(reply)
                assert code == "busy"
                assert "daemon.max_connections_per_uid = 3" in message
                assert reply["id"] is None
                assert await closed(d)
            assert server.connections == 3
        with anyio.fail_after(TIMEOUT):
            while server.connections:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        async with raw(sock) as e:
            assert (await ping(e))["ok"] is True


@pytest.mark.asyncio
async def test_the_global_cap_refuses_and_a_client_gets_the_busy_error(sock: Path) -> None:
    async with serving(sock, max_connections=2), raw(sock) as a, raw(sock) as b:
        assert (await ping(a))["ok"] and (await ping(b))["ok"]
        with anyio.fail_after(TIMEOUT):
            async with ControlClient(sock) as client:
                # the refusal is there before the request goes: its busy line is readable
                assert client._stream is not None
                await anyio.wait_readable(client._stream.extra(SocketAttribute.raw_socket))
                with pytest.raises(ControlError) as info:
                    await client.call("ping")
        assert info.value.code == "busy"
        assert "daemon.max_connections = 2" in info.value.message


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("limit", "before", "needle"),
    [
        ("first_byte_timeout_s", b"", "no request arrived within 0.3 s"),
        ("request_timeout_s", b'{"v":1,"id":1,', "not complete within 0.3 s"),
        ("idle_timeout_s", b'{"v":1,"id":1,"op":"ping"}\n', "idle for 0.3 s"),
    ],
)
async def test_timeouts_close_with_one_timeout_line(
    sock: Path, limit: str, before: bytes, needle: str
) -> None:
    async with serving(sock, **{limit: 0.3}), raw(sock) as conn:
        await conn.stream.send(before)
        if before.endswith(b"\n"):
            assert (await conn.reply())["ok"] is True
        with anyio.fail_after(TIMEOUT):
            reply = await conn.reply()
        code, message = error_of(reply)
        assert code == "timeout"
        assert needle in message
        assert await closed(conn)


@pytest.mark.asyncio
async def test_a_client_that_trickles_bytes_is_still_cut_at_the_request_timeout(
    sock: Path,
) -> None:
    async with serving(sock, request_timeout_s=0.5), raw(sock) as conn:
        with anyio.fail_after(TIMEOUT):
            start = anyio.current_time()
            try:
                for _ in range(100):
                    await conn.stream.send(b" ")
                    await anyio.sleep(0.05)
            except (anyio.BrokenResourceError, BrokenPipeError, ConnectionResetError):
                pass
            assert error_of(await conn.reply())[0] == "timeout"
            assert anyio.current_time() - start < 3


@pytest.mark.asyncio
async def test_the_stream_cap_answers_busy_and_keeps_the_connection(sock: Path) -> None:
    async with serving(sock, max_streams_per_uid=1) as server, raw(sock) as a, raw(sock) as b:
        await a.send(b'{"v":1,"id":1,"op":"wait","args":{"run":"forever"}}')
        handler = server.handler
        assert isinstance(handler, DummyHandler)
        with anyio.fail_after(TIMEOUT):
            await handler.started.wait()  # a's wait is streaming: it holds the one stream
            reply = await b.request({"v": 1, "id": 2, "op": "wait", "args": {"run": "2"}})
        code, message = error_of(reply)
        assert code == "busy" and reply["id"] == 2
        assert "daemon.max_streams_per_uid = 1" in message
        assert (await ping(b))["ok"] is True  # not closed


@pytest.mark.asyncio
async def test_idle_connections_hold_no_budget_so_many_of_one_uid_are_served(sock: Path) -> None:
    # 2 MiB is eight reads' worth: forty idle connections must not use it up.
    limits = {"request_buffer_bytes_per_uid": 2 << 20}
    async with serving(sock, **limits) as server, anyio.create_task_group() as tg:
        conns: list[Raw] = []
        for _ in range(40):
            conns.append(Raw(await tg.start(_open, sock)))
        await until(lambda: server.connections == 40, TIMEOUT, "all 40 connections served")
        assert server.buffered == 0
        for conn in conns:
            assert (await ping(conn))["ok"] is True
        tg.cancel_scope.cancel()


async def _open(sock: Path, *, task_status: anyio.abc.TaskStatus[object]) -> None:
    async with await anyio.connect_unix(sock) as stream:
        task_status.started(stream)
        await anyio.sleep_forever()


@pytest.mark.asyncio
async def test_a_client_that_does_not_read_is_dropped_at_the_write_timeout(sock: Path) -> None:
    async with serving(sock, write_timeout_s=0.3) as server, raw(sock) as conn:
        # 20,000 items of about 80 bytes: far more than the socket buffers hold.
        await conn.send(b'{"v":1,"id":1,"op":"wait","args":{"run":"20000"}}')
        with anyio.fail_after(TIMEOUT):
            while server.connections:  # noqa: ASYNC110
                await anyio.sleep(0.05)


@pytest.mark.asyncio
async def test_partial_lines_are_held_within_the_per_uid_budget(sock: Path) -> None:
    budget = 2 << 20
    async with serving(sock, request_buffer_bytes_per_uid=budget, request_timeout_s=1.5) as server:
        peak = 0
        async with anyio.create_task_group() as tg:

            async def half_line() -> None:
                async with raw(sock) as conn:
                    try:
                        with anyio.move_on_after(TIMEOUT):
                            await conn.stream.send(b'{"v":1,"id":1,"op":"' + b"x" * (1 << 20))
                            await conn.reply()
                    except (anyio.BrokenResourceError, BrokenPipeError, ConnectionResetError):
                        pass

            for _ in range(8):
                tg.start_soon(half_line)
            with anyio.move_on_after(4):
                while True:
                    peak = max(peak, server.buffered)
                    await anyio.sleep(0.005)
        # The budget, plus the first read of each line (charged once it arrived).
        assert budget // 2 < peak <= budget + 8 * (16 << 10), peak
        assert server.buffered == 0


@pytest.mark.asyncio
async def test_over_long_ids_are_refused_and_no_error_reply_is_unbounded(sock: Path) -> None:
    async with serving(sock), raw(sock) as conn:
        replies = []
        for obj in (
            {"v": 1, "id": "i" * 129, "op": "ping"},
            {"v": 1, "id": 1, "op": "\u0001" * 150_000},
            {"v": 1, "id": 2, "op": "status", "args": {"run": 5, "x" * 300_000: 1}},
            {"v": "\u0001" * 150_000, "id": 3, "op": "ping"},
        ):
            line = json.dumps(obj).encode()
            await conn.send(line)
            with anyio.fail_after(TIMEOUT):
                replies.append(await conn.reply())
        assert [r["id"] for r in replies] == [None, 1, 2, 3]
        for reply in replies:
            assert reply["ok"] is False
            assert len(json.dumps(reply)) < 1500


@pytest.fixture
def console_log() -> Iterator[io.TextIOWrapper]:
    """structlog's console renderer printing to a strict UTF-8 stream, as on a terminal."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    structlog.configure(
        processors=[structlog.processors.format_exc_info, structlog.dev.ConsoleRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(file=out),
    )
    yield out
    structlog.reset_defaults()


@pytest.mark.asyncio
async def test_a_lone_surrogate_id_gets_its_one_final_reply_under_the_console_renderer(
    sock: Path, console_log: io.TextIOWrapper
) -> None:
    surrogate = "\ud800"
    async with serving(sock), raw(sock) as conn:
        for op, args in (
            ("ping", {}),
            ("status", {"run": "missing"}),
            ("status", {"run": "boom"}),
            ("status", {"run": "unjson"}),
            ("nope", {}),
            ("wait", {"run": "2"}),
            ("status", {"run": surrogate}),
        ):
            line = json.dumps({"v": 1, "id": surrogate, "op": op, "args": args}).encode()
            await conn.send(line)
            with anyio.fail_after(TIMEOUT):
                reply = await conn.reply()
                while "stream" in reply:
                    reply = await conn.reply()
            assert reply["id"] == surrogate, (op, args, reply)
            assert "ok" in reply


def test_the_unit_and_the_shipped_config_agree_with_the_limits() -> None:
    from llmd_supervisor.core.config import load_config
    from tests.devcluster import REPO

    shipped = load_config((REPO / "deploy" / "llmd-supervisor.toml").read_text())
    assert shipped.socket_limits == BASE  # the file documents the defaults
    service: dict[str, str] = {}
    for line in (REPO / "systemd" / "llmd-supervisor.service").read_text().splitlines():
        key, eq, value = line.partition("=")
        if eq and not line.startswith("#"):
            service[key.strip()] = value.strip()
    assert service["UMask"] == "0077"  # as the daemon sets it at start (serve)
    # Every admitted client (an fd, and an inotify fd while following) plus room for SSH
    # links and log copies; refusals need an fd for a moment too.
    assert int(service["LimitNOFILE"]) >= 2 * BASE.max_connections + 4096


@pytest.mark.asyncio
async def test_the_budget_grants_in_order_and_one_uid_never_holds_up_another() -> None:
    from llmd_supervisor.adapters.control.limits import Budget

    budget = Budget(total=100, per_uid=40)
    await budget.take(1, 40)
    got: list[str] = []
    async with anyio.create_task_group() as tg:

        async def take(name: str, uid: int, n: int) -> None:
            await budget.take(uid, n)
            got.append(name)

        tg.start_soon(take, "a1", 1, 30)
        tg.start_soon(take, "a2", 1, 10)
        await anyio.wait_all_tasks_blocked()
        await budget.take(2, 40)  # another uid: at once, though uid 1 has waiters
        budget.give(1, 25)  # room for a2 (10), not yet for a1 (30): a2 goes first
        await anyio.wait_all_tasks_blocked()
        assert got == ["a2"]
        budget.give(1, 15)
        await anyio.wait_all_tasks_blocked()
        assert got == ["a2", "a1"]
    assert budget.by_uid == {1: 40, 2: 40} and budget.held == 80
    with anyio.move_on_after(0.05):
        await budget.take(2, 10)  # over uid 2's share: waits, then is cancelled
    assert budget.held == 80 and not budget._waiters
