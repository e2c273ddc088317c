"""The benchmark's files of a finished job, read through the cluster's `RunFiles`.

What the verdict's validity gate reads (each point's result file) and what the archive
keeps besides the log copies: the raw result files and point logs (`results/`), and each
rank's last status file and diagnostic (`ranks/`). Every read goes through
`node/safe_read.py` (no link followed, plain files of the job's account only, bounded); a
refused file is reported, never read. What a run reads is bounded by its `Budget` (files
and bytes, from [limits]), and result files are parsed in the result parser's child
process (`adapters.files.result_parser`), never on the event loop.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from llmd_supervisor.adapters.files.result_parser import ParseLimits, parse_many
from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
from llmd_supervisor.adapters.nodes.jobfiles import RESULT_FILE_MAX, SMALL_FILE_MAX
from llmd_supervisor.core.config import Limits
from llmd_supervisor.core.protocol.runs import ResultsTable
from llmd_supervisor.core.results.declared import known_deployment
from llmd_supervisor.core.results.evidence import (
    FORMATS,
    GateResult,
    Point,
    PointEvidence,
    ResultFormat,
    ResultProblem,
    Validity,
    gate,
    judge_alone,
    results_table,
)
from llmd_supervisor.core.results.gpus import RoleGpus
from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.core.run.layout import RESULTS, RunLayout
from llmd_supervisor.core.spec.runspec import RunSpec
from llmd_supervisor.errors import FileRefused
from llmd_supervisor.supervision.cluster.clusters import RunFiles

Refused = Callable[[FileRefused], Awaitable[None]]
Parsed = Point | ResultProblem
_RESULT_NAME = re.compile(r"c([1-9][0-9]{0,5})\.json")
_DEFAULTS = Limits()
K = TypeVar("K")


@dataclass(frozen=True)
class JudgedFiles:
    """What a verdict was made from, as verification read it: the marker's bytes (None:
    missing or refused) and the benchmark's files (None: not read, a foreign job). The
    archive keeps these, not a later read of files the job's owner can still change."""

    marker: bytes | None
    bench: BenchFiles | None


@dataclass
class BenchFiles:
    """What was read: per concurrency its result file parsed (None: missing; a refused
    file is a `ResultProblem` of kind ``refused``), the archive's extra files by relative
    name, and each archived JSON result of a foreign job parsed, by archive name."""

    results: dict[int, Parsed | None] = field(default_factory=dict)
    archived: dict[str, bytes] = field(default_factory=dict)
    parsed: dict[str, Parsed] = field(default_factory=dict)


