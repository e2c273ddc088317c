"""Benchmark results as evidence: parse, gate, tabulate (pure, no I/O).

A benchmark point's result file is what a client saved with ``--save-result``:

* ``vllm`` -- ``vllm bench serve`` (vllm/benchmarks/serve.py): has ``failed``;
  ``max_concurrency`` is null when the client ran unbounded.
* ``inferencex`` -- InferenceX's ``utils/bench_serving/benchmark_serving.py``: the same
  keys without ``failed`` (failed = num_prompts - completed).

:func:`parse_result` turns the file's bytes into a :class:`Point` or a named
:class:`ResultProblem` (never an exception). :func:`gate` decides whether every configured
concurrency has a believable point (DESIGN.md section 5, item 4) and keeps per-point
evidence for the receipt. :func:`results_table` is the archive's ``results.json``.
The field list and its provenance are in ``tests/data/results/README.md``.

Per-GPU throughputs follow InferenceX's ``utils/process_result.py``
(``tests/data/inferencex-agg/SOURCE.md``): with the GPUs of each role known
(:class:`RoleGpus`), total tokens/s is divided by all GPUs, output tokens/s by the decode
GPUs and input tokens/s by the prefill GPUs; with only a total, all three by the total.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Final, Literal, TypedDict, get_args

from llmd_supervisor.core.results.declared import Declared, declared, declared_again
from llmd_supervisor.core.results.gpus import ROLE_GPU_KEYS, RoleGpus, declared_roles, per_gpu
from llmd_supervisor.node import common

if TYPE_CHECKING:  # the parser's child imports this module: it starts within its time limit
    from llmd_supervisor.core.protocol.runs import Deployment, LatencyView, PointView, ResultsTable

__all__ = [
    "FORMATS",
    "MAX_RESULT_BYTES",
    "PERCENTILES_MAX",
    "PERCENTILE_RE",
    "GateResult",
    "Point",
    "PointEvidence",
    "ResultFormat",
    "ResultProblem",
    "RoleGpus",
    "Stats",
    "Validity",
    "gate",
    "judge_alone",
    "min_completed",
    "parse_any",
    "parse_result",
    "parsed_from_json",
    "parsed_to_json",
    "result_name",
    "results_table",
]

ResultFormat = Literal["vllm", "inferencex"]
FORMATS: Final[tuple[ResultFormat, ...]] = get_args(ResultFormat)
# A saved result without --save-detailed is a few KiB; with it, per-request arrays.
MAX_RESULT_BYTES: Final = 64 * 1024 * 1024
LATENCIES: Final = ("ttft", "tpot", "itl", "e2el")
STAT_KEYS: Final = ("mean", "median", "p99", "std")  # Stats' numbers, in order
# A percentile as both clients name it: ``p`` and --metric-percentiles' value, written
# without ``.0`` (p90, p99, p99.9); `PERCENTILES_MAX` of them per metric are kept (the
# lowest; a client asked for more reports the rest nowhere we read).
PERCENTILE_RE: Final = re.compile(r"p(?:100|[1-9]?[0-9])(?:\.[0-9]{1,6})?")
_PERCENTILE_KEY_RE: Final = re.compile(rf"({PERCENTILE_RE.pattern})_({'|'.join(LATENCIES)})_ms")
PERCENTILES_MAX: Final = 16

ProblemKind = Literal[
    "missing",  # no result file
    "too_large",  # over MAX_RESULT_BYTES
    "not_json",  # not UTF-8 JSON (or several documents: --append-result)
    "not_object",  # JSON, but not an object
    "missing_field",  # a required key is absent
    "bad_value",  # a key has the wrong type, is negative or not finite
    "inconsistent",  # the numbers contradict each other
    "refused",  # not read or not parsed: a link, not a plain file, over a limit, ...
]
PROBLEM_KINDS: Final[tuple[ProblemKind, ...]] = get_args(ProblemKind)
# A problem's detail as it crosses from the parser's process (they are short sentences).
DETAIL_MAX: Final = 1000


@dataclass(frozen=True)
class Stats:
    """One latency metric in milliseconds; None where the client did not report it
    (``--percentile-metrics`` left it out, or ``--metric-percentiles`` has no 99).
    `percentiles` holds every percentile it reported, p99 too, by the client's name
    (``("p90", 41.2), ("p99", 48.0), ("p99.9", 49.1)``), in increasing order."""

    mean: float | None = None
    median: float | None = None
    p99: float | None = None
    std: float | None = None  # the population standard deviation (InferenceX keeps it)
    percentiles: tuple[tuple[str, float], ...] = ()

    def as_dict(self) -> LatencyView:
        return {
            "mean": self.mean,
            "median": self.median,
            "p99": self.p99,
            "std": self.std,
            "percentiles": dict(self.percentiles),
        }


@dataclass(frozen=True)
class Point:
    """One benchmark point, normalised from either format."""

    format: ResultFormat
    concurrency: int | None  # the result's max_concurrency; None = unbounded
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: Stats = Stats()
    tpot_ms: Stats = Stats()
    itl_ms: Stats = Stats()
    e2el_ms: Stats = Stats()
    role_gpus: RoleGpus | None = None  # what the result file says (ROLE_GPU_KEYS), if anything
    # The deployment fields it declares in InferenceX's names (`core.results.declared`).
    declared: Declared = ()

    @property
    def input_throughput(self) -> float:
        """Input tokens/s as InferenceX's process_result.py derives it."""
        return max(0.0, self.total_token_throughput - self.output_throughput)


