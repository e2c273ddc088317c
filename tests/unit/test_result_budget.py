"""A run's result budget (issue 3.2, item 2): at most limits.result_files_max_per_run
result files and limits.result_bytes_max_per_run bytes are read of a job for its verdict
and archive; past either, a file is refused unread, and the refusal names the budget and
its value (the gate's reason, the foreign table, a `log.refused` event)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import pytest_asyncio

from llmd_supervisor.adapters.files.result_parser import PARSERS
from llmd_supervisor.core.config import Limits, load_config
from llmd_supervisor.core.results.evidence import Point, ResultProblem
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.spec.foreign import Watch
from llmd_supervisor.core.spec.runspec import RunSpec, load_spec
from llmd_supervisor.errors import ConfigError, FileRefused
from llmd_supervisor.supervision.cluster.clusters import SharedLogDir
from llmd_supervisor.supervision.run import bench_files as bench_files
from tests.daemon_helpers import demo_spec
from tests.fakes.bench_results import vllm_result
from tests.fakes.hostile_results import write_nested

MIB = 1 << 20
JOB = "4711"


def _spec(log_dir: Path) -> RunSpec:
    return load_spec(demo_spec(log_dir))  # concurrencies 1, 2, 4


def _padded(data: bytes, size: int) -> bytes:
    """A result file of exactly `size` bytes (JSON allows trailing blanks)."""
    return data + b" " * (size - len(data))


def _results(spec: RunSpec, layout: RunLayout, size: int) -> None:
    """Each point's result file and client log, `size` bytes each."""
    for c in spec.benchmark.concurrencies:
        result, point_log = (Path(p) for p in layout.bench_files(JOB, c))
        result.parent.mkdir(parents=True, exist_ok=True)
        result.write_bytes(_padded(vllm_result(c, spec.benchmark.num_prompts(c)), size))
        point_log.write_bytes(b"x" * size)


@pytest_asyncio.fixture
async def files() -> AsyncIterator[SharedLogDir]:
    """The cluster's files seen here (its reader children ended after the test)."""
    shared = SharedLogDir()
    yield shared
    await shared.aclose()


async def _ignore(exc: FileRefused) -> None:
    pass


@pytest.fixture
def run(tmp_path: Path) -> tuple[RunSpec, RunLayout]:
    spec = _spec(tmp_path / "L")
    return spec, RunLayout(str(tmp_path / "L"), "llmd-r1", tmp_path / "archive")


