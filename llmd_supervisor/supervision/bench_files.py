"""The benchmark's files of a finished job, read through the cluster's `RunFiles`.

What the verdict's validity gate reads (each point's result file) and what the archive
keeps besides the log copies: the raw result files and point logs (`results/`), and each
rank's last status file and diagnostic (`ranks/`). Every read goes through
`node/jobfile.py` (no link followed, plain files of the job's account only, bounded); a
refused file is reported, never read.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llmd_supervisor.adapters import jobfiles
from llmd_supervisor.adapters.jobfiles import RESULT_FILE_MAX, SMALL_FILE_MAX
from llmd_supervisor.core.layout import RESULTS, RunLayout
from llmd_supervisor.core.results import (
    FORMATS,
    GateResult,
    Point,
    PointEvidence,
    ResultFormat,
    ResultProblem,
    Validity,
    gate,
    parse_result,
    results_table,
)
from llmd_supervisor.core.spec import RunSpec
from llmd_supervisor.errors import FileRefused
from llmd_supervisor.supervision.cluster import RunFiles

Refused = Callable[[FileRefused], Awaitable[None]]
RESULT_FILES_MAX = 256  # a foreign job's result files archived at most
_RESULT_NAME = re.compile(r"c([1-9][0-9]{0,5})\.json")


@dataclass
class BenchFiles:
    """What was read: per concurrency its result file's bytes (None: missing; a
    `FileRefused`: not a plain file), and the archive's extra files by relative name."""

    results: dict[int, bytes | FileRefused | None] = field(default_factory=dict)
    archived: dict[str, bytes] = field(default_factory=dict)


def judge(spec: RunSpec, raw: Mapping[int, bytes | FileRefused | None]) -> GateResult:
    """The validity gate on what `read_results` found (pure)."""
    bench = spec.benchmark
    parsed: dict[int, Point | ResultProblem | None] = {
        c: ResultProblem("refused", data.why)
        if isinstance(data, FileRefused)
        else parse_result(data, bench.result_format)
        for c, data in raw.items()
    }
    return gate(parsed, bench.expected_prompts(), bench.validity, {})


async def gate_dir(
    results_dir: str, fmt: ResultFormat, validity: Validity, *, time_limit: float = 30
) -> GateResult:
    """The validity gate on a directory of result files ``c<N>.json`` without a spec (the
    `verify` command): the points are the files found, each requested as many prompts as
    its own result says (an unparsable one fails by itself; none found fails)."""
    log_dir = posixpath.dirname(results_dir.rstrip("/"))
    try:
        names = await jobfiles.list_local(log_dir, results_dir, time_limit=time_limit)
    except FileRefused as exc:
        return _refused_dir(exc)
    points: dict[int, Point | ResultProblem | None] = {}
    expected: dict[int, int] = {}
    for name in names:
        m = _RESULT_NAME.fullmatch(name)
        if m is None:
            continue
        c = int(m.group(1))
        path = f"{results_dir}/{name}"
        try:
            data = await jobfiles.read_local(
                log_dir, path, time_limit=time_limit, limit=RESULT_FILE_MAX
            )
        except FileRefused as exc:
            points[c] = ResultProblem("refused", exc.why)
        else:
            points[c] = parse_result(data, fmt)
        got = points[c]
        expected[c] = got.num_prompts if isinstance(got, Point) else 0
    return gate(points, expected, validity, {c: f"{results_dir}/c{c}.json" for c in points})


def _refused_dir(exc: FileRefused) -> GateResult:
    return GateResult(False, f"benchmark: results directory refused ({exc.why})", ())


async def read_results(
    files: RunFiles, layout: RunLayout, job_id: str, concurrencies: Sequence[int]
) -> dict[int, bytes | FileRefused | None]:
    """Each point's result file, as the validity gate takes it."""
    paths = {c: layout.bench_files(job_id, c)[0] for c in concurrencies}
    got = await files.read_many(layout.log_dir, [(p, RESULT_FILE_MAX) for p in paths.values()])
    return {c: got.get(p) for c, p in paths.items()}


