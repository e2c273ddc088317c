"""What crosses the control socket: the typed results and stream items of every op.

The daemon's API builds these and the CLI reads them, both with these types. They are
plain JSON objects on the wire (control protocol version 1, which versions them: a change
here is a protocol change). `read(kind, value)` checks a decoded value against its
TypedDict before a reader trusts it; keys it does not know are dropped, so a newer daemon
may add fields without breaking an older client.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Literal, NotRequired, TypedDict, TypeVar, Union

from llmd_supervisor.errors import SummaryError

__all__ = [
    "ArchiveInfo",
    "AttemptView",
    "DeclaredDeployment",
    "Deployment",
    "DryRun",
    "Headline",
    "LatencyView",
    "LogChunk",
    "LogsDone",
    "NodeView",
    "NodesView",
    "PointView",
    "Pong",
    "QuarantineView",
    "ResultsTable",
    "RunBrief",
    "RunList",
    "RunResults",
    "RunSummary",
    "TransitionView",
    "UsageView",
    "chunk_bytes",
    "headline",
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


class _RunSummary(TypedDict):
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


class _QuarantineView(TypedDict):
    cluster: str
    node: str
    failures: int
    active: bool  # kept out of submissions now
    reason: str
    run: str  # the run whose failure was counted last ("": another user's)
    since: str  # ISO 8601, UTC
    until: str


class QuarantineView(_QuarantineView, total=False):
    """One node's counted infrastructure failures on a cluster (`nodes`), for everyone's
    runs (`owner_uid` null, or absent from an older daemon) or for one owner's."""

    owner_uid: int | None


class NodesView(TypedDict):
    """What `nodes` shows (and `nodes release` returns, after the release)."""

    nodes: list[QuarantineView]
    released: bool  # `nodes release`: whether the node had failures counted


class AttemptView(TypedDict):
    """One ended attempt of a run (a job; a retry is the next one)."""

    attempt: int
    submission: int
    slurm_job_id: str | None
    nodes: list[str]
    outcome: str
    reason: str
    cause: str | None  # infrastructure | workload | cancelled | unknown (null: succeeded)
    implicated: list[str]  # the nodes an infrastructure failure names
    retry: str  # the retry decision, one phrase
    node_hours: float | None
    gpu_hours: float | None


class UsageView(TypedDict):
    """A run's node- and GPU-hours: the last attempt's are useful, the others' lost."""

    gpu_hours_useful: float
    gpu_hours_lost: float
    node_hours_useful: float
    node_hours_lost: float


class RunSummary(_RunSummary, total=False):
    """A run as ``status``, ``cancel``, ``submit`` and ``wait`` show it. `headline` is
    its best valid benchmark point once archived (null before; absent from an older
    daemon). `attempts` lists its ended attempts (at most the last 20) and `usage` what
    they cost. `held_until` is set while the run is held for want of nodes (its
    reason says why): it fails then (ISO 8601, UTC). `name` and `finished_at` are
    RunBrief's."""

    headline: Headline | None
    attempts: list[AttemptView]
    usage: UsageView
    # The run's SIGTERM grace: a waiting client stops waiting for the end of a cancel after
    # it plus a margin (`cli.signals`).
    sigterm_grace_s: int
    held_until: str | None
    name: str  # as RunBrief's
    finished_at: str | None


class _LatencyView(TypedDict):
    mean: float | None
    median: float | None
    p99: float | None


class LatencyView(_LatencyView, total=False):
    """One latency of a benchmark point, in milliseconds (null where not measured;
    `std` absent from a table an older daemon wrote). `percentiles`: every percentile
    the client reported, p99 too, by its name (``{"p90": ..., "p99": ..., "p99.9":
    ...}``; absent from an older daemon's table, which kept p99 alone)."""

    std: float | None
    percentiles: dict[str, float]


class PointView(TypedDict):
    """One benchmark point of ``results.json`` (`core.results.evidence.results_table`); numbers
    are null when its result file was missing or unparsable."""

    concurrency: int
    num_prompts: int | None
    completed: int | None
    failed: int | None
    duration_s: float | None
    request_throughput: float | None
    output_throughput: float | None
    total_token_throughput: float | None
    input_throughput: float | None
    output_throughput_per_gpu: float | None
    total_token_throughput_per_gpu: float | None
    input_throughput_per_gpu: float | None
    ttft_ms: LatencyView | None
    tpot_ms: LatencyView | None
    itl_ms: LatencyView | None
    e2el_ms: LatencyView | None
    file: str
    valid: bool
    problem: str | None


