"""sd_notify against real datagram sockets (path and abstract), and the loop monitor."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.sdnotify import Notifier, loop_monitor, watchdog_interval


@pytest.fixture
def dgram(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()


def test_messages_arrive_one_datagram_each_on_a_path_socket(
    dgram: tuple[socket.socket, str],
) -> None:
    sock, path = dgram
    n = Notifier.from_environ({"NOTIFY_SOCKET": path})
    assert n.enabled
    n.notify("READY=1\nSTATUS=0 runs in flight; 0 finished")
    n.notify("STOPPING=1")
    assert sock.recv(4096) == b"READY=1\nSTATUS=0 runs in flight; 0 finished"
    assert sock.recv(4096) == b"STOPPING=1"
    assert n.sent == 2
    n.close()


def test_abstract_socket_name_with_at_sign() -> None:
    name = f"llmd-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2)
    try:
        n = Notifier(f"@{name}")
        n.notify("WATCHDOG=1")
        assert sock.recv(64) == b"WATCHDOG=1"
        n.close()
    finally:
        sock.close()


def test_without_notify_socket_every_call_is_a_noop() -> None:
    n = Notifier.from_environ({})
    assert not n.enabled
    n.notify("READY=1")
    assert n.sent == 0


def test_an_unreachable_socket_is_logged_never_raised(tmp_path: Path) -> None:
    n = Notifier(str(tmp_path / "nobody-listens"))
    n.notify("READY=1")  # must not raise
    assert n.sent == 0
    n.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "junk"}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ],
)
def test_watchdog_interval_from_environment(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env) == expected


@pytest.mark.asyncio
@pytest.mark.blocks_event_loop(
    "time.sleep(0.6) is the stall whose missed watchdog pings are tested"
)
async def test_loop_monitor_pings_every_half_interval_and_a_blocked_loop_misses_them(
    dgram: tuple[socket.socket, str],
) -> None:
    sock, path = dgram
    sock.setblocking(False)
    n = Notifier(path)
    lags: list[float] = []
    arrivals: list[float] = []

    def drain() -> None:
        while True:
            try:
                assert sock.recv(64) == b"WATCHDOG=1"
            except BlockingIOError:
                return
            arrivals.append(time.monotonic())

    async with anyio.create_task_group() as tg:
        await tg.start(loop_monitor, n.notify, 0.2, lags.append)  # ping every 0.1 s
        for _ in range(8):
            await anyio.sleep(0.1)
            drain()
        before = len(arrivals)
        # Block the event loop on purpose: no ping can be sent meanwhile.
        time.sleep(0.6)  # noqa: ASYNC251 - the blocked loop is what is tested
        blocked_until = time.monotonic()
        drain()
        during_block = len(arrivals) - before
        for _ in range(4):
            await anyio.sleep(0.1)
            drain()
        tg.cancel_scope.cancel()
    n.close()
    assert len(arrivals) >= 8
    # Six pings were due while the loop was blocked; a pinger off the loop (a thread)
    # would have sent them. At most one (sent just before the block) may be waiting.
    assert during_block <= 1, during_block
    assert any(t > blocked_until for t in arrivals)  # and pings resume afterwards
    assert max(lags) >= 0.45  # the monitor measured the stall as loop lag
