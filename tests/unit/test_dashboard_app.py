"""The dashboard's app and server in this process (supervision.web.dashboard over
adapters.web.server), with a fake control API: the TCP token and cookie, the Host rule,
GET/HEAD only, the security headers on every answer, a log stream's event ids, and a stop
that ends an open stream at once."""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
import pytest

from llmd_supervisor.adapters.control.protocol import Peer, Request, Send
from llmd_supervisor.adapters.control.requests import LogsRequest, StatusRequest
from llmd_supervisor.adapters.control.server import bind_unix_socket
from llmd_supervisor.adapters.web.server import STOP_GRACE_S, bind_tcp, serve_asgi
from llmd_supervisor.core.config import DashboardConfig, WebLimits
from llmd_supervisor.core.protocol.runs import LogChunk, LogsDone, RunSummary
from llmd_supervisor.core.web import pages as pages
from llmd_supervisor.errors import ControlError
from llmd_supervisor.supervision.web.dashboard import TOKEN_PEER, Dashboard

pytestmark = pytest.mark.timeout(60)
TOKEN = "t" * 40
FILE = "attempt1/llmd-r1-7.out"


class FakeApi:
    """Run r1 of uid 0 whose batch log is `log`; `logs` follows it until `done` is set."""

    def __init__(self, archive: Path) -> None:
        self.archive = archive
        self.log = b""
        self.grew = anyio.Event()
        self.done = False
        self.peers: list[Peer] = []
        self.runs = self  # what the dashboard asks directly: its `RunsService`

    async def status(self, peer: Peer, req: StatusRequest) -> RunSummary:
        answer = await self.handle(Request(1, "status", {"run": req.run}), peer, _no_stream)
        return cast(RunSummary, answer)

    async def logs(
        self, peer: Peer, req: LogsRequest, send: Callable[[LogChunk], Awaitable[None]]
    ) -> LogsDone:
        async def item(chunk: Mapping[str, object]) -> None:
            await send(cast(LogChunk, chunk))

        args = {"run": req.run, "rank": req.rank, "follow": req.follow, "offsets": req.offsets}
        return cast(LogsDone, await self.handle(Request(1, "logs", args), peer, item))

    def write(self, data: bytes) -> None:
        self.log += data
        self.grew.set()
        self.grew = anyio.Event()

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        self.peers.append(peer)
        if request.args.get("run") not in (None, "r1") or peer.uid not in (0, TOKEN_PEER.uid):
            raise ControlError("not_found", f"No run {request.args.get('run')!r} is known.")
        if request.op == "status":
            return {"run": "r1", "archive": str(self.archive), "state": "running"}
        assert request.op == "logs", request.op
        offsets = cast(Mapping[str, int], request.args["offsets"])
        at = offsets.get(FILE, 0)
        while True:
            if at < len(self.log):
                data = self.log[at:]
                await send(
                    {
                        "file": FILE,
                        "offset": at,
                        "end": at + len(data),
                        "data": data.decode(),
                        "encoding": "utf-8",
                    }
                )
                at += len(data)
            elif self.done:
                return {"bytes": at, "state": "succeeded"}
            else:
                await self.grew.wait()


async def _no_stream(item: Mapping[str, object]) -> None:
    raise AssertionError(f"unexpected stream item {item}")


async def request(
    address: Path | tuple[str, int], head: str, *, until: bytes | None = None
) -> bytes:
    """Send a request head, read the answer (to its end, or until `until` was read)."""
    if isinstance(address, Path):
        stream: anyio.abc.ByteStream = await anyio.connect_unix(address)
    else:
        stream = await anyio.connect_tcp(*address)
    async with stream:
        head = head.replace("\n", "\nConnection: close\n", 1)  # else it waits for keep-alive
        await stream.send(head.replace("\n", "\r\n").encode() + b"\r\n")
        data = b""
        with anyio.fail_after(10):
            while until is None or until not in data:
                try:
                    data += await stream.receive()
                except anyio.EndOfStream:
                    break
    return data


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