@pytest.mark.asyncio
async def test_result_files_past_the_byte_budget_are_refused_naming_it(
    run: tuple[RunSpec, RunLayout], files: SharedLogDir
) -> None:
    spec, layout = run
    _results(spec, layout, MIB)
    limits = Limits(result_bytes_max_per_run=5 * MIB // 2)
    with anyio.fail_after(60):
        found = await bench_files.read_all(files, layout, JOB, spec, _ignore, limits)
    got = found.results
    assert isinstance(got[1], Point) and isinstance(got[2], Point)
    over = got[4]
    assert isinstance(over, ResultProblem) and over.kind == "refused"
    assert over.detail == (
        f"the run's files read before it took {2 * MIB} of its {5 * MIB // 2} bytes "
        "(limits.result_bytes_max_per_run) and it is larger than the rest; raise the limit "
        "to read it"
    )
    verdict = bench_files.judge(spec, got)
    assert not verdict.ok
    assert verdict.reason.startswith("benchmark c=4: result file refused (the run's files")
    assert "(limits.result_bytes_max_per_run)" in verdict.reason


@pytest.mark.asyncio
async def test_result_files_past_the_count_budget_are_refused_naming_it(
    run: tuple[RunSpec, RunLayout], files: SharedLogDir
) -> None:
    spec, layout = run
    _results(spec, layout, 4096)
    limits = Limits(result_files_max_per_run=2)
    with anyio.fail_after(60):
        found = await bench_files.read_all(files, layout, JOB, spec, _ignore, limits)
    got = found.results
    assert isinstance(got[1], Point) and isinstance(got[2], Point)
    assert got[4] == ResultProblem(
        "refused",
        "the run has 3 result files and reads the first 2 (limits.result_files_max_per_run); "
        "raise it to read more",
    )


@pytest.mark.asyncio
async def test_the_archive_takes_results_first_and_refuses_what_the_budget_leaves_out(
    run: tuple[RunSpec, RunLayout], files: SharedLogDir
) -> None:
    spec, layout = run
    _results(spec, layout, MIB // 2)  # 1.5 MiB of results, 1.5 MiB of point logs
    refused: list[FileRefused] = []

    async def seen(exc: FileRefused) -> None:
        refused.append(exc)

    limits = Limits(result_bytes_max_per_run=2 * MIB)
    with anyio.fail_after(60):
        got = await bench_files.read_all(files, layout, JOB, spec, seen, limits)
    assert all(isinstance(got.results[c], Point) for c in (1, 2, 4))
    assert {"results/c1.json", "results/c2.json", "results/c4.json"} <= set(got.archived)
    assert sum(len(v) for v in got.archived.values()) <= limits.result_bytes_max_per_run
    assert [r.path for r in refused] == [layout.bench_files(JOB, c)[1] for c in (2, 4)]
    assert all("limits.result_bytes_max_per_run" in r.why for r in refused)


@pytest.fixture
def foreign(tmp_path: Path) -> RunLayout:
    """A foreign job whose `--results results/*.json` match 256 files: a real result
    (a.json) and 255 of 256 KiB of ``[[],...]``."""
    results = tmp_path / "ix" / "results"
    write_nested(results, [f"n{i:03}.json" for i in range(255)], 256 << 10)
    (results / "a.json").write_bytes(vllm_result(4, 40))
    watch = Watch(str(tmp_path / "ix"), results=("results/*.json",))
    return RunLayout(str(tmp_path / "ix"), "ixci-r1", tmp_path / "archive", watch=watch)


@pytest.mark.asyncio
async def test_a_foreign_job_with_256_result_files_is_read_within_its_budget(
    foreign: RunLayout, files: SharedLogDir
) -> None:
    """The finding: 256 result files of 32 MiB were read into the daemon (8 GiB), then
    parsed on its loop. Now the first 64 are read (one refusal says how many matched and
    the setting), each parsed in the child; with a byte budget of 4 MiB, those past it are
    refused each, naming the budget."""
    refused: list[FileRefused] = []

    async def seen(exc: FileRefused) -> None:
        refused.append(exc)

    with anyio.fail_after(120):
        got = await bench_files.read_foreign(files, foreign, JOB, seen)
    assert len(got.archived) == 64 and len(got.parsed) == 64
    assert [r.path for r in refused] == [f"{foreign.log_dir}/results/n063.json"]
    assert refused[0].why == (
        "the run has 256 result files and reads the first 64 "
        "(limits.result_files_max_per_run); raise it to read more"
    )
    table = bench_files.foreign_table(got)
    rows = table["points"]
    assert isinstance(rows, list) and len(rows) == 64
    assert [r["concurrency"] for r in rows if r["valid"]] == [4]
    assert {r["problem"] for r in rows if not r["valid"]} == {
        "not_object: the JSON is a list, not an object"
    }
    json.dumps(table, allow_nan=False)

    refused.clear()
    limits = Limits(result_bytes_max_per_run=4 * MIB)
    with anyio.fail_after(120):
        got = await bench_files.read_foreign(files, foreign, JOB, seen, limits)
    assert sum(len(v) for v in got.archived.values()) <= 4 * MIB
    assert len(got.archived) == 16 and len(refused) == 1 + 48
    assert all("(limits.result_bytes_max_per_run)" in r.why for r in refused[1:])
    rows = bench_files.foreign_table(got)["points"]
    assert isinstance(rows, list) and len(rows) == 64
    assert sum("limits.result_bytes_max_per_run" in str(r["problem"]) for r in rows) == 48


def test_the_budgets_are_settings_with_sane_bounds() -> None:
    limits = load_config("").limits
    assert (limits.result_files_max_per_run, limits.result_bytes_max_per_run) == (64, 256 * MIB)
    assert (limits.result_parse_memory_bytes, limits.result_parse_timeout_s) == (512 * MIB, 10)
    text = """[limits]
result_files_max_per_run = 500
result_bytes_max_per_run = 1073741824
result_parse_memory_bytes = 2147483648
result_parse_timeout_s = 60
"""
    limits = load_config(text).limits
    assert limits.result_files_max_per_run == 500 and limits.result_parse_timeout_s == 60
    for bad in (
        "result_files_max_per_run = 0",
        "result_bytes_max_per_run = 1000",
        "result_parse_memory_bytes = 1.5",
        "result_parse_timeout_s = 0",
    ):
        with pytest.raises(ConfigError, match=bad.split(" ")[0]):
            load_config(f"[limits]\n{bad}\n")


@pytest.mark.parametrize(
    "unit", ["systemd/llmd-supervisor.service", "systemd/user/llmd-supervisor.service"]
)
def test_the_units_memory_max_holds_the_parsers_and_two_runs_budgets(unit: str) -> None:
    """What the daemon may hold by these bounds, besides itself (measured: 376 MiB while
    one run's 8 result files of 32 MiB were read and archived): both result parsers at
    their limit, and two runs' whole budgets being archived at once."""
    text = (Path(__file__).resolve().parents[2] / unit).read_text()
    (value,) = [ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith("MemoryMax=")]
    memory_max = int(value.removesuffix("G")) << 30
    limits = Limits()
    need = 512 * MIB + PARSERS * limits.result_parse_memory_bytes
    need += 2 * limits.result_bytes_max_per_run
    assert memory_max >= need, f"{unit}: MemoryMax={value} is below {need >> 20} MiB"


def test_a_foreign_result_file_name_reaches_the_table_escaped() -> None:
    """A foreign job names its result files: a name with a terminal escape, a newline and
    an undecodable byte (a surrogate escape) is the table's `file` only escaped."""
    hostile = "results/\x1b]52;c;eA==\x07x\n\udcff.json"
    got = bench_files.BenchFiles(parsed={hostile: ResultProblem("not_object", "a list")})
    rows = bench_files.foreign_table(got)["points"]
    assert isinstance(rows, list) and len(rows) == 1
    name = rows[0]["file"]
    assert isinstance(name, str) and name.isprintable() and name.startswith("results/")
    json.dumps(rows, allow_nan=False).encode("utf-8")


def test_a_foreign_jobs_roles_divide_its_per_gpu_numbers_as_inferencex_does() -> None:
    """`submit --script ... --prefill-gpus 16 --decode-gpus 8`: output tok/s per GPU over
    the decode GPUs, input over the prefill ones, total over both."""
    from llmd_supervisor.core.results.evidence import parse_result
    from llmd_supervisor.core.results.gpus import RoleGpus

    point = parse_result(vllm_result(4, 40), "vllm")
    assert isinstance(point, Point)
    got = bench_files.BenchFiles(parsed={"results/a.json": point})
    table = bench_files.foreign_table(got, RoleGpus(16, 8))
    assert (table["gpus"], table.get("prefill_gpus"), table.get("decode_gpus")) == (24, 16, 8)
    (row,) = table["points"]
    assert row["output_throughput_per_gpu"] == pytest.approx(point.output_throughput / 8)
    assert row["input_throughput_per_gpu"] == pytest.approx(point.input_throughput / 16)