@dataclass(frozen=True)
class ResultProblem:
    """Why a result file is not a point: a kind (see ProblemKind) and a bounded detail."""

    kind: ProblemKind
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


@dataclass(frozen=True)
class Validity:
    """What makes a point valid (the spec's ``[benchmark.validity]``)."""

    min_completed_fraction: float = 0.95
    min_output_tokens: int = 1
    max_failed: int | None = None  # None: whatever the fraction leaves


def min_completed(fraction: float, num_prompts: int) -> int:
    """ceil(fraction x num_prompts), immune to float noise (0.95 x 320 = 304)."""
    return max(0, math.ceil(round(fraction * num_prompts, 9)))


def result_name(concurrency: int) -> str:
    """The archive's name of a point's result file."""
    return f"results/{common.result_name(concurrency)}"


# --- parsing -----------------------------------------------------------------------------


class _Bad(Exception):
    def __init__(self, problem: ResultProblem) -> None:
        super().__init__(str(problem))
        self.problem = problem


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _reject_constant(name: str) -> float:
    raise _Bad(ResultProblem("bad_value", f"the JSON holds {name}, not a finite number"))


def parse_result(data: bytes | str | None, fmt: ResultFormat) -> Point | ResultProblem:
    """Parse one saved result (the file's bytes; None = no file) in format `fmt`."""
    return parse_any(data, (fmt,))


def parse_any(data: bytes | str | None, formats: Sequence[ResultFormat]) -> Point | ResultProblem:
    """`data` as the first of `formats` it is a point of, else the last format's problem
    (the JSON is decoded once)."""
    for fmt in formats or ("",):
        if fmt not in FORMATS:
            return ResultProblem("bad_value", f"unknown result format {_shown(fmt)}")
    doc = _document(data)
    if isinstance(doc, ResultProblem):
        return doc
    got = ResultProblem("missing", "")
    for fmt in formats:
        try:
            return _point(doc, fmt)
        except _Bad as bad:
            got = bad.problem
    return got


def _document(data: bytes | str | None) -> dict[str, object] | ResultProblem:
    """The JSON object a result file holds, or why it is none."""
    if data is None:
        return ResultProblem("missing", "no result file")
    if len(data) > MAX_RESULT_BYTES:
        return ResultProblem("too_large", f"{len(data)} bytes (max {MAX_RESULT_BYTES})")
    if isinstance(data, bytes | bytearray):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            return ResultProblem("not_json", f"not UTF-8 at byte {exc.start}")
    if not data.strip():
        return ResultProblem("not_json", "empty file")
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except _Bad as bad:
        return bad.problem
    except RecursionError:
        return ResultProblem("not_json", "nested too deeply")
    except ValueError as exc:  # JSONDecodeError
        line = getattr(exc, "lineno", "?")
        col = getattr(exc, "colno", "?")
        msg = getattr(exc, "msg", "invalid JSON")
        return ResultProblem("not_json", f"{msg} at line {line} column {col}")
    if not isinstance(doc, dict):
        return ResultProblem("not_object", f"the JSON is a {type(doc).__name__}, not an object")
    return doc


def _get(doc: Mapping[str, object], key: str, fmt: ResultFormat) -> object:
    if key not in doc:
        hint = ""
        if key == "failed" and fmt == "vllm" and "completed" in doc:
            hint = " (InferenceX's client writes none: set benchmark.result_format = 'inferencex')"
        raise _Bad(ResultProblem("missing_field", f"no {key!r}{hint}"))
    return doc[key]


