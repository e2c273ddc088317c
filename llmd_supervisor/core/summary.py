"""What crosses the control socket: the typed results and stream items of every op.

The daemon's API builds these and the CLI reads them, both with these types. They are
plain JSON objects on the wire (control protocol version 1, which versions them: a change
here is a protocol change). `read(kind, value)` checks a decoded value against its
TypedDict before a reader trusts it; keys it does not know are dropped, so a newer daemon
may add fields without breaking an older client.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Literal, NotRequired, TypedDict, TypeVar, Union

from llmd_supervisor.errors import SummaryError

__all__ = [
    "ArchiveInfo",
    "DryRun",
    "LogChunk",
    "LogsDone",
    "NodeView",
    "Pong",
    "RunList",
    "RunSummary",
    "TransitionView",
    "read",
]


class NodeView(TypedDict):
    """One allocated node as the heartbeat last saw it."""

    rank: int
    reachable: bool
    agent_state: str  # the node agent's own state ("" until its status file is read)


class TransitionView(TypedDict):
    """One state change of the run."""

    state: str  # a RunState value
    at: str  # ISO 8601, UTC
    event: str


class RunSummary(TypedDict):
    """A run as ``status``, ``cancel``, ``submit``, ``list`` and ``wait`` show it."""

    run: str  # the run id
    job_name: str
    state: str  # a RunState value
    outcome: str | None  # an Outcome value once the verdict is known
    reason: str  # the verdict's one-line evidence ("" before)
    slurm_job_id: str | None
    attempt: int
    nodes: list[str]
    nodes_healthy: int  # how many of `nodes` answered the last heartbeat
    cancel_requested: bool
    cluster: str
    owner_uid: int
    created_at: str  # ISO 8601, UTC
    elapsed_s: float  # since created_at, when the summary was made
    archive: str  # the run's archive directory
    log_dir: str  # the run's log directory on the cluster
    health: dict[str, NodeView]  # node name -> what its heartbeat said
    transitions: list[TransitionView]
    last_log_line: str  # the last non-empty line of the batch log copy, or ""


class DryRun(TypedDict):
    """``submit`` with ``dry_run``: the script the spec becomes; nothing was submitted."""

    dry_run: Literal[True]
    script: str


class RunList(TypedDict):
    """``list``: the runs the peer may see, oldest first."""

    runs: list[RunSummary]


class ArchiveInfo(TypedDict):
    """``archive``: where the run's archive is (complete once the run is final)."""

    archive: str
    state: str


class LogChunk(TypedDict):
    """A ``logs`` stream item: bytes ``offset .. end`` of one local log copy.

    `data` is those bytes decoded as UTF-8 (invalid bytes replaced; a character split by a
    read is never split between two chunks). The offsets are byte offsets in the copy, so
    a client resumes by sending `end` back in the ``offsets`` argument.
    """

    file: str  # relative to the run's log copies, e.g. "attempt1/llmd-ab12-42.out"
    offset: int
    end: int
    data: str


class LogsDone(TypedDict):
    """The final reply of ``logs``: how many bytes were sent, and the run's state then."""

    bytes: int
    state: str


class Pong(TypedDict):
    """``ping``."""

    pong: Literal[True]


T = TypeVar("T")


def read(kind: type[T], value: object) -> T:
    """`value` (decoded JSON) checked against the TypedDict `kind`; raise `SummaryError`."""
    return typing.cast(T, _check(kind, value, kind.__name__, kind.__name__))


def _check(tp: object, value: object, kind: str, where: str) -> object:
    """`value` as type `tp` (unknown keys of objects dropped), or raise `SummaryError`."""
    if typing.is_typeddict(tp):
        if not isinstance(value, dict):
            raise SummaryError(kind, where, f"is {_kind(value)}, not an object")
        assert isinstance(tp, type)
        hints = _hints(tp)
        out: dict[str, object] = {}
        for key, hint in hints.items():
            if key not in value:
                if key in getattr(tp, "__required_keys__", frozenset()):
                    raise SummaryError(kind, f"{where}.{key}", "is missing")
                continue
            out[key] = _check(hint, value[key], kind, f"{where}.{key}")
        return out
    origin = typing.get_origin(tp)
    if origin is NotRequired:
        return _check(typing.get_args(tp)[0], value, kind, where)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _check(option, value, kind, where)
            except SummaryError:
                continue
        raise SummaryError(kind, where, f"has the wrong type ({_kind(value)})")
    if origin is Literal:
        if not any(type(value) is type(o) and value == o for o in typing.get_args(tp)):
            raise SummaryError(kind, where, f"is {value!r}, not one of {typing.get_args(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise SummaryError(kind, where, f"is {_kind(value)}, not an array")
        (item,) = typing.get_args(tp)
        return [_check(item, v, kind, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise SummaryError(kind, where, f"is {_kind(value)}, not an object")
        _, item = typing.get_args(tp)
        return {str(k): _check(item, v, kind, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is type(None):
        if value is not None:
            raise SummaryError(kind, where, f"is {_kind(value)}, not null")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise SummaryError(kind, where, f"is {_kind(value)}, not a boolean")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SummaryError(kind, where, f"is {_kind(value)}, not an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SummaryError(kind, where, f"is {_kind(value)}, not a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SummaryError(kind, where, f"is {_kind(value)}, not a string")
        return value
    raise TypeError(f"core.summary cannot check values of type {tp!r}")


@functools.cache
def _hints(tp: type) -> dict[str, object]:
    return typing.get_type_hints(tp)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), f"a {type(value).__name__}"
    )