async def read_statuses(
    files: RunFiles, layout: RunLayout, job_id: str, ranks: int
) -> list[dict[str, object]]:
    """Each rank's last status file that reads and parses as a JSON object (the others are
    left out: missing, refused or torn)."""
    paths = [(p, SMALL_FILE_MAX) for r in range(ranks) if (p := layout.status_file(job_id, r))]
    out = []
    for data in (await files.read_many(layout.log_dir, paths)).values():
        try:
            value = json.loads(data) if isinstance(data, bytes) else None
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


async def read_all(
    files: RunFiles,
    layout: RunLayout,
    job_id: str,
    concurrencies: Sequence[int],
    ranks: int,
    refused: Refused,
) -> BenchFiles:
    """The result files, point logs, status files and diagnostics of a job (one batch)."""
    wanted = [(RESULTS, layout.bench_files(job_id, c)[0], RESULT_FILE_MAX) for c in concurrencies]
    wanted += [(RESULTS, layout.bench_files(job_id, c)[1], RESULT_FILE_MAX) for c in concurrencies]
    for rank in range(ranks):
        if (status := layout.status_file(job_id, rank)) is not None:
            wanted.append(("ranks", status, SMALL_FILE_MAX))
        if (diag := layout.diag_file(job_id, rank)) is not None:
            wanted.append(("ranks", diag, RESULT_FILE_MAX))
    got = await files.read_many(layout.log_dir, [(path, limit) for _, path, limit in wanted])
    out = BenchFiles()
    for c in concurrencies:
        out.results[c] = got.get(layout.bench_files(job_id, c)[0])
    names = {path: f"{folder}/{posixpath.basename(path)}" for folder, path, _ in wanted}
    await _keep(got, names, refused, out)
    return out


async def _keep(
    got: Mapping[str, bytes | FileRefused | None],
    names: Mapping[str, str],
    refused: Refused,
    out: BenchFiles,
) -> None:
    """What was read of `names` (path -> archive name) into `out.archived`; a refused
    file is reported instead, a missing one left out."""
    for path, name in names.items():
        data = got.get(path)
        if isinstance(data, FileRefused):
            await refused(data)
        elif data is not None:
            out.archived[name] = data


async def read_foreign(
    files: RunFiles, layout: RunLayout, job_id: str, refused: Refused
) -> BenchFiles:
    """A foreign job's result files (its `--results` patterns), byte-exact under
    ``results/`` by their path below the log directory (at most RESULT_FILES_MAX)."""
    watch = layout.watch
    out = BenchFiles()
    if watch is None or not watch.results:
        return out
    found: list[str] = []
    for directory in watch.dirs(watch.results, job_id):
        try:
            names = await files.list_dir(layout.log_dir, directory)
        except FileRefused as exc:
            await refused(exc)
            continue
        found += [
            f"{directory}/{n}" for n in names if watch.matching(watch.results, job_id, directory, n)
        ]
    kept = {p: f"{RESULTS}/{watch.copy_name(p)}" for p in found[:RESULT_FILES_MAX]}
    got = await files.read_many(layout.log_dir, [(p, RESULT_FILE_MAX) for p in kept])
    await _keep(got, kept, refused, out)
    return out


def foreign_table(archived: Mapping[str, bytes]) -> dict[str, object]:
    """`results.json` of a foreign job: a row per JSON result file that parses as vLLM's
    (or InferenceX's) benchmark result; no validity gate (the job defines none)."""
    evidence: list[PointEvidence] = []
    for name, data in sorted(archived.items()):
        if not name.startswith(f"{RESULTS}/") or not name.endswith(".json"):
            continue
        point: Point | ResultProblem = ResultProblem("missing", "")
        for fmt in FORMATS:
            point = parse_result(data, fmt)
            if isinstance(point, Point):
                break
        if isinstance(point, Point):
            conc, problem = point.concurrency or 0, None
            requested = point.num_prompts
        else:
            conc, problem, requested = 0, str(point), 0
        parsed = point if isinstance(point, Point) else None
        evidence.append(
            PointEvidence(conc, name, requested, 0, requested, problem is None, problem, parsed)
        )
    return results_table(evidence, None)