def _count(doc: Mapping[str, object], key: str, fmt: ResultFormat) -> int:
    value = _get(doc, key, fmt)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Bad(ResultProblem("bad_value", f"{key}={_shown(value)} is not a count (int >= 0)"))
    return value


def _number(value: object, key: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise _Bad(ResultProblem("bad_value", f"{key}={_shown(value)} is not a number >= 0"))
    return float(value)


def _stats(
    doc: Mapping[str, object], metric: str, percentiles: Mapping[str, Sequence[str]]
) -> Stats:
    """`metric`'s statistics in `doc`; `percentiles` names each metric's percentile keys
    (`_percentile_keys`)."""
    got: list[float | None] = []
    for prefix in STAT_KEYS:
        key = f"{prefix}_{metric}_ms"
        value = doc.get(key)
        got.append(None if value is None else _number(value, key))
    each = []
    for name in percentiles.get(metric, ()):
        key = f"{name}_{metric}_ms"
        if doc[key] is not None:
            each.append((name, _number(doc[key], key)))
    mean, median, p99, std = got
    return Stats(mean, median, p99, std, tuple(each))


def _percentile_value(name: str) -> float:
    return float(name[1:])


def _percentile_keys(doc: Mapping[str, object]) -> dict[str, list[str]]:
    """The percentiles `doc` reports of each latency (``p90`` of ``p90_ttft_ms``), the
    `PERCENTILES_MAX` lowest of each in increasing order."""
    found: dict[str, list[str]] = {}
    for key in doc:
        m = _PERCENTILE_KEY_RE.fullmatch(key)
        if m is not None:
            found.setdefault(m.group(2), []).append(m.group(1))
    return {
        metric: sorted(names, key=_percentile_value)[:PERCENTILES_MAX]
        for metric, names in found.items()
    }


def _point(doc: Mapping[str, object], fmt: ResultFormat) -> Point:
    num_prompts = _count(doc, "num_prompts", fmt)
    completed = _count(doc, "completed", fmt)
    if completed > num_prompts:
        raise _Bad(
            ResultProblem(
                "inconsistent", f"completed={completed} is more than num_prompts={num_prompts}"
            )
        )
    if fmt == "vllm" or "failed" in doc:
        failed = _count(doc, "failed", fmt)
        if completed + failed > num_prompts:
            raise _Bad(
                ResultProblem(
                    "inconsistent",
                    f"completed={completed} + failed={failed} is more than "
                    f"num_prompts={num_prompts}",
                )
            )
    else:
        failed = num_prompts - completed
    conc_key = "max_concurrency" if "max_concurrency" in doc else "concurrency"
    raw_conc = doc.get(conc_key)
    if isinstance(raw_conc, float) and raw_conc.is_integer():
        raw_conc = int(raw_conc)
    if raw_conc is not None and (
        isinstance(raw_conc, bool) or not isinstance(raw_conc, int) or raw_conc < 1
    ):
        raise _Bad(
            ResultProblem("bad_value", f"{conc_key}={_shown(raw_conc)} is not an integer >= 1")
        )
    concurrency = raw_conc if isinstance(raw_conc, int) else None
    percentiles = _percentile_keys(doc)
    return Point(
        format=fmt,
        concurrency=concurrency,
        num_prompts=num_prompts,
        completed=completed,
        failed=failed,
        duration_s=_number(_get(doc, "duration", fmt), "duration"),
        request_throughput=_number(_get(doc, "request_throughput", fmt), "request_throughput"),
        output_throughput=_number(_get(doc, "output_throughput", fmt), "output_throughput"),
        total_token_throughput=_number(
            _get(doc, "total_token_throughput", fmt), "total_token_throughput"
        ),
        total_input_tokens=_count(doc, "total_input_tokens", fmt),
        total_output_tokens=_count(doc, "total_output_tokens", fmt),
        ttft_ms=_stats(doc, "ttft", percentiles),
        tpot_ms=_stats(doc, "tpot", percentiles),
        itl_ms=_stats(doc, "itl", percentiles),
        e2el_ms=_stats(doc, "e2el", percentiles),
        role_gpus=declared_roles(doc),
        declared=declared(doc),
    )


# --- across the parser's process boundary ------------------------------------------------

# The version of what `parsed_to_json` writes; `parsed_from_json` reads only this one.
# A latency's `percentiles` came later within it: a reader takes a latency without them.
PARSED_VERSION: Final = 1


def parsed_to_json(got: Point | ResultProblem) -> dict[str, object]:
    """What `parse_any` made of a file, as the parser's process hands it back."""
    if isinstance(got, ResultProblem):
        return {"v": PARSED_VERSION, "problem": {"kind": got.kind, "detail": got.detail}}
    return {"v": PARSED_VERSION, "point": asdict(got)}


def parsed_from_json(value: object) -> Point | ResultProblem:
    """The inverse of `parsed_to_json`; ValueError for anything else (another version, a
    wrong type, a value the parser could not have let through)."""
    if not isinstance(value, dict) or value.get("v") != PARSED_VERSION:
        raise ValueError(f"not a parsed result of version {PARSED_VERSION}: {_shown(value)}")
    problem, p = value.get("problem"), value.get("point")
    if isinstance(problem, dict):
        kind = next((k for k in PROBLEM_KINDS if k == problem.get("kind")), None)
        detail = problem.get("detail")
        if kind is None or not isinstance(detail, str):
            raise ValueError(f"not a result problem: {_shown(problem)}")
        return ResultProblem(kind, detail[:DETAIL_MAX])
    if not isinstance(p, dict):
        raise ValueError(f"neither a point nor a problem: {_shown(value)}")
    fmt = next((f for f in FORMATS if f == p.get("format")), None)
    conc = p.get("concurrency")
    if fmt is None or not (conc is None or (_is_count(conc) and conc >= 1)):
        raise ValueError(f"not a point: {_shown(p)}")
    try:
        return Point(
            format=fmt,
            concurrency=conc,
            num_prompts=_count(p, "num_prompts", fmt),
            completed=_count(p, "completed", fmt),
            failed=_count(p, "failed", fmt),
            duration_s=_number(p.get("duration_s"), "duration_s"),
            request_throughput=_number(p.get("request_throughput"), "request_throughput"),
            output_throughput=_number(p.get("output_throughput"), "output_throughput"),
            total_token_throughput=_number(
                p.get("total_token_throughput"), "total_token_throughput"
            ),
            total_input_tokens=_count(p, "total_input_tokens", fmt),
            total_output_tokens=_count(p, "total_output_tokens", fmt),
            ttft_ms=_stats_of(p.get("ttft_ms"), "ttft"),
            tpot_ms=_stats_of(p.get("tpot_ms"), "tpot"),
            itl_ms=_stats_of(p.get("itl_ms"), "itl"),
            e2el_ms=_stats_of(p.get("e2el_ms"), "e2el"),
            role_gpus=_role_gpus_of(p.get("role_gpus")),
            declared=_declared_of(p.get("declared", ())),
        )
    except _Bad as bad:
        raise ValueError(f"not a point: {bad.problem}") from None


def _role_gpus_of(value: object) -> RoleGpus | None:
    if value is None:
        return None
    got = (
        declared_roles(
            dict(zip(ROLE_GPU_KEYS, (value.get("prefill"), value.get("decode")), strict=True))
        )
        if isinstance(value, dict)
        else None
    )
    if got is None:
        raise _Bad(ResultProblem("bad_value", f"role_gpus={_shown(value)} is not role GPUs"))
    return got


def _declared_of(value: object) -> Declared:
    got = declared_again(value)
    if got is None:
        raise _Bad(ResultProblem("bad_value", f"declared={_shown(value)} is not a deployment"))
    return got


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _stats_of(value: object, metric: str) -> Stats:
    if not isinstance(value, dict) or set(value) - {"percentiles"} != set(STAT_KEYS):
        raise _Bad(ResultProblem("bad_value", f"{metric}_ms={_shown(value)} is not a statistic"))
    got = [value[k] for k in STAT_KEYS]
    each = value.get("percentiles", [])
    if (
        not isinstance(each, list)
        or len(each) > PERCENTILES_MAX
        or not all(
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and PERCENTILE_RE.fullmatch(pair[0])
            for pair in each
        )
    ):
        raise _Bad(ResultProblem("bad_value", f"{metric}_ms={_shown(value)} is not a statistic"))
    mean, median, p99, std = (None if v is None else _number(v, metric) for v in got)
    return Stats(mean, median, p99, std, tuple((name, _number(v, metric)) for name, v in each))


# --- the validity gate -------------------------------------------------------------------


class PointJson(TypedDict):
    """A point's evidence as receipts and `results.json` hold it."""

    concurrency: int
    file: str
    requested: int
    min_completed: int
    max_failed: int
    result_concurrency: int | None
    num_prompts: int | None
    completed: int | None
    failed: int | None
    total_output_tokens: int | None
    duration_s: float | None
    valid: bool
    problem: str | None


class GateJson(TypedDict):
    ok: bool
    reason: str
    points: list[PointJson]


@dataclass(frozen=True)
class PointEvidence:
    """What the gate saw and decided for one configured concurrency."""

    concurrency: int
    file: str
    requested: int
    min_completed: int
    max_failed: int
    valid: bool
    problem: str | None  # why not valid (None when valid)
    point: Point | None  # None when the file was missing or unparsable

    def as_dict(self) -> PointJson:
        p = self.point
        return {
            "concurrency": self.concurrency,
            "file": self.file,
            "requested": self.requested,
            "min_completed": self.min_completed,
            "max_failed": self.max_failed,
            "result_concurrency": p.concurrency if p else None,
            "num_prompts": p.num_prompts if p else None,
            "completed": p.completed if p else None,
            "failed": p.failed if p else None,
            "total_output_tokens": p.total_output_tokens if p else None,
            "duration_s": p.duration_s if p else None,
            "valid": self.valid,
            "problem": self.problem,
        }


@dataclass(frozen=True)
class GateResult:
    ok: bool
    reason: str  # one line: the first failing point, or how many points passed
    points: tuple[PointEvidence, ...]  # sorted by concurrency

    def as_dict(self) -> GateJson:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "points": [e.as_dict() for e in self.points],
        }


