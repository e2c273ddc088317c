"""Control protocol: the wire format, the table of ops, request decoding and reply encoding.

Wire protocol (version 1)
-------------------------
Newline-delimited JSON over a Unix stream socket, UTF-8, one JSON object per line.

Request::

    {"v": 1, "id": <int or str>, "op": "<op>", "args": {...}}

``args`` may be omitted when empty. Replies carry ``v`` and the request's ``id``:

* final success: ``{"v": 1, "id": ..., "ok": true, "result": {...}}``
* stream item (streaming ops only, zero or more before the final reply):
  ``{"v": 1, "id": ..., "stream": {...}}``
* error: ``{"v": 1, "id": ... or null, "ok": false, "error": {"code": ..., "message": ...}}``;
  ``id`` is null when the request's id could not be read. Codes are in `ERROR_CODES`.

Every request line gets exactly one final reply (success or error). Requests on one
connection are handled one after another, in order; a client may pipeline them, and a
streaming request occupies the connection until its final reply.

Message bound: a line (without its newline) may be at most ``max_message`` bytes (1 MiB by
default) in either direction. An over-long request line gets a ``too_large`` error with a
null id and the connection is then closed: the rest of that line is still in flight and
there is no way to tell where the next request starts. Malformed JSON, a non-object, a
wrong version, an unknown op or wrong argument types get an error reply and the connection
stays usable. The schema in `OPS` is checked strictly before a handler sees a request:
unknown argument keys are refused, booleans are not integers, and optional arguments that
were not sent are filled in with their defaults.

Every error reply is bounded: its message is at most ``MAX_ERROR_MESSAGE`` characters, and
a value a peer sent is echoed shortened (`show`). A run the peer may not see is
``not_found``, exactly like a run that does not exist.

Limits (the daemon's ``[daemon]`` keys, `core.config.SocketLimits`): connections in all and
per uid, concurrent streaming requests per uid, and timeouts for a new connection's first
byte, for a started request line to complete, for an idle connection between requests and
for a client to take a reply. Going over one gets one error reply (``busy`` or ``timeout``)
and, except for the stream cap, the connection is then closed.

Run refs: a run id, a job name, or a Slurm job id; a job id is ambiguous when several
runs (of different clusters, or of one cluster's reused ids) have it, and ``CLUSTER:JOBID``
picks the cluster. An ambiguous ref is an ``ambiguous`` error naming the candidates.

``list`` is paginated: ``limit`` runs at most (and never more than fit in half the message
bound) from after the cursor ``after``; the result's ``next`` is the cursor of the next
page, null on the last. ``logs`` chunks carry ``encoding``: ``"utf-8"`` when the bytes
are valid UTF-8 (``data`` is the text), else ``"base64"`` (``data`` is the bytes in
base64), so any file round-trips byte for byte and every chunk fits the bound.

The shapes of results and stream items are the typed structures of
`llmd_supervisor.core.protocol.runs` (runs) and `llmd_supervisor.core.campaign.views`
(campaigns); changing one of them changes the protocol version (adding an optional field
does not: readers drop keys they do not know).

This module is pure (no sockets): `control_server` serves it, `control_client` speaks it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, NoReturn, Protocol

from llmd_supervisor.errors import ControlError

__all__ = [
    "COUNTS_MAX_ENTRIES",
    "COUNTS_MAX_KEY",
    "DEFAULT_MAX_MESSAGE",
    "ERROR_CODES",
    "LIST_MAX_LIMIT",
    "MAX_ERROR_MESSAGE",
    "MAX_ID_CHARS",
    "OPS",
    "PROTOCOL_VERSION",
    "ArgSpec",
    "Handler",
    "OpSpec",
    "Peer",
    "Request",
    "RequestRejected",
    "Send",
    "bounded",
    "decode_request",
    "encode",
    "error_line",
    "show",
]

PROTOCOL_VERSION: Final = 1
DEFAULT_MAX_MESSAGE: Final = 1 << 20
MAX_ERROR_MESSAGE: Final = 1000  # characters of an error reply's message
LIST_MAX_LIMIT: Final = 1000  # runs per ``list`` page at most
MAX_ID_CHARS: Final = 128  # a string request id is echoed in every reply: keep it short

ERROR_CODES: Final = frozenset(
    {
        "bad_json",  # the line is not UTF-8 JSON (or is empty)
        "bad_request",  # wrong, missing or unknown field, or a wrong type; the message names it
        "unsupported_version",  # "v" is an integer other than PROTOCOL_VERSION
        "unknown_op",  # "op" is a string that is not in OPS
        "too_large",  # the line exceeds the message bound; the connection is closed
        "not_found",  # no such run (or rank), or one the peer may not see (control.access)
        "ambiguous",  # the run ref names several runs; the message names them and how to pick
        "conflict",  # the run is in a state that does not allow the op
        "forbidden",  # the peer may not do this (release a node without being an admin)
        "not_leader",  # a standby of a shared journal: the message names the cluster's leader
        "busy",  # a connection or stream cap is reached; the message names it
        "timeout",  # the request did not arrive in time, or a reply was not taken; closed
        "internal",  # the daemon failed; details are in its log
    }
)

# The "counts" argument kind: an object whose keys are strings and whose values are
# non-negative integers (e.g. byte offsets per file), bounded in entries and key length.
COUNTS_MAX_ENTRIES: Final = 256
COUNTS_MAX_KEY: Final = 512
_COUNT_MAX: Final = (1 << 63) - 1
_SHOWN_VALUE_MAX: Final = 60


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class ArgSpec:
    """One argument of an op: the JSON kinds it accepts, and its default when optional."""

    kinds: frozenset[str]  # subset of {"str", "bool", "int", "null", "counts"}
    required: bool = False
    default: object = None


@dataclass(frozen=True)
class OpSpec:
    """One op: its arguments and whether it sends stream items before the final reply."""

    args: Mapping[str, ArgSpec]
    streaming: bool = False


_STR: Final = frozenset({"str"})
_BOOL: Final = frozenset({"bool"})
_RUN: Final = ArgSpec(_STR, required=True)
_CAMPAIGN: Final = ArgSpec(_STR, required=True)  # a campaign id or name
# None: the daemon's first configured cluster
_CLUSTER: Final = ArgSpec(frozenset({"str", "null"}), default=None)
_OPT_STR: Final = ArgSpec(frozenset({"str", "null"}), default=None)

# The one table of the protocol's ops.
OPS: Final[Mapping[str, OpSpec]] = MappingProxyType(
    {
        "ping": OpSpec({}),
        "submit": OpSpec(
            {
                "spec_toml": ArgSpec(_STR, required=True),
                "spec_path": ArgSpec(_STR, default=None),  # only for messages
                "dry_run": ArgSpec(_BOOL, default=False),
                "cluster": _CLUSTER,
            }
        ),
        # a user's own batch script, and a job submitted without the daemon: a foreign
        # spec as JSON (`core.spec.foreign`; the CLI builds it from its options)
        "submit_script": OpSpec({"spec_json": ArgSpec(_STR, required=True), "cluster": _CLUSTER}),
        "adopt": OpSpec({"spec_json": ArgSpec(_STR, required=True), "cluster": _CLUSTER}),
        "list": OpSpec(
            {
                "all": ArgSpec(_BOOL, default=False),
                # 1 .. LIST_MAX_LIMIT; None: as many as fit
                "limit": ArgSpec(frozenset({"int", "null"}), default=None),
                # the previous page's ``next``; None: from the oldest run
                "after": ArgSpec(frozenset({"str", "null"}), default=None),
                # one cluster's runs (a shared journal holds several); None: every cluster's
                "cluster": ArgSpec(frozenset({"str", "null"}), default=None),
            }
        ),
        "status": OpSpec({"run": _RUN}),
        # the quarantined nodes; with `release` (admins only) that node's failures are
        # forgotten first, on `cluster` (None: the first configured)
        "nodes": OpSpec(
            {"release": ArgSpec(frozenset({"str", "null"}), default=None), "cluster": _CLUSTER}
        ),
        "logs": OpSpec(
            {
                "run": _RUN,
                "rank": ArgSpec(frozenset({"int", "null"}), default=None),
                "follow": ArgSpec(_BOOL, default=False),
                # file (as named in stream items) -> byte offset to resume from; files not
                # named start at 0. A client that reconnects sends what it has printed.
                "offsets": ArgSpec(frozenset({"counts", "null"}), default=None),
            },
            streaming=True,
        ),
        "cancel": OpSpec({"run": _RUN}),
        "wait": OpSpec({"run": _RUN}, streaming=True),
        "archive": OpSpec({"run": _RUN}),
        "results": OpSpec({"run": _RUN}),
        # campaigns (supervision.campaign.api): a campaign file and its base spec's text
        # (or its batch script's)
        # streaming (though it sends no item): a client that goes away cancels it, and
        # with it the campaign's expansion (supervision.campaign.expansion)
        "campaign_submit": OpSpec(
            {
                "file_text": ArgSpec(_STR, required=True),
                "base_text": ArgSpec(_STR, required=True),
                "file_path": ArgSpec(_STR, default=None),  # only for messages
                # the campaign file's absolute directory: a script campaign's paths
                "file_dir": ArgSpec(frozenset({"str", "null"}), default=None),
                # --export-env of a script campaign: the client's environment as a JSON
                # object of strings (None: the runs get what a job gets of the daemon's)
                "export_env_json": ArgSpec(frozenset({"str", "null"}), default=None),
                "name": ArgSpec(_STR, required=True),  # the default name: the file's stem
                "dry_run": ArgSpec(_BOOL, default=False),
                "rerun": ArgSpec(_BOOL, default=False),
                # at most this many points (null: the daemon's limits.campaign_max_points,
                # which also caps it)
                "max_points": ArgSpec(frozenset({"int", "null"}), default=None),
                "cluster": _CLUSTER,
            },
            streaming=True,
        ),
        "campaign_list": OpSpec({}),
        "campaign_status": OpSpec({"campaign": _CAMPAIGN}),
        "campaign_cancel": OpSpec({"campaign": _CAMPAIGN}),
        "campaign_wait": OpSpec({"campaign": _CAMPAIGN}, streaming=True),
        "campaign_results": OpSpec({"campaign": _CAMPAIGN}, streaming=True),
        # outbound events (supervision.events.api): deliveries, newest event first, of one
        # run (a run ref) and in one status (core.events.outbox.DeliveryStatus); one event; a
        # dead or disabled delivery queued again (of `destination`, None: every one)
        "events_list": OpSpec({"run": _OPT_STR, "status": _OPT_STR}),
        "events_show": OpSpec({"event": ArgSpec(_STR, required=True)}),
        "events_replay": OpSpec({"event": ArgSpec(_STR, required=True), "destination": _OPT_STR}),
        # a test.ping to one configured destination (root and the admin group)
        "events_test": OpSpec({"destination": ArgSpec(_STR, required=True)}),
    }
)

_TOP_LEVEL_KEYS: Final = frozenset({"v", "id", "op", "args"})
_KIND_WORDS: Final = {
    "str": "a string",
    "bool": "a boolean",
    "int": "an integer",
    "null": "null",
    "counts": "an object of strings to non-negative integers",
    "float": "a non-integer number",
    "array": "an array",
    "object": "an object",
}


@dataclass(frozen=True)
class Peer:
    """The connecting process, as the kernel reports it (SO_PEERCRED)."""

    uid: int
    gid: int
    pid: int


@dataclass(frozen=True)
class Request:
    """A request that passed schema validation; `args` holds every argument of the op."""

    id: int | str
    op: str
    args: Mapping[str, object]


Send = Callable[[Mapping[str, object]], Awaitable[None]]


class Handler(Protocol):
    """What the daemon plugs into `ControlServer`."""

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        """Return the final result; raise `ControlError` for an error reply.

        `send` emits one stream item (streaming ops only; a stream item must not have a
        top-level ``"final"`` key, which the client reserves). It is cancelled, like the
        handler, when the client goes away.
        """
        ...


class RequestRejected(ControlError):
    """A request refused before dispatch, with whatever id could be read from it."""

    def __init__(self, request_id: int | str | None, code: str, message: str) -> None:
        super().__init__(code, message)
        self.request_id = request_id


def _kind(value: object) -> str:
    """The JSON kind of a decoded value, with bool and int kept apart."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def show(value: object) -> str:
    """Render a peer's value for an error message, short enough to stay within any bound."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= _SHOWN_VALUE_MAX else text[: _SHOWN_VALUE_MAX - 3] + "..."


def bounded(text: str, limit: int = MAX_ERROR_MESSAGE) -> str:
    """`text` cut to at most `limit` characters (the cut marked with "...")."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _expect(kinds: frozenset[str]) -> str:
    return " or ".join(_KIND_WORDS.get(k, k) for k in sorted(kinds, key=lambda k: k == "null"))


