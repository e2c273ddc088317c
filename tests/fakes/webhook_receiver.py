"""A webhook receiver on 127.0.0.1 (a port of its own), for the outbox's tests: real HTTP/1.1
over TCP (or TLS), answering each request with the answer set for its ``webhook-id``
(once), else with the next of a script of answers (then 200), and keeping every request
it got."""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.streams.tls import TLSListener


@dataclass(frozen=True)
class Answer:
    status: int
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Received:
    target: str
    headers: dict[str, str]  # names in lower case
    body: bytes


@dataclass
class Receiver:
    """Serve with ``port = await tg.start(receiver.serve)``."""

    script: list[Answer] = field(default_factory=list)
    once_for: dict[str, Answer] = field(default_factory=dict)  # webhook-id -> its next answer
    got: list[Received] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)

    async def serve(
        self,
        *,
        tls: ssl.SSLContext | None = None,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled; over TLS with `tls` (a server context)."""
        tcp = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = int(tcp.extra(anyio.abc.SocketAttribute.local_port))
        listener: anyio.abc.Listener[Any] = tcp if tls is None else TLSListener(tcp, tls)
        async with listener:
            task_status.started(port)
            await listener.serve(self._handle)

    async def until(self, count: int, timeout_s: float = 20) -> Sequence[Received]:
        """Wait until `count` requests came in."""
        with anyio.fail_after(timeout_s):
            while len(self.got) < count:
                changed = self.changed
                await changed.wait()
        return self.got

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += await stream.receive()
            head, _, body = buf.partition(b"\r\n\r\n")
            request_line, *lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                body += await stream.receive()
            self.got.append(Received(request_line.split(" ")[1], headers, body))
            answer = self.once_for.pop(headers.get("webhook-id", ""), None)
            if answer is None:
                answer = self.script.pop(0) if self.script else Answer(200)
            extra = "".join(f"{k}: {v}\r\n" for k, v in answer.headers)
            await stream.send(
                f"HTTP/1.1 {answer.status} X\r\nContent-Length: 2\r\n{extra}"
                "Connection: close\r\n\r\nok".encode("latin-1")
            )
            self.changed.set()
            self.changed = anyio.Event()