def _judge(
    conc: int,
    got: Point | ResultProblem | None,
    requested: int,
    need: int,
    max_failed: int,
    validity: Validity,
) -> tuple[Point | None, str | None]:
    if got is None:
        return None, "no result file"
    if isinstance(got, ResultProblem):
        if got.kind == "missing":
            return None, "no result file"
        if got.kind == "refused":
            return None, f"result file refused ({got.detail})"
        return None, f"unparsable result ({got})"
    if got.concurrency != conc:
        shown = "none (unbounded)" if got.concurrency is None else str(got.concurrency)
        return got, f"result for the wrong concurrency (max_concurrency {shown})"
    if got.completed < need:
        return got, f"{got.completed} of {requested} requests completed (min {need})"
    if got.failed > max_failed:
        return got, f"{got.failed} of {requested} requests failed (max {max_failed})"
    if got.total_output_tokens < validity.min_output_tokens:
        return got, (f"{got.total_output_tokens} output tokens (min {validity.min_output_tokens})")
    if not got.duration_s > 0:
        return got, f"duration {got.duration_s:g} s (must be > 0)"
    return got, None


def judge_alone(point: Point, validity: Validity = Validity()) -> str | None:
    """Why a result file that stands alone is not a valid point (None when it is): the gate
    against the requests the file itself says were sent (a `--script` job's files, whose
    run has no spec to say how many)."""
    requested = point.num_prompts
    need = min_completed(validity.min_completed_fraction, requested)
    max_failed = validity.max_failed if validity.max_failed is not None else requested - need
    conc = point.concurrency if point.concurrency is not None else 0
    return _judge(conc, point, requested, need, max_failed, validity)[1]


