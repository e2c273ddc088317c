"""Control socket: protocol, schema, failure handling and peer credentials over real sockets."""

from __future__ import annotations

import grp
import json
import os
import pwd
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import anyio
import anyio.abc
import pytest
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from llmd_supervisor.adapters.control.client import ControlClient
from llmd_supervisor.adapters.control.protocol import (
    COUNTS_MAX_ENTRIES,
    COUNTS_MAX_KEY,
    OPS,
    PROTOCOL_VERSION,
    Peer,
    Request,
    Send,
    decode_request,
)
from llmd_supervisor.adapters.control.server import ControlServer
from llmd_supervisor.errors import (
    ControlError,
    ControlProtocolError,
    ControlSocketError,
    DaemonUnreachable,
    SupervisorError,
)
from llmd_supervisor.supervision.control.access import may_access

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10


class DummyHandler:
    """Behaviour chosen by the op and the `run` argument.

    ping reports the peer. Otherwise by `run`: "quiet..." returns a small result; "boom"
    raises RuntimeError; "missing" raises ControlError; "unjson" returns a non-JSON result;
    "send-anyway", "final-key" and "huge-item" send a stream item (the last two bad ones);
    for wait, "<n>" streams n items and "forever" sleeps until cancelled; for cancel,
    "gated" waits for `gate`; else it echoes.
    """

    def __init__(self) -> None:
        self.requests: list[tuple[Request, Peer]] = []
        self.started = anyio.Event()
        self.cancelled = anyio.Event()
        self.gate = anyio.Event()
        self.finished = anyio.Event()

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        self.requests.append((request, peer))
        run = request.args.get("run")
        if isinstance(run, str) and run.startswith("quiet"):
            return {"quiet": True}
        if request.op == "ping":
            return {"pong": True, "uid": peer.uid, "gid": peer.gid, "pid": peer.pid}
        if run == "boom":
            raise RuntimeError("kaboom")
        if run == "missing":
            raise ControlError("not_found", "Run 'missing' does not exist.")
        if run == "unjson":
            return {"x": object()}
        if run == "send-anyway":
            await send({"x": 1})
        if run == "final-key":
            await send({"final": 1})
        if run == "huge-item":
            await send({"x": "y" * 5000})
        if request.op == "cancel" and run == "gated":
            self.started.set()
            await self.gate.wait()
            self.finished.set()
            return {"cancelled": True}
        if request.op == "wait" and run == "forever":
            self.started.set()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.cancelled.set()
                raise
        if request.op == "wait" and isinstance(run, str) and run.isdigit():
            for i in range(int(run)):
                await send({"i": i, "state": "running"})
            return {"state": "succeeded"}
        return {"op": request.op, "args": dict(request.args)}


@asynccontextmanager
async def serving(
    path: Path, handler: DummyHandler | None = None, **kwargs: object
) -> AsyncIterator[DummyHandler]:
    handler = handler or DummyHandler()
    server = ControlServer(path, handler, **kwargs)  # type: ignore[arg-type]  # test passthrough
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        yield handler
        # Let closed clients be noticed first: cancelling a read in the same loop iteration
        # as the peer's EOF makes anyio's asyncio backend log an InvalidStateError.
        with anyio.move_on_after(2):
            while server.connections:  # noqa: ASYNC110  # a bounded poll of a counter, test-only
                await anyio.sleep(0.001)
        tg.cancel_scope.cancel()