class Budget:
    """What a run may read of its job's files for the verdict and the archive: at most
    limits.result_files_max_per_run result files and limits.result_bytes_max_per_run bytes
    in all. A file beyond either is refused, unread, with the budget and its value."""

    def __init__(self, limits: Limits) -> None:
        self.files = limits.result_files_max_per_run
        self.total = limits.result_bytes_max_per_run
        self.left = self.total  # bytes not yet taken by the files read

    def too_many(self, path: str, found: int) -> FileRefused:
        return FileRefused(
            path,
            f"the run has {found} result files and reads the first {self.files} "
            "(limits.result_files_max_per_run); raise it to read more",
        )

    def too_large(self, path: str) -> FileRefused:
        return FileRefused(
            path,
            f"the run's files read before it took {self.total - self.left} of its "
            f"{self.total} bytes (limits.result_bytes_max_per_run) and it is larger than "
            "the rest; raise the limit to read it",
        )

    async def read(
        self, files: RunFiles, log_dir: str, wanted: Sequence[tuple[str, int]]
    ) -> dict[str, bytes | FileRefused | None]:
        """`files.read_many` of `wanted` (path, limit) in order, in batches whose limits
        add up to what is left of the budget; each file's bytes are taken from it. A file
        larger than its share of a batch is asked again while more is left than that
        share, and refused (`too_large`) once it is larger than all that is left."""
        out: dict[str, bytes | FileRefused | None] = {}
        pending = list(wanted)
        while pending:
            batch = self._batch(pending)
            got = await files.read_many(log_dir, batch)
            again: list[tuple[str, int]] = []
            for (path, limit), (_, cap) in zip(batch, pending, strict=False):
                data = got.get(path)
                if isinstance(data, bytes):
                    self.left = max(0, self.left - len(data))
                elif (
                    isinstance(data, FileRefused)
                    and limit < cap
                    and data.why == jobfiles.too_large(limit)
                ):
                    again.append((path, cap))
                    continue
                out[path] = data
            shares, retry = dict(batch), []
            for path, cap in again:  # asked again only for a larger share: this ends
                if min(cap, self.left) > shares[path]:
                    retry.append((path, cap))
                else:
                    out[path] = self.too_large(path)
            pending = retry + pending[len(batch) :]
        return out

    def _batch(self, pending: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """The next files to read, each with its share of what is left (nothing left: all
        of them, for 0 bytes, so that a missing file stays missing)."""
        if self.left == 0:
            return [(path, 0) for path, _ in pending]
        batch: list[tuple[str, int]] = []
        reserved = 0
        for path, cap in pending:
            if reserved >= self.left:
                break
            batch.append((path, min(cap, self.left - reserved)))
            reserved += batch[-1][1]
        return batch


def judge(spec: RunSpec, parsed: Mapping[int, Parsed | None]) -> GateResult:
    """The validity gate on what `read_all` found (pure)."""
    bench = spec.benchmark
    return gate(parsed, bench.expected_prompts(), bench.validity, {})


async def parse_points(
    paths: Mapping[K, str],
    got: Mapping[str, bytes | FileRefused | None],
    formats: Sequence[ResultFormat],
    limits: Limits,
) -> dict[K, Parsed | None]:
    """Each result file (`paths`: key -> path, `got`: what was read) parsed in the result
    parser's child, by key; a refused file is a problem of kind refused, a missing one None."""
    items = [(p, data, formats) for p in paths.values() if isinstance(data := got.get(p), bytes)]
    parsed = await parse_many(items, ParseLimits.of(limits))
    out: dict[K, Parsed | None] = {}
    for c, path in paths.items():
        data = got.get(path)
        if isinstance(data, FileRefused):
            out[c] = ResultProblem("refused", data.why)
        else:
            out[c] = None if data is None else parsed[path]
    return out


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
    paths: dict[int, str] = {}
    got: dict[str, bytes | FileRefused | None] = {}
    for name in names:
        if (m := _RESULT_NAME.fullmatch(name)) is None:
            continue
        path = paths[int(m.group(1))] = f"{results_dir}/{name}"
        try:
            got[path] = await jobfiles.read_local(
                log_dir, path, time_limit=time_limit, limit=RESULT_FILE_MAX
            )
        except FileRefused as exc:
            got[path] = exc
    points = await parse_points(paths, got, (fmt,), _DEFAULTS)
    expected = {c: p.num_prompts if isinstance(p, Point) else 0 for c, p in points.items()}
    return gate(points, expected, validity, {c: f"{results_dir}/c{c}.json" for c in points})


def _refused_dir(exc: FileRefused) -> GateResult:
    return GateResult(False, f"benchmark: results directory refused ({exc.why})", ())


def _result_paths(
    layout: RunLayout, job_id: str, spec: RunSpec, budget: Budget
) -> tuple[dict[int, str], dict[str, FileRefused]]:
    """concurrency -> its result file's path, and the paths beyond the budget's count."""
    concurrencies = spec.benchmark.concurrencies
    paths = {c: layout.bench_files(job_id, c)[0] for c in concurrencies}
    over = [paths[c] for c in concurrencies[budget.files :]]
    return paths, {p: budget.too_many(p, len(concurrencies)) for p in over}


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
    spec: RunSpec,
    refused: Refused,
    limits: Limits = _DEFAULTS,
) -> BenchFiles:
    """The result files (parsed, and kept raw), point logs, status files and diagnostics
    of a job, within the run's `Budget` (in that order: the results come first)."""
    budget = Budget(limits)
    paths, over = _result_paths(layout, job_id, spec, budget)
    concurrencies = [c for c in spec.benchmark.concurrencies if paths[c] not in over]
    wanted = [(RESULTS, paths[c], RESULT_FILE_MAX) for c in concurrencies]
    for rank in range(spec.topology.nodes):
        if (status := layout.status_file(job_id, rank)) is not None:
            wanted.append(("ranks", status, SMALL_FILE_MAX))
    wanted += [(RESULTS, layout.bench_files(job_id, c)[1], RESULT_FILE_MAX) for c in concurrencies]
    for rank in range(spec.topology.nodes):
        if (diag := layout.diag_file(job_id, rank)) is not None:
            wanted.append(("ranks", diag, RESULT_FILE_MAX))
    got = await budget.read(files, layout.log_dir, [(path, limit) for _, path, limit in wanted])
    got.update(over)
    out = BenchFiles()
    out.results = await parse_points(paths, got, (spec.benchmark.result_format,), limits)
    names = {path: f"{folder}/{posixpath.basename(path)}" for folder, path, _ in wanted}
    names.update((path, f"{RESULTS}/{posixpath.basename(path)}") for path in over)
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
    files: RunFiles, layout: RunLayout, job_id: str, refused: Refused, limits: Limits = _DEFAULTS
) -> BenchFiles:
    """A foreign job's result files (its `--results` patterns), byte-exact under
    ``results/`` by their path below the log directory, within the run's `Budget` (the
    files past its count are reported once, by the first of them); the JSON ones parsed
    as either format (`foreign_table`)."""
    watch = layout.watch
    out = BenchFiles()
    if watch is None or not watch.results:
        return out
    budget = Budget(limits)
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
    if len(found) > budget.files:
        await refused(budget.too_many(found[budget.files], len(found)))
    kept = {p: f"{RESULTS}/{watch.copy_name(p)}" for p in found[: budget.files]}
    got = await budget.read(files, layout.log_dir, [(p, RESULT_FILE_MAX) for p in kept])
    await _keep(got, kept, refused, out)
    json_names = {name: path for path, name in kept.items() if name.endswith(".json")}
    parsed = await parse_points(json_names, got, FORMATS, limits)
    out.parsed = {name: p for name, p in parsed.items() if p is not None}
    return out


