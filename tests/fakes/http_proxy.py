"""A forwarding HTTP proxy on 127.0.0.1 (a port of its own), for the tests of outbound
events through a login node's proxy: ``CONNECT host:port`` opens a tunnel (https), an
absolute-form request (``POST http://host:port/path HTTP/1.1``) is forwarded with its
body and the answer relayed (http). Every request line it got is kept, in order, in
`seen`; it only ever connects to loopback."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
import anyio.abc

HEAD_MAX = 64 << 10


@dataclass
class Proxy:
    """Serve with ``port = await tg.start(proxy.serve)``."""

    seen: list[str] = field(default_factory=list)  # request lines, as received
    authorizations: list[str | None] = field(default_factory=list)  # Proxy-Authorization

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        async with listener:
            task_status.started(int(listener.extra(anyio.abc.SocketAttribute.local_port)))
            await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            head, rest = await _head(client)
            request_line, *lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)
            }
            self.seen.append(request_line)
            self.authorizations.append(headers.get("proxy-authorization"))
            method, target, version = request_line.split(" ")
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
                assert host in ("127.0.0.1", "localhost"), target
                async with await anyio.connect_tcp(host, int(port)) as upstream:
                    await client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    await _pump_both(client, upstream, rest)
                return
            url = urlsplit(target)
            assert url.hostname in ("127.0.0.1", "localhost") and url.port, target
            length = int(headers.get("content-length", "0"))
            while len(rest) < length:
                rest += await client.receive()
            path = url.path + (f"?{url.query}" if url.query else "")
            kept = [
                x
                for x in lines
                if x.partition(":")[0].strip().lower()
                not in ("proxy-authorization", "proxy-connection", "connection")
            ]
            forwarded = "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close"])
            async with await anyio.connect_tcp(url.hostname, url.port) as upstream:
                await upstream.send(forwarded.encode("latin-1") + b"\r\n\r\n" + rest)
                while True:
                    try:
                        await client.send(await upstream.receive())
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break


async def _head(stream: anyio.abc.ByteReceiveStream) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        assert len(buf) < HEAD_MAX, "request head too large"
        buf += await stream.receive()
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


async def _pump_both(
    client: anyio.abc.SocketStream, upstream: anyio.abc.SocketStream, first: bytes
) -> None:
    async def pump(src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream) -> None:
        try:
            async for chunk in src:
                await dst.send(chunk)
        except anyio.BrokenResourceError:
            pass
        finally:
            tg.cancel_scope.cancel()  # one side closed: the tunnel is over

    if first:
        await upstream.send(first)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pump, client, upstream)
        tg.start_soon(pump, upstream, client)
