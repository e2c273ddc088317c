"""Result files parsed in a child process with memory and time limits (issue 3.2, item 2).

The finding: `parse_result` ran on the event loop, and 32 MiB of ``[[],[],...]`` held it
for 6.8 s and took 803 MiB; a foreign job's three such files held it for 43 s, past the
unit's WatchdogSec=30. Now a child parses them: a file over a limit is refused naming the
file, the limit and its setting; the daemon's memory and its loop are untouched (the loop
guard of tests/conftest.py fails any test here whose callbacks hold the loop)."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.files import result_parser as result_parser
from llmd_supervisor.adapters.files.result_parser import ParseLimits, parse_many
from llmd_supervisor.core.results.evidence import (
    FORMATS,
    Point,
    ResultFormat,
    ResultProblem,
    parse_result,
)
from tests.fakes.hostile_results import nested_lists

DATA = Path(__file__).resolve().parents[1] / "data" / "results"
REAL = {
    "vllm-serve-c4.json": "vllm",
    "vllm-serve-c8-failures.json": "vllm",
    "inferencex-c32.json": "inferencex",
}
MIB = 1 << 20


@pytest.fixture(scope="module")
def nested() -> bytes:
    """32 MiB of ``[[],[],...]`` (made once, off any event loop)."""
    return nested_lists()


def _rss() -> int:
    """This process's resident set now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@asynccontextmanager
async def peak_rss() -> AsyncIterator[Callable[[], int]]:
    """Sample this process's RSS every 20 ms while the block runs; yields a function that
    says how far above its value at the start it went."""
    start, peak = _rss(), _rss()

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, _rss())
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        yield lambda: peak - start
        tg.cancel_scope.cancel()


def _children() -> list[int]:
    """PIDs of this process's parser children that are still there."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"result_parser_child" in cmdline:
            found.append(int(entry))
    return found


@pytest.mark.asyncio
async def test_real_results_parse_in_the_child_as_they_do_here() -> None:
    items = [(name, (DATA / name).read_bytes(), FORMATS) for name in REAL]
    items += [("garbage", b"{not json", ("vllm",)), ("empty", b"", ("inferencex",))]
    with anyio.fail_after(30):
        got = await parse_many(items, ParseLimits())
    for name, fmt in REAL.items():
        here = parse_result((DATA / name).read_bytes(), fmt)  # type: ignore[arg-type]
        assert isinstance(here, Point) and got[name] == here
    assert got["garbage"] == parse_result(b"{not json", "vllm")
    assert got["empty"] == ResultProblem("not_json", "empty file")
    assert _children() == []


@pytest.mark.asyncio
async def test_hostile_files_are_refused_for_memory_and_the_daemon_stays_small(
    nested: bytes,
) -> None:
    """Two 32 MiB files of ``[[],...]`` (each held the loop 6.8 s and took 803 MiB) and a
    real one after them: each hostile one is refused naming itself, the limit and the
    setting; the real one is parsed; this process grows by no more than a few MiB."""
    items = [(f"/runs/L/results/c{i}.json", nested, FORMATS) for i in range(2)]
    items.append(("real", (DATA / "vllm-serve-c4.json").read_bytes(), FORMATS))
    with anyio.fail_after(120):
        async with peak_rss() as grown:
            got = await parse_many(items, ParseLimits())
            growth = grown()
    for name, _, _ in items[:2]:
        refused = got[name]
        assert isinstance(refused, ResultProblem) and refused.kind == "refused", refused
        assert f"parsing {name} needs more than 512 MiB of memory" in refused.detail
        assert "limits.result_parse_memory_bytes (now 536870912)" in refused.detail
    assert isinstance(got["real"], Point)
    assert growth < 16 * MIB, f"the daemon's RSS grew by {growth / MIB:.0f} MiB"


@pytest.mark.asyncio
async def test_sixteen_files_of_32_mib_are_parsed_without_blocking_the_loop(
    nested: bytes,
) -> None:
    """The issue's 16 files (read by `jobfiles.read_many_local` in
    tests/unit/test_jobfiles.py, through the whole daemon in
    tests/faults/test_hostile_results.py): the loop is never held (the guard), every file
    is refused by the parser's memory limit (lowered here so that the test is quick)."""
    vllm: tuple[ResultFormat] = ("vllm",)
    items = [(f"/runs/L/bench/c{i}.json", nested, vllm) for i in range(16)]
    with anyio.fail_after(240):
        parsed = await parse_many(items, ParseLimits(memory_bytes=128 * MIB))
    assert len(parsed) == 16
    assert all(
        isinstance(p, ResultProblem) and p.kind == "refused" and "128 MiB" in p.detail
        for p in parsed.values()
    ), parsed