def gate(
    points_by_concurrency: Mapping[int, Point | ResultProblem | None],
    expected: Mapping[int, int],
    validity: Validity,
    result_names: Mapping[int, str],
) -> GateResult:
    """Judge every configured concurrency (`expected`: concurrency -> prompts requested).

    A concurrency absent from `points_by_concurrency` counts as a missing file; points for
    concurrencies not in `expected` are ignored. `result_names` names each point's file in
    the reason (default ``results/c<N>.json``).
    """
    evidence: list[PointEvidence] = []
    first: str | None = None
    for conc in sorted(expected):
        requested = expected[conc]
        need = min_completed(validity.min_completed_fraction, requested)
        max_failed = validity.max_failed if validity.max_failed is not None else requested - need
        name = result_names.get(conc, result_name(conc))
        got = points_by_concurrency.get(conc)
        point, problem = _judge(conc, got, requested, need, max_failed, validity)
        evidence.append(
            PointEvidence(conc, name, requested, need, max_failed, problem is None, problem, point)
        )
        if problem is not None and first is None:
            first = f"benchmark c={conc}: {problem}; {name}"
    if not expected:
        return GateResult(False, "benchmark: no concurrency configured", ())
    if first is not None:
        return GateResult(False, first, tuple(evidence))
    n = len(evidence)
    return GateResult(True, f"benchmark: {n} of {n} points valid", tuple(evidence))