@pytest.mark.asyncio
async def test_the_dashboard_app_over_both_listeners(tmp_path: Path) -> None:
    api = FakeApi(tmp_path / "archive")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    listen = f"127.0.0.1:{port}"
    dash = Dashboard(cast(Any, api), DashboardConfig(tcp=listen), token=TOKEN)
    path = tmp_path / "web.sock"
    unix, _ = await bind_unix_socket(path, 0o600, None)
    tcp = bind_tcp(listen, "dashboard.tcp")
    async with anyio.create_task_group() as tg:
        await tg.start(
            functools.partial(serve_asgi, dash.app(), [unix, tcp], name="t", on_stop=dash.stop)
        )
        addr = ("127.0.0.1", port)
        # TCP: the token once, then the cookie; a foreign Host never.
        assert status_of(await request(addr, "GET / HTTP/1.1\nHost: localhost\n")) == 403
        answer = await request(addr, f"GET /?token={TOKEN} HTTP/1.1\nHost: localhost:{port}\n")
        assert status_of(answer) == 303 and b"location: /\r\n" in answer.lower()
        assert b"httponly" in answer.lower() and b"samesite=strict" in answer.lower()
        cookie = f"Cookie: {pages.TOKEN_COOKIE}={TOKEN}\n"
        foreign = f"GET /?token={TOKEN} HTTP/1.1\nHost: evil.example:{port}\n{cookie}"
        assert status_of(await request(addr, foreign)) == 403
        css = f"GET /static/dashboard.css HTTP/1.1\nHost: localhost\n{cookie}"
        answer = await request(addr, css)
        assert status_of(answer) == 200 and b"text/css" in answer
        # Unix socket: the peer is this process's uid; writes are refused; headers always.
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            answer = await request(path, f"{method} / HTTP/1.1\nHost: localhost\n")
            assert status_of(answer) == 405 and b"allow: GET, HEAD" in answer
        answer = await request(path, "GET /nope HTTP/1.1\nHost: localhost\n")
        assert status_of(answer) == 404
        assert f"content-security-policy: {pages.CSP}".encode() in answer
        assert status_of(await request(path, "GET / HTTP/1.1\nHost: evil.example\n")) == 403
        answer = await request(path, "GET /static/dashboard.js HTTP/1.1\nHost: localhost\n")
        assert status_of(answer) == 200 and b"textContent" in answer
        assert b"innerHTML" not in answer.split(b"\r\n\r\n", 1)[1]

        # A log stream: each event's id is where it got to; resuming from one sends the rest.
        api.write(b"one\n")
        got = await request(path, "GET /runs/r1/logs HTTP/1.1\nHost: localhost\n", until=b"one\\n")
        assert status_of(got) == 200 and b"content-length" not in got.lower()
        assert b"content-type: text/event-stream" in got.lower()
        event_id = pages.encode_offsets({FILE: 4})
        assert f"id: {event_id}".encode() in got
        api.write(b"two\n")
        again = await request(
            path,
            f"GET /runs/r1/logs HTTP/1.1\nHost: localhost\nLast-Event-ID: {event_id}\n",
            until=b"two\\n",
        )
        assert b"one\\n" not in again and f"id: {pages.encode_offsets({FILE: 8})}".encode() in again

        # An open stream ends at once when the server stops.
        stream = await anyio.connect_unix(path)
        await stream.send(b"GET /runs/r1/logs HTTP/1.1\r\nHost: localhost\r\n\r\n")
        with anyio.fail_after(5):
            while b"two" not in await stream.receive():
                pass
        started = anyio.current_time()
        tg.cancel_scope.cancel()
    assert anyio.current_time() - started < STOP_GRACE_S + 1
    with anyio.fail_after(5):
        rest = b""
        try:
            while True:
                rest += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    await stream.aclose()
    assert all(p.uid in (0, TOKEN_PEER.uid) for p in api.peers)


@pytest.mark.asyncio
async def test_a_kept_alive_connection_must_finish_its_next_request_head_in_time(
    tmp_path: Path,
) -> None:
    dash = Dashboard(cast(Any, FakeApi(tmp_path)), DashboardConfig(), token=None)
    path = tmp_path / "web.sock"
    unix, _ = await bind_unix_socket(path, 0o600, None)
    limits = WebLimits(head_timeout_s=0.5)  # under uvicorn's 5 s keep-alive
    serve = functools.partial(
        serve_asgi, dash.app(), [unix], name="dashboard", limits=limits, on_stop=dash.stop
    )
    async with anyio.create_task_group() as tg:
        await tg.start(serve)
        async with await anyio.connect_unix(path) as stream:
            await stream.send(b"GET /static/dashboard.css HTTP/1.1\r\nHost: localhost\r\n\r\n")
            first = b""
            with anyio.fail_after(10):
                while b"\r\n\r\n" not in first:
                    first += await stream.receive()
                head, _, body = first.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += await stream.receive()
            assert status_of(first) == 200
            # The next request's head starts (so the keep-alive timer is off) and stops.
            await stream.send(b"GET / HTTP/1.1\r\nHost: loc")
            rest = b""
            with anyio.fail_after(10):
                try:
                    while True:
                        rest += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass
        tg.cancel_scope.cancel()
    assert status_of(rest) == 408, rest
    assert b"within 0.5 s (dashboard.head_timeout_s)" in rest


@pytest.mark.asyncio
async def test_a_request_body_trickled_after_its_answer_does_not_hold_the_connection(
    tmp_path: Path,
) -> None:
    dash = Dashboard(cast(Any, FakeApi(tmp_path)), DashboardConfig(), token=None)
    path = tmp_path / "web.sock"
    unix, _ = await bind_unix_socket(path, 0o600, None)
    serve = functools.partial(serve_asgi, dash.app(), [unix], name="dashboard", on_stop=dash.stop)
    async with anyio.create_task_group() as tg:
        await tg.start(serve)
        async with await anyio.connect_unix(path) as stream:
            head = b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000000\r\n\r\n"
            await stream.send(head + b"x")
            got = b""
            sent = 1
            # The peer sends one more body byte whenever nothing came for 0.5 s (so uvicorn's
            # keep-alive timer, stopped by each, never fires), until the server closes.
            with anyio.fail_after(20):
                while True:
                    with anyio.move_on_after(0.5):
                        try:
                            got += await stream.receive()
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            break
                        continue
                    with contextlib.suppress(anyio.BrokenResourceError):
                        await stream.send(b"x")
                        sent += 1
        tg.cancel_scope.cancel()
    assert status_of(got) == 405, got
    assert sent < 1000, sent
