"""Benchmark result files parsed in a child process, with memory and time limits.

A result file is up to 32 MiB of JSON a job wrote. Parsed in the daemon it would hold the
event loop for seconds and take some 25 times its size in memory (32 MiB of ``[[],[],...``:
6.8 s and 800 MiB), long enough for systemd's watchdog to restart the daemon into the same
step. So `parse_many` hands the bytes to a child (`result_parser_child`) that limits its
own address space and CPU time, and kills it when one file takes longer than its time
limit. A file over a limit is refused (a `ResultProblem` of kind ``refused`` whose detail
names the file, the limit and the setting that raises it); the files after it are parsed
by a fresh child. At most `PARSERS` children run at once in the daemon, so what they may
take in all is PARSERS x limits.result_parse_memory_bytes.

Within `kept_children` (the daemon's life) a child that parsed at most `KEEP_AFTER_BYTES`
without a problem stays running for the next `parse_many` (at most `PARSERS` wait so): the
ten runs of a campaign that end together do not start twenty children. A child that
refused a file, timed out or ended is never kept.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Final

import anyio
import anyio.abc
import structlog
from anyio.lowlevel import RunVar
from anyio.streams.buffered import BufferedByteReceiveStream

from llmd_supervisor.adapters.files import result_parser_child as result_parser_child
from llmd_supervisor.core.config import Limits
from llmd_supervisor.core.results.evidence import (
    Point,
    ResultFormat,
    ResultProblem,
    parsed_from_json,
)

log = structlog.get_logger("llmd_supervisor.result_parser")

# Parser children running at once in the daemon (the machine's cores are for the loop too).
PARSERS: Final = 2
# An answer line is a point or a short problem; anything longer is not the parser's.
ANSWER_MAX: Final = 64 << 10
# A file goes to the child in pieces of this size (each waits for the pipe to drain).
SEND_CHUNK: Final = 1 << 20
# CPU seconds a child may use on a file besides its time limit (starting, answering).
CPU_SLACK_S: Final = 5
# How long a new child may take to start (a busy login node); files are timed after it.
START_TIMEOUT_S: Final = 60
# A child kept for the next files has parsed at most this much (its memory stays small).
KEEP_AFTER_BYTES: Final = 8 << 20
_STDERR_KEEP = 2000
_SLOTS: RunVar[anyio.CapacityLimiter] = RunVar("llmd_result_parsers")
_KEPT: RunVar[list[_Child] | None] = RunVar("llmd_result_parsers_kept", default=None)


@dataclass
class _Child:
    process: anyio.abc.Process
    answers: BufferedByteReceiveStream
    memory_bytes: int


@contextlib.asynccontextmanager
async def kept_children() -> AsyncIterator[None]:
    """Keep parser children between `parse_many` calls within the block; end them after."""
    kept: list[_Child] = []
    _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.set(None)
        with anyio.CancelScope(shield=True):
            for child in kept:
                await _stop(child.process)


@dataclass(frozen=True)
class ParseLimits:
    """What one result file's parse may take (the [limits] keys named below)."""

    memory_bytes: int = Limits.result_parse_memory_bytes  # the child's address space
    time_s: float = Limits.result_parse_timeout_s  # per file, wall clock

    @classmethod
    def of(cls, limits: Limits) -> ParseLimits:
        return cls(limits.result_parse_memory_bytes, limits.result_parse_timeout_s)


Item = tuple[str, bytes, Sequence[ResultFormat]]  # (the file's name, its bytes, formats)


async def parse_many(
    items: Sequence[Item], limits: ParseLimits
) -> dict[str, Point | ResultProblem]:
    """Each item's bytes parsed as the first of its formats it is a point of (see
    `core.results.evidence.parse_any`), by name. Never raises for what a file holds. On
    cancellation the child is killed (and waited for, at most 5 s) before this returns."""
    out: dict[str, Point | ResultProblem] = {}
    if not items:
        return out
    async with _slots():
        done = 0
        while done < len(items):
            done += await _one_child(items[done:], limits, out)
    return out


def _slots() -> anyio.CapacityLimiter:
    """The event loop's limiter of running parser children."""
    try:
        return _SLOTS.get()
    except LookupError:
        _SLOTS.set(limiter := anyio.CapacityLimiter(PARSERS))
        return limiter


async def _child(limits: ParseLimits) -> _Child | str:
    """A kept child with the same memory limit, else a new one once it said it is ready;
    why not, when it did not start."""
    kept = _KEPT.get()
    while kept:
        child = kept.pop()
        if child.memory_bytes == limits.memory_bytes and child.process.returncode is None:
            return child
        await _stop(child.process)
    argv = [sys.executable, "-I", "-m", result_parser_child.__name__, str(limits.memory_bytes)]
    try:
        process = await anyio.open_process(argv, stderr=subprocess.PIPE)
    except OSError as exc:
        return str(exc)
    assert process.stdout is not None
    child = _Child(process, BufferedByteReceiveStream(process.stdout), limits.memory_bytes)
    try:
        with anyio.fail_after(START_TIMEOUT_S):
            ready = await child.answers.receive_until(b"\n", len(result_parser_child.READY))
    except TimeoutError:
        why = f"it was not ready within {START_TIMEOUT_S} s"
    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound, OSError):
        why = "it ended as it started"
    except BaseException:  # cancelled: no child left behind
        with anyio.CancelScope(shield=True):
            await _stop(process)
        raise
    else:
        if ready + b"\n" == result_parser_child.READY:
            return child
        why = f"it said {ready[:40]!r}"
    await _stop(process)
    return why