# --- results.json -------------------------------------------------------------------------

# The numbers of a results.json row (null when its file was missing or unparsable).
NUMBER_FIELDS: Final = (
    "num_prompts",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "input_throughput",
    "output_throughput_per_gpu",
    "total_token_throughput_per_gpu",
    "input_throughput_per_gpu",
)


def _row(e: PointEvidence, gpus: int | RoleGpus | None) -> PointView:
    p = e.point
    if p is None:
        return {
            "concurrency": e.concurrency,
            "num_prompts": None,
            "completed": None,
            "failed": None,
            "duration_s": None,
            "request_throughput": None,
            "output_throughput": None,
            "total_token_throughput": None,
            "input_throughput": None,
            "output_throughput_per_gpu": None,
            "total_token_throughput_per_gpu": None,
            "input_throughput_per_gpu": None,
            "ttft_ms": Stats().as_dict(),
            "tpot_ms": Stats().as_dict(),
            "itl_ms": Stats().as_dict(),
            "e2el_ms": Stats().as_dict(),
            "file": e.file,
            "valid": e.valid,
            "problem": e.problem,
        }
    # The caller's roles (the spec's) win; else the file's own; else the bare total.
    each = per_gpu(
        p.total_token_throughput,
        p.output_throughput,
        gpus if isinstance(gpus, RoleGpus) else (p.role_gpus or gpus),
    )
    return {
        "concurrency": e.concurrency,
        "num_prompts": p.num_prompts,
        "completed": p.completed,
        "failed": p.failed,
        "duration_s": p.duration_s,
        "request_throughput": p.request_throughput,
        "output_throughput": p.output_throughput,
        "total_token_throughput": p.total_token_throughput,
        "input_throughput": p.input_throughput,
        "output_throughput_per_gpu": each.output,
        "total_token_throughput_per_gpu": each.total,
        "input_throughput_per_gpu": each.input,
        "ttft_ms": p.ttft_ms.as_dict(),
        "tpot_ms": p.tpot_ms.as_dict(),
        "itl_ms": p.itl_ms.as_dict(),
        "e2el_ms": p.e2el_ms.as_dict(),
        "file": e.file,
        "valid": e.valid,
        "problem": e.problem,
    }


def results_table(
    points: GateResult | Iterable[PointEvidence],
    gpus: int | RoleGpus | None,
    fmt: ResultFormat | None = None,
    *,
    deployment: Deployment | None = None,
) -> ResultsTable:
    """The archive's ``results.json``: one row per point, sorted by concurrency.

    `gpus` is the run's GPUs: per role (:class:`RoleGpus`, from the spec's topology), or a
    total (None or 0: unknown). Without roles from the caller, a point's result file may
    declare them (`ROLE_GPU_KEYS`); see :func:`per_gpu` for the division. `prefill_gpus`
    and `decode_gpus` are the roles every row was divided by (null when not one split).
    `deployment` is what InferenceX's aggregate says about the configuration
    (`core.spec.recipe.deployment_of`; null for a foreign job).
    `fmt` defaults to the format of the parsed points (``vllm`` when none parsed).
    """
    evidence = sorted(
        points.points if isinstance(points, GateResult) else points, key=lambda e: e.concurrency
    )
    parsed = [e.point.format for e in evidence if e.point is not None and e.point.format]
    fmt = fmt or (parsed[0] if parsed else "vllm")
    given: int | RoleGpus | None = gpus if isinstance(gpus, RoleGpus) or (gpus or 0) > 0 else None
    roles = given if isinstance(given, RoleGpus) else _common_roles(evidence)
    total = roles.total if roles is not None else given
    return {
        "format": fmt,
        "gpus": total if isinstance(total, int) and total > 0 else None,
        "prefill_gpus": roles.prefill if roles else None,
        "decode_gpus": roles.decode if roles else None,
        "deployment": deployment,
        "points": [_row(e, given) for e in evidence],
    }


def _common_roles(evidence: Sequence[PointEvidence]) -> RoleGpus | None:
    """The roles' GPUs every parsed point's file declares alike, else None."""
    declared = {e.point.role_gpus for e in evidence if e.point is not None}
    return declared.pop() if len(declared) == 1 and None not in declared else None
