"""Control socket fuzzing: thousands of hostile lines, zero crashes, an error for every bad one.

The server runs on its own event loop in a thread (anyio blocking portal) for the whole
module; the examples are sent over one real Unix socket connection with the stdlib, and a
new connection is opened whenever the server closes one (only after ``too_large``).
Whether a message is valid is decided by `oracle`, written independently of
`decode_request` from the protocol description.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio.from_thread
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmd_supervisor.adapters.control.protocol import Peer, Request, Send
from llmd_supervisor.adapters.control.server import ControlServer

MAX_MESSAGE = 2048
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

pytestmark = pytest.mark.timeout(120)


class EchoHandler:
    """Echoes the op and arguments; streaming ops send one item first."""

    def __init__(self) -> None:
        self.handled = 0

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        self.handled += 1
        if request.op in ("logs", "wait"):
            await send({"n": 1})
        return {"op": request.op, "args": dict(request.args)}


class Wire:
    """A blocking client connection that reconnects when the server closed the last one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.reader: Any = None
        self.reconnects = 0
        self.sent = 0

    def _connect(self) -> None:
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(self.path))
        self.sock, self.reader = sock, sock.makefile("rb")
        self.reconnects += 1

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.sock is not None:
            self.sock.close()
        self.sock = self.reader = None

    def send(self, line: bytes) -> None:
        if self.sock is None:
            self._connect()
        assert self.sock is not None
        self.sock.sendall(line + b"\n")
        self.sent += 1

    def reply(self) -> dict[str, Any]:
        line = self.reader.readline()
        assert line.endswith(b"\n"), f"server closed or sent a partial line: {line[:80]!r}"
        assert len(line) - 1 <= MAX_MESSAGE
        reply = json.loads(line)
        assert isinstance(reply, dict)
        assert reply["v"] == 1
        assert set(reply) in (
            {"v", "id", "ok", "result"},
            {"v", "id", "ok", "error"},
            {"v", "id", "stream"},
        )
        return reply

    def expect_closed(self) -> None:
        try:
            rest = self.reader.readline()
        except ConnectionResetError:
            rest = b""
        assert rest == b""
        self.close()


class Server:
    def __init__(self, path: Path, handler: EchoHandler, wire: Wire) -> None:
        self.path, self.handler, self.wire = path, handler, wire


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("fuzz") / "ctl.sock"
    handler = EchoHandler()
    wire = Wire(path)
    # Rejections and bound violations are logged per message; keep the fuzz run quiet.
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))
    try:
        with anyio.from_thread.start_blocking_portal() as portal:
            control = ControlServer(path, handler, max_message=MAX_MESSAGE)
            future, _ = portal.start_task(control.serve)
            try:
                yield Server(path, handler, wire)
                assert not future.done(), "the control server stopped during fuzzing"
                # Still serving a fresh client after everything.
                wire.close()
                wire.send(b'{"v":1,"id":"last","op":"ping"}')
                assert wire.reply() == {
                    "v": 1,
                    "id": "last",
                    "ok": True,
                    "result": {"op": "ping", "args": {}},
                }
            finally:
                wire.close()
                # Cancel only once the server has seen the close (see test_control.serving).
                deadline = time.monotonic() + 2
                while control.connections and time.monotonic() < deadline:
                    time.sleep(0.001)
                future.cancel()
    finally:
        structlog.configure(**saved)
    assert not path.exists()


# ----------------------------------------------------------------------------- oracle

ARG_KINDS: dict[str, dict[str, tuple[set[str], bool]]] = {
    "ping": {},
    "submit": {
        "spec_toml": ({"str"}, True),
        "spec_path": ({"str"}, False),
        "dry_run": ({"bool"}, False),
    },
    "list": {
        "all": ({"bool"}, False),
        "limit": ({"int", "null"}, False),
        "after": ({"str", "null"}, False),
    },
    "status": {"run": ({"str"}, True)},
    "logs": {
        "run": ({"str"}, True),
        "rank": ({"int", "null"}, False),
        "follow": ({"bool"}, False),
        "offsets": ({"counts", "null"}, False),
    },
    "cancel": {"run": ({"str"}, True)},
    "wait": {"run": ({"str"}, True)},
    "archive": {"run": ({"str"}, True)},
}


def kind(value: object) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "bool"
    if isinstance(value, dict) and is_counts(value):
        return "counts"
    return {int: "int", float: "float", str: "str", list: "array", dict: "object"}[type(value)]


def is_counts(value: dict[str, object]) -> bool:
    """An object of at most 256 strings (512 characters at most) to integers 0..2**63-1."""
    return len(value) <= 256 and all(
        len(k) <= 512 and type(v) is int and 0 <= v < 2**63 for k, v in value.items()
    )


def oracle(obj: object) -> tuple[bool, object]:
    """(valid, id the reply must carry) for a decoded JSON value sent as a request."""
    if not isinstance(obj, dict):
        return False, None
    rid = obj.get("id")
    rid = rid if "id" in obj and kind(rid) in ("int", "str") else None
    # Echoed ids are bounded: strings up to 128 characters, integers in 64 bits.
    if isinstance(rid, str) and len(rid) > 128:
        rid = None
    if isinstance(rid, int) and not -(2**63) < rid < 2**63:
        rid = None
    if rid is None:
        return False, None
    if set(obj) - {"v", "id", "op", "args"} or kind(obj.get("v")) != "int" or obj["v"] != 1:
        return False, rid
    op, args = obj.get("op"), obj.get("args", {})
    if not isinstance(op, str) or op not in ARG_KINDS or not isinstance(args, dict):
        return False, rid
    spec = ARG_KINDS[op]
    if set(args) - set(spec):
        return False, rid
    for name, (kinds, required) in spec.items():
        if name in args and kind(args[name]) not in kinds:
            return False, rid
        if required and name not in args:
            return False, rid
    return True, rid