async def _one_child(
    items: Sequence[Item], limits: ParseLimits, out: dict[str, Point | ResultProblem]
) -> int:
    """Parse `items` in order in one child until it ends; how many were answered (a file
    that ended the child counts, as refused)."""
    cpu = math.ceil(limits.time_s) + CPU_SLACK_S
    child = await _child(limits)
    if isinstance(child, str):
        name = items[0][0]
        out[name] = _refused(name, f"the result parser did not start for {name}: {child}")
        return 1
    process, answers = child.process, child.answers
    assert process.stdin is not None
    keep = False
    try:
        for i, (name, data, formats) in enumerate(items):
            try:
                with anyio.fail_after(limits.time_s):
                    head = json.dumps([list(formats), len(data), cpu]).encode()
                    await process.stdin.send(head + b"\n")
                    for start in range(0, len(data), SEND_CHUNK):  # no 32 MiB pipe buffer
                        await process.stdin.send(data[start : start + SEND_CHUNK])
                    line = await answers.receive_until(b"\n", ANSWER_MAX)
            except TimeoutError:
                out[name] = _refused(
                    name,
                    f"parsing {name} took longer than {limits.time_s:g} s; raise "
                    "limits.result_parse_timeout_s if the file is genuine",
                )
                return i + 1
            except (
                anyio.EndOfStream,
                anyio.IncompleteRead,
                anyio.BrokenResourceError,
                anyio.DelimiterNotFound,
                OSError,
            ):
                out[name] = await _ended(process, name, limits, cpu)
                return i + 1
            out[name] = _answer(name, line, limits)
        refused = [n for n, _, _ in items if _is_refused(out[n])]
        keep = not refused and sum(len(d) for _, d, _ in items) <= KEEP_AFTER_BYTES
        return len(items)
    finally:
        kept = _KEPT.get()
        if keep and kept is not None and len(kept) < PARSERS:
            kept.append(child)
        else:
            with anyio.CancelScope(shield=True):
                await _stop(process)


def _is_refused(got: Point | ResultProblem) -> bool:
    return isinstance(got, ResultProblem) and got.kind == "refused"


def _answer(name: str, line: bytes, limits: ParseLimits) -> Point | ResultProblem:
    try:
        got = parsed_from_json(json.loads(line))
    except ValueError as exc:
        return _refused(name, f"the result parser answered something unreadable for {name} ({exc})")
    if isinstance(got, ResultProblem) and got == _OUT_OF_MEMORY:
        return _refused(name, _memory_reason(name, limits))
    return got


_OUT_OF_MEMORY = ResultProblem("refused", result_parser_child.OUT_OF_MEMORY)


def _memory_reason(name: str, limits: ParseLimits) -> str:
    mib = limits.memory_bytes / (1 << 20)
    return (
        f"parsing {name} needs more than {mib:g} MiB of memory; raise "
        f"limits.result_parse_memory_bytes (now {limits.memory_bytes}) if the file is genuine"
    )


async def _ended(
    process: anyio.abc.Process, name: str, limits: ParseLimits, cpu: int
) -> ResultProblem:
    """Why the child ended while it parsed `name` (it is logged with its stderr)."""
    with anyio.move_on_after(5):
        await process.wait()
    status = process.returncode
    if status == -signal.SIGXCPU:
        why = (
            f"parsing {name} used more than its {cpu} s of CPU time; raise "
            "limits.result_parse_timeout_s if the file is genuine"
        )
    elif status == -signal.SIGKILL:  # the kernel's OOM killer, under the unit's MemoryMax
        why = f"the result parser was killed while parsing {name}; {_memory_reason(name, limits)}"
    else:
        why = f"the result parser ended (status {status}) while parsing {name}"
    stderr = b""
    if process.stderr is not None:
        with anyio.move_on_after(1), contextlib.suppress(anyio.EndOfStream, OSError):
            stderr = await process.stderr.receive(_STDERR_KEEP)
    log.warning(
        "results.parser_ended",
        path=name,
        status=status,
        stderr=stderr.decode("utf-8", "replace")[-_STDERR_KEEP:],
    )
    return _refused(name, why)


def _refused(name: str, why: str) -> ResultProblem:
    log.warning("results.parse_refused", path=name, reason=why)
    return ResultProblem("refused", why)


async def _stop(process: anyio.abc.Process) -> None:
    """End the child: EOF to its stdin, a kill if it is still running, a bounded wait."""
    if process.stdin is not None:
        with contextlib.suppress(anyio.BrokenResourceError, OSError):
            await process.stdin.aclose()
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    with anyio.move_on_after(5):
        await process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            await stream.aclose()