class Raw:
    """A bare protocol connection: bytes in, decoded reply lines out."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    async def send(self, line: bytes) -> None:
        await self.stream.send(line + b"\n")

    async def reply(self) -> dict[str, object]:
        line = await self.reader.receive_until(b"\n", 1 << 21)
        reply = json.loads(line)
        assert isinstance(reply, dict)
        assert reply["v"] == PROTOCOL_VERSION
        return reply

    async def request(self, obj: object) -> dict[str, object]:
        await self.send(json.dumps(obj).encode())
        return await self.reply()


@asynccontextmanager
async def raw(path: Path) -> AsyncIterator[Raw]:
    async with await anyio.connect_unix(path) as stream:
        yield Raw(stream)


def error_of(reply: Mapping[str, object]) -> tuple[str, str]:
    assert reply["ok"] is False
    error = reply["error"]
    assert isinstance(error, dict)
    return error["code"], error["message"]


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "ctl.sock"


# ----------------------------------------------------------------------------- schema

GOOD: list[tuple[str, dict[str, object], dict[str, object]]] = [
    ("ping", {}, {}),
    (
        "submit",
        {"spec_toml": "x = 1"},
        {"spec_toml": "x = 1", "spec_path": None, "dry_run": False, "cluster": None},
    ),
    (
        "submit",
        {"spec_toml": "", "spec_path": "/a/b.toml", "dry_run": True, "cluster": "dev"},
        {"spec_toml": "", "spec_path": "/a/b.toml", "dry_run": True, "cluster": "dev"},
    ),
    ("list", {}, {"all": False, "limit": None, "after": None, "cluster": None}),
    ("list", {"all": True}, {"all": True, "limit": None, "after": None, "cluster": None}),
    (
        "list",
        {"limit": 5, "after": "x|y"},
        {"all": False, "limit": 5, "after": "x|y", "cluster": None},
    ),
    ("status", {"run": "r1"}, {"run": "r1"}),
    ("logs", {"run": "r1"}, {"run": "r1", "rank": None, "follow": False, "offsets": None}),
    (
        "logs",
        {"run": "r1", "rank": 3, "follow": True},
        {"run": "r1", "rank": 3, "follow": True, "offsets": None},
    ),
    (
        "logs",
        {"run": "r1", "rank": None, "offsets": {"attempt1/a.out": 12, "b": 0}},
        {"run": "r1", "rank": None, "follow": False, "offsets": {"attempt1/a.out": 12, "b": 0}},
    ),
    (
        "logs",
        {"run": "r1", "offsets": {}},
        {"run": "r1", "rank": None, "follow": False, "offsets": {}},
    ),
    ("cancel", {"run": "r1"}, {"run": "r1"}),
    ("wait", {"run": "r1"}, {"run": "r1"}),
    ("archive", {"run": "r1"}, {"run": "r1"}),
    ("results", {"run": "r1"}, {"run": "r1"}),
    ("submit_script", {"spec_json": "{}"}, {"spec_json": "{}", "cluster": None}),
    ("adopt", {"spec_json": "{}", "cluster": "dev"}, {"spec_json": "{}", "cluster": "dev"}),
    ("nodes", {}, {"release": None, "cluster": None}),
    ("nodes", {"release": "node4"}, {"release": "node4", "cluster": None}),
    (
        "campaign_submit",
        {"file_text": "base = 'b.toml'", "base_text": "", "name": "sweep"},
        {
            "file_text": "base = 'b.toml'",
            "base_text": "",
            "file_path": None,
            "file_dir": None,
            "export_env_json": None,
            "name": "sweep",
            "dry_run": False,
            "rerun": False,
            "max_points": None,
            "cluster": None,
        },
    ),
    ("campaign_list", {}, {}),
    ("campaign_status", {"campaign": "c1"}, {"campaign": "c1"}),
    ("campaign_cancel", {"campaign": "c1"}, {"campaign": "c1"}),
    ("campaign_wait", {"campaign": "c1"}, {"campaign": "c1"}),
    ("campaign_results", {"campaign": "c1"}, {"campaign": "c1"}),
    ("events_list", {}, {"run": None, "status": None}),
    ("events_list", {"run": "r1", "status": "dead"}, {"run": "r1", "status": "dead"}),
    ("events_show", {"event": "evt_x"}, {"event": "evt_x"}),
    ("events_replay", {"event": "evt_x"}, {"event": "evt_x", "destination": None}),
    ("events_test", {"destination": "ci"}, {"destination": "ci"}),
]


@pytest.mark.parametrize(("op", "args", "filled"), GOOD)
def test_decode_good_requests_fill_defaults(
    op: str, args: dict[str, object], filled: dict[str, object]
) -> None:
    request = decode_request(json.dumps({"v": 1, "id": 7, "op": op, "args": args}).encode())
    assert request == Request(id=7, op=op, args=request.args)
    assert dict(request.args) == filled


def test_every_op_is_covered_by_the_good_table() -> None:
    assert {op for op, _, _ in GOOD} == set(OPS)
    streaming = {op for op, spec in OPS.items() if spec.streaming}
    # campaign_submit sends no item: streaming, a client that goes away cancels it
    assert streaming == {"logs", "wait", "campaign_submit", "campaign_wait", "campaign_results"}


def _bad_arg_cases() -> Iterator[tuple[str, dict[str, object], str]]:
    """Per op: each argument with each wrong kind, each required one missing, an unknown key."""
    samples: dict[str, object] = {"str": "s", "bool": True, "int": 1, "null": None}
    samples["counts"] = {"f": 1}
    extra: list[tuple[str, object]] = [("float", 1.5), ("array", []), ("object", {"a": "b"})]
    for op, spec in OPS.items():
        base = {name: samples[sorted(arg.kinds)[0]] for name, arg in spec.args.items()}
        for name, arg in spec.args.items():
            for kind, value in [*samples.items(), *extra]:
                if kind in arg.kinds:
                    continue
                yield op, {**base, name: value}, f"args.{name}"
            if arg.required:
                yield op, {k: v for k, v in base.items() if k != name}, f"args.{name}"
        yield op, {**base, "bogus": 1}, "args.bogus"


BAD_ARGS = list(_bad_arg_cases())


@pytest.mark.parametrize(("op", "args", "field"), BAD_ARGS)
def test_decode_rejects_bad_args_naming_the_field(
    op: str, args: dict[str, object], field: str
) -> None:
    with pytest.raises(ControlError) as info:
        decode_request(json.dumps({"v": 1, "id": "a", "op": op, "args": args}).encode())
    assert info.value.code == "bad_request"
    assert repr(field)[1:-1] in info.value.message
    assert getattr(info.value, "request_id", None) == "a"


def _logs(offsets: object) -> bytes:
    args = {"run": "r", "offsets": offsets}
    return json.dumps({"v": 1, "id": 4, "op": "logs", "args": args}).encode()


@pytest.mark.parametrize(
    ("offsets", "needle"),
    [
        ({"a": -1}, 'maps "a" to -1, outside 0..'),
        ({"a": 2**63}, "outside 0.."),
        ({"a": True}, 'maps "a" to true, which is not an integer'),
        ({"a": 1.0}, "not an integer"),
        ({"a": "1"}, "not an integer"),
        ({"a": None}, "not an integer"),
        ({"a": {"b": 1}}, "not an integer"),
        ({"a": [1]}, "not an integer"),
        ({"x" * (COUNTS_MAX_KEY + 1): 1}, f"over the limit of {COUNTS_MAX_KEY}"),
        ({f"f{i}": i for i in range(COUNTS_MAX_ENTRIES + 1)}, f"limit of {COUNTS_MAX_ENTRIES}"),
        ([["a", 1]], "must be an object of strings to non-negative integers or null"),
        ("a=1", "must be an object of strings to non-negative integers or null"),
        (0, "must be an object"),
    ],
)
def test_offsets_are_a_bounded_object_of_non_negative_ints(offsets: object, needle: str) -> None:
    with pytest.raises(ControlError) as info:
        decode_request(_logs(offsets))
    assert info.value.code == "bad_request"
    assert "'args.offsets' of op 'logs'" in info.value.message
    assert needle in info.value.message
    assert info.value.message.endswith(".")
    assert len(info.value.message) < 400


def test_offsets_at_their_bounds_are_accepted() -> None:
    most = {f"f{i}": i for i in range(COUNTS_MAX_ENTRIES - 1)}
    most["k" * COUNTS_MAX_KEY] = 2**63 - 1
    request = decode_request(_logs(most))
    assert request.args["offsets"] == most
    assert decode_request(_logs(None)).args["offsets"] is None
    assert decode_request(_logs({})).args["offsets"] == {}


def test_bools_are_not_ints_and_ints_are_not_bools() -> None:
    for args in ({"run": "r", "rank": True}, {"run": "r", "follow": 1}, {"run": "r", "rank": 1.0}):
        with pytest.raises(ControlError, match="args"):
            decode_request(json.dumps({"v": 1, "id": 1, "op": "logs", "args": args}).encode())
    with pytest.raises(ControlError, match="'v' must be an integer"):
        decode_request(b'{"v": true, "id": 1, "op": "ping"}')


TOP_LEVEL: list[tuple[bytes, str, object, str]] = [
    (b"{", "bad_json", None, "not valid JSON"),
    (b"", "bad_json", None, "empty"),
    (b"   \r", "bad_json", None, "empty"),
    (b"\xff\xfe{}", "bad_json", None, "UTF-8"),
    (b'{"v": 1, "id": 1, "op": "ping", "args": {"x": NaN}}', "bad_json", None, "NaN"),
    (b'{"v": 1, "id": 1, "op": "ping", "op": "list"}', "bad_json", None, "duplicate key"),
    (b"[" * 100_000, "bad_json", None, "nested"),
    (b'{"v": 1, "id": ' + b"9" * 5000 + b', "op": "ping"}', "bad_json", None, "JSON"),
    (b"[]", "bad_request", None, "JSON object"),
    (b"42", "bad_request", None, "JSON object"),
    (b'"ping"', "bad_request", None, "JSON object"),
    (b'{"v": 1, "op": "ping"}', "bad_request", None, "'id'"),
    (b'{"v": 1, "id": true, "op": "ping"}', "bad_request", None, "'id'"),
    (b'{"v": 1, "id": 1.5, "op": "ping"}', "bad_request", None, "'id'"),
    (b'{"v": 1, "id": null, "op": "ping"}', "bad_request", None, "'id'"),
    (b'{"id": 3, "op": "ping"}', "bad_request", 3, "'v'"),
    (b'{"v": "1", "id": 3, "op": "ping"}', "bad_request", 3, "'v'"),
    (b'{"v": 2, "id": 3, "op": "ping"}', "unsupported_version", 3, "version 2"),
    (b'{"v": 0, "id": "x", "op": "ping"}', "unsupported_version", "x", "version 0"),
    (b'{"v": 1, "id": 3, "op": "ping", "extra": 1}', "bad_request", 3, '"extra"'),
    (b'{"v": 1, "id": 3}', "bad_request", 3, "'op'"),
    (b'{"v": 1, "id": 3, "op": 5}', "bad_request", 3, "'op'"),
    (b'{"v": 1, "id": 3, "op": "frobnicate"}', "unknown_op", 3, '"frobnicate"'),
    (b'{"v": 1, "id": 3, "op": "ping", "args": []}', "bad_request", 3, "'args'"),
    (b'{"v": 1, "id": 3, "op": "ping", "args": {"a": 1}}', "bad_request", 3, "args.a"),
]


@pytest.mark.parametrize(("line", "code", "request_id", "needle"), TOP_LEVEL)
def test_decode_rejects_bad_envelopes(
    line: bytes, code: str, request_id: object, needle: str
) -> None:
    with pytest.raises(ControlError) as info:
        decode_request(line)
    assert (info.value.code, getattr(info.value, "request_id", None)) == (code, request_id)
    assert needle in info.value.message
    assert info.value.message.endswith(".")
    assert len(info.value.message) < 400


def test_args_may_be_omitted_and_ids_may_be_strings() -> None:
    assert decode_request(b'{"v":1,"id":"abc","op":"ping"}') == Request("abc", "ping", {})


# ------------------------------------------------------------------------ over sockets


@pytest.mark.asyncio
async def test_every_op_round_trips_over_the_socket(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock) as handler, ControlClient(sock) as client:
            pong = await client.call("ping")
            assert pong == {
                "pong": True,
                "uid": os.getuid(),
                "gid": os.getgid(),
                "pid": os.getpid(),
            }
            for op, args, filled in GOOD[1:]:
                result = await client.call(op, args)
                assert result == {"op": op, "args": filled}
            assert [r.op for r, _ in handler.requests] == [op for op, _, _ in GOOD]


@pytest.mark.asyncio
async def test_bad_args_over_the_socket_are_refused_before_the_handler(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock) as handler, ControlClient(sock) as client:
            for op, args, field in BAD_ARGS:
                with pytest.raises(ControlError) as info:
                    await client.call(op, args)
                assert info.value.code == "bad_request"
                assert field in info.value.message
            assert handler.requests == []
            assert (await client.call("ping"))["pong"] is True


@pytest.mark.asyncio
async def test_malformed_lines_get_errors_and_the_connection_stays_usable(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock), raw(sock) as conn:
            for line, code, request_id, needle in TOP_LEVEL:
                await conn.send(line)
                reply = await conn.reply()
                assert reply["id"] == request_id
                got_code, message = error_of(reply)
                assert got_code == code
                assert needle in message
            reply = await conn.request({"v": 1, "id": 99, "op": "ping"})
            assert reply["ok"] is True
            assert reply["id"] == 99


@pytest.mark.asyncio
async def test_pipelined_requests_are_answered_in_order(sock: Path) -> None:
    lines = [
        json.dumps({"v": 1, "id": i, "op": "status", "args": {"run": f"r{i}"}}).encode()
        for i in range(5)
    ]
    with anyio.fail_after(TIMEOUT):
        async with serving(sock), raw(sock) as conn:
            await conn.stream.send(b"\n".join([*lines[:2], b"{bad", *lines[2:]]) + b"\n")
            replies = [await conn.reply() for _ in range(6)]
    assert [r["id"] for r in replies] == [0, 1, None, 2, 3, 4]
    assert [r["ok"] for r in replies] == [True, True, False, True, True, True]


@pytest.mark.asyncio
async def test_over_long_line_gets_too_large_and_the_connection_closes(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock, max_message=256):
            # Exactly at the bound: accepted.
            envelope = {"v": 1, "id": 1, "op": "status", "args": {"run": "quiet"}}
            pad = 256 - len(json.dumps(envelope).encode())
            async with raw(sock) as conn:
                envelope["args"] = {"run": "quiet" + "x" * pad}
                line = json.dumps(envelope).encode()
                assert len(line) == 256
                assert (await conn.request(envelope))["ok"] is True
                # One byte over, arriving whole with its newline in one write.
                await conn.send(line[:-2] + b'x"}')
                code, message = error_of(await conn.reply())
                assert code == "too_large"
                assert "256-byte" in message
                with pytest.raises((anyio.IncompleteRead, anyio.BrokenResourceError)):
                    await conn.reply()
            # Far over, streamed without a newline: refused before the line ends.
            async with raw(sock) as conn:
                await conn.stream.send(b"{" + b" " * 10_000)
                reply = await conn.reply()
                assert reply["id"] is None
                assert error_of(reply)[0] == "too_large"
            # The server is fine.
            async with ControlClient(sock) as client:
                assert (await client.call("ping"))["pong"] is True


@pytest.mark.asyncio
async def test_client_refuses_to_send_an_over_long_request(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock, max_message=256), ControlClient(sock, max_message=256) as c:
            with pytest.raises(ControlError) as info:
                await c.call("status", {"run": "x" * 300})
            assert info.value.code == "too_large"
            assert (await c.call("ping"))["pong"] is True


@pytest.mark.asyncio
async def test_server_replies_over_the_bound_become_internal_errors(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock, max_message=256), ControlClient(sock) as client:
            with pytest.raises(ControlError) as info:
                await client.call("status", {"run": "x" * 200})
            assert info.value.code == "internal"
            assert "256-byte" in str(info.value)
            with pytest.raises(ControlError, match="256-byte") as info:
                await client.call("wait", {"run": "huge-item"})
            assert info.value.code == "internal"
            assert (await client.call("ping"))["pong"] is True


@pytest.mark.asyncio
async def test_unknown_op_is_an_error_reply(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock), ControlClient(sock) as client:
            with pytest.raises(ControlError) as info:
                await client.call("frobnicate")
            assert info.value.code == "unknown_op"
            assert 'Unknown op "frobnicate"' in str(info.value)
            assert (
                "adopt, archive, campaign_cancel, campaign_list, campaign_results, "
                "campaign_status, campaign_submit, campaign_wait, cancel, events_list, "
                "events_replay, events_show, events_test, list, logs, nodes, ping, results, "
                "status, submit, submit_script, wait" in str(info.value)
            )


@pytest.mark.asyncio
async def test_handler_errors_become_replies_and_the_server_lives(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock), ControlClient(sock) as client:
            with structlog.testing.capture_logs() as logs, pytest.raises(ControlError) as info:
                await client.call("status", {"run": "boom"})
            assert info.value.code == "internal"
            assert "RuntimeError: kaboom" in info.value.message
            assert "see the daemon log" in info.value.message
            failed = [e for e in logs if e["event"] == "control.handler_failed"]
            assert len(failed) == 1
            assert failed[0]["op"] == "status"
            assert failed[0]["log_level"] == "error"

            with pytest.raises(ControlError) as info:
                await client.call("status", {"run": "missing"})
            assert (info.value.code, str(info.value)) == (
                "not_found",
                "Run 'missing' does not exist.",
            )

            for run, needle in [
                ("unjson", "cannot be sent as JSON"),
                ("send-anyway", "does not stream"),
            ]:
                with pytest.raises(ControlError, match=needle) as info:
                    await client.call("status", {"run": run})
                assert info.value.code == "internal"
            with pytest.raises(ControlError, match="'final'"):
                await client.call("wait", {"run": "final-key"})
            assert (await client.call("ping"))["pong"] is True


@pytest.mark.asyncio
async def test_streaming_yields_items_then_the_final_result(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock), ControlClient(sock) as client:
            async with aclosing(client.stream("wait", {"run": "3"})) as items:
                got = [item async for item in items]
            assert got == [
                {"i": 0, "state": "running"},
                {"i": 1, "state": "running"},
                {"i": 2, "state": "running"},
                {"final": {"state": "succeeded"}},
            ]
            assert await client.call("wait", {"run": "2"}) == {"state": "succeeded"}
            with pytest.raises(ControlError) as info:
                async with aclosing(client.stream("wait", {"run": "missing"})) as items:
                    async for _ in items:
                        pass
            assert info.value.code == "not_found"
            assert (await client.call("ping"))["pong"] is True


@pytest.mark.asyncio
async def test_stream_items_carry_the_request_id_on_the_wire(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock), raw(sock) as conn:
            await conn.send(b'{"v":1,"id":"w","op":"wait","args":{"run":"2"}}')
            replies = [await conn.reply() for _ in range(3)]
    assert replies == [
        {"v": 1, "id": "w", "stream": {"i": 0, "state": "running"}},
        {"v": 1, "id": "w", "stream": {"i": 1, "state": "running"}},
        {"v": 1, "id": "w", "ok": True, "result": {"state": "succeeded"}},
    ]


@pytest.mark.asyncio
async def test_client_disconnect_mid_stream_cancels_the_handler(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock) as handler:
            async with raw(sock) as conn:
                await conn.send(b'{"v":1,"id":1,"op":"wait","args":{"run":"forever"}}')
                await handler.started.wait()
            await handler.cancelled.wait()
            async with ControlClient(sock) as client:
                assert (await client.call("ping"))["pong"] is True


@pytest.mark.asyncio
async def test_a_non_streaming_request_completes_after_the_client_leaves(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock) as handler:
            async with raw(sock) as conn:
                await conn.send(b'{"v":1,"id":1,"op":"cancel","args":{"run":"gated"}}')
                await handler.started.wait()
            handler.gate.set()
            await handler.finished.wait()
            assert not handler.cancelled.is_set()
            async with ControlClient(sock) as client:
                assert (await client.call("ping"))["pong"] is True


@pytest.mark.asyncio
async def test_abandoned_stream_leaves_the_client_busy_and_closing_cancels(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock) as handler:
            async with ControlClient(sock) as client:
                async with aclosing(client.stream("wait", {"run": "forever"})) as items:
                    waiter = items.__anext__()
                    with anyio.move_on_after(0.05):
                        await waiter
                with pytest.raises(ControlProtocolError, match="not finished"):
                    await client.call("ping")
            await handler.cancelled.wait()


@pytest.mark.asyncio
async def test_requests_pipelined_during_a_stream_are_served_after_it(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock), raw(sock) as conn:
            await conn.send(b'{"v":1,"id":1,"op":"wait","args":{"run":"1"}}')
            await conn.send(b'{"v":1,"id":2,"op":"ping"}')
            replies = [await conn.reply() for _ in range(3)]
    assert [(r["id"], "stream" in r) for r in replies] == [(1, True), (1, False), (2, False)]


@pytest.mark.asyncio
async def test_twenty_concurrent_clients(sock: Path) -> None:
    results: dict[int, list[object]] = {}

    async def client_task(n: int) -> None:
        async with ControlClient(sock) as client:
            got: list[object] = []
            for i in range(5):
                got.append((await client.call("status", {"run": f"c{n}-{i}"}))["args"])
            async with aclosing(client.stream("wait", {"run": str(n % 4)})) as items:
                got.append([item async for item in items])
            with pytest.raises(ControlError):
                await client.call("status", {"run": "boom"})
            got.append(await client.call("ping"))
            results[n] = got

    with anyio.fail_after(TIMEOUT), structlog.testing.capture_logs():
        async with serving(sock) as handler, anyio.create_task_group() as tg:
            for n in range(20):
                tg.start_soon(client_task, n)
    assert sorted(results) == list(range(20))
    for n, got in results.items():
        assert got[:5] == [{"run": f"c{n}-{i}"} for i in range(5)]
        stream = got[5]
        assert isinstance(stream, list)
        assert len(stream) == n % 4 + 1
        assert stream[-1] == {"final": {"state": "succeeded"}}
    assert len(handler.requests) == 20 * 8


@pytest.mark.asyncio
async def test_shutdown_cancels_handlers_and_removes_the_socket(sock: Path) -> None:
    handler = DummyHandler()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(ControlServer(sock, handler).serve)
            assert stat.S_ISSOCK((await anyio.Path(sock).lstat()).st_mode)

            async def waiter() -> None:
                async with ControlClient(sock) as client:
                    with pytest.raises(ControlProtocolError, match="closed the connection"):
                        await client.call("wait", {"run": "forever"})

            tg.start_soon(waiter)
            await handler.started.wait()
            tg.cancel_scope.cancel()
        assert handler.cancelled.is_set()
        assert not await anyio.Path(sock).exists()


# ------------------------------------------------------------------- socket file & mode


@pytest.mark.asyncio
async def test_socket_mode_and_group(sock: Path) -> None:
    nogroup = grp.getgrgid(65534).gr_name
    with anyio.fail_after(TIMEOUT):
        async with serving(sock):  # no group given: only the daemon's own user
            st = await anyio.Path(sock).lstat()
            assert stat.S_ISSOCK(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == 0o600
        assert not await anyio.Path(sock).exists()
        async with serving(sock, mode=0o600, group=nogroup):
            st = await anyio.Path(sock).lstat()
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o600, 65534)
        async with serving(sock, group=65534):
            assert (await anyio.Path(sock).lstat()).st_gid == 65534
        with pytest.raises(ControlSocketError, match="group 'no-such-group-x' does not exist"):
            await ControlServer(sock, DummyHandler(), group="no-such-group-x").serve()
    assert not await anyio.Path(sock).exists()


def _stale_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


@pytest.mark.asyncio
async def test_stale_socket_is_replaced_but_a_live_one_is_refused(sock: Path) -> None:
    _stale_socket(sock)
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(DaemonUnreachable, match="nothing listens on the socket") as info:
            async with ControlClient(sock):
                pass
        assert str(sock) in str(info.value)
        assert "not running" in str(info.value)
        with structlog.testing.capture_logs() as logs:
            async with serving(sock):
                inode = (await anyio.Path(sock).lstat()).st_ino
                with pytest.raises(ControlSocketError, match="already listening") as err:
                    await ControlServer(sock, DummyHandler()).serve()
                assert str(sock) in str(err.value)
                # The refused second server left the live socket alone.
                assert (await anyio.Path(sock).lstat()).st_ino == inode
                async with ControlClient(sock) as client:
                    assert (await client.call("ping"))["pong"] is True
        assert "control.stale_socket_removed" in [e["event"] for e in logs]


@pytest.mark.asyncio
async def test_a_non_socket_at_the_path_is_never_removed(sock: Path) -> None:
    await anyio.Path(sock).write_text("precious")
    with anyio.fail_after(TIMEOUT), pytest.raises(ControlSocketError, match="not a socket"):
        await ControlServer(sock, DummyHandler()).serve()
    assert await anyio.Path(sock).read_text() == "precious"


@pytest.mark.asyncio
async def test_a_replaced_socket_file_is_not_removed_on_exit(sock: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with serving(sock):
            await anyio.Path(sock).unlink()
            await anyio.Path(sock).write_text("someone else's")
        assert await anyio.Path(sock).read_text() == "someone else's"


@pytest.mark.asyncio
async def test_missing_socket_and_permission_errors_name_the_path(
    sock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(DaemonUnreachable) as info:
            async with ControlClient(sock):
                pass
        assert isinstance(info.value, SupervisorError)
        assert str(sock) in str(info.value)
        assert "daemon is not running" in str(info.value)

        async def denied(path: object) -> anyio.abc.SocketStream:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(anyio, "connect_unix", denied)
        with pytest.raises(DaemonUnreachable, match="permission denied") as info:
            async with ControlClient(sock):
                pass
        assert str(sock) in str(info.value)


# ------------------------------------------------------------------- peers and access


CHILD = r"""
import json, os, socket, sys
path = sys.argv[1]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.connect(path)
    s.sendall(b'{"v": 1, "id": "child", "op": "ping"}\n')
    reply = s.makefile("rb").readline()