def not_json(name: str) -> object:
    """NaN and Infinity are Python's extension, not JSON (RFC 8259)."""
    raise ValueError(name)


def check_one(server: Server, line: bytes) -> None:
    """Send one line; a valid request must succeed, anything else must get an error."""
    wire = server.wire
    wire.send(line)
    reply = wire.reply()
    if len(line) > MAX_MESSAGE:
        assert reply["ok"] is False
        assert reply["error"]["code"] == "too_large"
        wire.expect_closed()
        return
    try:
        decoded = json.loads(line, parse_constant=not_json)
    except (ValueError, RecursionError):
        valid, rid = False, None
    else:
        valid, rid = oracle(decoded)
    if "stream" in reply:
        assert valid, reply
        assert reply["id"] == rid
        reply = wire.reply()
    assert reply["id"] == rid, (line[:200], reply)
    if valid:
        assert reply["ok"] is True, (line[:200], reply)
    else:
        assert reply["ok"] is False, (line[:200], reply)
        assert reply["error"]["code"] in {
            "bad_json",
            "bad_request",
            "unsupported_version",
            "unknown_op",
        }
        message = reply["error"]["message"]
        assert isinstance(message, str)
        assert message.endswith(".")


# ------------------------------------------------------------------------- strategies

json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
near_kinds: st.SearchStrategy[object] = st.sampled_from(
    ["s", "", True, False, 0, 3, -1, 1.5, None, [], {}, "1", 2**70, {"a": 1}, {"a": -1}]
)
arg_names = st.sampled_from(
    [
        "run",
        "rank",
        "follow",
        "offsets",
        "all",
        "spec_toml",
        "spec_path",
        "dry_run",
        "bogus",
        "Run",
        "",
    ]
)
ops = st.sampled_from([*ARG_KINDS, "frobnicate", "", "PING", "ping "]) | st.text(max_size=8)


def chance(draw: st.DrawFn, percent: int) -> bool:
    """True about `percent` % of the time (sampled_from, so hypothesis draws it evenly)."""
    return draw(st.sampled_from([True] * percent + [False] * (100 - percent)))


@st.composite
def near_requests(draw: st.DrawFn) -> dict[str, object]:
    """Requests that are valid about a third of the time, otherwise wrong in a field or two."""
    obj: dict[str, object] = {}
    if chance(draw, 97):
        obj["v"] = 1 if chance(draw, 90) else draw(st.sampled_from([2, 0, True, "1", 1.0, None]))
    if chance(draw, 97):
        obj["id"] = draw(st.integers(-(2**63), 2**63) | st.text(max_size=8) | near_kinds)
    if chance(draw, 97):
        obj["op"] = draw(st.sampled_from(list(ARG_KINDS))) if chance(draw, 85) else draw(ops)
    op = obj.get("op")
    if chance(draw, 90):
        spec = ARG_KINDS.get(op, {}) if isinstance(op, str) else {}
        args: dict[str, object] = {}
        for name, (kinds, required) in spec.items():
            if required or draw(st.booleans()):
                good = {"str": "r1", "bool": True, "int": 2, "null": None, "counts": {"f": 3}}[
                    sorted(kinds)[0]
                ]
                args[name] = good if chance(draw, 85) else draw(near_kinds)
        if chance(draw, 10):
            args[draw(arg_names)] = draw(near_kinds)
        obj["args"] = args if chance(draw, 95) else draw(json_values)
    if chance(draw, 3):
        obj[draw(st.text(max_size=5))] = draw(json_scalars)
    return obj


# ------------------------------------------------------------------------------ tests


@settings(FUZZ, max_examples=600)
@given(st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")))
def test_random_bytes_lines(server: Server, line: bytes) -> None:
    check_one(server, line)


@settings(FUZZ, max_examples=300)
@given(st.text(max_size=200).map(lambda t: t.replace("\n", "").encode("utf-8", "surrogatepass")))
def test_random_text_lines(server: Server, line: bytes) -> None:
    check_one(server, line)


@settings(FUZZ, max_examples=400)
@given(json_values)
def test_random_json_values(server: Server, value: object) -> None:
    check_one(server, json.dumps(value).encode())


@settings(FUZZ, max_examples=800)
@given(near_requests())
def test_near_valid_requests(server: Server, obj: dict[str, object]) -> None:
    check_one(server, json.dumps(obj).encode())


@settings(FUZZ, max_examples=60)
@given(st.integers(MAX_MESSAGE + 1, 4 * MAX_MESSAGE), st.binary(max_size=50))
def test_over_long_lines_are_refused_and_closed(server: Server, size: int, head: bytes) -> None:
    line = (head.replace(b"\n", b"") + b"x" * size)[:size]
    check_one(server, line)


def test_the_fuzz_sent_thousands_of_messages(server: Server) -> None:
    # Runs last in this module: the valid requests reached the handler, the server lives.
    assert server.wire.sent >= 2000
    assert server.handler.handled > 100
    assert server.wire.reconnects > 30