def foreign_table(
    got: BenchFiles, roles: RoleGpus | None = None, nodes: int | None = None
) -> ResultsTable:
    """`results.json` of a foreign job: a row per archived JSON result file, a point where
    it parsed as vLLM's (or InferenceX's) benchmark result, valid when it passes the
    default validity gate against the requests it says were sent (`judge_alone`: the job
    has no spec to say more). A file's name is the job's text: escaped before it reaches the table.
    `roles`: the GPUs of each role the user gave (--prefill-gpus, --decode-gpus); without
    them a file's own declaration counts (`core.results.gpus.ROLE_GPU_KEYS`). Its `declared`
    deployment is what the files, the roles and the job's `nodes` (its allocation's
    size; None: unknown) say of it (`core.results.declared.known_deployment`)."""
    evidence: list[PointEvidence] = []
    for name, point in sorted(got.parsed.items()):
        if isinstance(point, Point):
            conc, problem = point.concurrency or 0, judge_alone(point)
            requested = point.num_prompts
        else:
            conc, problem, requested = 0, str(point), 0
        parsed = point if isinstance(point, Point) else None
        evidence.append(
            PointEvidence(
                conc, job_text(name), requested, 0, requested, problem is None, problem, parsed
            )
        )
    table = results_table(evidence, roles)
    prefill, decode = table.get("prefill_gpus"), table.get("decode_gpus")
    split = RoleGpus(prefill, decode) if prefill is not None and decode is not None else None
    points = [e.point for e in evidence if e.point is not None]
    table["declared"] = known_deployment((p.declared for p in points), split, nodes)
    return table