class RouterMeta(TypedDict):
    """The router of a deployment, as InferenceX's aggregate names it."""

    name: str
    version: str


class _Deployment(TypedDict):
    # InferenceX's names and types (utils/process_result.py, its multi-node case; see
    # tests/data/inferencex-agg/SOURCE.md). Null where the spec does not say.
    hw: str | None
    image: str | None
    model: str
    infmax_model_prefix: str | None
    framework: str | None
    precision: str | None
    spec_decoding: str
    disagg: bool
    recipe_fingerprint: str  # sha256 hex of the configuration but the concurrencies
    isl: int
    osl: int
    is_multinode: bool
    prefill_tp: int | None
    prefill_pp: int
    prefill_dcp_size: int
    prefill_pcp_size: int
    prefill_ep: int
    prefill_dp_attention: str  # "true" | "false", a string as InferenceX has it
    prefill_num_workers: int
    decode_tp: int | None
    decode_pp: int
    decode_dcp_size: int
    decode_pcp_size: int
    decode_ep: int
    decode_dp_attention: str
    decode_num_workers: int
    num_prefill_gpu: int | None
    num_decode_gpu: int | None


class Deployment(_Deployment, total=False):
    """What identifies a run's configuration in InferenceX's aggregate, from its spec
    (`core.spec.recipe.deployment_of`). `router` and `kv_p2p_transfer` only when declared,
    as InferenceX adds them only when its recipe has them."""

    router: RouterMeta
    kv_p2p_transfer: str


class DeclaredDeployment(TypedDict, total=False):
    """A foreign job's deployment in InferenceX's names and types (as `Deployment`), only
    the fields known: what its result files declare alike (``--metadata KEY=VALUE``, and
    ``model_id`` as `model`), `disagg` from the roles' GPUs it was given, `is_multinode`
    from its allocation (`core.results.declared.known_deployment`)."""

    hw: str
    image: str
    model: str
    infmax_model_prefix: str
    framework: str
    precision: str
    spec_decoding: str
    recipe_fingerprint: str
    kv_p2p_transfer: str
    disagg: bool
    is_multinode: bool
    isl: int
    osl: int
    prefill_tp: int
    prefill_pp: int
    prefill_dcp_size: int
    prefill_pcp_size: int
    prefill_ep: int
    prefill_dp_attention: str
    prefill_num_workers: int
    decode_tp: int
    decode_pp: int
    decode_dcp_size: int
    decode_pcp_size: int
    decode_ep: int
    decode_dp_attention: str
    decode_num_workers: int


class _ResultsTable(TypedDict):
    format: str  # "vllm" or "inferencex"
    gpus: int | None  # the run's GPUs, when the spec says (per-GPU numbers need it)
    points: list[PointView]


class ResultsTable(_ResultsTable, total=False):
    """A run's ``results.json``: its benchmark points, sorted by concurrency.

    `prefill_gpus` and `decode_gpus`: the roles' GPUs its per-GPU numbers were divided
    by (null when the split is unknown; absent from an older table, whose per-GPU numbers
    are all divided by `gpus`). `deployment`: the run's configuration in InferenceX's
    terms (null for a foreign job; absent from an older table). `declared`: a foreign
    job's, as far as it is known (absent otherwise, and from an older table)."""

    prefill_gpus: int | None
    decode_gpus: int | None
    deployment: Deployment | None
    declared: DeclaredDeployment


class _RunResults(TypedDict):
    run: str
    state: str
    outcome: str | None
    reason: str
    results: ResultsTable | None


class RunResults(_RunResults, total=False):
    """``results``: a run's verdict and its results table (null before it is archived,
    or when no job ran), what its attempts cost, and when it ended (ISO 8601 UTC; null
    while it runs). The last two are absent from an older daemon."""

    usage: UsageView
    finished_at: str | None


class Headline(TypedDict):
    """The best valid point of a run (highest total token throughput)."""

    concurrency: int
    total_token_throughput: float
    output_throughput: float
    ttft_ms_median: float | None


def headline(table: ResultsTable) -> Headline | None:
    """The table's best valid point, or None when no point is valid."""
    valid = [p for p in table["points"] if p["valid"] and p["total_token_throughput"] is not None]
    if not valid:
        return None
    best = max(valid, key=lambda p: p["total_token_throughput"] or 0.0)
    return {
        "concurrency": best["concurrency"],
        "total_token_throughput": best["total_token_throughput"] or 0.0,
        "output_throughput": best["output_throughput"] or 0.0,
        "ttft_ms_median": best["ttft_ms"]["median"] if best["ttft_ms"] else None,
    }