sys.stdout.write(json.dumps({"pid": os.getpid(), "reply": json.loads(reply)}))
"""


@pytest.mark.asyncio
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to uid 65534 needs root")
async def test_peer_credentials_of_another_uid(tmp_path: Path) -> None:
    # pytest's tmp_path is private to root; the child needs to reach the socket.
    with tempfile.TemporaryDirectory(prefix="llmd-ctl-", dir="/tmp") as d:
        await anyio.Path(d).chmod(0o711)
        path = Path(d) / "ctl.sock"
        with anyio.fail_after(TIMEOUT):
            async with serving(path, mode=0o666) as handler:
                # The interpreter lives under root's 0700 home, so the child starts as root
                # and drops to 65534 itself before it connects.
                done = await anyio.run_process([sys.executable, "-c", CHILD, str(path)])
        out = json.loads(done.stdout)
        assert out["reply"]["ok"] is True
        assert out["reply"]["result"] == {
            "pong": True,
            "uid": 65534,
            "gid": 65534,
            "pid": out["pid"],
        }
        ((_, peer),) = handler.requests
        assert peer == Peer(uid=65534, gid=65534, pid=out["pid"])
        assert not may_access(peer, owner_uid=0, admin_group=None)
        assert not may_access(peer, owner_uid=0, admin_group="root")
        assert may_access(peer, owner_uid=65534, admin_group=None)
        assert may_access(Peer(0, 0, 1), owner_uid=65534, admin_group=None)


@pytest.fixture
def fake_users(monkeypatch: pytest.MonkeyPatch) -> None:
    """alice(1000, group 1000), bob(1001, primary 2000 'admins'), carol(1002, in 'admins')."""
    users = {
        1000: SimpleNamespace(pw_name="alice", pw_gid=1000),
        1001: SimpleNamespace(pw_name="bob", pw_gid=2000),
        1002: SimpleNamespace(pw_name="carol", pw_gid=1002),
        1003: SimpleNamespace(pw_name="dave", pw_gid=1003),
    }
    groups = {
        2000: SimpleNamespace(gr_name="admins", gr_gid=2000, gr_mem=["carol"]),
        3000: SimpleNamespace(gr_name="ldap-ops", gr_gid=3000, gr_mem=[]),
    }

    def getpwuid(uid: int) -> SimpleNamespace:
        return users[uid]

    def getgrgid(gid: int) -> SimpleNamespace:
        return groups[gid]

    def getgrnam(name: str) -> SimpleNamespace:
        for g in groups.values():
            if g.gr_name == name:
                return g
        raise KeyError(name)

    def getgrouplist(user: str, gid: int) -> list[int]:
        return [gid, 3000] if user == "dave" else [gid]

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    monkeypatch.setattr(grp, "getgrgid", getgrgid)
    monkeypatch.setattr(grp, "getgrnam", getgrnam)
    monkeypatch.setattr(os, "getgrouplist", getgrouplist)


@pytest.mark.usefixtures("fake_users")
@pytest.mark.parametrize(
    ("peer", "owner", "group", "allowed"),
    [
        (Peer(0, 0, 1), 1000, None, True),  # root
        (Peer(1000, 1000, 1), 1000, None, True),  # owner
        (Peer(1000, 1000, 1), 1001, None, False),  # someone else's run, no admin group
        (Peer(1000, 1000, 1), 1001, "admins", False),  # not a member
        (Peer(1000, 2000, 1), 1001, "admins", True),  # effective gid is the admin group
        (Peer(1001, 1001, 1), 1000, "admins", True),  # primary group in passwd
        (Peer(1002, 1002, 1), 1000, "admins", True),  # supplementary member by name
        (Peer(1002, 1002, 1), 1000, 2000, True),  # admin group given as a gid
        (Peer(1003, 1003, 1), 1000, "ldap-ops", True),  # member only through NSS grouplist
        (Peer(1003, 1003, 1), 1000, "admins", False),
        (Peer(1002, 1002, 1), 1000, "no-such-group", False),  # unknown group admits nobody
        (Peer(4242, 4242, 1), 1000, "admins", False),  # uid without a passwd entry
        (Peer(4242, 4242, 1), 4242, "admins", True),  # ...still owns its runs
    ],
)
def test_may_access(peer: Peer, owner: int, group: str | int | None, allowed: bool) -> None:
    assert may_access(peer, owner, group) is allowed