@pytest.mark.asyncio
async def test_a_parse_over_its_time_limit_is_refused_and_the_next_file_is_parsed(
    nested: bytes,
) -> None:
    real = (DATA / "inferencex-c32.json").read_bytes()
    items = [("slow.json", nested, FORMATS), ("real.json", real, FORMATS)]
    with anyio.fail_after(60):
        got = await parse_many(items, ParseLimits(time_s=0.2))
    slow = got["slow.json"]
    assert isinstance(slow, ResultProblem) and slow.kind == "refused"
    assert slow.detail == (
        "parsing slow.json took longer than 0.2 s; raise limits.result_parse_timeout_s if "
        "the file is genuine"
    )
    assert isinstance(got["real.json"], Point)
    assert _children() == []


@pytest.mark.asyncio
async def test_a_parser_ended_by_its_cpu_limit_refuses_its_file_and_the_rest_go_on(
    nested: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(result_parser, "CPU_SLACK_S", -29)  # 30 s a file - 29: 1 CPU s
    real = (DATA / "vllm-serve-c4.json").read_bytes()
    vllm: tuple[ResultFormat] = ("vllm",)
    items = [("cpu.json", nested, vllm), ("real.json", real, vllm)]
    with anyio.fail_after(60):
        got = await parse_many(items, ParseLimits(memory_bytes=4 << 30, time_s=30))
    cpu = got["cpu.json"]
    assert isinstance(cpu, ResultProblem) and cpu.kind == "refused"
    assert "parsing cpu.json used more than its 1 s of CPU time" in cpu.detail, cpu
    assert "limits.result_parse_timeout_s" in cpu.detail
    assert isinstance(got["real.json"], Point)


@pytest.mark.asyncio
async def test_a_cancelled_parse_leaves_no_child(nested: bytes) -> None:
    with anyio.move_on_after(0.5):
        await parse_many([("big.json", nested, FORMATS)], ParseLimits())
    assert _children() == []


@pytest.mark.asyncio
async def test_at_most_two_parsers_run_at_once(nested: bytes) -> None:
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(len(_children()))
            await anyio.sleep(0.05)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            async with anyio.create_task_group() as parsers:
                for i in range(4):
                    items = [(f"f{i}", nested[: 4 * MIB - 2] + b"]]", FORMATS)]
                    parsers.start_soon(parse_many, items, ParseLimits())
            tg.cancel_scope.cancel()
    assert 0 < max(seen) <= result_parser.PARSERS


@pytest.mark.asyncio
async def test_a_kept_child_parses_the_next_files_and_ends_with_the_block(nested: bytes) -> None:
    """Within `kept_children` (the daemon), a child that parsed small files without a
    problem serves the next call; one that refused a file is not kept; none outlives the
    block."""
    real = (DATA / "vllm-serve-c4.json").read_bytes()
    vllm: tuple[ResultFormat] = ("vllm",)
    with anyio.fail_after(60):
        async with result_parser.kept_children():
            first = await parse_many([("a.json", real, vllm)], ParseLimits())
            kept = _children()
            assert len(kept) == 1
            second = await parse_many([("b.json", real, vllm)], ParseLimits())
            assert _children() == kept  # the same child, no new one
            assert isinstance(first["a.json"], Point) and second["b.json"] == first["a.json"]
            limits = ParseLimits(memory_bytes=128 * MIB)  # another limit: a new child
            hostile = await parse_many([("n.json", nested, vllm)], limits)
            assert _is_refused(hostile["n.json"])
            assert _children() == []  # the kept one (other limit) and the refusing one end
        assert _children() == []


def _is_refused(got: Point | ResultProblem) -> bool:
    return isinstance(got, ResultProblem) and got.kind == "refused"


@pytest.mark.asyncio
async def test_a_parser_that_does_not_start_refuses_each_file_naming_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child that ends before it says it is ready (here: /bin/false as the interpreter)
    refuses the file that waited for it, and the next file tries a new child."""
    monkeypatch.setattr(sys, "executable", "/bin/false")
    real = (DATA / "vllm-serve-c4.json").read_bytes()
    vllm: tuple[ResultFormat] = ("vllm",)
    with anyio.fail_after(30):
        got = await parse_many([("a.json", real, vllm), ("b.json", real, vllm)], ParseLimits())
    for name in ("a.json", "b.json"):
        problem = got[name]
        assert isinstance(problem, ResultProblem) and problem.kind == "refused"
        assert problem.detail == (
            f"the result parser did not start for {name}: it ended as it started"
        )