class DryRun(TypedDict):
    """``submit`` with ``dry_run``: the script the spec becomes; nothing was submitted."""

    dry_run: Literal[True]
    script: str


class _RunBrief(TypedDict):
    run: str
    job_name: str
    state: str
    outcome: str | None
    reason: str
    slurm_job_id: str | None
    attempt: int
    nodes: list[str]
    nodes_healthy: int
    cancel_requested: bool
    cluster: str
    owner_uid: int
    created_at: str
    elapsed_s: float
    archive: str


class RunBrief(_RunBrief, total=False):
    """A run as ``list`` shows it: bounded in size (no history, no health, no log line;
    `reason` cut to 200 characters, `nodes` to 256 names). `name` is its spec's
    ``[run] name`` ("" when it has none), its batch script's file name or
    ``adopted-JOBID``; `finished_at` when it ended (ISO 8601 UTC; null while it runs).
    Both are absent from an older daemon."""

    name: str
    finished_at: str | None


class _RunPage(TypedDict):
    runs: list[RunBrief]


class RunList(_RunPage, total=False):
    """``list``: one page of the runs the peer may see, oldest first. `next` is the cursor
    to send as ``after`` for the next page; null (or absent, from an older daemon) on the
    last page."""

    next: str | None


class ArchiveInfo(TypedDict):
    """``archive``: where the run's archive is (complete once the run is final)."""

    archive: str
    state: str


class _Chunk(TypedDict):
    file: str  # relative to the run's log copies, e.g. "attempt1/llmd-ab12-42.out"
    offset: int
    end: int
    data: str


class LogChunk(_Chunk, total=False):
    """A ``logs`` stream item: bytes ``offset .. end`` of one local log copy.

    With `encoding` "utf-8" (or absent, from an older daemon) `data` is those bytes as
    text (they are valid UTF-8, and a character is not split between two chunks while the
    run goes on); with "base64" it is the bytes in base64 (they are not valid UTF-8, or
    their text would not fit the message bound escaped). `chunk_bytes` gives the bytes
    either way. The offsets are byte offsets in the copy, so a client resumes by sending
    `end` back in the ``offsets`` argument.
    """

    encoding: Literal["utf-8", "base64"]


def chunk_bytes(chunk: LogChunk) -> bytes:
    """The bytes a chunk carries; raise `SummaryError` when they are not `end - offset`
    of them."""
    if chunk.get("encoding") == "base64":
        try:
            data = base64.b64decode(chunk["data"], validate=True)
        except (binascii.Error, ValueError):
            raise SummaryError("LogChunk", "LogChunk.data", "is not valid base64") from None
    else:
        try:
            data = chunk["data"].encode("utf-8")
        except UnicodeEncodeError:
            raise SummaryError("LogChunk", "LogChunk.data", "is not valid text") from None
    # An older daemon (no `encoding`) replaced invalid bytes, so its text may differ in size.
    if "encoding" in chunk and len(data) != chunk["end"] - chunk["offset"]:
        raise SummaryError(
            "LogChunk",
            "LogChunk.data",
            f"holds {len(data)} bytes, not the {chunk['end'] - chunk['offset']} of its offsets",
        )
    return data


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
    if tp is object:  # any JSON value (a campaign's matrix values): nothing to check
        return value
    origin = typing.get_origin(tp)
    if origin is NotRequired:
        return _check(typing.get_args(tp)[0], value, kind, where)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is not None and len(options) == 2 and type(None) in options:
            # `X | None` holding a value: X's own error names the field that is wrong
            (option,) = (o for o in options if o is not type(None))
            return _check(option, value, kind, where)
        for option in options:
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
    if origin in (dict, Mapping):
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
        try:
            return float(value)
        except OverflowError:  # an integer beyond a float: infinite, as json reads 1e400
            return math.inf if value > 0 else -math.inf
    if tp is str:
        if not isinstance(value, str):
            raise SummaryError(kind, where, f"is {_kind(value)}, not a string")
        return value
    raise TypeError(f"core.protocol.runs cannot check values of type {tp!r}")


@functools.cache
def _hints(tp: type) -> dict[str, object]:
    return typing.get_type_hints(tp)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), f"a {type(value).__name__}"
    )