def _counts_problem(value: dict[str, object]) -> str | None:
    """Why `value` is not a valid "counts" object, or None when it is."""
    if len(value) > COUNTS_MAX_ENTRIES:
        return f"has {len(value)} entries, over the limit of {COUNTS_MAX_ENTRIES}"
    for key, count in value.items():
        if len(key) > COUNTS_MAX_KEY:
            return f"has a key of {len(key)} characters, over the limit of {COUNTS_MAX_KEY}"
        if _kind(count) != "int":
            return f"maps {show(key)} to {show(count)}, which is not an integer"
        assert isinstance(count, int)
        if not 0 <= count <= _COUNT_MAX:
            return f"maps {show(key)} to {count}, outside 0..{_COUNT_MAX}"
    return None


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {show(key)}")
        obj[key] = value
    return obj


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not allowed in JSON")


def decode_request(line: bytes) -> Request:
    """Parse and validate one request line (without its newline); pure.

    Raises `RequestRejected` (a `ControlError`) whose ``request_id`` is the request's id when
    it could be read (None otherwise).
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestRejected(
            None,
            "bad_json",
            f"Request is not valid UTF-8: byte 0x{line[exc.start]:02x} at offset {exc.start}.",
        ) from None
    if not text.strip():
        raise RequestRejected(
            None, "bad_json", "Request line is empty; send one JSON object per line."
        )
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
    except RecursionError:
        raise RequestRejected(None, "bad_json", "Request JSON is nested too deeply.") from None
    except ValueError as exc:
        raise RequestRejected(None, "bad_json", f"Request is not valid JSON: {exc}.") from None
    if not isinstance(obj, dict):
        raise RequestRejected(
            None,
            "bad_request",
            f"Request must be a JSON object, got {_KIND_WORDS[_kind(obj)]} {show(obj)}.",
        )

    if "id" not in obj:
        raise RequestRejected(None, "bad_request", "Request field 'id' is missing.")
    request_id = obj["id"]
    if not isinstance(request_id, int | str) or isinstance(request_id, bool):
        raise RequestRejected(
            None,
            "bad_request",
            f"Request field 'id' must be an integer or a string, got {show(request_id)}.",
        )
    if isinstance(request_id, str) and len(request_id) > MAX_ID_CHARS:
        raise RequestRejected(
            None,
            "bad_request",
            f"Request field 'id' is a string of {len(request_id)} characters, over the "
            f"limit of {MAX_ID_CHARS}.",
        )
    if isinstance(request_id, int) and not -_COUNT_MAX <= request_id <= _COUNT_MAX:
        raise RequestRejected(
            None, "bad_request", "Request field 'id' is an integer outside the 64-bit range."
        )

    def reject(code: str, message: str) -> NoReturn:
        raise RequestRejected(request_id, code, message)

    if "v" not in obj:
        reject(
            "bad_request", f"Request field 'v' is missing; this daemon speaks {PROTOCOL_VERSION}."
        )
    version = obj["v"]
    if _kind(version) != "int":
        reject("bad_request", f"Request field 'v' must be an integer, got {show(version)}.")
    if version != PROTOCOL_VERSION:
        reject(
            "unsupported_version",
            f"Protocol version {show(version)} is not supported; "
            f"this daemon speaks version {PROTOCOL_VERSION}.",
        )
    for key in sorted(set(obj) - _TOP_LEVEL_KEYS):
        reject(
            "bad_request",
            f"Request field {show(key)} is not part of protocol version {PROTOCOL_VERSION}; "
            "a request has v, id, op and args.",
        )

    if "op" not in obj:
        reject("bad_request", "Request field 'op' is missing.")
    op = obj["op"]
    if not isinstance(op, str):
        reject("bad_request", f"Request field 'op' must be a string, got {show(op)}.")
    spec = OPS.get(op)
    if spec is None:
        reject("unknown_op", f"Unknown op {show(op)}; known ops are {', '.join(sorted(OPS))}.")

    raw_args = obj.get("args", {})
    if not isinstance(raw_args, dict):
        reject("bad_request", f"Request field 'args' must be an object, got {show(raw_args)}.")
    for key in sorted(set(raw_args) - set(spec.args)):
        takes = ", ".join(sorted(spec.args)) or "no arguments"
        reject(
            "bad_request",
            f"Request field 'args.{key}' is not an argument of op {op!r}; it takes {takes}.",
        )
    args: dict[str, object] = {}
    for name, arg in spec.args.items():
        if name not in raw_args:
            if arg.required:
                reject("bad_request", f"Request field 'args.{name}' is required for op {op!r}.")
            args[name] = arg.default
            continue
        value = raw_args[name]
        kind = _kind(value)
        if kind == "object" and "counts" in arg.kinds:
            assert isinstance(value, dict)
            problem = _counts_problem(value)
            if problem is not None:
                reject(
                    "bad_request",
                    f"Request field 'args.{name}' of op {op!r} must be "
                    f"{_KIND_WORDS['counts']}, but it {problem}.",
                )
            value = dict(value)
        elif kind not in arg.kinds:
            reject(
                "bad_request",
                f"Request field 'args.{name}' of op {op!r} must be {_expect(arg.kinds)}, "
                f"got {show(value)}.",
            )
        args[name] = value
    return Request(id=request_id, op=op, args=MappingProxyType(args))


def encode(message: Mapping[str, object]) -> bytes:
    """One protocol line. ASCII-only output, so any string a peer sent can be echoed."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode("ascii") + b"\n"


def error_line(request_id: int | str | None, code: str, message: str) -> bytes:
    """The error reply line for `request_id`, bounded whatever the message (and an id the
    peer sent, echoed as it came, is within the request's own bound)."""
    return encode(
        {
            "v": PROTOCOL_VERSION,
            "id": request_id,
            "ok": False,
            "error": {"code": code, "message": bounded(message)},
        }
    )
